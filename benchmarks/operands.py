"""Benchmark: masks and scores that read operands, side by side in one process.

    python3 benchmarks/operands.py                          # every workload
    python3 benchmarks/operands.py --workload documents     # or bias, sinks, runtime
    python3 benchmarks/operands.py --runs 3 --no-flex       # each row three times; no Flex

bf16, head dim 128, 16 query and K/V heads; every column of a row timed in turn over rounds
(`mhadsl.host.bench.time_side_by_side`, medians; with `--runs N` the row is timed N times and
each cell is the median, then the range). TFLOP/s count the kept pairs' work
(4 x pairs x head dim x heads). Every column's output is first checked against mhadsl's
(relative difference < 2e-2); one that disagrees is left out.

- `documents`: sequences of documents packed end to end (lengths drawn uniformly from a
  range, seeded), a token seeing the earlier tokens of its own document
  (`examples/document_mask.mha`, `doc` the position's document id). Columns: the call with
  its tile classes made once and passed (`block_classes=`, as every layer of a model shares
  them); the call classifying per call, and what that costs over the first (its time less
  the first's, run by run: the classes kernel in the call's stream, with no allocation);
  mhadsl's ragged causal call and FlashAttention-4's varlen entry with the documents as
  `cu_seqlens` (the specialised path); FlexAttention with a block mask made once from the
  same ids.
- `bias`: a per-head relative-position bias table (`examples/relative_bias.mha`), causal,
  against the same declaration without the score and FlexAttention's `score_mod` over the same
  table; the table's gradient against the float64 reference (`mhadsl.reference_backward`) on
  a smaller shape.
- `sinks`: a learned sink logit per query head (`sink(b, h) = sink_logits[h]`), causal,
  forward and backward (`Kernel.backward`, the sink's gradient too) against the same
  declaration without the sink; the gradients against the float64 reference on a smaller
  shape.
- `runtime`: `examples/runtime_window.mha` (a window and a soft cap passed per call as scalar
  operands) against the same rule with both written as constants, and each alone.
"""
import argparse
import datetime
import statistics
import sys
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import mhadsl  # noqa: E402
from mhadsl.host.bench import require_gpu, source_commit, time_side_by_side  # noqa: E402

HEADS, HEAD_DIM = 16, 128
CONSTANTS = """
import "std/schedulers.mha"
attention causal { dtype = bf16  head_dim = 128  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention window_softcap { dtype = bf16  head_dim = 128
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx && q_idx - kv_idx < 256
    score(s, b, h, q_idx, kv_idx) = 30.0 * tanh(s / 30.0) }
attention window_1024 { dtype = bf16  head_dim = 128
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx && q_idx - kv_idx < 1024 }
attention softcap { dtype = bf16  head_dim = 128
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx
    score(s, b, h, q_idx, kv_idx) = 30.0 * tanh(s / 30.0) }
attention cap_per_call(cap: f32) { dtype = bf16  head_dim = 128
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx
    score(s, b, h, q_idx, kv_idx) = cap * tanh(s / cap) }
attention causal_sinks(sink_logits: f32[heads]) { dtype = bf16  head_dim = 128
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx
    sink(b, h) = sink_logits[h] }
attention window_per_call(window: i32) { dtype = bf16  head_dim = 128
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx && q_idx - kv_idx < window }
"""
DOCUMENT_ROWS = [  # (sequences, tokens per sequence, shortest document, longest document)
    (1, 16384, 256, 4096),
    (1, 32768, 1024, 8192),
    (4, 8192, 128, 2048),
    (8, 4096, 64, 1024),
]
BIAS_ROWS = [(4, 4096), (1, 16384)]  # (batch, tokens)
# FlexAttention's kernel for the bias table's `score_mod` faulted (an illegal address, which
# ends the process's CUDA context) at B1 S16384 (H200, torch 2.11); longer rows go without it
FLEX_BIAS_TOKENS = 8192
GRADIENT_SHAPE = (1, 1024)  # the gradients' check against float64: (batch, tokens)
# (what, runtime kernel, its scalars, constant kernel, window or None): B4 S4096
RUNTIME_ROWS = [
    ("window 256 and softcap 30", "runtime_window", {"window": 256, "cap": 30.0},
     "window_softcap", 256),
    ("window 1024", "window_per_call", {"window": 1024}, "window_1024", 1024),
    ("softcap 30", "cap_per_call", {"cap": 30.0}, "softcap", None),
]


