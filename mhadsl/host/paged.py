"""A decode call against a KV cache: its layouts, and the argument checks that the
float64 reference (`mhadsl.analysis.reference.reference_decode`) and the decode kernels' call share.

With an int32 `page_table` (B, max_pages), `k_cache` and `v_cache` are (num_pages, page_size,
Hkv, D) and position p of sequence b lives at `k_cache[page_table[b, p // page_size],
p % page_size]`; without one they are contiguous, (B, max_cache_len, Hkv, D), and position p is
`k_cache[b, p]`. `cache_seqlens` (int32, B) counts the positions of each sequence that hold keys.
q holds 1..16 query rows per sequence, dense (B, Sq, Hq, D), or any number ragged
(total_q, Hq, D) with `cu_seqlens_q` (chunked prefill). Query rows are the last positions of
their sequence's cache, so no sequence has more query rows than cached keys.

A call may append the step's new rows first: `k_new`/`v_new` in q's layout with Hkv heads,
one row per query row, which the call writes into the cache at positions cache_seqlens[b] ...
cache_seqlens[b] + Sq_b - 1 before it attends over cache_seqlens[b] + Sq_b keys (the caller
then advances cache_seqlens, as FlashAttention's `flash_attn_with_kvcache` has it).

The cache may be float8_e4m3fn (torch tensors) with one scale per tensor, `k_scale` and
`v_scale` (default 1): key = k_cache's element x k_scale, value likewise. New rows come in q's
dtype and are stored as round-to-nearest-even(row / scale), saturated to +-448.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from mhadsl.front.attention_spec import AttentionOptions
from mhadsl.host.calls import check_max_seqlen, dtype_name, softmax_scale

PAGE_SIZES = (16, 32, 64, 128, 256, 512)
MAX_DECODE_ROWS = 16  # query rows per sequence of a dense decode call
MAX_KV_SPLITS = 128  # KV splits of a decode launch
FP8_CACHE = "float8_e4m3fn"
_CACHE_LAYOUT = ("(num_pages, page_size, kv_heads, head_dim) with a page_table, else "
                 "(batch, max_cache_len, kv_heads, head_dim)")


class DecodeCall(NamedTuple):
    """A checked decode call's sizes, and its index values where they were read."""
    batch: int
    page_size: int | None  # None: a contiguous cache
    cu_seqlens_q: np.ndarray | None  # (B + 1,) query row offsets, dense or ragged
    cache_seqlens: np.ndarray | None  # (B,)
    max_seqlen_q: int  # query rows of the longest sequence (dense: Sq)
    scale: float
    appends: bool = False  # k_new/v_new given; then cache_seqlens counts the new rows too
    kv_scales: tuple[float, float] | None = None  # an FP8 cache's (k_scale, v_scale)


def _check_cache_dtype(k_cache, v_cache, k_scale, v_scale) -> tuple[float, float] | None:
    """An FP8 cache's (k_scale, v_scale), checked (finite, above 0; default 1); None for a
    cache in the kernel's dtype, which takes no scale."""
    fp8 = [dtype_name(t) == FP8_CACHE for t in (k_cache, v_cache)]
    if fp8[0] != fp8[1]:
        raise TypeError(f"k_cache and v_cache must both be {FP8_CACHE} or neither, got "
                        f"{dtype_name(k_cache)} and {dtype_name(v_cache)}")
    if not fp8[0]:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale and v_scale dequantise a {FP8_CACHE} cache; this "
                             f"cache is {dtype_name(k_cache)}")
        return None
    scales = []
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if x is None:
            x = 1.0
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise TypeError(f"{name} must be a float, got {type(x).__name__}")
        if not (np.isfinite(x) and 0 < x < 3.4e38):
            raise ValueError(f"{name} must be finite and above 0, got {x!r}")
        scales.append(float(x))
    return scales[0], scales[1]


def _check_new_rows(q, k_cache, k_new, v_new) -> bool:
    """Whether the call appends new rows (`k_new`/`v_new`, both or neither), checked: q's
    layout with the cache's K/V heads and head dim, q's dtype (an FP8 cache stores them
    quantised)."""
    if (k_new is None) != (v_new is None):
        raise TypeError("give k_new and v_new together (the step's new keys and values), or "
                        "neither")
    if k_new is None:
        return False
    want = tuple(q.shape[:-2]) + tuple(k_cache.shape[-2:])
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {want}: q's rows "
                             f"with the cache's K/V heads and head dim")
        if dtype_name(t) != dtype_name(q):
            raise TypeError(f"{name} has dtype {dtype_name(t)}; q's is {dtype_name(q)}")
    return True


