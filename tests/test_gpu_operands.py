"""Operands on the GPU against the float64 references: `examples/runtime_window.mha` (a
sliding window and a soft cap passed at each call) in the forward of both designs, dense and
ragged, decode against contiguous and paged caches, the backward of both designs (atomic and
deterministic), and the torch operator; a new value never rebuilds, and reaches the kernel
(a window of one key is the identity on V)."""
import numpy as np
import pytest

import mhadsl
from helpers import REPO

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from test_gpu_attention import assert_matches, backend, dense, ragged  # noqa: E402,F401
from test_gpu_backward import assert_close  # noqa: E402
from test_gpu_decode import cache, check, queries  # noqa: E402

VALUES = [dict(), dict(window=1, cap=5.0), dict(window=300, cap=2.5),
          dict(window=-3), dict(window=1 << 30, cap=1e4)]


def windowed(design=None):
    kern = mhadsl.compile(REPO / "examples" / "runtime_window.mha")["runtime_window"]
    kern.backend = design
    return kern


@pytest.mark.parametrize("values", VALUES, ids=str)
def test_forward_dense_and_ragged(backend, values):
    kern = windowed(backend)
    assert_matches(kern, dense(kern, 2, 700, 900, 8, 2, **values), lse=True)
    assert_matches(kern, ragged(kern, [0, 1, 129, 700], [0, 5, 300, 700], 8, 2, **values))


def test_a_new_value_never_builds_and_reaches_the_kernel(backend):
    """The first call loads the forward's two builds (the window a short band of keys or
    not); every value after it runs one of them."""
    kern = windowed(backend)
    args = dense(kern, 1, 256, 256, 4, 4)
    assert_matches(kern, dict(args, **VALUES[0]))
    loaded, built = dict(kern.launcher.loaded), kern.builds_compiled
    assert sorted(key[0].short_band for key in loaded) == [False, True]
    for values in VALUES[1:]:
        assert_matches(kern, dict(args, **values))
    assert kern.launcher.loaded == loaded and kern.builds_compiled == built
    assert sorted(key[4].short_band for key in kern.launcher.plans) == [False, True]
    out = kern(**args, window=1)  # each row keeps its own key alone: out = v
    torch.testing.assert_close(out, args["v"])


@pytest.mark.parametrize("page_size", [None, 64])
@pytest.mark.parametrize("values", VALUES[1:3], ids=str)
def test_decode(page_size, values):
    kern = windowed()
    k, v, seqlens, table = cache([4, 700, 4000], 2, 128, page_size=page_size)
    out = check(kern, queries(3, 4, 8, 128), k, v, seqlens, table, **values)
    assert out.shape == (3, 4, 8, 128)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("values", VALUES[1:3], ids=str)
def test_backward(values, deterministic):
    kern = windowed()
    for args in (dense(kern, 2, 300, 400, 4, 2), ragged(kern, [1, 129, 300], [5, 200, 300], 4, 2)):
        offsets = {n: args[n] for n in ("cu_seqlens_q", "cu_seqlens_k") if n in args}
        out, lse = kern(**args, return_lse=True, **values)
        dout = torch.randn_like(out)
        grads = kern.backward(args["q"], args["k"], args["v"], out, lse, dout, **offsets,
                              deterministic=deterministic, **values)
        ref = mhadsl.reference_backward(kern, args["q"], args["k"], args["v"], dout,
                                        **offsets, **values)
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
            assert_close(name, got, want, dout)


