"""Tile classes found per call for masks that read data, on the GPU: the classes kernel's
table against `mhadsl.reference_block_classes`, classes made once and passed to many calls,
their checks, the backward, and CUDA-graph replay with new documents."""
import numpy as np
import pytest

import mhadsl

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from test_block_classes import SOURCE  # noqa: E402
from test_gpu_attention import assert_matches, backend, dense, ragged  # noqa: E402,F401
from test_gpu_backward import assert_close  # noqa: E402


def kernel(name, design=None):
    kern = mhadsl.compile(SOURCE, name="gpu_block_classes")[name]
    kern.backend = design
    return kern


def documents(lengths, seed=0, most=4):
    """Each sequence's rows split into a few documents, ids rising (int32, on the GPU)."""
    rng = np.random.default_rng(seed)
    return torch.tensor(np.concatenate([np.sort(rng.integers(0, most, n)) for n in lengths]),
                        dtype=torch.int32, device="cuda")


def _cell(kern, args):
    """The tile of the build a call with `args` runs (the classes' cells)."""
    arch = "sm_90a" if torch.cuda.get_device_capability() == (9, 0) else "sm_80"
    config = kern.build(arch, gqa_group=args["q"].shape[-2] // args["k"].shape[-2],
                        ragged="cu_seqlens_q" in args, backend=kern.backend).config
    return config.block_m, config.block_n


def test_the_device_classes_are_the_masks_meaning(backend):
    kern = kernel("packed", backend)
    lens = [1, 700, 129, 1500, 70]
    docs = documents(lens)
    args = ragged(kern, lens, lens, 8, 2, doc=docs, doc_k=docs)
    made = kern.block_classes(**args)
    want = mhadsl.reference_block_classes(kern, args["q"], args["k"], cell=_cell(kern, args),
                                          **{n: v for n, v in args.items()
                                             if n not in ("q", "k", "v")})
    np.testing.assert_array_equal(made.numpy(), want)
    assert (want == 0).mean() > 0.3  # documents leave most tiles empty
    per = kernel("per_head", backend)  # the classes differ per head
    args = dense(per, 2, 600, 600, 4, 4,
                 table=torch.randint(0, 40, (4, 38), dtype=torch.int32, device="cuda"))
    want = mhadsl.reference_block_classes(per, args["q"], args["k"], cell=_cell(per, args),
                                          table=args["table"])
    assert want.shape[1] == 4
    np.testing.assert_array_equal(per.block_classes(**args).numpy(), want)
    assert_matches(per, args, lse=True)


def test_classes_made_once_serve_many_calls(backend):
    kern = kernel("packed", backend)
    lens = [300, 1000, 64]
    docs = documents(lens, 1)
    args = ragged(kern, lens, lens, 8, 2, one_offsets=True, doc=docs, doc_k=docs,
                  max_seqlen_q=1000, max_seqlen_k=1000)
    classes = kern.block_classes(**args)
    plain = kern(**args)
    for _ in range(2):  # the planned (torch fast path) call too
        given = kern(**args, block_classes=classes)
        assert torch.equal(given, plain)
    assert_matches(kern, {**args, "block_classes": classes}, lse=True)
    other = docs.clone()
    with pytest.raises(ValueError, match="other row offsets or operands"):
        kern(**{**args, "doc": other}, block_classes=classes)
    with pytest.raises(ValueError, match="made for a call on device 0 with 3 sequences of "
                                         "1000 query rows and 1000 keys at most"):
        kern(**{**args, "max_seqlen_q": 1100, "max_seqlen_k": 1100}, block_classes=classes)
    with pytest.raises(TypeError, match="classifies its tiles at compile time"):
        kernel("prefix_lm", backend)(args["q"], args["k"], args["v"],
                                     block_classes=classes, cu_seqlens_q=args["cu_seqlens_q"],
                                     cu_seqlens_k=args["cu_seqlens_q"],
                                     prefix=torch.tensor([3, 4, 5], dtype=torch.int32,
                                                         device="cuda"))
    with pytest.raises(TypeError, match="what Kernel.block_classes"):
        kern(**args, block_classes=np.zeros(4, np.uint8))
    # the same tensor's longer view, dense: the same tiles, other pairs
    per = kernel("per_batch", backend)
    doc = torch.zeros(1, 1100, dtype=torch.int32, device="cuda")
    doc[:, 1005:] = 1
    args = dense(per, 1, 1000, 1000, 4, 4, doc=doc[:, :1000])
    classes = per.block_classes(**args)
    longer = dense(per, 1, 1020, 1020, 4, 4, doc=doc[:, :1020])
    with pytest.raises(ValueError, match="made for a call on device 0 with 1 sequences of "
                                         "1000 query rows"):
        per(**longer, block_classes=classes)
    with pytest.raises(ValueError, match="another kernel"):
        mhadsl.compile(SOURCE + "\n", name="other.mha")["per_batch"](
            **args, block_classes=classes)


