"""Benchmark: what a serving decode step adds to decode alone, side by side in one process
(`mhadsl.host.bench.time_side_by_side`): the step's new K/V rows written by the same call
(`k_new`/`v_new`), a learned sink per query head, and an FP8 (e4m3) cache.

    python3 benchmarks/serving_step.py [--rounds N]

Each row times, in turn, decode alone over a cache of `Sk` keys (`cache_seqlens` = Sk) and
the same step with one piece added; the ratio is the piece's time over decode alone's:

- append: `cache_seqlens` = Sk - Sq and the step's Sq rows passed as `k_new`/`v_new`, so
  the kernel writes them into the cache (crossing a page boundary where Sk - Sq is not a
  multiple of the page) and attends over the same Sk keys;
- sinks: the same declaration with `sink(b, h) = sink_logits[h]`;
- FP8: the cache in float8_e4m3fn with per-tensor scales (half the bytes).

Each variant's output is checked against the float64 references (`mhadsl.reference_decode`,
the first 4 sequences): relative error below 2e-2.

Then the split rule (`serving.BALANCED_MIN_KEYS`) on a generation step's batches: 8 calls
(a model's layers) with the step's row appended, captured in one CUDA graph and replayed,
the call's default split beside `num_splits=1`, µs per call; `short`: B32 with 169-992 keys
a sequence + 64 in a 1,120-key cache, `long`: B16 with 677-3,970 + 64 in 4,098
(`benchmarks/generate.py`'s prompts), paged 64.
"""
import argparse
import datetime

import mhadsl
from mhadsl.host.bench import require_gpu, source_commit, time_side_by_side

# (this folder's: a generation step's batches, and the error against a float64 reference)
from generate import WORKLOADS, prompt_lengths
from sanitize import relative_error

MASK = "mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = kv_idx <= q_idx + seqlen_k - seqlen_q"
SOURCE = f"""
import "std/schedulers.mha"
attention decode {{ dtype = bf16  head_dim = 128
    {MASK} }}
attention decode_sinks(sink_logits: f32[heads]) {{ dtype = bf16  head_dim = 128
    {MASK}
    sink(b, h) = sink_logits[h] }}
"""
ROWS = [  # piece, B, Hq, Hkv, Sq, Sk, page size (0: contiguous)
    ("append", 32, 32, 8, 1, 8192, 16), ("append", 32, 32, 8, 1, 8192, 64),
    ("append", 32, 32, 8, 1, 8192, 0), ("append", 32, 32, 8, 4, 8194, 64),
    ("sinks", 32, 32, 8, 1, 8192, 64), ("sinks", 32, 32, 8, 1, 8192, 0),
    ("FP8", 32, 32, 8, 1, 8192, 64), ("FP8", 32, 32, 8, 1, 8192, 0),
]
SCALES = dict(k_scale=0.05, v_scale=0.05)
FEW = 4  # sequences checked against the float64 reference
TOLERANCE = 2e-2