def header(*columns: str) -> None:
    """A markdown table's header row and rule."""
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))


def qkv(torch, batch: int, tokens: int) -> tuple:
    """Random bf16 q, k and v, (batch, tokens, HEADS, HEAD_DIM)."""
    return tuple(torch.randn(batch, tokens, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                 for _ in range(3))


def difference(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def agrees(peer: str, out, expected) -> bool:
    error = difference(out, expected)
    if error > 2e-2:
        print(f"({peer} disagrees with mhadsl: relative difference {error:.1e})")
    return error <= 2e-2


def timed_runs(torch, fns: dict, rounds: int, runs: int) -> dict[str, list[float] | None]:
    """Each function's median ms per run, `runs` runs of `time_side_by_side`."""
    per_run = [time_side_by_side(torch, fns, rounds=rounds) for _ in range(runs)]
    return {name: None if per_run[0][name] is None else [t[name].ms for t in per_run]
            for name in fns}


def cell(figure: list[float] | None, digits: int = 0, unit: str = "") -> str:
    """The runs' median, then their range where they differ at these digits."""
    if figure is None:
        return "—"
    mid, lo, hi = statistics.median(figure), min(figure), max(figure)
    spread = "" if f"{lo:.{digits}f}" == f"{hi:.{digits}f}" else \
        f" ({lo:.{digits}f}–{hi:.{digits}f})"
    return f"{mid:.{digits}f}{unit}{spread}"


def tflops(flops: float, ms: list[float] | None) -> list[float] | None:
    return None if ms is None else [flops / t / 1e9 for t in ms]


def speedup(ours: list[float] | None, peer: list[float] | None) -> str:
    """The peer's time over ours, run by run (above 1: mhadsl is faster)."""
    if ours is None or peer is None:
        return "—"
    return cell([p / o for o, p in zip(ours, peer)], 2, "×")


def flex_attention_fn(torch, q, k, v, expected, mask_mod, score_mod=None):
    """FlexAttention compiled, its block mask made once; None where it cannot run or
    disagrees with `expected`."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        block_mask = torch.compile(create_block_mask)(mask_mod, q.shape[0], None, q.shape[1],
                                                      k.shape[1], device="cuda")
        compiled = torch.compile(flex_attention, dynamic=False)

        def run():
            return compiled(qt, kt, vt, score_mod=score_mod, block_mask=block_mask)
        out = run().transpose(1, 2)
    except Exception as err:  # noqa: BLE001 - inductor raises many types; the column is optional
        print(f"(FlexAttention unavailable: {type(err).__name__}: {str(err)[:100]})")
        return None
    return run if agrees("FlexAttention", out, expected) else None


def fa4_varlen_fn(torch, q, k, v, cu, longest: int, expected):
    """FlashAttention-4's varlen entry, causal, over the sequences `cu` cuts; None where it is
    not installed, cannot run or disagrees."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError:
        return None
    warnings.filterwarnings("ignore", message="Argument aux_data")

    def run():
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                      max_seqlen_q=longest, max_seqlen_k=longest,
                                      causal=True)[0]
    try:
        out = run()
    except Exception as err:  # noqa: BLE001 - the CuTe DSL raises many types; optional column
        print(f"(FlashAttention-4 unavailable: {type(err).__name__}: {str(err)[:100]})")
        return None
    return run if agrees("FlashAttention-4", out.reshape(expected.shape), expected) else None


def documents(rng, tokens: int, shortest: int, longest: int) -> list[int]:
    """Document lengths drawn uniformly, the last cut to fill `tokens` exactly."""
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(rng.integers(shortest, longest + 1)))
    lengths[-1] -= sum(lengths) - tokens
    return lengths


