"""The decode design without a GPU: its PTX assembles for sm_80 and sm_90a without spills
across GQA groups, query rows, page sizes, ragged query rows and mask/score rules; its
kernel ABI is the kernel's signature; the default split count; the scheduler's decode work
space simulated (every (sequence, K/V head, split) exactly once); bad calls refused before
anything runs."""
import json
import re

import numpy as np
import pytest

import mhadsl
from mhadsl.codegen.assemble import find_ptxas
from mhadsl.codegen.backends import CacheLayout, decode
from mhadsl.codegen.scheduler import SchedulerSpec
from mhadsl.host.serving import decode_work, default_splits, kv_tile
from mhadsl.analysis.simulate import simulate

CAUSAL = "mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = kv_idx <= q_idx + seqlen_k - seqlen_q"
SOURCE = f"""
import "std/schedulers.mha"
attention causal {{ dtype = bf16  head_dim = 128  {CAUSAL} }}
attention causal_d64 {{ dtype = fp16  head_dim = 64  {CAUSAL} }}
attention head_window {{ dtype = bf16  head_dim = 128
    mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) =
        kv_idx <= q_idx + seqlen_k - seqlen_q && q_idx + seqlen_k - seqlen_q - kv_idx < 100 + 200 * h }}
attention softcap {{ dtype = bf16  head_dim = 128  scheduler = Persistent()  {CAUSAL}
    score(s, b, h, q_idx, kv_idx) = 30.0 * tanh(s / 30.0) }}
attention plain_d256 {{ dtype = bf16  head_dim = 256 }}
attention causal_lpt {{ dtype = bf16  head_dim = 128  scheduler = LPT()  {CAUSAL} }}
attention causal_transient {{ dtype = bf16  head_dim = 128  scheduler = Transient()  {CAUSAL} }}
attention causal_adaptive {{ dtype = bf16  head_dim = 128  scheduler = Adaptive()  {CAUSAL} }}
"""
PROGRAM = mhadsl.compile(SOURCE, name="decode_cpu")
needs_ptxas = pytest.mark.skipif(find_ptxas() is None, reason="needs ptxas")

BUILDS = [  # kernel, GQA group, cache layout (query rows, page size), LSE
    ("causal", 8, CacheLayout(1, 0), True),
    ("causal", 4, CacheLayout(1, 16), False),
    ("causal", 1, CacheLayout(4, 64), True),
    ("causal", 16, CacheLayout(16, 256), True),
    ("causal", 8, CacheLayout(0, 512), True),
    ("causal_d64", 8, CacheLayout(2, 32), True),
    ("head_window", 4, CacheLayout(1, 16), False),
    ("softcap", 8, CacheLayout(1, 128), True),
    ("causal", 8, CacheLayout(1, 16, 32), True),
    ("plain_d256", 4, CacheLayout(2, 64), True),
    ("plain_d256", 8, CacheLayout(16, 0), False),
    ("causal", 4, CacheLayout(16, 0), False),  # 64 rows: one warpgroup (wgmma on sm_90a)
    ("softcap", 4, CacheLayout(16, 64), True),
    ("head_window", 16, CacheLayout(4, 16), True),
    ("causal_d64", 4, CacheLayout(16, 32), False),
    ("causal", 4, CacheLayout(16, 0, 32), False),  # the planner's tile for many of those
    ("softcap", 4, CacheLayout(0, 64, 32), True),
]


@needs_ptxas
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("name,group,cache,lse", BUILDS)
def test_decode_builds_assemble_without_spills(arch, name, group, cache, lse):
    build = PROGRAM[name].build(arch, gqa_group=group, return_lse=lse, cache=cache)
    assert build.backend == "decode" and build.config.page_size == cache.page_size
    kernel = build.assembled.kernels[decode.KERNEL_NAME]
    if build.config.head_dim < 256:  # (head dim 256 holds a 16 x 256 fp32 O per warp)
        assert kernel.spills == 0
    assert build.config.rows % 16 == 0
    assert build.config.rows >= min(decode.MAX_ROWS, (cache.query_rows or 1) * group)


