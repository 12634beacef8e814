"""Benchmark: training with a learned score operand, forward + backward side by side in one
process.

    python3 benchmarks/operand_grads.py
    python3 benchmarks/operand_grads.py --rounds 3

Each row runs one training step's attention, forward and backward through autograd, bf16,
head dim 128, 16 query and K/V heads, causal, with one of two learned f32 tensors in the
score: a relative-position bias `s + table[h][q_idx - kv_idx]` (`table` (16, S): many pairs
add into each element) or a per-head gain `s * gain[h]` (one element per tile). Columns,
timed in turn over rounds (`mhadsl.host.bench.time_side_by_side`, medians, ms):

- mhadsl, the tensor learned: the torch operator with the tensor requiring a gradient
  (`mha_bwd_operand_grads` runs after the backward's kernels);
- mhadsl, the tensor fixed: the same step with the tensor not requiring one;
- FlexAttention: `flex_attention` compiled with the same `score_mod` closing over the
  tensor (requiring a gradient) and a causal block mask made once.

Each column's gradients (q, k, v and the tensor's) are first checked against mhadsl's
(relative difference < 2e-2); one that disagrees is left out.
"""
import argparse
import datetime
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import mhadsl  # noqa: E402
from mhadsl.host.bench import require_gpu, source_commit, time_side_by_side  # noqa: E402

SOURCE = """
import "std/schedulers.mha"
attention bias(table: f32[heads, _]) {
    dtype = bf16  head_dim = 128
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx
    score(s, b, h, q_idx, kv_idx) = s + table[h][q_idx - kv_idx]
}
attention gain(gain: f32[heads]) {
    dtype = bf16  head_dim = 128
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx
    score(s, b, h, q_idx, kv_idx) = s * gain[h]
}
"""
HEADS, HEAD_DIM = 16, 128
OPERAND = {"bias": "table", "gain": "gain"}  # each declaration's learned tensor
ROWS = [(1, 4096), (2, 4096), (4, 2048), (1, 8192)]  # (batch, tokens)


def difference(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch = require_gpu()
    program = mhadsl.compile(SOURCE, name="operand_grads.mha")
    gpu = torch.cuda.get_device_name()
    commit = source_commit()
    print(f"# a learned score tensor, forward + backward, {gpu}, {datetime.date.today()}, "
          f"commit {commit}: ms per step")
    print("| score | batch x tokens | mhadsl, learned | mhadsl, fixed | FlexAttention | "
          "Flex / learned |")
    print("|---|---|---|---|---|---|")
    for name in ("bias", "gain"):
        op = program[name].torch_op()
        for batch, tokens in ROWS:
            q, k, v = (torch.randn(batch, tokens, HEADS, HEAD_DIM, device="cuda",
                                   dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            shape = (HEADS, tokens) if name == "bias" else (HEADS,)
            learned = (torch.randn(shape, device="cuda") * 0.5 + (name == "gain")
                       ).requires_grad_()
            fixed = learned.detach()
            dout = torch.randn(batch, tokens, HEADS, HEAD_DIM, device="cuda",
                               dtype=torch.bfloat16)

            def step(t):
                def run():
                    for x in (q, k, v, learned):
                        x.grad = None
                    out, _ = op(q, k, v, **{OPERAND[name]: t})
                    out.backward(dout)
                    return [x.grad for x in (q, k, v, t)]
                return run
            want = step(learned)()
            fns = {"learned": step(learned), "fixed": step(fixed),
                   "flex": flex_step(torch, name, q, k, v, learned, dout, want)}
            times = time_side_by_side(torch, fns, rounds=args.rounds)

            def cell(column):
                return "—" if times[column] is None else f"{times[column].ms:.3f}"
            ratio = "—" if times["flex"] is None else \
                f"{times['flex'].ms / times['learned'].ms:.2f}"
            print(f"| {name} | {batch} x {tokens} | {cell('learned')} | {cell('fixed')} | "
                  f"{cell('flex')} | {ratio} |", flush=True)


def flex_step(torch, name, q, k, v, learned, dout, want):
    """FlexAttention's step with the same score; None where it cannot run or disagrees."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        tokens = q.shape[1]

        def score(s, b, h, qi, kv):
            if name == "bias":
                return s + learned[h, qi - kv]
            return s * learned[h]
        mask = create_block_mask(lambda b, h, qi, kv: kv <= qi, None, None, tokens, tokens,
                                 device="cuda")
        compiled = torch.compile(flex_attention, dynamic=False)

        def run():
            for x in (q, k, v, learned):
                x.grad = None
            out = compiled(qt, kt, vt, score_mod=score, block_mask=mask)
            out.transpose(1, 2).backward(dout)
            return [x.grad for x in (q, k, v, learned)]
        got = run()
    except Exception as err:  # noqa: BLE001 - inductor raises many types; the column is optional
        print(f"(FlexAttention unavailable: {type(err).__name__}: {str(err)[:100]})")
        return None
    worst = max(difference(a, b) for a, b in zip(got, want))
    if worst > 2e-2:
        print(f"(FlexAttention disagrees with mhadsl: relative difference {worst:.1e})")
        return None
    return run


if __name__ == "__main__":
    main()