def test_the_operator_takes_operands_and_compiles_without_a_graph_break():
    kern = windowed()
    op = kern.torch_op()
    args = dense(kern, 1, 300, 300, 4, 4)
    q, k, v = (args[n].requires_grad_() for n in "qkv")
    out, _ = op(q, k, v, window=64, cap=3.0)
    ref = mhadsl.reference(kern, q.detach(), k.detach(), v.detach(), window=64, cap=3.0)
    err = np.linalg.norm(out.detach().float().cpu().numpy() - ref) / np.linalg.norm(ref)
    assert err < 1e-2
    out.sum().backward()
    want = mhadsl.reference_backward(kern, q.detach(), k.detach(), v.detach(),
                                     torch.ones_like(out), window=64, cap=3.0)
    assert_close("dq", q.grad, want[0], torch.ones_like(out))
    compiled = torch.compile(lambda q, k, v, w: op(q, k, v, window=w)[0], fullgraph=True)
    for w in (8, 64):
        torch.testing.assert_close(compiled(q, k, v, w), op(q, k, v, window=w)[0])
    with torch.no_grad():  # out= with the operands by name, then in their places
        want = op(q, k, v, window=64, cap=3.0)[0]
        for call in (lambda out: op(q, k, v, window=64, cap=3.0, out=out),
                     lambda out: op(q, k, v, *(None,) * 6, 64, 3.0, out=out)):
            out = torch.empty_like(want)
            assert call(out)[0] is out and torch.equal(out, want)


# ---------------------------------------------------------------- tensor operands
def example(name: str, design=None):
    kern = mhadsl.compile(REPO / "examples" / f"{name}.mha")[name]
    kern.backend = design
    return kern


def test_prefix_lm_dense_and_ragged(backend):
    kern = example("prefix_lm", backend)
    prefix = torch.tensor([0, 700, 5], dtype=torch.int32, device="cuda")
    assert_matches(kern, dense(kern, 3, 700, 700, 8, 2, prefix=prefix), lse=True)
    assert_matches(kern, ragged(kern, [1, 700, 129], [1, 700, 129], 8, 2,
                                prefix=torch.tensor([1, 300, 200], dtype=torch.int32,
                                                    device="cuda")))
    host = prefix.cpu().numpy()  # a NumPy tensor operand is copied, as q would be
    assert_matches(kern, dense(kern, 3, 300, 300, 8, 2, prefix=host))


def test_relative_bias_reads_its_table_and_zero_past_it(backend):
    kern = example("relative_bias", backend)
    for distances in (4096, 100):  # 100: most scores read past the table's end
        table = torch.randn(8, distances, device="cuda")
        assert_matches(kern, dense(kern, 2, 600, 600, 8, 2, table=table))
    strided = torch.randn(8, 256, device="cuda")[:, ::2]  # strides (256, 2)
    assert_matches(kern, dense(kern, 1, 300, 300, 8, 8, table=strided))


def test_tensor_operands_in_decode_and_the_backward():
    kern = example("relative_bias")
    table = torch.randn(8, 1000, device="cuda")
    k, v, seqlens, pages = cache([4, 700, 4000], 2, 128, page_size=64)
    check(kern, queries(3, 4, 8, 128), k, v, seqlens, pages, table=table)
    args = dense(kern, 2, 300, 400, 8, 2)
    out, lse = kern(**args, table=table, return_lse=True)
    dout = torch.randn_like(out)
    grads = kern.backward(args["q"], args["k"], args["v"], out, lse, dout, table=table)
    ref = mhadsl.reference_backward(kern, args["q"], args["k"], args["v"], dout, table=table)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        assert_close(name, got, want, dout)


def test_document_mask(backend):
    kern = example("document_mask", backend)
    lengths = [1, 300, 129, 600, 70]  # documents packed end to end, per sequence
    ids = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])
    doc = torch.stack([ids, ids.flip(0)]).cuda()
    s = len(ids)
    assert_matches(kern, dense(kern, 2, s, s, 8, 2, doc=doc), lse=True)


def test_run_and_trace_take_a_tensor_operand_from_the_command_line(capsys):
    """`mhadsl run` checks the kernel with the tensor against the float64 reference;
    `mhadsl trace` records every tile exactly once with it."""
    from mhadsl.cli import main
    path = str(REPO / "examples" / "prefix_lm.mha")
    assert main(["run", path, "--kernel", "prefix_lm", "--batch", "2", "--seqlen", "700",
                 "--heads", "4", "--operand", "prefix=100,650"]) == 0
    assert "(ok)" in capsys.readouterr().out
    assert main(["trace", path, "--kernel", "prefix_lm", "--seqlens", "300,1000,90",
                 "--heads", "2", "--operand", "prefix=0,999,45"]) == 0
    assert "every valid tile exactly once" in capsys.readouterr().out
