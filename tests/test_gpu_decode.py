"""Decode against a KV cache on the GPU (`mhadsl.host.serving`, the decode design) against the
float64 `mhadsl.reference_decode`: contiguous and paged caches (pages in random order),
cache lengths 0, 1, a page boundary +-1 and lengths not a multiple of the page, GQA 1/4/8/16,
head dims 64/128/256, 1/4/16 query rows, ragged query rows (chunked prefill), forced and
default KV splits, a window over the cache, softcap, ALiBi, a mask that reads the head, fp16,
the LSE, CUDA-graph replay with new lengths and page tables, and the host checks."""
import numpy as np
import pytest

import mhadsl

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

CAUSAL = "mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = kv_idx <= q_idx + seqlen_k - seqlen_q"
SOURCE = f"""
import "std/schedulers.mha"
attention causal {{ dtype = bf16  head_dim = 128  return_lse = true  {CAUSAL} }}
attention causal_d64 {{ dtype = bf16  head_dim = 64  {CAUSAL} }}
attention causal_d256 {{ dtype = bf16  head_dim = 256  {CAUSAL} }}
attention causal_fp16 {{ dtype = fp16  head_dim = 128  return_lse = true  {CAUSAL} }}
attention persistent {{ dtype = bf16  head_dim = 128  scheduler = Persistent()  {CAUSAL} }}
attention window {{ dtype = bf16  head_dim = 128
    mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) =
        kv_idx <= q_idx + seqlen_k - seqlen_q && q_idx + seqlen_k - seqlen_q - kv_idx < 300 }}
attention head_window {{ dtype = bf16  head_dim = 128
    mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) =
        kv_idx <= q_idx + seqlen_k - seqlen_q && q_idx + seqlen_k - seqlen_q - kv_idx < 100 + 200 * h }}
attention softcap {{ dtype = bf16  head_dim = 128  {CAUSAL}
    score(s, b, h, q_idx, kv_idx) = 30.0 * tanh(s / 30.0) }}
attention alibi {{ dtype = bf16  head_dim = 128  {CAUSAL}
    score(s, b, h, q_idx, kv_idx) = s - exp2(-1.0 - f32(h)) * f32(q_idx - kv_idx) }}
"""
PROGRAM = mhadsl.compile(SOURCE, name="decode_tests")


def cache(lengths, hkv, d, *, page_size=None, dtype=torch.bfloat16, seed=0):
    """(k_cache, v_cache, cache_seqlens, page_table) holding random keys for `lengths`:
    contiguous, or pages of `page_size` in a random order (plus unused pages)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    lengths = list(lengths)
    capacity = max(max(lengths), 1)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    if page_size is None:
        shape = (len(lengths), capacity, hkv, d)
        k = torch.randn(shape, generator=g, device="cuda").to(dtype)
        v = torch.randn(shape, generator=g, device="cuda").to(dtype)
        return k, v, seqlens, None
    max_pages = -(-capacity // page_size) + 1  # a spare column: never read
    num_pages = len(lengths) * max_pages + 3
    order = torch.randperm(num_pages, generator=g, device="cuda")[:len(lengths) * max_pages]
    table = order.reshape(len(lengths), max_pages).to(torch.int32).contiguous()
    shape = (num_pages, page_size, hkv, d)
    k = torch.randn(shape, generator=g, device="cuda").to(dtype)
    v = torch.randn(shape, generator=g, device="cuda").to(dtype)
    return k, v, seqlens, table


def check(kern, q, k, v, seqlens, pages, *, cu_q=None, max_q=None, lse=False, **kw):
    """The call against the reference; `kw`: the call's other arguments (num_splits, the
    declaration's operands), which the reference takes too."""
    out = torch.full_like(q, float("nan"))  # poison: every row must be written
    result = kern(q, k, v, cache_seqlens=seqlens, page_table=pages, cu_seqlens_q=cu_q,
                  max_seqlen_q=max_q, out=out, return_lse=lse, **kw)
    got, got_lse = result if lse else (result, None)
    assert got is out
    ref = mhadsl.reference_decode(kern, q, k, v, cache_seqlens=seqlens, page_table=pages,
                                  cu_seqlens_q=cu_q, return_lse=lse, **kw)
    ref, ref_lse = ref if lse else (ref, None)
    got = got.float().cpu().numpy().astype(np.float64)
    assert np.isfinite(got).all(), "NaN or unwritten output"
    err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err < 1e-2, err
    if lse:
        g = got_lse.cpu().numpy().astype(np.float64)
        finite = np.isfinite(ref_lse)
        assert np.array_equal(np.isfinite(g), finite)
        assert np.allclose(g[finite], ref_lse[finite], atol=2e-2, rtol=1e-3)
    return out


