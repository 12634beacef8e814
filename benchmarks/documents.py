"""Benchmark: packed documents, a mask that reads data, side by side in one process.

    python3 benchmarks/documents.py                 # every row
    python3 benchmarks/documents.py --rounds 3

Each row is one batch of sequences, each holding documents packed end to end (lengths drawn
uniformly from a range, seeded), with a token attending to the earlier tokens of its own
document (causal inside each), bf16, head dim 128, 16 query and K/V heads. Columns, timed in
turn over rounds (`mhadsl.host.bench.time_side_by_side`, medians):

- mhadsl per call: `attention packed(doc: i32[batch, queries], doc_k: i32[batch, keys])` on
  the dense batch, each call classifying its tiles on the device first (`codegen.block_classes`);
- mhadsl, classes given: the same call with `block_classes=` made once (as every layer of a
  model would share them);
- mhadsl ragged: the documents as the sequences of a ragged causal call (the same pairs, no
  data read: what the classes can at best reach);
- FlexAttention: `flex_attention` compiled, with its block mask made once by
  `create_block_mask` from the same document ids (its usual form).

TFLOP/s count the kept pairs' work (4 x pairs x head dim x heads). Every column's output is
first checked against mhadsl's (relative difference < 2e-2); one that disagrees is left out.
"""
import argparse
import datetime
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import mhadsl  # noqa: E402
from mhadsl.host.bench import require_gpu, source_commit, time_side_by_side  # noqa: E402

SOURCE = """
import "std/schedulers.mha"
attention packed(doc: i32[batch, queries], doc_k: i32[batch, keys]) {
    dtype = bf16  head_dim = 128
    mask(b, h, q_idx, kv_idx) = doc[b][q_idx] == doc_k[b][kv_idx] && kv_idx <= q_idx
}
attention causal() {
    dtype = bf16  head_dim = 128
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx
}
"""
HEADS, HEAD_DIM = 16, 128
ROWS = [  # (sequences, tokens per sequence, shortest document, longest document)
    (1, 16384, 256, 4096),
    (1, 32768, 1024, 8192),
    (4, 8192, 128, 2048),
    (8, 4096, 64, 1024),
]


def documents(rng, tokens: int, shortest: int, longest: int) -> list[int]:
    """Document lengths drawn uniformly, the last cut to fill `tokens` exactly."""
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(rng.integers(shortest, longest + 1)))
    lengths[-1] -= sum(lengths) - tokens
    return lengths


def agrees(peer: str, out, expected) -> bool:
    error = float((out.float() - expected.float()).norm() / expected.float().norm())
    if error > 2e-2:
        print(f"({peer} disagrees with mhadsl: relative difference {error:.1e})")
    return error <= 2e-2


def flex_fn(torch, q, k, v, doc, expected):
    """FlexAttention over the same documents; None where it cannot run or disagrees."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def mask(b, h, qi, kv):
            return (doc[b, qi] == doc[b, kv]) & (kv <= qi)
        block_mask = torch.compile(create_block_mask)(mask, q.shape[0], None, q.shape[1],
                                                      k.shape[1], device="cuda")
        compiled = torch.compile(flex_attention, dynamic=False)

        def run():
            return compiled(qt, kt, vt, block_mask=block_mask)
        out = run().transpose(1, 2)
    except Exception as err:  # noqa: BLE001 - inductor raises many types; the column is optional
        print(f"(FlexAttention unavailable: {type(err).__name__}: {str(err)[:100]})")
        return None
    return run if agrees("FlexAttention", out, expected) else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch = require_gpu()
    program = mhadsl.compile(SOURCE, name="documents.mha")
    packed, causal = program["packed"], program["causal"]
    gpu = torch.cuda.get_device_name()
    commit = source_commit()
    print(f"# packed documents, {gpu}, {datetime.date.today()}, commit {commit}: TFLOP/s of "
          f"the kept pairs (ms)")
    print("| batch | documents | mhadsl per call | mhadsl classes given | mhadsl ragged | "
          "FlexAttention | given / Flex |")
    print("|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for batch, tokens, shortest, longest in ROWS:
        per_seq = [documents(rng, tokens, shortest, longest) for _ in range(batch)]
        doc = torch.tensor(np.stack([np.repeat(np.arange(len(d)), d) for d in per_seq]),
                           dtype=torch.int32, device="cuda")
        q, k, v = (torch.randn(batch, tokens, HEADS, HEAD_DIM, device="cuda",
                               dtype=torch.bfloat16) for _ in range(3))
        classes = packed.block_classes(q, k, v, doc=doc, doc_k=doc)
        flat = [n for d in per_seq for n in d]
        cu = torch.tensor(np.concatenate(([0], np.cumsum(flat))), dtype=torch.int32,
                          device="cuda")
        qr, kr, vr = (x.reshape(batch * tokens, HEADS, HEAD_DIM) for x in (q, k, v))
        expected = packed(q, k, v, doc=doc, doc_k=doc)
        fns = {
            "per call": lambda: packed(q, k, v, doc=doc, doc_k=doc),
            "given": lambda: packed(q, k, v, doc=doc, doc_k=doc, block_classes=classes),
            "ragged": lambda: causal(qr, kr, vr, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                     max_seqlen_q=max(flat), max_seqlen_k=max(flat)),
            "flex": flex_fn(torch, q, k, v, doc, expected),
        }
        for name in ("given", "ragged"):
            out = fns[name]().reshape(expected.shape)
            if not agrees(name, out, expected):
                fns[name] = None
        times = time_side_by_side(torch, fns, rounds=args.rounds)
        pairs = sum(n * (n + 1) // 2 for n in flat)
        flops = 4.0 * pairs * HEAD_DIM * HEADS

        def cell(name):
            t = times[name]
            return "—" if t is None else f"{flops / t.ms / 1e9:.0f} ({t.ms:.3f})"
        ratio = "—" if times["given"] is None or times["flex"] is None else \
            f"{times['flex'].ms / times['given'].ms:.2f}"
        print(f"| {batch} x {tokens} | {len(flat)} of {shortest}–{longest} | "
              f"{cell('per call')} | {cell('given')} | {cell('ragged')} | {cell('flex')} | "
              f"{ratio} |", flush=True)


if __name__ == "__main__":
    main()