@pytest.mark.parametrize("name,group,cache,lse", BUILDS[:4])
def test_decode_ir_is_the_same_for_both_targets_below_a_warpgroup_of_rows(name, group, cache,
                                                                          lse):
    """Tiles of fewer than 64 packed rows: the design emits one IR for sm_80 and sm_90a
    (cp.async and mma.sync on both), so the GPU tests on an sm_90 device check the IR an
    sm_80 device runs; only ptxas differs, and the test above assembles it for sm_80.
    Tiles of whole warpgroups (64 rows or more: GQA 16 x 16 rows here) differ: sm_90a
    computes them by wgmma from shared memory in wgmma's swizzled layout, sm_80 by mma.sync
    (the next test); the GPU tests run such tiles on sm_90a only."""
    builds = {arch: PROGRAM[name].build(arch, gqa_group=group, return_lse=lse, cache=cache)
              for arch in ("sm_80", "sm_90a")}
    if builds["sm_80"].config.rows % decode.WGMMA_ROWS == 0:
        assert builds["sm_90a"].config.wgmma and not builds["sm_80"].config.wgmma
        assert builds["sm_80"].llvm != builds["sm_90a"].llvm
    else:
        assert not builds["sm_90a"].config.wgmma
        assert builds["sm_80"].llvm == builds["sm_90a"].llvm


WARPGROUP_BUILDS = [b for b in BUILDS if decode.packed_rows(b[2].query_rows, b[1]) % 64 == 0]


@needs_ptxas
@pytest.mark.parametrize("name,group,cache,lse", WARPGROUP_BUILDS)
def test_warpgroup_tiles_use_wgmma_on_sm90a_only(name, group, cache, lse):
    """Work tiles of whole warpgroups: wgmma (S = Q K^T from shared memory, O += P V with
    P in registers), never serialised by ptxas (C7519/C7520), and a fence of the async
    proxy after the copies land on sm_90a; mma.sync and ldmatrix on sm_80, as before."""
    h = PROGRAM[name].build("sm_90a", gqa_group=group, return_lse=lse, cache=cache)
    a = PROGRAM[name].build("sm_80", gqa_group=group, return_lse=lse, cache=cache)
    assert h.config.wgmma and not a.config.wgmma
    assert "wgmma.mma_async" in h.ptx and "mma.sync" not in h.ptx and "ldmatrix" not in h.ptx
    assert "fence.proxy.async.shared::cta" in h.ptx
    assert "C7519" not in h.assembled.log and "C7520" not in h.assembled.log
    assert "wgmma" not in a.ptx and "mma.sync" in a.ptx
    # the launch's shared memory: the sm_80 tile plus the slack to a 1024-byte boundary,
    # less the split flag's 16 bytes (it lives in Q's tile)
    assert h.config.shared_bytes == a.config.shared_bytes - 16 + decode.WGMMA_SLACK


TRACED = [("causal", 8, CacheLayout(1, 64), True), ("causal", 1, CacheLayout(4, 0), False),
          ("softcap", 8, CacheLayout(1, 16, 32), True), ("causal_d64", 4, CacheLayout(2, 256), True)]


@needs_ptxas
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("name,group,cache,lse", TRACED)
def test_traced_decode_records_combines_after_splits_and_assembles_without_spills(
        arch, name, group, cache, lse):
    """`mhadsl trace` on decode: the traced build runs the untraced config; it reads the
    clock five times (a work item's start and end, a split's end where it has published
    its partial result, a combine's start and end), none untraced; a split's end is read
    before the count that may make another split last, a combine's start after the count
    that made it last (the order `trace.check_combines` relies on)."""
    from mhadsl.analysis.trace import scheduler_kernel
    builds = {t: scheduler_kernel(PROGRAM, name, trace=t).build(arch, gqa_group=group,
                                                                return_lse=lse, cache=cache)
              for t in (False, True)}
    assert builds[True].config == builds[False].config
    assert builds[False].ptx.count("%globaltimer") == 0
    ptx = builds[True].ptx
    assert ptx.count("%globaltimer") == 5
    assert builds[True].assembled.kernels[decode.KERNEL_NAME].spills == 0
    lines = ptx.splitlines()
    # the split counter: the one counter the kernel resets to 0 before its exit count
    reset = next(i for i, line in enumerate(lines) if "atom.global.exch.b32" in line)
    counter = lines[reset].split("[")[1].split("]")[0]
    count = max(i for i in range(reset) if "atom.global.add.u32" in lines[i]
                and f"[{counter}]" in lines[i])
    published = max(i for i in range(count) if "bar.sync" in lines[i])
    assert any("%globaltimer" in line for line in lines[published:count])
    told = next(i for i in range(count, len(lines)) if "bar.sync" in lines[i])
    combine_start = next(i for i in range(told, len(lines)) if "%globaltimer" in lines[i])
    assert not any("bar.sync" in line for line in lines[told + 1:combine_start])


