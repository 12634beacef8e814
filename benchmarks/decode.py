"""Benchmark: decode against a KV cache, side by side in one process with
cuDNN and flash through torch SDPA and, when installed, FlashAttention-4.

    python benchmarks/decode.py                     # the table, paged and ragged rows, host time
    python benchmarks/decode.py --quick             # the table only
    python benchmarks/decode.py --workload tails    # heavy-tailed batches only
    python benchmarks/decode.py --workload paged    # paged against contiguous, shapes x pages
    python benchmarks/decode.py --workload all      # table and tails
    python benchmarks/decode.py --show-lengths      # the heavy-tailed lengths (no GPU needed)
    python benchmarks/decode.py --quick --sweep --kernels  # each row's kernels and gaps, µs

Bandwidth is bytes of K and V read (each K/V head once: B x Hkv x Sk x D x 2 x 2 bytes, the
sequences' own lengths on the ragged and heavy-tailed rows) over the kernel's median time
(`mhadsl.host.bench.time_side_by_side`, every column timed in turn over rounds). Each column's
output is checked against mhadsl's first (relative error < 1e-2). SDPA sees q as
(B, Hq, Sq, D) and the cache as (B, Hkv, Sk, D) with enable_gqa; with 16 query rows it runs
without a mask (every row sees the whole cache: the same bytes), FlashAttention-4 and
mhadsl bottom-right causal.

Heavy-tailed rows (`--workload tails`, `TAILS`): 1 query row per sequence against a cache
paged by 64 rows (pages in random order), most lengths a lognormal draw around a median of
1536 keys and a few of them 30 to 60 times the median (`tail_lengths`, seed 0: the same
lengths on every run). mhadsl runs its default split (no num_splits). Peers: FlashAttention-4's
varlen entry on the same pages (`page_table`, `seqused_k`) where it takes them, else on a
packed contiguous copy of the same keys (`cu_seqlens_k`; the same bytes), with its own split
heuristic where it has one; and torch's flash kernel in its varlen form on that packed copy
(SDPA takes no per-sequence cache lengths, and a padded cache would read 30x the bytes, so
cuDNN is not timed there). Each column is checked sequence by sequence against an fp32
reference (the long sequences' outputs are the smallest, so a batch-wide norm would hide
them): the largest relative error must be below 1e-2. `--json FILE` writes those rows in
`benchmarks/results.json`'s row format.
"""
import argparse
import datetime
import json
import sys

import numpy as np

import mhadsl
from mhadsl.host.bench import kernel_times, require_gpu, source_commit, time_side_by_side

sys.path.insert(0, "benchmarks")

SOURCE = """
import "std/schedulers.mha"
attention decode { dtype = bf16  head_dim = 128
    mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = kv_idx <= q_idx + seqlen_k - seqlen_q }
attention decode_d64 { dtype = bf16  head_dim = 64
    mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = kv_idx <= q_idx + seqlen_k - seqlen_q }
attention decode_d256 { dtype = bf16  head_dim = 256
    mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = kv_idx <= q_idx + seqlen_k - seqlen_q }
"""
KERNELS = {128: "decode", 64: "decode_d64", 256: "decode_d256"}
TABLE = [  # B, Hq, Hkv, Sq, Sk
    (32, 32, 8, 1, 8192), (8, 32, 8, 1, 32768), (64, 32, 8, 1, 2048), (32, 32, 4, 1, 8192),
    (32, 32, 8, 16, 8192), (1, 32, 8, 1, 131072), (32, 32, 1, 1, 8192), (16, 64, 8, 1, 16384),
]
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
TAILS = [  # B, Hq, Hkv: 1 query row, pages of TAIL_PAGE rows, lengths from tail_lengths(B)
    (64, 32, 8), (128, 32, 8), (64, 32, 1),
]
PAGED = [  # B, Hq, Hkv, Sk, D: a paged cache against the contiguous one, 1 query row
    (32, 32, 8, 8192, 128), (32, 32, 1, 8192, 128), (32, 16, 4, 8192, 64),
    (16, 64, 8, 16384, 128), (16, 32, 8, 8192, 256),
]
PAGE_SIZES = (16, 64, 256, 512)
TAIL_PAGE = 64
TAIL_MEDIAN = 1536


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


