"""Attention sinks on the GPU against the float64 references: `examples/sinks.mha` (a
learned logit per head) in the forward of both designs, dense and ragged, with sinks that
take a little, most and none of each row's weight; decode against contiguous and paged
caches with one and several splits (the splits' merge adds the sink once); the backward of
both designs (the gradients of q, k and v see the sink through the forward's LSE; the
sink's own gradient per sequence and head); and the torch operator."""
import numpy as np
import pytest

import mhadsl
from helpers import REPO

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from test_gpu_attention import assert_matches, backend, dense, ragged  # noqa: E402,F401
from test_gpu_backward import assert_close  # noqa: E402
from test_gpu_decode import cache, check, queries  # noqa: E402

DECODE = """
attention decode_sinks(logits: f32[heads]) {
    dtype = bf16
    head_dim = 128
    mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = kv_idx <= q_idx + seqlen_k - seqlen_q
    sink(b, h) = logits[h] + 0.25 * f32(seqlen_q)
}
"""


def sinks(design=None):
    kern = mhadsl.compile(REPO / "examples" / "sinks.mha")["sinks"]
    kern.backend = design
    return kern


def logits(heads, kind):
    """Sink logits that take some of each row's weight (`mixed`), nearly all of it (`high`:
    the outputs go to 0) or none (`low`)."""
    if kind == "high":
        return torch.full((heads,), 60.0, device="cuda")
    if kind == "low":
        return torch.full((heads,), -60.0, device="cuda")
    return torch.linspace(-2.0, 6.0, heads, device="cuda")


@pytest.mark.parametrize("kind", ["mixed", "high", "low"])
def test_forward_dense_and_ragged(backend, kind):
    kern = sinks(backend)
    assert_matches(kern, dense(kern, 2, 700, 700, 8, 2, sink_logits=logits(8, kind)), lse=True)
    assert_matches(kern, ragged(kern, [0, 1, 129, 700], [0, 1, 129, 700], 8, 2,
                                sink_logits=logits(8, kind)), lse=True)


@pytest.mark.parametrize("page_size", [None, 64])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode(page_size, splits):
    kern = mhadsl.compile(DECODE)["decode_sinks"]
    k, v, seqlens, table = cache([4, 700, 4000], 2, 128, page_size=page_size)
    for rows in (1, 4):
        check(kern, queries(3, rows, 8, 128), k, v, seqlens, table, lse=True,
              num_splits=splits, logits=logits(8, "mixed"))


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward(deterministic):
    kern = sinks()
    values = dict(sink_logits=logits(4, "mixed"))
    for args in (dense(kern, 2, 300, 300, 4, 2), ragged(kern, [1, 129, 300], [1, 129, 300], 4, 2)):
        offsets = {n: args[n] for n in ("cu_seqlens_q", "cu_seqlens_k") if n in args}
        out, lse = kern(**args, return_lse=True, **values)
        dout = torch.randn_like(out)
        grads = kern.backward(args["q"], args["k"], args["v"], out, lse, dout, **offsets,
                              deterministic=deterministic, **values)
        ref = mhadsl.reference_backward(kern, args["q"], args["k"], args["v"], dout,
                                        **offsets, **values)
        assert len(grads) == len(ref) == 4
        for name, got, want in zip(("dq", "dk", "dv", "dsink"), grads, ref):
            assert_close(name, got, want, dout)
        if deterministic:  # the sink's gradient is summed in a fixed order too
            again = kern.backward(args["q"], args["k"], args["v"], out, lse, dout, **offsets,
                                  deterministic=True, **values)
            assert all(torch.equal(x, y) for x, y in zip(grads, again))


def test_the_operator_takes_the_sinks_and_learns_them():
    kern = sinks()
    op = kern.torch_op()
    args = dense(kern, 2, 300, 300, 4, 4)
    q, k, v = (args[n].requires_grad_() for n in "qkv")
    sink_logits = logits(4, "mixed").requires_grad_()
    out, _ = op(q, k, v, sink_logits=sink_logits)
    detached = [x.detach() for x in (q, k, v)]
    ref = mhadsl.reference(kern, *detached, sink_logits=sink_logits.detach())
    err = np.linalg.norm(out.detach().float().cpu().numpy() - ref) / np.linalg.norm(ref)
    assert err < 1e-2
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_grads = mhadsl.reference_backward(kern, *detached, dout,
                                          sink_logits=sink_logits.detach())
    assert_close("dq", q.grad, ref_grads[0], dout)
    # the sink of head h is sink_logits[h] in every sequence: its gradient sums over them
    assert_close("dsink", sink_logits.grad, ref_grads[3].sum(0), dout)
