"""Benchmark: the backward pass on ragged batches (cu_seqlens), the Hopper design against the
sm80-style one, side by side in one process.

    python benchmarks/backward_ragged.py

On compute capability 9.0 a ragged atomic call runs `backward_sm90`; the same declaration
compiled again with `backend = "backward"` runs the sm80-style design. TFLOP/s = 2.5 x the
forward's FLOPs (4 H Sq Sk D summed over the sequences, halved under a causal mask) / the
median backward time (`mhadsl.host.bench.time_side_by_side`). Each row first checks the Hopper
design's gradients against the sm80-style design's (relative error, Frobenius norm), and ends
with the main kernel's design of either column.
"""
import datetime

import numpy as np

import mhadsl
from mhadsl.host.bench import require_gpu, time_side_by_side

SOURCE = """
import "std/schedulers.mha"
attention plain { dtype = bf16  head_dim = 128 }
attention causal { dtype = bf16  head_dim = 128  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention causal_d64 { dtype = bf16  head_dim = 64  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
"""
MIXED = [int(n) for n in np.random.default_rng(0).integers(1, 4097, 16)]  # 16 lengths, 1-4096
ROWS = [  # kernel, Hq, Hkv, lengths
    ("plain", 16, 16, [4096] * 4), ("causal", 16, 16, [4096] * 4),
    ("plain", 16, 16, MIXED), ("causal", 16, 16, MIXED), ("causal", 32, 8, MIXED),
    ("causal_d64", 32, 32, MIXED), ("causal", 16, 16, [0, 1, 127, 129, 3000] * 4),
]


def relative(got, want) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def row(torch, hopper, sm80, name, Hq, Hkv, lengths):
    kerns = {"backward_sm90": hopper[name], "sm80-style": sm80[name]}
    D = kerns["sm80-style"].options.head_dim
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32,
                      device="cuda")
    total = sum(lengths)
    q = torch.randn(total, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ragged = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                  max_seqlen_k=max(lengths))
    out, lse = kerns["sm80-style"](q, k, v, return_lse=True, **ragged)
    dout = torch.randn_like(q)
    fns = {label: (lambda kern=kern: kern.backward(q, k, v, out, lse, dout,
                                                    cu_seqlens_q=cu, cu_seqlens_k=cu))
           for label, kern in kerns.items()}
    grads = {label: fn() for label, fn in fns.items()}
    error = max(relative(g, w) for g, w in zip(grads["backward_sm90"], grads["sm80-style"]))
    t = time_side_by_side(torch, fns)
    causal = name != "plain"
    flops = 2.5 * 4 * Hq * D * sum(n * n for n in lengths) / (2 if causal else 1)
    tf = {label: flops / (x.ms * 1e-3) / 1e12 for label, x in t.items()}
    designs = "/".join(kern.backward_build(gqa_group=Hq // Hkv, ragged=True).backend
                       for kern in kerns.values())
    shown = lengths if len(lengths) <= 5 else f"{len(lengths)} seqs, mean {total // len(lengths)}"
    print(f"| {shown} H{Hq}:{Hkv} D{D} {'causal' if causal else 'plain'} | "
          f"**{tf['backward_sm90']:.0f}** | {tf['sm80-style']:.0f} | "
          f"{tf['backward_sm90'] / tf['sm80-style']:.2f}x | {error:.1e} | {designs} |",
          flush=True)


def main():
    torch = require_gpu()
    hopper = mhadsl.compile(SOURCE, name="backward_ragged")
    sm80 = mhadsl.compile(SOURCE, name="backward_ragged")
    for name in ("plain", "causal", "causal_d64"):
        sm80[name].backend = "backward"  # the sm80-style design (the forward keeps its own)
    print(f"ragged backward, {datetime.date.today()}, {torch.cuda.get_device_name()}, bf16; "
          f"TFLOP/s = 2.5 x forward FLOPs / time")
    print("| lengths | Hopper design | sm80-style design | speed-up | max relative difference "
          "| main kernels' designs |")
    for spec in ROWS:
        row(torch, hopper, sm80, *spec)


if __name__ == "__main__":
    main()
