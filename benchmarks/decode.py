"""Benchmark: decode against a KV cache, side by side in one process with
cuDNN and flash through torch SDPA and, when installed, FlashAttention-4.

    python benchmarks/decode.py            # the table, paged and ragged rows, split sweep
    python benchmarks/decode.py --quick    # the table only

Bandwidth is bytes of K and V read (each K/V head once: B x Hkv x Sk x D x 2 x 2 bytes, the
sequences' own lengths on the ragged row) over the kernel's median time
(`mhadsl.host.bench.time_side_by_side`, every column timed in turn over rounds). Each column's
output is checked against mhadsl's first (relative error < 1e-2). SDPA sees q as
(B, Hq, Sq, D) and the cache as (B, Hkv, Sk, D) with enable_gqa; with 16 query rows it runs
without a mask (every row sees the whole cache: the same bytes), FlashAttention-4 and
mhadsl bottom-right causal.
"""
import argparse
import datetime
import sys

import numpy as np

import mhadsl
from mhadsl.host.bench import require_gpu, time_side_by_side

sys.path.insert(0, "benchmarks")

SOURCE = """
import "std/schedulers.mha"
attention decode { dtype = bf16  head_dim = 128
    mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = kv_idx <= q_idx + seqlen_k - seqlen_q }
"""
TABLE = [  # B, Hq, Hkv, Sq, Sk
    (32, 32, 8, 1, 8192), (8, 32, 8, 1, 32768), (64, 32, 8, 1, 2048), (32, 32, 4, 1, 8192),
    (32, 32, 8, 16, 8192), (1, 32, 8, 1, 131072),
]
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def fa4_fn(torch):
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return None

    def run(q, k, v, causal):
        return flash_attn_func(q, k, v, causal=causal)[0]
    return run


def tbps(nbytes: int, timing) -> float | None:
    return None if timing is None else nbytes / (timing.ms * 1e-3) / 1e12