def queries(b, sq, hq, d, dtype=torch.bfloat16):
    return torch.randn(b, sq, hq, d, device="cuda").to(dtype)


@pytest.mark.parametrize("page_size", [None, 16, 64, 256])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_lengths_and_pages(page_size, splits):
    """Cache lengths 0 (no query row then: a ragged call), 1, a page boundary +-1, and
    lengths not a multiple of the page; forced and default splits."""
    kern = PROGRAM["causal"]
    p = page_size or 64
    lengths = [1, p - 1, p, p + 1, 3 * p + 5, 1000]
    k, v, seqlens, table = cache(lengths, 2, 128, page_size=page_size)
    q = queries(len(lengths), 1, 8, 128)
    check(kern, q, k, v, seqlens, table, lse=True, num_splits=splits)


@pytest.mark.parametrize("group", [1, 4, 8, 16])
@pytest.mark.parametrize("sq", [1, 4, 16])
def test_gqa_and_query_rows(group, sq):
    kern = PROGRAM["causal"]
    k, v, seqlens, table = cache([sq + 40, 700, 2100], 2, 128, page_size=64, seed=group)
    check(kern, queries(3, sq, 2 * group, 128), k, v, seqlens, table, lse=True)


@pytest.mark.parametrize("name", ["causal_d64", "causal_d256", "causal_fp16"])
@pytest.mark.parametrize("sq", [2, 16])  # 16: 64 packed rows, a warpgroup (wgmma on sm_90a)
def test_head_dims_and_fp16(name, sq):
    kern = PROGRAM[name]
    d = kern.options.head_dim
    dt = torch.float16 if kern.options.dtype == "fp16" else torch.bfloat16
    k, v, seqlens, table = cache([sq + 5, 300, 1500], 2, d, page_size=16, dtype=dt)
    check(kern, queries(3, sq, 8, d, dt), k, v, seqlens, table,
          lse=kern.options.return_lse)
    check(kern, queries(3, sq, 8, d, dt), k, v, seqlens, table, num_splits=4)


@pytest.mark.parametrize("name", ["window", "head_window", "softcap", "alibi", "persistent"])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("sq", [4, 16])  # 16 rows x GQA 4: a warpgroup's 64 packed rows
def test_rules_over_the_cache(name, splits, sq):
    kern = PROGRAM[name]
    k, v, seqlens, table = cache([sq, 257, 1200, 2500], 2, 128, page_size=64, seed=7)
    check(kern, queries(4, sq, 8, 128), k, v, seqlens, table, lse=True, num_splits=splits)


def poison_past_lengths(k, v, seqlens, table):
    """NaN at every cache position past its sequence's length (a cache never written there),
    unused pages included."""
    lengths = seqlens.tolist()
    if table is None:
        for b, n in enumerate(lengths):
            k[b, n:], v[b, n:] = float("nan"), float("nan")
        return
    page_size = k.shape[1]
    valid = torch.zeros(k.shape[0], dtype=torch.int64)
    for b, pages in enumerate(table.tolist()):
        for j, page in enumerate(pages):
            valid[page] = min(max(lengths[b] - j * page_size, 0), page_size)
    for page, n in enumerate(valid.tolist()):
        k[page, n:], v[page, n:] = float("nan"), float("nan")