def chunk_variants(run, chunks) -> dict:
    """`run(kernel)` on a kernel of its own planned at each of `chunks` chunks per
    multiprocessor (`serving.CHUNKS_PER_SM`, read when a call signature is planned, which
    each first call does here), as callables by column name."""
    from mhadsl.host import serving
    saved, fns = serving.CHUNKS_PER_SM, {}
    try:
        for c in chunks:
            serving.CHUNKS_PER_SM = c
            kern = mhadsl.compile(SOURCE, name=f"decode_bench_chunks{c}")["decode"]
            run(kern)
            fns[f"chunks={c}"] = lambda kern=kern: run(kern)
    finally:
        serving.CHUNKS_PER_SM = saved
    return fns


def chunk_column(torch, fns: dict, nbytes: int) -> str:
    """The chunk variants timed side by side: each one's TB/s, the best first."""
    t = time_side_by_side(torch, fns, rounds=3)
    ranked = sorted(t, key=lambda n: t[n].ms)
    return " " + ", ".join(f"{n.removeprefix('chunks=')}: {tbps(nbytes, t[n]):.2f}"
                           for n in ranked) + " |"


def kernels_line(torch, fns: dict) -> str:
    """Each call's kernels and the idle time before them (`kernel_times`), µs."""
    return "; ".join(f"{name}: " + ", ".join(f"{k} {us:.1f}" for k, us in
                                            kernel_times(torch, fn).items())
                     for name, fn in fns.items())


def table_row(torch, kern, fa4, B, Hq, Hkv, Sq, Sk, sweep: bool, chunks=(), kernels=False):
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
    if chunks:
        line += chunk_column(torch, chunk_variants(
            lambda kn: kn(q, k, v, cache_seqlens=lens, out=out), chunks), nbytes)
    print(line, flush=True)
    if kernels:
        fns = {"default": ours, **({f"{best} splits": lambda: ours(best)} if sweep else {})}
        print(f"  kernels, µs: {kernels_line(torch, fns)}", flush=True)
    del q, k, v, out


def paged_rows(torch, kerns, B=32, Hq=32, Hkv=8, Sk=8192, D=128, pages=(16, 64, 256)):
    """The same cache contiguous and paged by each page size (pages in random order)."""
    kern = kerns[D]
    q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((B,), Sk, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    nbytes = B * Hkv * Sk * D * 2 * 2
    k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    fns = {"contiguous": lambda: kern(q, k, v, cache_seqlens=lens, out=out)}
    # fp32 attention of the one query row over the whole cache; the planner picks another KV
    # tile for some page sizes, so the paged and contiguous outputs differ by bf16 rounding
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2).float() for x in (q, k, v)), enable_gqa=True).transpose(1, 2)
    assert float((fns["contiguous"]().float() - ref).norm() / ref.norm()) < 1e-2
    for page in pages:
        pages_per_seq = Sk // page
        perm = torch.randperm(B * pages_per_seq, device="cuda")
        table = perm.reshape(B, pages_per_seq).to(torch.int32)
        # page p of the shuffled cache holds the contiguous cache's rows of page perm^-1
        kp = torch.empty(B * pages_per_seq, page, Hkv, D, device="cuda", dtype=k.dtype)
        vp = torch.empty_like(kp)
        kp[perm] = k.reshape(B * pages_per_seq, page, Hkv, D)
        vp[perm] = v.reshape(B * pages_per_seq, page, Hkv, D)
        fn = (lambda kp=kp, vp=vp, table=table:
              kern(q, kp, vp, cache_seqlens=lens, page_table=table, out=out))
        err = float((fn().float() - ref).norm() / ref.norm())
        assert err < 1e-2, err
        fns[f"page {page}"] = fn
    t = time_side_by_side(torch, fns)
    base = t["contiguous"].ms
    for name, x in t.items():
        print(f"| B{B} {Hq}:{Hkv} Sk {Sk} D{D}, {name} | {tbps(nbytes, x):.2f} TB/s | "
              f"{base / x.ms:.3f}× contiguous |", flush=True)
    del q, k, v, out, fns


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