def _zeroed_after_none(llvm: str) -> bool:
    """Whether the build's scheduler advance selects its SeqInfo fields on the `return none`
    flag (`lower_scheduler`'s `zero_after_none`)."""
    start = llvm.index("define internal i1 @", llvm.index("advance"))
    body = llvm[start:llvm.index("\n}\n", start)]
    flags = re.findall(r'(%"[^"]+") = load i1, ptr %"is_none"', body)
    return any(re.search(rf"select\s+i1 {re.escape(flag)}", body) for flag in flags)


def test_the_decode_builds_last_advance_leaves_its_seq_info_undefined():
    """The decode build lets its scheduler's last advance (`return none`) leave the SeqInfo
    undefined, where the prefill builds store zeros (`KernelArgs.zero_after_none`): with
    zeros ptxas allocates the split rows' build worse (benchmarks/log/BENCHMARKS_LOG.md,
    decode)."""
    kern = PROGRAM["causal_lpt"]  # a persistent scheduler: its advance returns none
    decode_ir = kern.build("sm_90a", gqa_group=4, cache=CacheLayout(1, 0, 64)).llvm
    prefill_ir = kern.build("sm_90a").llvm
    assert not _zeroed_after_none(decode_ir)
    assert _zeroed_after_none(prefill_ir)


@pytest.mark.parametrize("group,cache", [(8, CacheLayout(1, 0, 64)), (4, CacheLayout(1, 0, 32)),
                                         (1, CacheLayout(4, 16, 64))])
