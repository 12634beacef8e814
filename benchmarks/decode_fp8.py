"""Benchmark: decode against a float8_e4m3fn KV cache beside the same call on a bf16 cache,
side by side in one process (`mhadsl.host.bench.time_side_by_side`).

    python benchmarks/decode_fp8.py

TB/s counts the bytes of K and V read (1 byte an element in FP8, 2 in bf16); the speed-up is
the bf16 call's time over the FP8 call's. The FP8 error is the output's relative error against
the float64 `mhadsl.reference_decode` on the dequantised cache (first 4 sequences).
"""
import datetime

import numpy as np

import mhadsl
from mhadsl.host.bench import require_gpu, time_side_by_side

SOURCE = """
import "std/schedulers.mha"
attention decode { dtype = bf16  head_dim = 128
    mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = kv_idx <= q_idx + seqlen_k - seqlen_q }
attention decode_d64 { dtype = bf16  head_dim = 64
    mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = kv_idx <= q_idx + seqlen_k - seqlen_q }
"""
ROWS = [  # B, Hq, Hkv, Sq, Sk, D, page size (0: contiguous)
    (32, 32, 8, 1, 8192, 128, 64), (32, 32, 8, 1, 8192, 128, 16), (32, 32, 8, 1, 8192, 128, 0),
    (8, 32, 8, 1, 32768, 128, 64), (32, 32, 1, 1, 8192, 128, 64), (32, 32, 8, 4, 8192, 128, 64),
    (32, 32, 8, 16, 8192, 128, 64), (32, 64, 8, 1, 8192, 64, 64),
]
SCALES = dict(k_scale=0.05, v_scale=0.05)


def row(torch, program, B, Hq, Hkv, Sq, Sk, D, page):
    kern = program["decode" if D == 128 else "decode_d64"]
    q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((B,), Sk, dtype=torch.int32, device="cuda")
    shape = (B, Sk, Hkv, D)
    table = None
    if page:
        pages = B * Sk // page
        table = torch.randperm(pages, device="cuda").reshape(B, Sk // page).to(torch.int32)
        shape = (pages, page, Hkv, D)
    k, v = (torch.randn(shape, device="cuda") for _ in range(2))
    k8, v8 = ((x / SCALES[n]).clamp(-448, 448).to(torch.float8_e4m3fn)
              for x, n in ((k, "k_scale"), (v, "v_scale")))
    kb, vb = k.to(torch.bfloat16), v.to(torch.bfloat16)
    out = torch.empty_like(q)
    fns = {"bf16": lambda: kern(q, kb, vb, cache_seqlens=lens, page_table=table, out=out),
           "fp8": lambda: kern(q, k8, v8, cache_seqlens=lens, page_table=table, out=out,
                               **SCALES)}
    t = time_side_by_side(torch, fns)
    elements = B * Hkv * Sk * D * 2
    few = 4
    sub = (lambda x: x[:few]) if table is None else (lambda x: x)
    ref = mhadsl.reference_decode(kern, q[:few], sub(k8), sub(v8), cache_seqlens=lens[:few],
                                  page_table=None if table is None else table[:few], **SCALES)
    got = kern(q[:few], sub(k8), sub(v8), cache_seqlens=lens[:few],
               page_table=None if table is None else table[:few], **SCALES)
    err = np.linalg.norm(got.float().cpu().numpy() - ref) / np.linalg.norm(ref)
    tb = {n: elements * (1 if n == "fp8" else 2) / (x.ms * 1e-3) / 1e12 for n, x in t.items()}
    print(f"| B{B} {Hq}:{Hkv}, Sq {Sq}, Sk {Sk}, D{D}, {f'page {page}' if page else 'contiguous'}"
          f" | {tb['bf16']:.2f} | {tb['fp8']:.2f} | **{t['bf16'].ms / t['fp8'].ms:.2f}×** | "
          f"{err:.1e} |", flush=True)


def main():
    torch = require_gpu()
    program = mhadsl.compile(SOURCE, name="decode_fp8_bench")
    print(f"decode, FP8 (e4m3) cache against bf16, {datetime.date.today()}, "
          f"{torch.cuda.get_device_name()}; TB/s of K and V read")
    print("| shape | bf16 TB/s | FP8 TB/s | FP8 speed-up | FP8 error vs float64 |")
    for r in ROWS:
        row(torch, program, *r)


if __name__ == "__main__":
    main()