@pytest.mark.parametrize("page_size", [None, 16, 64, 256])
@pytest.mark.parametrize("sq", [1, 16])  # 16 x GQA 4: wgmma on sm_90a
def test_cache_positions_past_the_lengths_never_reach_the_output(page_size, sq):
    """NaN past every sequence's length (a cache never written there): the KV tile that
    holds a sequence's end reads nothing past it (its copies zero-fill), so no 0 x NaN
    reaches P V, with and without splits."""
    kern = PROGRAM["causal"]
    k, v, seqlens, table = cache([sq, 31, 63, 64, 65, 200, 1000], 2, 128,
                                 page_size=page_size, seed=11)
    poison_past_lengths(k, v, seqlens, table)
    for splits in (None, 3):
        check(kern, queries(7, sq, 8, 128), k, v, seqlens, table, lse=True,
              num_splits=splits)


def test_ragged_query_rows():
    """Chunked prefill: ragged query rows (0 for a sequence with an empty cache) against the
    cache, more packed rows than one tile holds."""
    kern = PROGRAM["causal"]
    lengths_q, lengths_k = [3, 0, 40, 1, 17], [3, 0, 900, 64, 200]
    k, v, seqlens, table = cache(lengths_k, 2, 128, page_size=16)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths_q)]), dtype=torch.int32,
                      device="cuda")
    q = torch.randn(sum(lengths_q), 8, 128, device="cuda").to(torch.bfloat16)
    for splits in (1, 3):
        check(kern, q, k, v, seqlens, table, cu_q=cu, max_q=max(lengths_q), lse=True,
              num_splits=splits)