def row(torch, program, piece, B, Hq, Hkv, Sq, Sk, page, rounds):
    plain, sinks = program["decode"], program["decode_sinks"]
    q = torch.randn(B, Sq, Hq, D := 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((B,), Sk, dtype=torch.int32, device="cuda")
    shape, table = (B, Sk, Hkv, D), None
    if page:
        pages = B * -(-Sk // page)
        table = torch.randperm(pages, device="cuda").reshape(B, -1).to(torch.int32)
        shape = (pages, page, Hkv, D)
    k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(q)

    base = dict(cache_seqlens=lens, page_table=table, out=out)
    extra, check = {}, None
    if piece == "append":
        k_new, v_new = (torch.randn(B, Sq, Hkv, D, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
        before = lens - Sq
        kern, args = plain, (q, k, v)
        extra = dict(cache_seqlens=before, k_new=k_new, v_new=v_new)
        few_table = None if table is None else table[:FEW]
        cache = (k, v) if table is not None else (k[:FEW], v[:FEW])
        ref = mhadsl.reference_decode(plain, q[:FEW], *cache, cache_seqlens=before[:FEW],
                                      page_table=few_table, k_new=k_new[:FEW],
                                      v_new=v_new[:FEW])

        def appended():
            return ref, plain(q[:FEW], *(x.clone() for x in cache), cache_seqlens=before[:FEW],
                              page_table=few_table, k_new=k_new[:FEW], v_new=v_new[:FEW])
        check = appended
    elif piece == "sinks":
        logits = torch.randn(Hq, device="cuda", dtype=torch.float32)
        kern, args, extra = sinks, (q, k, v), dict(sink_logits=logits)
    else:
        k8, v8 = ((x.float() / SCALES[n]).clamp(-448, 448).to(torch.float8_e4m3fn)
                  for x, n in ((k, "k_scale"), (v, "v_scale")))
        kern, args, extra = plain, (q, k8, v8), SCALES
    fns = {"decode": lambda: plain(q, k, v, **base),
           piece: lambda: kern(*args, **{**base, **extra})}
    t = time_side_by_side(torch, fns, rounds=rounds)
    if check is None:
        few_table = None if table is None else table[:FEW]
        cache = args[1:] if table is not None else tuple(x[:FEW] for x in args[1:])
        call = dict(cache_seqlens=lens[:FEW], page_table=few_table,
                    **extra)
        ref = mhadsl.reference_decode(kern, q[:FEW], *cache, **call)
        got = kern(q[:FEW], *cache, **call)
    else:
        ref, got = check()
    err = relative_error(got, ref)
    layout = f"page {page}" if page else "contiguous"
    status = "" if err < TOLERANCE else "  FAILED: above tolerance"
    print(f"| {piece} | B{B} {Hq}:{Hkv}, Sq {Sq}, {Sk} keys, {layout} | "
          f"{t['decode'].ms * 1e3:.1f} | {t[piece].ms * 1e3:.1f} | "
          f"**{t[piece].ms / t['decode'].ms:.3f}×** | {err:.1e}{status} |", flush=True)
    return err < TOLERANCE


LAYERS = 8


def split_rule_row(torch, program, name, rounds):
    """The default split against one split on a generation step's batch, in a CUDA graph."""
    op = program["decode"].torch_decode_op()
    batch, shortest, longest = WORKLOADS[name]
    prompts = prompt_lengths(batch, shortest, longest)
    capacity, page, Hq, Hkv, D = max(prompts) + 128, 64, 32, 8, 128
    pages = -(-capacity // page)
    table = torch.randperm(batch * pages, device="cuda").reshape(batch, pages).int()
    k, v = (torch.randn(batch * pages, page, Hkv, D, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    lens = torch.tensor([n + 64 for n in prompts], dtype=torch.int32, device="cuda")
    q = torch.randn(batch, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(batch, 1, Hkv, D, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))

    def layers(**kw):
        def run():
            for _ in range(LAYERS):
                op(q, k, v, lens, page_table=table, k_new=k_new, v_new=v_new, **kw)
        return run
    graphs = {}
    stream = torch.cuda.Stream()
    for column, run in (("default", layers()), ("1 split", layers(num_splits=1))):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # (warmed up on the stream it is captured on)
            for _ in range(3):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graphs[column] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[column], stream=stream):
            run()
    t = time_side_by_side(torch, {c: g.replay for c, g in graphs.items()}, rounds=rounds)
    per_call = {c: x.ms * 1e3 / LAYERS for c, x in t.items()}
    print(f"| {name} | B{batch} 32:8, {min(prompts) + 64}-{max(prompts) + 64} keys, capacity "
          f"{capacity}, page {page} | {per_call['default']:.1f} | {per_call['1 split']:.1f} | "
          f"**{per_call['1 split'] / per_call['default']:.3f}×** |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch = require_gpu()
    program = mhadsl.compile(SOURCE, name="serving_step_bench")
    print(f"serving decode step, {datetime.date.today()}, {torch.cuda.get_device_name()}, "
          f"commit {source_commit()}; µs per call (medians)")
    print("| piece | shape | decode alone | with the piece | × decode alone | error vs float64 |")
    print("|---|---|---|---|---|---|")
    ok = all([row(torch, program, *r, args.rounds) for r in ROWS])
    print("\nthe split rule in a CUDA graph of 8 calls, the step's row appended; µs per call")
    print("| batch | shape | default | 1 split | 1 split ÷ default |")
    print("|---|---|---|---|---|")
    for name in ("short", "long"):
        split_rule_row(torch, program, name, args.rounds)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
