"""compute-sanitizer's memcheck and racecheck over the decode kernel: contiguous and paged
caches (pages in random order), forced KV splits (the last split's combine), ragged query
rows, both KV tiles, and on sm_90a the wgmma work tiles (64 and 128 packed rows). Needs an
NVIDIA GPU, torch and compute-sanitizer on PATH.

    python3 benchmarks/sanitize_decode.py [--tools memcheck,racecheck]

The kernels are built first, outside the sanitizer; each tool then runs this script's
`--worker` mode, which launches every case and checks it against `mhadsl.reference_decode`.
Exit status 0 when every tool ran and found no error.
"""
from __future__ import annotations

import sys

import numpy as np

import mhadsl

sys.path.insert(0, "benchmarks")
from sanitize import relative_error, worker_main  # noqa: E402

SOURCE = """
import "std/schedulers.mha"
attention decode { dtype = bf16  head_dim = 128  return_lse = true
    mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = kv_idx <= q_idx + seqlen_k - seqlen_q }
"""
KERNELS = "mha_decode"  # what compute-sanitizer watches
CASES = [  # lengths, K/V heads, query heads, query rows (0: ragged), page size, splits
    ([1, 70, 300], 2, 8, 1, None, 3),
    ([5, 64, 65, 400], 2, 16, 2, 16, 1),
    ([129, 700], 1, 4, 4, 64, 4),
    ([3, 200, 33], 2, 8, 0, 16, 2),
    ([20 + i for i in range(300)], 1, 8, 1, 16, None),  # many groups: the 32-row KV tile
    # 64 and 128 packed rows: wgmma on sm_90a (with many groups, over the 32-row KV tile)
    ([300, 1000, 17], 2, 8, 16, 64, 2),
    ([500, 90], 1, 8, 16, None, 1),
    ([40 + i for i in range(200)], 1, 4, 16, 64, None),
    # heavy tails: the long sequences split, the short ones do not (splits by length)
    ([1, 70, 9000, 300, 5000], 2, 8, 1, 64, None),
    ([3, 12000, 33, 1], 2, 8, 0, 16, None),
    ([6000, 100, 17], 2, 8, 16, 64, None),
    ([50 + 7 * i for i in range(60)] + [20000], 1, 8, 1, 16, None),
]


def worker() -> int:
    import torch
    kern = mhadsl.compile(SOURCE, name="sanitize_decode")["decode"]
    g = torch.Generator(device="cuda").manual_seed(0)
    worst = 0.0
    for lengths, hkv, hq, rows, page, splits in CASES:
        b, d = len(lengths), 128
        cap = max(lengths)
        if page is None:
            k = torch.randn(b, cap, hkv, d, generator=g, device="cuda").bfloat16()
            table = None
        else:
            per = -(-cap // page)
            k = torch.randn(b * per, page, hkv, d, generator=g, device="cuda").bfloat16()
            table = torch.randperm(b * per, generator=g, device="cuda").reshape(b, per)
            table = table.to(torch.int32).contiguous()
        v = torch.randn_like(k)
        seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        extra = {}
        if rows:
            q = torch.randn(b, rows, hq, d, generator=g, device="cuda").bfloat16()
        else:
            lens_q = [min(n, 3) for n in lengths]
            extra = dict(cu_seqlens_q=torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]),
                                                   dtype=torch.int32, device="cuda"),
                         max_seqlen_q=max(lens_q))
            q = torch.randn(sum(lens_q), hq, d, generator=g, device="cuda").bfloat16()
        out, _ = kern(q, k, v, cache_seqlens=seqlens, page_table=table, num_splits=splits,
                      **extra)
        ref = mhadsl.reference_decode(kern, q, k, v, cache_seqlens=seqlens, page_table=table,
                                      cu_seqlens_q=extra.get("cu_seqlens_q"))[0]
        worst = max(worst, relative_error(out, ref))
    print(f"{len(CASES)} decode cases, worst relative error {worst:.2e}")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(worker_main(__file__, KERNELS, worker))