def test_the_warps_that_share_rows_read_each_partial_once(group, cache):
    """The cross-warp merge reads every warp's partial O once, in 16-byte vectors, split
    over the CTA's threads, rather than each warp reading every part of its rows (scalar
    loads, four times the bytes)."""
    build = PROGRAM["causal"].build("sm_90a", gqa_group=group, cache=cache)
    c = build.config
    assert c.warps_n > 1
    pieces = -(-c.rows * c.head_dim // 4 // c.threads)  # 4-column pieces per thread
    loads = re.findall(r"\bld\.shared(?:\.(v\d))?\.b32\b", build.ptx)
    assert loads.count("v4") == c.warps_n * pieces
    # each warp's row max and sum per piece; the split flag and the scheduler's slots
    assert len(loads) - loads.count("v4") <= 2 * c.warps_n * pieces + 4



def test_a_decode_tile_takes_its_scheduler_step_under_its_first_loads():
    """The decode tile takes its scheduler's step (LPT's queue atomic) and counts the CTA's
    exit between issuing its first K/V tiles and waiting for them, where their latency hides
    the atomics; after the tile they would lengthen every launch's tail."""
    ptx = PROGRAM["causal_lpt"].build("sm_90a", gqa_group=8, cache=CacheLayout(1, 0, 64)).ptx
    first_copies = ptx.index("cp.async.commit_group")
    first_wait = ptx.index("cp.async.wait_group")
    assert first_copies < ptx.index("atom.global.add") < first_wait
    assert first_copies < ptx.index("call.uni mhadsl_$_count_exit") < first_wait


def test_a_transient_decode_build_ends_without_counting_its_exit():
    """Transient reads no queue, so its decode build has no exit count (the count's fence
    and atomics lengthen every launch's tail); LPT's keeps it."""
    def ptx(name):
        return PROGRAM[name].build("sm_90a", gqa_group=8, cache=CacheLayout(1, 0, 64)).ptx
    transient, lpt = ptx("causal_transient"), ptx("causal_lpt")
    assert "count_exit" not in transient and "atom.global.add.u64" not in transient
    assert "call.uni mhadsl_$_count_exit" in lpt and "atom.global.add.u64" in lpt


def test_decode_calls_run_transient_where_the_declaration_names_no_scheduler():
    """A declaration that names no scheduler runs its decode calls one work tile per CTA
    (Transient: no queue step to wait for; faster than LPT on the H200) and its prefill
    calls by Adaptive; one that names a scheduler runs it for both."""
    cache = CacheLayout(1, 0, 64)
    default, lpt = PROGRAM["causal"], PROGRAM["causal_lpt"]
    config = default.config(gqa_group=8, cache=cache)
    assert default.scheduler_spec(config, decode.BACKEND).name == "Transient"
    assert default.scheduler_spec(default.config()).name == "Adaptive"
    assert lpt.scheduler_spec(config, decode.BACKEND).name == "LPT"
    built = default.build("sm_90a", gqa_group=8, cache=cache).ptx
    assert built == PROGRAM["causal_transient"].build("sm_90a", gqa_group=8, cache=cache).ptx
    assert built != lpt.build("sm_90a", gqa_group=8, cache=cache).ptx
    assert default.build("sm_90a").ptx == PROGRAM["causal_adaptive"].build("sm_90a").ptx


def test_decode_abi_is_the_kernel_signature():
    build = PROGRAM["causal"].build("sm_90a", gqa_group=8, cache=CacheLayout(1, 64))
    entry = build.ptx.split(".entry mha_decode(")[1].split(")")[0]
    params = [line.split()[-1].rstrip(",") for line in entry.strip().splitlines()]
    assert len(params) == len(decode.ABI.params)
    kinds = {"ptr": ".u64", "i64": ".u64", "i32": ".u32", "f32": ".f32"}
    for line, param in zip(entry.strip().splitlines(), decode.ABI):
        assert kinds[param.kind] in line or (param.kind == "i64" and ".s64" in line) or \
            (param.kind == "f32" and ".f32" in line), (line, param)


def test_kv_tile_follows_the_shape():
    assert kv_tile(16, 256, 132) == 32  # B32 x 8 K/V heads: four small CTAs per SM
    assert kv_tile(16, 128, 132) == 64  # fewer groups than two per SM
    assert kv_tile(128, 4096, 132) == 64  # 128 packed rows
    assert kv_tile(16, 256, 132, page_size=16) == 64  # a 16-row page: more bytes in flight
    assert kv_tile(16, 256, 132, page_size=64) == 32
    # 64 packed rows (GQA 4 x 16 query rows): the 32-row tile where wgmma computes them
    assert kv_tile(64, 256, 132) == 64  # sm_80: mma.sync, four warps over the tile
    assert kv_tile(64, 256, 132, wgmma=True) == 32  # sm_90a: three CTAs per SM
    assert kv_tile(64, 128, 132, wgmma=True) == 64
    assert kv_tile(64, 256, 132, page_size=16, wgmma=True) == 64
    assert kv_tile(128, 4096, 132, wgmma=True) == 64


@pytest.mark.parametrize("groups,capacity,want", [
    (256, 8192, 1),     # B32 x 8 K/V heads already fill the GPU
    (512, 2048, 1),
    (64, 32768, 2),     # B8 x 8
    (8, 131072, 16),    # B1 x 8: a long sequence over the SMs, in one wave
    (8, 512, 2),        # short caches: at least MIN_SPLIT_TILES KV tiles a split
    (45, 1 << 20, 5),   # one wave (2 splits) would leave a third of the SMs idle
])
def test_default_splits(groups, capacity, want):
    assert default_splits(groups, 132, capacity, 64) == want


def test_default_splits_fill_the_gpu():
    for groups in range(1, 106):
        splits = default_splits(groups, 132, 1 << 20, 64)
        assert groups * splits >= 0.8 * 0.85 * 132 or splits == 128


@pytest.mark.parametrize("scheduler", ["Queued", "Persistent", "LPT", "Transient"])
@pytest.mark.parametrize("batch,kv_heads,splits", [(1, 8, 15), (3, 2, 4), (5, 4, 1)])
def test_decode_work_space_covered_exactly_once(scheduler, batch, kv_heads, splits):
    program = mhadsl.compile('import "std/schedulers.mha"', name="std").checked
    spec = SchedulerSpec(scheduler, (), 1, 4)
    result = simulate(program, spec, decode_work(batch, kv_heads, splits), ctas=7,
                      cost="uniform")
    assert result.covered_exactly_once and result.terminated
    assert result.tiles == batch * kv_heads * splits


def test_cli_simulates_a_decode_launch(capsys):
    from mhadsl.cli import main
    from helpers import REPO
    rc = main(["simulate", str(REPO / "mhadsl/std/schedulers.mha"), "--scheduler", "Queued",
               "--seqlens", "1,1,1", "--heads", "8", "--kv-splits", "6", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["covered_exactly_once"] and out["tiles"] == 3 * 8 * 6


def _cache(batch=2, capacity=64, page_size=None, hkv=2, d=128):
    if page_size is None:
        k = np.zeros((batch, capacity, hkv, d), np.float32)
        return k, k.copy(), None
    pages = -(-capacity // page_size)
    k = np.zeros((batch * pages, page_size, hkv, d), np.float32)
    table = np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
    return k, k.copy(), table


@pytest.mark.parametrize("change,error,match", [
    (dict(cache_seqlens=np.array([3, 4], np.int64)), TypeError, "int32"),
    (dict(cache_seqlens=np.array([3, 99], np.int32)), ValueError, "beyond the cache"),
    (dict(cache_seqlens=np.array([3], np.int32)), ValueError, "entries"),
    (dict(q=np.zeros((2, 17, 8, 128), np.float32)), ValueError, "query rows"),
    (dict(q=np.zeros((2, 1, 8, 64), np.float32)), ValueError, "head dim"),
    (dict(q=np.zeros((2, 1, 5, 128), np.float32)), ValueError, "multiple"),
    (dict(num_splits=0), ValueError, "num_splits"),
    (dict(num_splits=True), ValueError, "num_splits"),
    (dict(page_table=np.zeros((2, 3), np.int32), k=np.zeros((6, 12, 2, 128), np.float32),
          v=np.zeros((6, 12, 2, 128), np.float32)), ValueError, "page size"),
    (dict(cu_seqlens_k=np.array([0, 1, 2], np.int32)), ValueError, "cache_seqlens"),
    (dict(cache_seqlens=None, page_table=np.zeros((2, 4), np.int32)), ValueError,
     "needs cache_seqlens"),
])
def test_bad_decode_calls_raise_before_launch(change, error, match):
    kern = PROGRAM["causal"]
    k, v, _ = _cache()
    args = dict(q=np.zeros((2, 1, 8, 128), np.float32), k=k, v=v,
                cache_seqlens=np.array([3, 4], np.int32))
    args.update(change)
    with pytest.raises(error, match=match):
        kern(**args)


def test_bad_page_table_entries_raise():
    kern = PROGRAM["causal"]
    k, v, table = _cache(page_size=16)
    table[1, 0] = 99
    with pytest.raises(ValueError, match="not a page of the cache"):
        kern(np.zeros((2, 1, 8, 128), np.float32), k, v,
             cache_seqlens=np.array([3, 4], np.int32), page_table=table)


def _planned_shapes(appends: bool = False):
    """A planned decode signature's shapes (no GPU: nothing is launched); `appends`: its
    calls give the step's new rows."""
    from mhadsl.runtime.launch import TensorShape
    from mhadsl.host.serving import _READ_AND_WRITTEN, _DecodePlan
    q = TensorShape((2, 1, 8, 128), (1024, 1024, 128, 1), "bfloat16")
    cache = TensorShape((2, 64, 2, 128), (16384, 256, 128, 1), "bfloat16")
    shapes = {"q": q, "k_cache": cache, "v_cache": cache, "o": q}
    spans = {n: 2 * (sum((d - 1) * s for d, s in zip(t.shape, t.strides)) + 1) - 1
             for n, t in shapes.items() if n in _READ_AND_WRITTEN}
    return _DecodePlan(None, q.shape, None, (0, 0, 0), 0, {}, 1, 1, 64, False, shapes, spans,
                       True, lambda: False, appends)


def test_planned_calls_check_their_addresses():
    """A planned call's own checks: aligned rows, and out sharing no element with q or the
    cache (out inside k_cache's bytes is caught; out after it is not refused)."""
    planned = _planned_shapes()
    base = {"q": 0x10000, "k_cache": 0x100000, "v_cache": 0x200000, "o": 0x300000}
    planned.check_addresses(base)
    with pytest.raises(ValueError, match="16-byte aligned"):
        planned.check_addresses({**base, "v_cache": 0x200008})
    with pytest.raises(ValueError, match="out overlaps k_cache"):
        planned.check_addresses({**base, "o": 0x100000 + 4096})
    planned.check_addresses({**base, "o": 0x100000 + 2 * 16384 * 2})  # just past k_cache
    for _ in range(2):  # a refused call's addresses are never taken for checked ones
        with pytest.raises(ValueError, match="out overlaps k_cache"):
            planned.check_addresses({**base, "o": 0x100000 + 4096})
    appending = _planned_shapes(appends=True)  # the new rows are copied 16 bytes at a time
    rows = {"k_new": 0x400000, "v_new": 0x500000}
    appending.check_addresses({**base, **rows})
    with pytest.raises(ValueError, match="tensor 'v_new': rows must be 16-byte aligned"):
        appending.check_addresses({**base, **rows, "v_new": 0x500002})


SPLITTING = """
import "std/schedulers.mha"
// Queued, with the KV splits of a decode launch chosen here: one split per 4096 cached keys
// of the longest sequence, unless the batch's K/V heads fill the GPU already
scheduler Splitting(num_ctas: u32 = num_sms * ctas_per_sm) {
    may_advance = true
    schedule = DEFAULT
    grid_dim(batch_size, max_num_prompt_tiles) =
        (max(min(num_ctas, max_num_prompt_tiles * num_heads * batch_size), 1), 1, 1)
    kv_splits(batch_size, max_seq_len) {
        if batch_size * num_heads >= num_sms { return 1 }
        return (max_seq_len + 4095) / 4096
    }
    initial_state(slots, ts) = State(idx = block_idx.x, slots = slots, max_idx = ts.num_work())
    get_current_work_info(ts, state) = ts.work_info(state.idx, schedule)
    advance(ts, state, pipeline_idx) {
        if producer && thread_idx.x == 0 {
            state.slots[pipeline_idx] = atomic_add(queue, 1) + grid_dim.x
        }
        barrier(sync)
        state.idx = state.slots[pipeline_idx]
        if state.idx >= state.max_idx { return none }
        return ts.seq_info(ts.work_info(state.idx, schedule))
    }
    unsafe_seq_info(ts, state) = ts.seq_info(ts.work_info(state.idx, schedule))
}
"""


def test_a_scheduler_chooses_the_kv_splits():
    """The optional host rule `kv_splits`: its value where it gives one, None (the planner's
    default) where it gives 0 or is absent; past the limit, an error at the rule."""
    from mhadsl.analysis.simulate import HostScheduler
    program = mhadsl.compile(SPLITTING, name="splitting.mha").checked
    host = HostScheduler(program, SchedulerSpec("Splitting", (), 1, 8))
    assert host.kv_splits(1, 131072, 8, 132) == 32
    assert host.kv_splits(1, 100, 8, 132) == 1
    assert host.kv_splits(64, 131072, 8, 132) == 1  # 512 groups fill 132 SMs
    assert host.kv_splits(1, 0, 8, 132) is None  # 0: the default
    with pytest.raises(mhadsl.MhaError, match="at most 128"):
        host.kv_splits(1, 1 << 20, 8, 132)
    std = HostScheduler(program, SchedulerSpec("Queued", (), 1, 8))
    assert std.kv_splits(1, 131072, 8, 132) is None
    result = simulate(program, SchedulerSpec("Splitting", (), 1, 8), decode_work(2, 8, 32),
                      ctas=5, cost="uniform")
    assert result.covered_exactly_once


def test_kv_splits_is_checked_like_a_host_rule():
    bad = SPLITTING.replace("return (max_seq_len + 4095) / 4096", "return 1.5")
    with pytest.raises(mhadsl.MhaError, match="u32"):
        mhadsl.compile(bad, name="bad.mha")
    device_only = SPLITTING.replace("return (max_seq_len + 4095) / 4096",
                                    "return thread_idx.x")
    with pytest.raises(mhadsl.MhaError, match="thread_idx"):
        mhadsl.compile(device_only, name="bad.mha")