def peers(torch, q, k, v, sq, fa4):
    """cuDNN and flash through SDPA, FlashAttention-4: name -> callable (None: unavailable)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    fns = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("flash", SDPBackend.FLASH_ATTENTION)):
        def run(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, enable_gqa=True).transpose(1, 2)
        try:
            run()
            fns[name] = run
        except RuntimeError as err:
            print(f"  ({name} unavailable: {str(err).splitlines()[0][:100]})")
            fns[name] = None
    fns["fa4"] = (lambda: fa4(q, k, v, sq > 1)) if fa4 else None
    return fns


def checked(torch, fns: dict, ours, sq: int) -> dict:
    ref = ours().float()
    for name, fn in list(fns.items()):
        if fn is None or name == "mhadsl" or (sq > 1 and name in ("cudnn", "flash")):
            continue  # (SDPA runs 16 query rows unmasked: not the same result)
        err = float((fn().float() - ref).norm() / ref.norm())
        if not err < 1e-2:
            print(f"  ({name} differs from mhadsl: relative error {err:.3g}; not timed)")
            fns[name] = None
    return fns


def table_row(torch, kern, fa4, B, Hq, Hkv, Sq, Sk, sweep: bool):
    q = torch.randn(B, Sq, Hq, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Sk, Hkv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.full((B,), Sk, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    nbytes = B * Hkv * Sk * 128 * 2 * 2

    def ours(splits=None):
        return kern(q, k, v, cache_seqlens=lens, out=out, num_splits=splits)
    ours()
    default = list(kern.launcher.fast_plans.values())[-1].num_splits  # the plan that call made
    fns = checked(torch, {"mhadsl": ours, **peers(torch, q, k, v, Sq, fa4)}, ours, Sq)
    t = time_side_by_side(torch, fns)
    result = {name: tbps(nbytes, x) for name, x in t.items()}
    best_peer = max((x for n, x in result.items() if n != "mhadsl" and x), default=None)
    line = (f"| {B}, {Hq}:{Hkv}, {Sq}, {Sk} | **{result['mhadsl']:.2f}** | "
            + " | ".join(f"{result[n]:.2f}" if result.get(n) else "—"
                         for n in ("cudnn", "fa4", "flash"))
            + (f" | {result['mhadsl'] / best_peer:.3f}× | {default} |" if best_peer else
               f" | — | {default} |"))
    if sweep:
        sweeps = {s: (lambda s=s: ours(s)) for s in SPLITS}
        st = time_side_by_side(torch, {**sweeps, "default": ours}, rounds=3)
        best = min(SPLITS, key=lambda s: st[s].ms)
        line += (f" {best} ({st['default'].ms / st[best].ms:.3f}) |")
    print(line, flush=True)
    del q, k, v, out


def paged_rows(torch, kern):
    B, Hq, Hkv, Sk = 32, 32, 8, 8192
    q = torch.randn(B, 1, Hq, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((B,), Sk, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    nbytes = B * Hkv * Sk * 128 * 2 * 2
    k = torch.randn(B, Sk, Hkv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    fns = {"contiguous": lambda: kern(q, k, v, cache_seqlens=lens, out=out)}
    # fp32 attention of the one query row over the whole cache; the planner picks another KV
    # tile for some page sizes, so the paged and contiguous outputs differ by bf16 rounding
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2).float() for x in (q, k, v)), enable_gqa=True).transpose(1, 2)
    assert float((fns["contiguous"]().float() - ref).norm() / ref.norm()) < 1e-2
    for page in (16, 64, 256):
        pages_per_seq = Sk // page
        perm = torch.randperm(B * pages_per_seq, device="cuda")
        table = perm.reshape(B, pages_per_seq).to(torch.int32)
        # page p of the shuffled cache holds the contiguous cache's rows of page perm^-1
        kp = torch.empty(B * pages_per_seq, page, Hkv, 128, device="cuda", dtype=k.dtype)
        vp = torch.empty_like(kp)
        kp[perm] = k.reshape(B * pages_per_seq, page, Hkv, 128)
        vp[perm] = v.reshape(B * pages_per_seq, page, Hkv, 128)
        fn = (lambda kp=kp, vp=vp, table=table:
              kern(q, kp, vp, cache_seqlens=lens, page_table=table, out=out))
        err = float((fn().float() - ref).norm() / ref.norm())
        assert err < 1e-2, err
        fns[f"page {page}"] = fn
    t = time_side_by_side(torch, fns)
    base = t["contiguous"].ms
    for name, x in t.items():
        print(f"| B32 32:8 Sk 8192, {name} | {tbps(nbytes, x):.2f} TB/s | "
              f"{base / x.ms:.3f}× contiguous |", flush=True)


def ragged_row(torch, kern):
    B, Hq, Hkv, cap = 64, 32, 8, 32768
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, cap + 1, B)
    q = torch.randn(B, 1, Hq, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, cap, Hkv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    nbytes = int(lengths.sum()) * Hkv * 128 * 2 * 2
    fns = {"mhadsl": lambda: kern(q, k, v, cache_seqlens=lens, out=out)}
    t = time_side_by_side(torch, fns)
    print(f"| B64 32:8, lengths uniform in 1..32768 (sum {int(lengths.sum())}) | "
          f"{tbps(nbytes, t['mhadsl']):.2f} TB/s |", flush=True)


def host_time(torch, kern, calls: int = 2000):
    """Host time per decode call (a tiny paged decode queued back to back, then one
    synchronize), beside SDPA's cuDNN backend (chosen once) on the same query and cache."""
    from launch_overhead import host_us
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(8, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.tensor([128], dtype=torch.int32, device="cuda")
    table = torch.arange(8, dtype=torch.int32, device="cuda").reshape(1, 8)
    kc, vc = (x.reshape(1, 128, 8, 128).transpose(1, 2) for x in (k, v))
    qt = q.transpose(1, 2)

    def per_call(fn):
        return host_us(torch, fn, calls)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(qt, kc, vc, enable_gqa=True)
    kd, vd = (x.reshape(1, 128, 8, 128) for x in (k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        results = {"mhadsl": [], "mhadsl without a cache (prefill path)": [], "SDPA cuDNN": []}
        for _ in range(3):
            results["mhadsl"].append(per_call(
                lambda: kern(q, k, v, cache_seqlens=lens, page_table=table)))
            results["mhadsl without a cache (prefill path)"].append(per_call(
                lambda: kern(q, kd, vd)))
            results["SDPA cuDNN"].append(per_call(sdpa))
    print(f"host time per decode call (B1 32:8 D128, paged 16, {calls} calls then one "
          f"synchronize): " + ", ".join(f"{n} {min(x):.1f} us" for n, x in results.items()))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="time every split count too")
    args = parser.parse_args()
    torch = require_gpu()
    kern = mhadsl.compile(SOURCE, name="decode_bench")["decode"]
    fa4 = fa4_fn(torch)
    print(f"decode, {datetime.date.today()}, {torch.cuda.get_device_name()}, bf16 D128; "
          f"TB/s of K and V read; FlashAttention-4 {'present' if fa4 else 'absent'}")
    print("| B, Hq:Hkv, Sq, Sk | mhadsl | cuDNN | FA4 | torch flash | vs best peer | splits |"
          + (" best splits (default/best time) |" if args.sweep else ""))
    for row in TABLE:
        table_row(torch, kern, fa4, *row, sweep=args.sweep)
    if not args.quick:
        paged_rows(torch, kern)
        ragged_row(torch, kern)
        host_time(torch, kern)


if __name__ == "__main__":
    main()