def check_decode_call(options: AttentionOptions, q, k_cache, v_cache, *, cache_seqlens,
                      page_table=None, cu_seqlens_q=None, max_seqlen_q=None, scale=None,
                      num_splits=None, k_new=None, v_new=None, k_scale=None, v_scale=None,
                      read: Callable[[object], np.ndarray | None] = np.asarray) -> DecodeCall:
    """Refuse, with a ValueError or TypeError saying why, a decode call the kernel cannot run.

    Shapes and dtypes come from the arguments' `.shape` and `.dtype` (NumPy, torch or CuPy
    arrays, or device tensor views); the index values from `read`, which returns None for
    values it leaves where they are. The reference reads them all; the decode kernels' call
    reads device-side ones only under MHADSL_DEBUG=1, and checks what it read.
    """
    if cache_seqlens is None:
        raise TypeError("cache_seqlens is required: int32, the cached keys of each sequence")
    ragged = cu_seqlens_q is not None
    q_rank = 3 if ragged else 4
    if len(q.shape) != q_rank:
        layout = "(total_q, heads, head_dim) with cu_seqlens_q" if ragged else \
            "(batch, seqlen_q, heads, head_dim)"
        raise ValueError(f"q has shape {tuple(q.shape)}; expected rank {q_rank}: {layout}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if len(cache.shape) != 4:
            raise ValueError(f"{name} has shape {tuple(cache.shape)}; expected rank 4: "
                             f"{_CACHE_LAYOUT}")
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"k_cache and v_cache must have the same shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    for name, t in (("q", q), ("k_cache", k_cache)):
        if t.shape[-1] != options.head_dim:
            raise ValueError(f"{name} has head dim {t.shape[-1]}, but kernel '{options.name}' "
                             f"is declared head_dim = {options.head_dim}")
    if problem := options.heads_problem(q.shape[-2], k_cache.shape[-2]):
        raise ValueError(problem)
    kv_scales = _check_cache_dtype(k_cache, v_cache, k_scale, v_scale)
    appends = _check_new_rows(q, k_cache, k_new, v_new)

    if ragged:
        _check_int32(cu_seqlens_q, "cu_seqlens_q", 1, "batch + 1 entries")
        if cu_seqlens_q.shape[0] < 1:
            raise ValueError("cu_seqlens_q must have batch + 1 entries, got none")
        batch = cu_seqlens_q.shape[0] - 1
        cu_q = read(cu_seqlens_q)
    else:
        batch, sq = q.shape[:2]
        if not 1 <= sq <= MAX_DECODE_ROWS:
            raise ValueError(f"a dense decode call takes 1 to {MAX_DECODE_ROWS} query rows per "
                             f"sequence, got {sq}; pass more as ragged q with cu_seqlens_q")
        cu_q = np.arange(batch + 1) * sq
    _check_int32(cache_seqlens, "cache_seqlens", 1, "batch entries")
    if cache_seqlens.shape[0] != batch:
        raise ValueError(f"cache_seqlens has {cache_seqlens.shape[0]} entries for {batch} "
                         f"sequences")

    if page_table is None:
        page_size = None
        if k_cache.shape[0] != batch:
            raise ValueError(f"a contiguous k_cache/v_cache has batch {k_cache.shape[0]} but "
                             f"there are {batch} sequences")
        capacity = k_cache.shape[1]
    else:
        num_pages, page_size = k_cache.shape[:2]
        if page_size not in PAGE_SIZES:
            raise ValueError(f"page size (k_cache.shape[1]) must be a power of two from 16 to "
                             f"512, got {page_size}")
        _check_int32(page_table, "page_table", 2, "(batch, max_pages)")
        if page_table.shape[0] != batch:
            raise ValueError(f"page_table has {page_table.shape[0]} rows for {batch} sequences")
        capacity = page_table.shape[1] * page_size

    seqlens = read(cache_seqlens)
    if seqlens is not None:
        _check_cache_seqlens(seqlens, capacity)
        if appends and cu_q is not None:  # the keys the call attends over: with the new rows
            seqlens = np.asarray(seqlens, np.int64) + np.diff(np.asarray(cu_q, np.int64))
            if np.any(seqlens > capacity):
                b = int(np.argmax(seqlens > capacity))
                raise ValueError(f"sequence {b}'s {seqlens[b] - int(read(cache_seqlens)[b])} "
                                 f"new rows after its {int(read(cache_seqlens)[b])} cached "
                                 f"keys go beyond the cache's {capacity} positions")
    if cu_q is not None:
        _check_query_rows(cu_q, q.shape[0] if ragged else None, seqlens)
    if page_table is not None and seqlens is not None:
        pages = read(page_table)
        if pages is not None:
            _check_pages(pages, seqlens, page_size, num_pages)
    cu_q = None if cu_q is None else np.asarray(cu_q, np.int64)
    if not ragged:
        if max_seqlen_q is not None:
            raise ValueError("max_seqlen_q belongs to ragged calls (with cu_seqlens_q); a "
                             "dense call takes its query rows from q")
        max_q = q.shape[1]
    elif max_seqlen_q is None and cu_q is None:
        raise ValueError("a ragged decode call with cu_seqlens_q on the device needs "
                         "max_seqlen_q (reading it would synchronise with the device)")
    else:
        max_q = check_max_seqlen(cu_q, max_seqlen_q, "max_seqlen_q")
    scale = softmax_scale(options, scale)
    if num_splits is not None:
        words = f"num_splits must be an integer from 1 to {MAX_KV_SPLITS}, got {num_splits!r}"
        if not isinstance(num_splits, int):
            raise TypeError(words)
        if isinstance(num_splits, bool) or not 1 <= num_splits <= MAX_KV_SPLITS:
            raise ValueError(words)
    return DecodeCall(batch, page_size, cu_q,
                      None if seqlens is None else np.asarray(seqlens, np.int64), max_q, scale,
                      appends, kv_scales)


def _check_int32(t, name: str, rank: int, layout: str) -> None:
    if dtype_name(t) != "int32":
        raise TypeError(f"{name} must be int32, got {dtype_name(t)}")
    if len(t.shape) != rank:
        raise ValueError(f"{name} must be {rank}-D, {layout}, got shape {tuple(t.shape)}")


def _check_cache_seqlens(seqlens: np.ndarray, capacity: int) -> None:
    if np.any(seqlens < 0):
        raise ValueError(f"cache_seqlens must not be negative, got {seqlens.tolist()}")
    if np.any(seqlens > capacity):
        raise ValueError(f"cache_seqlens {seqlens.tolist()} go beyond the cache's {capacity} "
                         f"positions per sequence")


def _check_query_rows(cu_q: np.ndarray, total_q: int | None,
                      seqlens: np.ndarray | None) -> None:
    """Ragged offsets as the kernel's call checks them (`total_q` rows; None: dense, made
    here), and no sequence with more query rows than cached keys."""
    lengths_q = np.diff(cu_q)
    if total_q is not None:
        if cu_q[0] < 0:
            raise ValueError(f"cu_seqlens_q must start at 0 or above, got {cu_q[0]}")
        if np.any(lengths_q < 0):
            raise ValueError(f"cu_seqlens_q must be non-decreasing, got {cu_q.tolist()}")
        if cu_q[-1] > total_q:
            raise ValueError(f"cu_seqlens_q ends at {cu_q[-1]}, beyond the {total_q} rows of q")
    if seqlens is not None and np.any(lengths_q > seqlens):
        b = int(np.argmax(lengths_q > seqlens))
        raise ValueError(f"sequence {b} has {lengths_q[b]} query rows but {seqlens[b]} cached "
                         f"keys; its query rows are the last positions of its cache, so "
                         f"cache_seqlens must count them too")


def _check_pages(pages: np.ndarray, seqlens: np.ndarray, page_size: int,
                 num_pages: int) -> None:
    """The page-table entries a sequence uses (those holding its first cache_seqlens
    positions) must name pages of the cache; the rest are never read."""
    pages_used = -(-seqlens // page_size)
    used = np.arange(pages.shape[1]) < pages_used[:, None]
    bad = used & ((pages < 0) | (pages >= num_pages))
    if bad.any():
        b, j = np.argwhere(bad)[0]
        raise ValueError(f"page_table[{b}, {j}] = {pages[b, j]} is not a page of the cache "
                         f"(0 to {num_pages - 1})")


def decode_operand_rows(call, q_shape, k_shape, table_shape
                        ) -> tuple[tuple[int, int], tuple[bool, bool]]:
    """The query rows and keys a tensor operand's `queries` and `keys` axes hold in a decode
    call (`paged.DecodeCall`; the shapes of q, k_cache and page_table): its query rows, per
    sequence dense or in all ragged; the cache's positions a sequence (every sequence's keys
    sit at the same positions, so a `keys` axis is never ragged)."""
    ragged = len(q_shape) == 3
    return (q_shape[0] if ragged else q_shape[1], cache_capacity(call, k_shape, table_shape)), \
        (ragged, False)


def cache_capacity(call: DecodeCall, k_shape, table_shape) -> int:
    """Positions a sequence's cache holds: the contiguous cache's length, or the page
    table's pages of `page_size`."""
    return k_shape[1] if call.page_size is None else table_shape[1] * call.page_size