def tail_lengths(batch: int, median: int = TAIL_MEDIAN, seed: int = 0) -> np.ndarray:
    """`batch` heavy-tailed cache lengths, the same on every run: a lognormal draw around
    `median` (sigma 0.5, clipped to 64 .. 4 x median), then one sequence in 16 (at least 2,
    at places drawn from the same generator) given 30 to 60 times the median, evenly
    spaced."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(rng.lognormal(np.log(median), 0.5, batch)), 64, 4 * median)
    lengths = lengths.astype(np.int64)
    n_long = max(2, batch // 16)
    where = rng.choice(batch, n_long, replace=False)
    lengths[where] = np.rint(np.linspace(30, 60, n_long) * median).astype(np.int64) + \
        rng.integers(1, TAIL_PAGE, n_long)  # not whole pages
    return lengths


def tail_shape(B: int, Hq: int, Hkv: int, lengths) -> str:
    return (f"B{B}, {Hq}:{Hkv}, page {TAIL_PAGE}, median {int(np.median(lengths))}, "
            f"longest {int(lengths.max())}, {int(lengths.sum())} keys")


def show_lengths() -> None:
    """The heavy-tailed rows' lengths: what `--workload tails` runs, without a GPU."""
    for B, Hq, Hkv in TAILS:
        lengths = tail_lengths(B)
        share = np.sort(lengths)[-max(2, B // 16):].sum() / lengths.sum()
        print(f"{tail_shape(B, Hq, Hkv, lengths)}; the long ones hold {share:.0%} of the "
              f"keys; {int(lengths.sum()) * Hkv * 128 * 2 * 2 / 1e9:.2f} GB of K and V")
        print("  " + " ".join(str(n) for n in lengths.tolist()))


def paged_tail_cache(torch, lengths, Hkv: int):
    """A cache of 64-row pages holding `lengths` keys per sequence (pages in random order;
    the table's unused entries name page 0, never read): (k, v, cache_seqlens, page_table)."""
    pages = -(-lengths // TAIL_PAGE)
    total = int(pages.sum())
    perm = torch.randperm(total, device="cuda").to(torch.int32)
    table = torch.zeros(len(lengths), int(pages.max()), dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(pages.tolist()):
        table[b, :n] = perm[start:start + n]
        start += n
    k = torch.randn(total, TAIL_PAGE, Hkv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    return k, v, lens, table


def sequence_keys(k, table, b: int, n: int):
    """Sequence b's first n keys (n, Hkv, D) out of a paged cache."""
    pages = table[b, :-(-n // TAIL_PAGE)].long()
    return k[pages].reshape(-1, *k.shape[2:])[:n]


def packed_keys(torch, k, v, table, lengths):
    """Every sequence's keys and values packed one after another, contiguous ((total, Hkv, D)
    each), and their int32 row offsets (B + 1,): the same bytes as the paged cache."""
    kp = torch.cat([sequence_keys(k, table, b, int(n)) for b, n in enumerate(lengths)])
    vp = torch.cat([sequence_keys(v, table, b, int(n)) for b, n in enumerate(lengths)])
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32,
                        device="cuda")
    return kp, vp, cu_k


def fa4_tail_fn(q, k, v, lens, table, packed, max_k: int, ref):
    """FlashAttention-4 on a heavy-tailed batch: (form, callable), its varlen entry over the
    paged cache (`page_table`, `seqused_k`) where it takes it, else over the packed copy
    (`cu_seqlens_k`); each with its own split heuristic (num_splits=0) where this version
    has one, else one split. The first form that runs and matches `ref` (every sequence's
    relative error below 1e-2) is kept; (None, None) where FlashAttention-4 is not installed
    or no form does."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError:
        return None, None
    B = q.shape[0]
    kp, vp, cu_k = packed
    cu_q = cu_k.new_tensor(np.arange(B + 1, dtype=np.int32))
    qp = q.reshape(B, *q.shape[2:])
    forms = {
        "paged": lambda splits: flash_attn_varlen_func(
            q, k, v, page_table=table, seqused_k=lens, max_seqlen_q=1, max_seqlen_k=max_k,
            num_splits=splits)[0],
        "packed": lambda splits: flash_attn_varlen_func(
            qp, kp, vp, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=1,
            max_seqlen_k=max_k, num_splits=splits)[0].reshape(q.shape),
    }
    for form, fn in forms.items():
        for splits in (0, 1):
            def run(fn=fn, splits=splits):
                return fn(splits)
            try:
                err = worst_sequence_error(run(), ref)
            except Exception as e:  # noqa: BLE001 (an assertion, a compile error: not timed)
                text = str(e).splitlines()[0][:100] if str(e) else type(e).__name__
                print(f"  (fa4 {form}, num_splits={splits}, unavailable: {text})")
                continue
            if err < 1e-2:
                return f"{form}, num_splits={splits}", run
            print(f"  (fa4 {form}, num_splits={splits} differs from the reference: worst "
                  f"sequence's relative error {err:.3g}; not timed)")
    return None, None


def torch_flash_varlen_fn(torch, q, packed, max_k: int):
    """torch's flash kernel in its varlen form (`aten._flash_attention_forward`) over the
    packed copy of every sequence's keys; None where this torch refuses it."""
    B = q.shape[0]
    kp, vp, cu_k = packed
    cu_q = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    qp = q.reshape(B, *q.shape[2:])

    def run():
        out = torch.ops.aten._flash_attention_forward(
            qp, kp, vp, cu_q, cu_k, 1, max_k, 0.0, False, False)[0]
        return out.reshape(q.shape)
    try:
        run()
        return run
    except (RuntimeError, AttributeError, TypeError) as err:
        print(f"  (torch flash varlen unavailable: {str(err).splitlines()[0][:100]})")
        return None


def tail_reference(torch, q, k, v, table, lengths):
    """fp32 attention of each sequence's query row over its own keys: (B, 1, Hq, D)."""
    rows = []
    for b, n in enumerate(lengths.tolist()):
        kb, vb = (sequence_keys(x, table, b, n).float().transpose(0, 1)[None] for x in (k, v))
        rows.append(torch.nn.functional.scaled_dot_product_attention(
            q[b:b + 1].float().transpose(1, 2), kb, vb, enable_gqa=True).transpose(1, 2))
    return torch.cat(rows)


def worst_sequence_error(got, ref) -> float:
    """The largest relative error of one sequence's output."""
    diff = (got.float() - ref).flatten(1).norm(dim=1)
    return float((diff / ref.flatten(1).norm(dim=1).clamp_min(1e-30)).max())


def tail_row(torch, kern, B, Hq, Hkv, sweep: bool, runs: list, chunks=()):
    lengths = tail_lengths(B)
    q = torch.randn(B, 1, Hq, 128, device="cuda", dtype=torch.bfloat16)
    k, v, lens, table = paged_tail_cache(torch, lengths, Hkv)
    out = torch.empty_like(q)
    nbytes = int(lengths.sum()) * Hkv * 128 * 2 * 2

    def ours(splits=None):
        return kern(q, k, v, cache_seqlens=lens, page_table=table, out=out, num_splits=splits)
    ref = tail_reference(torch, q, k, v, table, lengths)
    err = worst_sequence_error(ours(), ref)
    assert err < 1e-2, f"mhadsl: worst sequence's relative error {err:.3g}"
    plans = list(kern.launcher.fast_plans.values())  # (none under MHADSL_DEBUG=1)
    plan_splits = getattr(plans[-1], "num_splits", "?") if plans else "?"  # that call's plan
    balanced = any(getattr(b.config, "balanced", False)
                   and getattr(b.config, "page_size", None) == TAIL_PAGE
                   and getattr(b.config, "gqa_group", None) == Hq // Hkv
                   for b in kern.launcher.loaded.values())
    split = f"by length, at most {plan_splits}" if balanced else f"{plan_splits} (fixed)"
    packed = packed_keys(torch, k, v, table, lengths)
    fa4_form, fa4 = fa4_tail_fn(q, k, v, lens, table, packed, int(lengths.max()), ref)
    fns = {"mhadsl": ours, "fa4": fa4,
           "flash": torch_flash_varlen_fn(torch, q, packed, int(lengths.max()))}
    if fns["flash"] is not None:
        e = worst_sequence_error(fns["flash"](), ref)
        if not e < 1e-2:
            print(f"  (torch flash varlen differs from the reference: worst sequence's "
                  f"relative error {e:.3g}; not timed)")
            fns["flash"] = None
    t = time_side_by_side(torch, fns)
    result = {name: tbps(nbytes, x) for name, x in t.items()}
    best_peer = max((x for n, x in result.items() if n != "mhadsl" and x), default=None)
    line = (f"| {tail_shape(B, Hq, Hkv, lengths)} | **{result['mhadsl']:.2f}** | "
            + " | ".join(f"{result[n]:.2f}" if result.get(n) else "—" for n in ("fa4", "flash"))
            + (f" | {result['mhadsl'] / best_peer:.3f}× |" if best_peer else " | — |")
            + f" {split} | {fa4_form or '—'} |")
    best = None
    if sweep:
        sweeps = {s: (lambda s=s: ours(s)) for s in SPLITS}
        st = time_side_by_side(torch, {**sweeps, "default": ours}, rounds=3)
        best = min(SPLITS, key=lambda s: st[s].ms)
        line += f" {best} ({st['default'].ms / st[best].ms:.3f}) |"
    if chunks:
        line += chunk_column(torch, chunk_variants(
            lambda kn: kn(q, k, v, cache_seqlens=lens, page_table=table, out=out), chunks),
            nbytes)
    print(line, flush=True)
    runs.append({"shape": tail_shape(B, Hq, Hkv, lengths), "result": result,
                 "fa4_form": fns["fa4"] and fa4_form, "split": split,
                 "sweep": None if best is None else {"best": best, "tbps": tbps(nbytes, st[best]),
                                                     "default_over_best": st["default"].ms
                                                     / st[best].ms}})
    del q, k, v, out, ref, packed, fns


def tail_json_rows(runs: list, torch, fa4: bool, command: str) -> list[dict]:
    """The heavy-tailed rows in `benchmarks/results.json`'s row format (kind "decode")."""
    commit = source_commit()
    software = f"torch {torch.__version__}"
    if fa4:
        try:
            from importlib.metadata import version
            software += f", FlashAttention-4 {version('flash-attn-4')}"
        except Exception:  # noqa: BLE001 (a version we cannot read: left out)
            pass
    names = {"fa4": "FlashAttention-4", "flash": "torch flash"}
    rows = []
    for run in runs:
        row = {"kind": "decode", "workload": "heavy-tailed lengths, 1 query row",
               "shape": run["shape"], "ours": round(run["result"]["mhadsl"], 2),
               "peers": {names[n]: round(x, 2) for n, x in run["result"].items()
                         if n in names and x},
               "detail": f"default split ({run['split']})"
               + (f"; FlashAttention-4 {run['fa4_form']}" if run["fa4_form"] else ""),
               "notes": ["Heavy-tailed rows: 1 query row, pages of 64 rows, lengths from "
                         "`tail_lengths` (`--show-lengths`); FlashAttention-4 on the same "
                         "pages where it takes them, else (as torch flash, in its varlen "
                         "form) on a packed copy of the same keys."]}
        if run["sweep"]:
            row["variants"] = {f"num_splits={run['sweep']['best']} (best forced)":
                               round(run["sweep"]["tbps"], 2)}
        row.update(date=str(datetime.date.today()), gpu=torch.cuda.get_device_name(),
                   software=software, commit=commit, command=command)
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="the table's rows only (no paged, ragged or host-time rows)")
    parser.add_argument("--sweep", action="store_true", help="time every split count too")
    parser.add_argument("--workload", choices=("table", "tails", "paged", "all"),
                        default="table", help="table: the uniform rows (default); tails: "
                        "the heavy-tailed batches; paged: paged against contiguous caches "
                        "over shapes and page sizes; all: table and tails")
    parser.add_argument("--show-lengths", action="store_true",
                        help="print the heavy-tailed batches' lengths and exit (no GPU)")
    parser.add_argument("--json", metavar="FILE",
                        help="write the heavy-tailed rows in results.json's row format")
    parser.add_argument("--kernels", action="store_true",
                        help="under each table row, the default call's kernels and the idle "
                        "time before each (CUPTI, median µs of 20 calls); with --sweep, the "
                        "best fixed split's too")
    parser.add_argument("--chunks-per-sm", metavar="N,N,...", default="",
                        help="also time the default split at each of these chunks per "
                        "multiprocessor (serving.CHUNKS_PER_SM), side by side, e.g. 1,2,4")
    args = parser.parse_args()
    try:
        chunks = tuple(int(c) for c in args.chunks_per_sm.split(",") if c)
    except ValueError:
        parser.error(f"--chunks-per-sm takes integers, got {args.chunks_per_sm!r}")
    if any(c < 1 for c in chunks):
        parser.error("--chunks-per-sm takes positive integers")
    if args.show_lengths:
        show_lengths()
        return
    if args.json and args.workload in ("table", "paged"):
        parser.error("--json writes the heavy-tailed rows: add --workload tails or all")
    torch = require_gpu()
    program = mhadsl.compile(SOURCE, name="decode_bench")
    kerns = {d: program[name] for d, name in KERNELS.items()}
    kern = kerns[128]
    fa4 = fa4_fn(torch)
    print(f"decode, {datetime.date.today()}, {torch.cuda.get_device_name()}, bf16 D128; "
          f"TB/s of K and V read; FlashAttention-4 {'present' if fa4 else 'absent'}")
    if args.workload in ("table", "all"):
        print("| B, Hq:Hkv, Sq, Sk | mhadsl | cuDNN | FA4 | torch flash | vs best peer | "
              "splits |" + (" best splits (default/best time) |" if args.sweep else "")
              + (" chunks per SM: TB/s, best first |" if chunks else ""))
        for row in TABLE:
            table_row(torch, kern, fa4, *row, sweep=args.sweep, chunks=chunks,
                      kernels=args.kernels)
        if not args.quick:
            paged_rows(torch, kerns)
            ragged_row(torch, kern)
            host_time(torch, kern)
    if args.workload == "paged":
        print("| shape, cache | mhadsl | vs contiguous |")
        for B, Hq, Hkv, Sk, D in PAGED:
            paged_rows(torch, kerns, B, Hq, Hkv, Sk, D, PAGE_SIZES)
    if args.workload in ("tails", "all"):
        runs = []
        print("heavy-tailed lengths, 1 query row, default split (lengths: --show-lengths)")
        print("| shape | mhadsl | FA4 | torch flash varlen | vs best peer | mhadsl's "
              "splits a sequence | FA4 form |" + (" best forced splits (default/best time) |"
                                           if args.sweep else "")
              + (" chunks per SM: TB/s, best first |" if chunks else ""))
        for row in TAILS:
            tail_row(torch, kern, *row, sweep=args.sweep, runs=runs, chunks=chunks)
        if args.json:
            command = "python3 benchmarks/decode.py " + " ".join(sys.argv[1:])
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(tail_json_rows(runs, torch, fa4 is not None, command), f, indent=1,
                          ensure_ascii=False)
            print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