def test_small_kv_tiles_of_many_groups():
    """Enough 16-row work tiles for two per multiprocessor: the planner's 32-row KV tile
    (two-warp CTAs, whose copy passes keep the swizzle phase), contiguous and paged; with
    16-row pages, the 64-row tile (four warps)."""
    kern = PROGRAM["causal"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = 2 * sms // 2  # x 2 K/V heads: two groups per multiprocessor
    for page_size, threads in ((None, 64), (64, 64), (16, 128)):
        k, v, seqlens, table = cache([100 + 37 * i for i in range(batch)], 2, 128,
                                     page_size=page_size)
        check(kern, queries(batch, 1, 16, 128), k, v, seqlens, table, lse=True)
        # (the decode kernel: after the split index's, where the splits follow the lengths)
        assert list(kern.launcher.fast_plans.values())[-1].plans[-1].threads == threads


def test_small_kv_tiles_of_many_warpgroup_groups():
    """Enough 64-row work tiles (GQA 4 x 16 query rows) for two per multiprocessor: on
    sm_90a the planner's 32-row KV tile under wgmma, contiguous and paged (cache lengths
    not a multiple of either tile); 16-row pages keep the 64-row tile."""
    kern = PROGRAM["causal"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = sms  # x 2 K/V heads: two groups per multiprocessor
    for page_size, block_n in ((None, 32), (64, 32), (16, 64)):
        k, v, seqlens, table = cache([17 + 37 * i for i in range(batch)], 2, 128,
                                     page_size=page_size, seed=3)
        check(kern, queries(batch, 16, 8, 128), k, v, seqlens, table, lse=True)
        if torch.cuda.get_device_capability(0) == (9, 0):  # the build this call ran
            shared = list(kern.launcher.fast_plans.values())[-1].plans[-1].shared_bytes
            assert any(b.config.wgmma and b.config.block_n == block_n
                       for b in kern.launcher.loaded.values()
                       if getattr(b.config, "query_rows", None) == 16 and b.config.gqa_group == 4
                       and b.config.page_size == (page_size or 0)
                       and b.design.scheduled(b.config).shared_bytes == shared)


def test_long_single_sequence_splits():
    """One long sequence: the default split count spreads it over the GPU."""
    kern = PROGRAM["causal"]
    k, v, seqlens, table = cache([40000], 8, 128)
    check(kern, queries(1, 1, 32, 128), k, v, seqlens, table, lse=True)
    planned = list(kern.launcher.fast_plans.values())[-1]  # the plan that call made
    assert planned.num_splits > 1


@pytest.mark.parametrize("name, group, sq, page_size, splits", [
    ("causal", 4, 16, 64, None),  # 64 packed rows: a warpgroup's wgmma on sm_90a
    ("causal", 8, 16, None, 3),  # 128 rows
    ("causal", 8, 1, 16, 3),
    ("causal_d64", 4, 16, 16, 4),
    ("causal_d256", 4, 16, None, None),
    ("window", 4, 16, 64, 4),
    ("alibi", 4, 4, 256, 1),
])
def test_the_sm80_build_runs_every_kind_of_decode(monkeypatch, name, group, sq, page_size,
                                                  splits):
    """The sm_80 decode build (mma.sync for every tile, which sm_90a replaces by wgmma for
    whole warpgroups of rows), loaded as sm_80 PTX, which the driver JIT-compiles on GPUs
    newer than the 8.x family (`select_target`), so an H200 runs it too."""
    from mhadsl.codegen import backends
    monkeypatch.setattr(backends, "select_target",
                        lambda capability: backends.DeviceTarget("sm_80", "ptx"))
    kern = mhadsl.compile(SOURCE, name="decode_sm80_tests")[name]
    d = kern.options.head_dim
    k, v, seqlens, table = cache([sq + 3, 200, 1100], 2, d, page_size=page_size, seed=group)
    check(kern, queries(3, sq, 2 * group, d), k, v, seqlens, table,
          lse=kern.options.return_lse, num_splits=splits)
    assert [b.build.arch for b in kern.launcher.loaded.values()] == ["sm_80"]
    assert not any(b.config.wgmma for b in kern.launcher.loaded.values())


def test_graph_replay_new_contents():
    """A captured decode replays new cache lengths and page tables without recapture."""
    kern = PROGRAM["causal"]
    k, v, seqlens, table = cache([500, 1300, 70], 2, 128, page_size=64, seed=3)
    q = queries(3, 1, 8, 128)
    out = torch.empty_like(q)
    for splits in (1, 4):
        kern(q, k, v, cache_seqlens=seqlens, page_table=table, out=out, num_splits=splits)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                kern(q, k, v, cache_seqlens=seqlens, page_table=table, out=out,
                     num_splits=splits)
        for new_lengths in ([900, 20, 1400], [1, 1300, 64]):
            seqlens.copy_(torch.tensor(new_lengths, dtype=torch.int32))
            table.copy_(table.flip(0))  # other pages
            graph.replay()
            torch.cuda.synchronize()
            ref = mhadsl.reference_decode(kern, q, k, v, cache_seqlens=seqlens,
                                          page_table=table, return_lse=False)
            got = out.float().cpu().numpy()
            assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


def test_bad_calls_raise_before_launch():
    kern = PROGRAM["causal"]
    k, v, seqlens, table = cache([10, 20], 2, 128, page_size=16)
    q = queries(2, 1, 8, 128)
    with pytest.raises(TypeError, match="int32"):
        kern(q, k, v, cache_seqlens=seqlens.long(), page_table=table)
    with pytest.raises(ValueError, match="page size"):
        kern(q, k[:, :12], v[:, :12], cache_seqlens=seqlens, page_table=table)
    with pytest.raises(ValueError, match="query rows"):
        kern(queries(2, 17, 8, 128), k, v, cache_seqlens=seqlens, page_table=table)
    with pytest.raises(TypeError, match="dtype"):
        kern(q.half(), k, v, cache_seqlens=seqlens, page_table=table)
    with pytest.raises(ValueError, match="num_splits"):
        kern(q, k, v, cache_seqlens=seqlens, page_table=table, num_splits=0)
    host_lengths = np.array([10, 99], dtype=np.int32)
    with pytest.raises(ValueError, match="beyond the cache"):
        kern(q.cpu().float().numpy(), k, v, cache_seqlens=host_lengths,
             page_table=table.cpu().numpy())