@pytest.mark.parametrize("design", ["backward", "backward_sm90"])
def test_the_backward_of_packed_documents(design):
    if design == "backward_sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 backward runs on compute capability 9.0 only")
    kern = kernel("packed")
    lens = [64, 513, 5, 300]
    docs = documents(lens, 2)
    args = ragged(kern, lens, lens, 8, 2, doc=docs, doc_k=docs)
    out, lse = kern(**args, return_lse=True)
    dout = torch.randn_like(out)
    kern.backend = design
    grads = kern.backward(args["q"], args["k"], args["v"], out, lse, dout,
                          cu_seqlens_q=args["cu_seqlens_q"], cu_seqlens_k=args["cu_seqlens_k"],
                          max_seqlen_q=513, max_seqlen_k=513, doc=docs, doc_k=docs)
    ref = mhadsl.reference_backward(kern, args["q"], args["k"], args["v"], dout,
                                    cu_seqlens_q=args["cu_seqlens_q"],
                                    cu_seqlens_k=args["cu_seqlens_k"], doc=docs, doc_k=docs)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        assert_close(name, got, want, dout)


def test_a_graph_replay_classifies_new_documents():
    kern = kernel("packed")
    lens = [400, 900]
    docs = documents(lens, 3)
    args = ragged(kern, lens, lens, 8, 2, one_offsets=True, doc=docs, doc_k=docs,
                  max_seqlen_q=900, max_seqlen_k=900)
    out = torch.empty_like(args["q"])
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm-up on the capture stream: plans, its buffers
        kern(**args, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        kern(**args, out=out)
    docs.copy_(documents(lens, 4, most=9))
    graph.replay()
    torch.cuda.synchronize()
    want = mhadsl.reference(kern, **args)
    got = out.float().cpu().numpy()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


def test_the_operator_compiles_whole_with_classes_per_call():
    """`torch.compile(fullgraph=True)` of the operator on packed documents, forward and
    backward (each classifying its tiles inside the operator): the float64 references."""
    kern = kernel("packed")
    op = kern.torch_op()
    lens = [100, 640, 1]
    docs = documents(lens, 5)
    args = ragged(kern, lens, lens, 4, 2, one_offsets=True)
    q, k, v = (args[n].clone().requires_grad_() for n in ("q", "k", "v"))
    cu = args["cu_seqlens_q"]

    def step(q, k, v, doc):
        out, _ = op(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=640,
                    max_seqlen_k=640, doc=doc, doc_k=doc)
        return out
    compiled = torch.compile(step, fullgraph=True)
    out = compiled(q, k, v, docs)
    dout = torch.randn_like(out)
    out.backward(dout)
    want = mhadsl.reference(kern, args["q"], args["k"], args["v"], cu_seqlens_q=cu,
                            cu_seqlens_k=cu, doc=docs, doc_k=docs)
    assert_close("out", out.detach(), want, dout)
    grads = mhadsl.reference_backward(kern, args["q"], args["k"], args["v"], dout,
                                      cu_seqlens_q=cu, cu_seqlens_k=cu, doc=docs, doc_k=docs)
    for name, got, ref in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), grads):
        assert_close(name, got, ref, dout)


@pytest.mark.parametrize("scheduler", ["Adaptive()", "LPT()", "LPT(heads_per_section = 1)",
                                       "Queued()", "Persistent()", "Transient()"])
def test_packed_documents_under_every_standard_scheduler(scheduler):
    source = SOURCE.replace("attention per_batch(doc: i32[batch, _]) {",
                            "attention per_batch(doc: i32[batch, _]) {\n"
                            f"    scheduler = {scheduler}")
    kern = mhadsl.compile(source, name="scheduled_documents")["per_batch"]
    args = dense(kern, 2, 1500, 1500, 4, 4,
                 doc=documents([1500] * 2, most=5).reshape(2, 1500))
    assert_matches(kern, args)