def documents_table(torch, kernels, args) -> None:
    kern, causal = kernels["document_mask"], kernels["causal"]
    header("batch", "documents", "mhadsl, classes given", "mhadsl, classes per call",
           "classifying (ms)", "mhadsl ragged", "FlashAttention-4 varlen", "FlexAttention",
           "classifying / given", "given / FA4", "given / Flex")
    rng = np.random.default_rng(0)
    for batch, tokens, shortest, longest in DOCUMENT_ROWS:
        per_seq = [documents(rng, tokens, shortest, longest) for _ in range(batch)]
        doc = torch.tensor(np.stack([np.repeat(np.arange(len(d)), d) for d in per_seq]),
                           dtype=torch.int32, device="cuda")
        q, k, v = qkv(torch, batch, tokens)
        classes = kern.block_classes(q, k, v, doc=doc)
        flat = [n for d in per_seq for n in d]
        cu = torch.tensor(np.concatenate(([0], np.cumsum(flat))), dtype=torch.int32,
                          device="cuda")
        qr, kr, vr = (x.reshape(batch * tokens, HEADS, HEAD_DIM) for x in (q, k, v))
        expected = kern(q, k, v, doc=doc)
        fns = {
            "given": lambda: kern(q, k, v, doc=doc, block_classes=classes),
            "per call": lambda: kern(q, k, v, doc=doc),
            "ragged": lambda: causal(qr, kr, vr, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                     max_seqlen_q=max(flat), max_seqlen_k=max(flat)),
            "fa4": fa4_varlen_fn(torch, qr, kr, vr, cu, max(flat), expected),
            "flex": None if args.no_flex or tokens > FLEX_BIAS_TOKENS else flex_attention_fn(
                torch, q, k, v, expected,
                lambda b, h, qi, kv: (doc[b, qi] == doc[b, kv]) & (kv <= qi)),
        }
        for name in ("given", "ragged"):
            if not agrees(name, fns[name]().reshape(expected.shape), expected):
                fns[name] = None
        ms = timed_runs(torch, fns, args.rounds, args.runs)
        flops = 4.0 * sum(n * (n + 1) // 2 for n in flat) * HEAD_DIM * HEADS
        classifying = None if ms["given"] is None else \
            [p - g for p, g in zip(ms["per call"], ms["given"])]
        share = "—" if classifying is None else \
            cell([100 * c / g for c, g in zip(classifying, ms["given"])], 1, " %")
        print(f"| {batch} x {tokens} | {len(flat)} of {shortest}–{longest} | "
              f"{cell(tflops(flops, ms['given']))} | {cell(tflops(flops, ms['per call']))} | "
              f"{cell(classifying, 3)} | {cell(tflops(flops, ms['ragged']))} | "
              f"{cell(tflops(flops, ms['fa4']))} | {cell(tflops(flops, ms['flex']))} | "
              f"{share} | {speedup(ms['given'], ms['fa4'])} | "
              f"{speedup(ms['given'], ms['flex'])} |", flush=True)


def bias_table(torch, kernels, args) -> None:
    kern, causal = kernels["relative_bias"], kernels["causal"]
    header("batch x tokens", "mhadsl, bias", "mhadsl, no bias", "FlexAttention, bias",
           "bias / no bias", "bias / Flex")
    for batch, tokens in BIAS_ROWS:
        q, k, v = qkv(torch, batch, tokens)
        table = torch.randn(HEADS, tokens, device="cuda") * 0.5
        expected = kern(q, k, v, table=table)
        fns = {
            "bias": lambda: kern(q, k, v, table=table),
            "plain": lambda: causal(q, k, v),
            "flex": None if args.no_flex else flex_attention_fn(
                torch, q, k, v, expected, lambda b, h, qi, kv: kv <= qi,
                lambda s, b, h, qi, kv: s + table[h, qi - kv]),
        }
        ms = timed_runs(torch, fns, args.rounds, args.runs)
        flops = 4.0 * batch * tokens * (tokens + 1) / 2 * HEAD_DIM * HEADS
        print(f"| {batch} x {tokens} | {cell(tflops(flops, ms['bias']))} | "
              f"{cell(tflops(flops, ms['plain']))} | {cell(tflops(flops, ms['flex']))} | "
              f"{speedup(ms['bias'], ms['plain'])} | {speedup(ms['bias'], ms['flex'])} |",
              flush=True)
    gradient_errors(torch, kern, ("dq", "dk", "dv", "dtable"), dict(operand_grads=("table",)),
                    lambda tokens: dict(table=torch.randn(HEADS, tokens, device="cuda") * 0.5))


def gradient_errors(torch, kern, names, options: dict, operands) -> None:
    """Prints the relative error of each gradient of a call at `GRADIENT_SHAPE` against the
    float64 reference; `operands(tokens)` makes the call's operands."""
    batch, tokens = GRADIENT_SHAPE
    q, k, v = qkv(torch, batch, tokens)
    values = operands(tokens)
    out, lse = kern(q, k, v, return_lse=True, **values)
    dout = torch.randn_like(out)
    got = kern.backward(q, k, v, out, lse, dout, **options, **values)
    want = mhadsl.reference_backward(kern, q, k, v, dout, **options, **values)
    if "operand_grads" in options:  # the last result: a dict of the operands' gradients
        got = (*got[:-1], *got[-1].values())
        want = (*want[:-1], *want[-1].values())
    errors = {name: difference(g, torch.from_numpy(np.asarray(w)).to(g.device))
              for name, g, w in zip(names, got, want)}
    print(f"- gradients at B{batch} S{tokens} H{HEADS} against float64 (relative): " +
          ", ".join(f"{name} {e:.1e}" for name, e in errors.items()))


def sinks_table(torch, kernels, args) -> None:
    kern, causal = kernels["causal_sinks"], kernels["causal"]
    header("pass (causal)", "batch x tokens", "mhadsl, sinks", "mhadsl, no sinks",
           "sinks / no sinks")
    for batch, tokens in BIAS_ROWS:
        q, k, v = qkv(torch, batch, tokens)
        sink_logits = torch.randn(HEADS, device="cuda")
        out, lse = kern(q, k, v, sink_logits=sink_logits, return_lse=True)
        plain_out, plain_lse = causal(q, k, v, return_lse=True)
        dout = torch.randn_like(out)
        flops = 4.0 * batch * tokens * (tokens + 1) / 2 * HEAD_DIM * HEADS
        passes = {
            "forward": ({"sinks": lambda: kern(q, k, v, sink_logits=sink_logits),
                         "plain": lambda: causal(q, k, v)}, flops),
            "backward": ({"sinks": lambda: kern.backward(q, k, v, out, lse, dout,
                                                         sink_logits=sink_logits),
                          "plain": lambda: causal.backward(q, k, v, plain_out, plain_lse,
                                                           dout)}, 2.5 * flops),
        }
        for name, (fns, work) in passes.items():
            ms = timed_runs(torch, fns, args.rounds, args.runs)
            print(f"| {name} | {batch} x {tokens} | {cell(tflops(work, ms['sinks']))} | "
                  f"{cell(tflops(work, ms['plain']))} | {speedup(ms['sinks'], ms['plain'])} |",
                  flush=True)
    gradient_errors(torch, kern, ("dq", "dk", "dv", "dsink"), {},
                    lambda tokens: dict(sink_logits=torch.randn(HEADS, device="cuda")))


def runtime_table(torch, kernels, args) -> None:
    batch, tokens = 4, 4096
    header(f"rule (B{batch} S{tokens} H{HEADS})", "mhadsl, scalars per call",
           "mhadsl, constants", "scalars / constants")
    q, k, v = qkv(torch, batch, tokens)
    for what, runtime, scalars, constant, window in RUNTIME_ROWS:
        run_kern, const_kern = kernels[runtime], kernels[constant]
        expected = const_kern(q, k, v)
        if not agrees(what, run_kern(q, k, v, **scalars), expected):
            continue
        fns = {"runtime": lambda: run_kern(q, k, v, **scalars),
               "constant": lambda: const_kern(q, k, v)}
        ms = timed_runs(torch, fns, args.rounds, args.runs)
        kept = sum(min(i + 1, window or tokens) for i in range(tokens))
        flops = 4.0 * batch * kept * HEAD_DIM * HEADS
        print(f"| {what} | {cell(tflops(flops, ms['runtime']))} | "
              f"{cell(tflops(flops, ms['constant']))} | "
              f"{speedup(ms['runtime'], ms['constant'])} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", choices=("all", "documents", "bias", "sinks", "runtime"),
                        default="all")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--no-flex", action="store_true", help="leave FlexAttention out")
    args = parser.parse_args()
    torch = require_gpu()
    kernels = dict(mhadsl.compile(CONSTANTS, name="operands.mha"))
    for example in ("document_mask", "relative_bias", "runtime_window"):
        kernels[example] = mhadsl.compile(REPO / "examples" / f"{example}.mha")[example]
    print(f"# operands in masks and scores, {torch.cuda.get_device_name()}, "
          f"{datetime.date.today()}, commit {source_commit()}: TFLOP/s (ms where said)")
    tables = {"documents": documents_table, "bias": bias_table, "sinks": sinks_table,
              "runtime": runtime_table}
    for name, table in tables.items():
        if args.workload in ("all", name):
            print(f"\n## {name}\n")
            table(torch, kernels, args)


if __name__ == "__main__":
    main()
