"""Gradients of the f32 tensors a score reads, on the GPU against the float64 reference
(`mhadsl.reference_backward(..., operand_grads=...)`): a learned relative-position bias
(`examples/relative_bias.mha`) dense, ragged and with GQA, in both backward modes; scores
whose slope depends on s (a per-head scale, a soft cap around the bias) and whose reads
depend on s's control flow; a gain along the query rows of a ragged batch; and the torch
operator's autograd, eager and under `torch.compile(fullgraph=True)`."""
import numpy as np
import pytest

import mhadsl
from helpers import REPO

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from test_gpu_attention import dense, ragged  # noqa: E402
from test_gpu_backward import assert_close  # noqa: E402
from test_operand_grads import SCORES  # noqa: E402

# An operand's gradient sums signed dZ * slope terms over every pair, from a 16-bit P (as dS
# takes it), and their cancellation raises its relative error above the other gradients':
# over 40 random draws of the branching score's, median 5e-3, the largest 5e-2.
OPERAND_TOLERANCE = 3e-2


@pytest.fixture(autouse=True)
def fixed_draws():
    """The same inputs every run (the operands' errors depend on the draw)."""
    torch.manual_seed(0)


def kernels():
    return mhadsl.compile(SCORES, name="scores.mha")


def relative_bias():
    return mhadsl.compile(REPO / "examples" / "relative_bias.mha")["relative_bias"]


def check(kern, args, names, deterministic=False):
    """The call's gradients, the operands' among them, against the reference."""
    offsets = {n: args[n] for n in ("cu_seqlens_q", "cu_seqlens_k") if n in args}
    operands = {n: args[n] for n in args if n not in ("q", "k", "v", *offsets)}
    out, lse = kern(**args, return_lse=True)
    dout = torch.randn_like(out)
    *grads, found = kern.backward(args["q"], args["k"], args["v"], out, lse, dout, **offsets,
                                  deterministic=deterministic, operand_grads=names,
                                  **operands)
    *ref, want = mhadsl.reference_backward(kern, args["q"], args["k"], args["v"], dout,
                                           operand_grads=names, **offsets, **operands)
    for name, got, expected in zip(("dq", "dk", "dv"), grads, ref):
        assert_close(name, got, expected, dout)
    assert set(found) == set(names)
    for name in names:
        assert found[name].dtype == torch.float32
        assert found[name].shape == operands[name].shape
        assert_close("d" + name, found[name], want[name], dout, OPERAND_TOLERANCE)
    return found


@pytest.mark.parametrize("deterministic", [False, True])
def test_relative_bias_table_dense_ragged_and_gqa(deterministic):
    kern = relative_bias()
    table = torch.randn(8, 600, device="cuda")
    check(kern, dense(kern, 2, 300, 300, 8, 2, table=table), ("table",), deterministic)
    check(kern, ragged(kern, [1, 129, 300], [1, 129, 300], 8, 8, table=table), ("table",),
          deterministic)


def test_slopes_that_depend_on_s_and_reads_on_its_branches():
    program = kernels()
    kern = program["scaled"]
    gain = torch.rand(4, device="cuda") + 0.5
    check(kern, dense(kern, 2, 200, 200, 4, 4, gain=gain), ("gain",))
    kern = program["capped"]
    table = torch.randn(4, 1024, device="cuda")
    check(kern, dense(kern, 1, 300, 300, 4, 2, table=table), ("table",))
    kern = program["branchy"]
    low, high = torch.randn(4, device="cuda"), torch.randn(4, device="cuda")
    found = check(kern, dense(kern, 2, 150, 170, 4, 4, low=low, high=high), ("low", "high"))
    assert found["low"].abs().sum() > 0 and found["high"].abs().sum() > 0


def test_pairs_of_no_probability_add_nothing_where_the_slope_is_infinite():
    """log(prior) at a prior of 0: those pairs' scores are -inf (P = 0) and their slope
    1 / 0; they add 0, as in the reference, not NaN."""
    kern = kernels()["log_prior"]
    prior = torch.rand(4, 300, device="cuda") + 0.1
    prior[:, 3] = 0.0
    found = check(kern, dense(kern, 2, 200, 300, 4, 4, prior=prior), ("prior",))
    assert torch.isfinite(found["prior"]).all() and (found["prior"][:, 3] == 0).all()


def test_a_gain_along_the_query_rows_of_a_ragged_batch():
    kern = kernels()["row_gain"]
    lens = [1, 129, 300]
    gain = torch.rand(sum(lens), device="cuda") + 0.5
    found = check(kern, ragged(kern, lens, lens, 4, 4, gain=gain), ("gain",))
    assert abs(found["gain"][0]) < 1e-3  # (one key: P = 1, dZ = 0 up to rounding)


def test_asking_for_no_operand_gradient_adds_nothing():
    kern = relative_bias()
    table = torch.randn(8, 600, device="cuda")
    args = dense(kern, 1, 200, 200, 8, 8, table=table)
    out, lse = kern(**args, return_lse=True)
    dout = torch.randn_like(out)
    plain = kern.backward(args["q"], args["k"], args["v"], out, lse, dout, table=table)
    *grads, found = kern.backward(args["q"], args["k"], args["v"], out, lse, dout, table=table,
                                  operand_grads=("table",))
    assert len(plain) == 3 and set(found) == {"table"}
    for a, b in zip(plain, grads):  # (the builds' tiles may differ: not bitwise)
        assert_close("same", a, b.float().cpu().numpy().astype(np.float64), dout)


def test_autograd_sends_the_table_its_gradient_eager_and_compiled():
    kern = relative_bias()
    op = kern.torch_op()
    args = dense(kern, 2, 256, 256, 8, 2)
    q, k, v = (args[n].requires_grad_() for n in ("q", "k", "v"))
    table = torch.randn(8, 512, device="cuda", requires_grad=True)
    dout = torch.randn_like(args["q"])
    want = mhadsl.reference_backward(kern, q.detach(), k.detach(), v.detach(), dout,
                                     table=table.detach(), operand_grads=("table",))[-1]
    for run in (op, torch.compile(op, fullgraph=True)):
        table.grad = None
        out, _ = run(q, k, v, table=table)
        out.backward(dout)
        assert_close("dtable", table.grad, want["table"], dout)
    # a table that needs no gradient gets none, and its call adds none
    frozen = table.detach()
    out, _ = op(q, k, v, table=frozen)
    out.backward(dout)
    assert frozen.grad is None


def test_sizes_and_refusals():
    kern = relative_bias()
    args = dense(kern, 1, 64, 64, 8, 8, table=torch.randn(8, 64, device="cuda"))
    out, lse = kern(**args, return_lse=True)
    call = (args["q"], args["k"], args["v"], out, lse, torch.randn_like(out))
    with pytest.raises(TypeError, match="no operand 'bias'"):
        kern.backward(*call, table=args["table"], operand_grads=("bias",))
    with pytest.raises(TypeError, match="operand names"):
        kern.backward(*call, table=args["table"], operand_grads="table")
    np.testing.assert_equal(kern.backward(*call, table=args["table"],
                                          operand_grads=())[0].shape, args["q"].shape)
