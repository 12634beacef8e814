"""Decode splits that follow the lengths, without a GPU: the rule's meaning
(`valid_work.balanced_splits`), the split index kernel's arithmetic compiled for the host
against it, the builds, the planner's choice and the schedulers' coverage of the work."""
import ctypes
import json
import heapq
from types import SimpleNamespace

import numpy as np
import pytest
from llvmlite import binding, ir

import mhadsl
from mhadsl.abi import CallSizes
from mhadsl.analysis.simulate import Batch, simulate
from mhadsl.analysis.valid_work import balanced_splits
from mhadsl.codegen.assemble import find_ptxas
from mhadsl.codegen.backends import CacheLayout, decode
from mhadsl.codegen.backends.decode import MIN_SPLIT_TILES, DecodeConfig, SplitRule
from mhadsl.codegen.nvptx import i32, i64
from mhadsl.codegen.scheduler import SchedulerSpec
from mhadsl.host.paged import MAX_KV_SPLITS
from mhadsl.build import decode_splits_by_length
from mhadsl.host.serving import (
    BALANCED_MIN_KEYS, CHUNKS_PER_SM, default_splits, splits_follow_lengths,
)

CAUSAL = "mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = kv_idx <= q_idx + seqlen_k - seqlen_q"
SOURCE = f"""
import "std/schedulers.mha"
attention causal {{ dtype = bf16  head_dim = 128  {CAUSAL} }}
attention plain_d64 {{ dtype = fp16  head_dim = 64 }}
attention queued {{ dtype = bf16  head_dim = 128  scheduler = Queued()  {CAUSAL} }}
attention persistent {{ dtype = bf16  head_dim = 128  scheduler = Persistent()  {CAUSAL} }}
attention transient {{ dtype = bf16  head_dim = 128  scheduler = Transient()  {CAUSAL} }}
"""
PROGRAM = mhadsl.compile(SOURCE, name="decode_balanced_cpu")
SMS = 132
needs_ptxas = pytest.mark.skipif(find_ptxas() is None, reason="needs ptxas")


def splits_of(lens, query_rows=1, *, group=4, rows=16, block_n=64, capacity=1 << 17,
              appends=False, kv_heads=8, slots=SMS, max_splits=MAX_KV_SPLITS, max_q_tiles=64):
    return balanced_splits(lens, query_rows, gqa_group=group, rows=rows, block_n=block_n,
                           capacity=capacity, appends=appends, kv_heads=kv_heads, slots=slots,
                           max_splits=max_splits, min_tiles=MIN_SPLIT_TILES,
                           max_q_tiles=max_q_tiles)


def heavy_tail(batch=64, seed=0):
    """Cache lengths around a median of ~1,500 keys, one in 16 30-60x longer."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(800, 2400, batch)
    lens[rng.choice(batch, batch // 16, replace=False)] = rng.integers(45_000, 90_000,
                                                                        batch // 16)
    return lens


def makespan(items, slots) -> float:
    """Longest-first list scheduling of `items` (costs) on `slots` machines: the end of
    the last (a decode chunk streams at one multiprocessor's share of the bandwidth)."""
    ends = [0.0] * slots
    for cost in sorted(items, reverse=True):
        heapq.heapreplace(ends, ends[0] + cost)
    return max(ends)


def chunk_costs(lens, splits, kv_heads=8, block_n=64):
    """The KV tiles each (sequence, K/V head, split) reads, splits sharing evenly."""
    costs = []
    for n, s in zip(-(-np.asarray(lens) // block_n), splits):
        per = -(-int(n) // int(s))
        costs += [min(per, int(n) - k * per) for k in range(int(s))] * kv_heads
    return costs


@pytest.mark.parametrize("batch,length,kv_heads,want", [
    (32, 8192, 8, 1),     # 256 groups already fill 132 multiprocessors
    (8, 32768, 8, 2),     # the planner's fixed split for this shape too
    (1, 131072, 8, 16),   # one long sequence over the multiprocessors
    (32, 8192, 1, 4),     # MQA
    (4, 100, 8, 1),       # 2 KV tiles: fewer than MIN_SPLIT_TILES a split
])
def test_uniform_batches_split_as_the_fixed_planner_does(batch, length, kv_heads, want):
    _, splits = splits_of([length] * batch, kv_heads=kv_heads)
    assert set(splits.tolist()) == {want}
    if length >= 4 * MIN_SPLIT_TILES * 64:
        assert want == default_splits(batch * kv_heads, SMS, length, 64)


def test_every_split_keeps_kv_tiles_and_the_work_fits_the_workspace():
    rng = np.random.default_rng(1)
    for trial in range(300):
        batch = int(rng.integers(1, 200))
        kv_heads, group = int(rng.choice([1, 2, 8])), int(rng.choice([1, 4, 8]))
        lens = rng.integers(0, 1 << int(rng.integers(4, 18)), batch)
        q_rows = rng.integers(0, 5, batch) if trial % 2 else 1
        rows = 16 * max(1, -(-4 * group // 16))
        max_splits = int(rng.choice([4, 17, MAX_KV_SPLITS]))
        q_tiles, splits = splits_of(lens, q_rows, group=group, rows=rows, kv_heads=kv_heads,
                                    max_splits=max_splits, slots=int(rng.integers(1, 300)))
        n = -(-lens // 64)
        per = -(-n // splits)
        assert (splits >= 1).all() and (splits <= max_splits).all()
        assert ((splits - 1) * per < np.maximum(n, 1)).all()  # the last split has tiles too
        groups = batch * kv_heads * q_tiles.max(initial=1)
        slots_used = kv_heads * int((q_tiles * splits).sum())
        assert slots_used <= groups + 300  # `Decode.scratch`'s bound: groups + kv_slots


@pytest.mark.parametrize("batch,kv_heads,within", [(64, 8, 1.1), (128, 8, 1.1), (64, 1, 1.2)])
def test_a_heavy_tailed_batch_is_balanced_where_a_fixed_split_is_not(batch, kv_heads, within):
    """Sequences of which one in 16 is 30-60x the median, at the planner's CHUNKS_PER_SM:
    the long ones split, the short ones do not, and longest-first list scheduling (a work
    item costs its KV tiles and 2 more: its start and its share of the combine) ends within
    `within` of the ideal, better than at one chunk per multiprocessor; the fixed split
    takes more than 1.5 times as long."""
    group = 32 // kv_heads
    rows = 16 * max(1, -(-group // 16))
    for seed in range(5):
        lens = heavy_tail(batch, seed=seed)
        ideal = (-(-lens // 64)).sum() * kv_heads / SMS

        def ends(splits):
            return makespan([c + 2 for c in chunk_costs(lens, splits, kv_heads)], SMS) / ideal
        _, splits = splits_of(lens, kv_heads=kv_heads, group=group, rows=rows,
                              slots=CHUNKS_PER_SM * SMS)
        long = lens > 40_000
        assert splits[long].min() >= 2 and splits[long].min() > splits[~long].max()
        _, one_a_sm = splits_of(lens, kv_heads=kv_heads, group=group, rows=rows, slots=SMS)
        assert ends(splits) <= min(within, ends(one_a_sm) + 0.01)
        fixed = default_splits(batch * kv_heads, SMS, 1 << 17, 64)
        assert ends([fixed] * batch) > 1.5 * ends(splits)


@pytest.fixture(scope="module")
def host_rule():
    """`SplitRule` (the split index kernel's arithmetic) compiled for the host:
    count(lens, q_offsets, j, query_rows, capacity, q_tiles, num_splits, chunk) and
    chunk(work, kv_heads, slots), for a config of `config(query_rows, appends)`."""
    binding.initialize_native_target()
    binding.initialize_native_asmprinter()
    engines = {}

    def build(query_rows: int, appends: bool):
        key = (query_rows, appends)
        if key in engines:
            return engines[key][1:]
        c = DecodeConfig("bf16", 128, 4, query_rows, 0, appends=appends, balanced=True)
        module = ir.Module("split_rule")
        ptr = ir.PointerType(i32)
        count = ir.Function(module, ir.FunctionType(i32, [ptr, ptr, i32, i32, i32, i32, i32,
                                                          i32]), "count")
        lens, offsets, j, rows, capacity, q_tiles, most, chunk = count.args
        b = ir.IRBuilder(count.append_basic_block())
        rule = SplitRule(c, SimpleNamespace(
            cache_seqlens=lens, query_offsets=offsets, query_rows=rows, cache_capacity=capacity,
            q_tiles=q_tiles, num_splits=most))
        tiles, n = rule.extent(b, j)
        b.ret(b.mul(tiles, rule.splits(b, n, chunk)))
        chunk_fn = ir.Function(module, ir.FunctionType(i32, [i64, i32, i32]), "chunk")
        b = ir.IRBuilder(chunk_fn.append_basic_block())
        work, heads, slots = chunk_fn.args
        b.ret(SplitRule(c, SimpleNamespace(num_heads=heads, split_slots=slots)).chunk(b, work))
        machine = binding.Target.from_default_triple().create_target_machine()
        engine = binding.create_mcjit_compiler(binding.parse_assembly(str(module)), machine)
        engine.finalize_object()
        i32p = ctypes.POINTER(ctypes.c_int32)
        count_fn = ctypes.CFUNCTYPE(ctypes.c_int32, i32p, i32p, *[ctypes.c_int32] * 6)(
            engine.get_function_address("count"))
        chunk_of = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int64, ctypes.c_int32,
                                    ctypes.c_int32)(engine.get_function_address("chunk"))
        engines[key] = (engine, c, count_fn, chunk_of)
        return c, count_fn, chunk_of
    return build


@pytest.mark.parametrize("query_rows,appends", [(1, False), (4, True), (0, False), (0, True)])
def test_the_kernels_split_rule_is_its_meaning(host_rule, query_rows, appends):
    """The split index kernel's arithmetic, compiled for the host from the same IR builders,
    gives every sequence the work tiles `balanced_splits` gives it: random batches, ragged
    query rows, appended rows, lengths past the cache or negative (unchecked device values)."""
    c, count, chunk_of = host_rule(query_rows, appends)
    rng = np.random.default_rng(query_rows + 10 * appends)
    i32p = ctypes.POINTER(ctypes.c_int32)
    for trial in range(200):
        batch = int(rng.integers(1, 70))
        capacity = int(rng.integers(1, 1 << 18))
        lens = rng.integers(-100, capacity + 3000, batch).astype(np.int32)
        if trial % 3 == 0:
            lens[rng.integers(batch)] = capacity * 40  # past the cache: clamped
        rows = rng.integers(0, 40, batch) if not query_rows else np.full(batch, query_rows)
        offsets = np.concatenate(([0], np.cumsum(rows))).astype(np.int32)
        heads, slots = int(rng.choice([1, 8, 64])), int(rng.integers(0, 400))
        most = int(rng.integers(1, MAX_KV_SPLITS + 1))
        max_q_tiles = int(rng.integers(1, 4))
        want_tiles, want_splits = balanced_splits(
            lens, rows, gqa_group=c.gqa_group, rows=c.rows, block_n=c.block_n,
            capacity=capacity, appends=appends, kv_heads=heads, slots=slots, max_splits=most,
            min_tiles=MIN_SPLIT_TILES, max_q_tiles=max_q_tiles)
        q_tiles = np.minimum(-(-rows * c.gqa_group // c.rows), max_q_tiles)
        keys = np.clip(lens + (rows if appends else 0), 0, capacity)
        work = int((q_tiles * -(-keys // c.block_n)).sum())
        chunk = chunk_of(work, heads, slots)
        got = [count(lens.ctypes.data_as(i32p), offsets.ctypes.data_as(i32p), j,
                     query_rows, capacity, max_q_tiles, most, chunk) for j in range(batch)]
        assert got == (want_tiles * want_splits).tolist(), trial


def test_the_chunk_rule_at_its_limits(host_rule):
    _, _, chunk_of = host_rule(1, False)
    assert chunk_of(0, 8, 132) == MIN_SPLIT_TILES
    assert chunk_of(1000, 8, 0) == 8000  # no slots counts as one
    assert chunk_of(1 << 40, 64, 1) == 1 << 30  # held to 32-bit arithmetic


@needs_ptxas
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("name,group,cache", [
    ("causal", 4, CacheLayout(1, 64, 64, balanced=True)),
    ("causal", 8, CacheLayout(0, 16, 64, appends=True, balanced=True)),
    ("plain_d64", 32, CacheLayout(1, 0, 128, fp8=True, balanced=True)),
    ("queued", 4, CacheLayout(16, 0, 32, balanced=True)),
])
def test_balanced_builds_assemble_without_spills(arch, name, group, cache):
    """The split index comes from `mha_decode_splits`, or in a call that appends rows
    from the append kernel (one launch fewer), which then reads the index's address."""
    build = PROGRAM[name].build(arch, gqa_group=group, cache=cache, return_lse=True)
    kernels = build.assembled.kernels
    writer = decode.APPEND_NAME if cache.appends else decode.SPLITS_NAME
    assert set(kernels) >= {decode.KERNEL_NAME, writer}
    assert (decode.SPLITS_NAME in kernels) == (not cache.appends)
    assert all(k.spill_stores == 0 and k.spill_loads == 0 for k in kernels.values())
    config = build.config
    assert config.balanced and config.ragged  # the scheduler numbers the index's work
    abi = decode.decode_abi(config)
    for kernel in (decode.KERNEL_NAME, writer):
        entry = build.ptx.split(f".entry {kernel}(")[1].split(")")[0]
        assert len(entry.strip().splitlines()) == len(abi.params)
    index_param = [p.name for p in abi.params].index("split_index")
    body = build.ptx.split(f".entry {writer}(")[1].split(".entry")[0]
    assert f"[{writer}_param_{index_param}]" in body
    assert [k.name for k in decode.BACKEND.kernels(config)][-2:] == [writer,
                                                                      decode.KERNEL_NAME]


def test_an_even_split_build_has_no_split_index():
    build = PROGRAM["causal"].build("sm_90a", gqa_group=4, cache=CacheLayout(1, 64, 64))
    assert decode.SPLITS_NAME not in build.ptx and not build.config.balanced
    assert "split_index" not in [p.name for p in decode.decode_abi(build.config)]


def test_which_calls_split_by_the_lengths():
    """Unless a `kv_splits` rule fixes the splits (or the call's `num_splits`), or the named
    scheduler runs one tile per CTA; a declaration that names none runs them by LPT."""
    def by_length(kern):
        return decode_splits_by_length(kern.program.checked, kern.options)
    assert by_length(PROGRAM["causal"]) and by_length(PROGRAM["queued"])
    assert by_length(PROGRAM["persistent"]) and not by_length(PROGRAM["transient"])
    splitting = mhadsl.compile(SOURCE.replace("scheduler = Queued()", "scheduler = Splits()") +
                               SPLITS_RULE, name="splitting.mha")
    assert not by_length(splitting["queued"])
    one_each = mhadsl.compile(SOURCE.replace("scheduler = Queued()", "scheduler = OneEach()") +
                              SPLITS_RULE.replace("Splits", "OneEach").replace(
                                  "may_advance = true", "may_advance = false").replace(
                                  "    kv_splits(batch_size, max_seq_len) = 2\n", ""),
                              name="one_each.mha")
    assert not by_length(one_each["queued"])
    default = PROGRAM["causal"]
    balanced = default.config(gqa_group=4, cache=CacheLayout(1, 0, 64, balanced=True))
    even = default.config(gqa_group=4, cache=CacheLayout(1, 0, 64))
    assert default.scheduler_spec(balanced, decode.BACKEND).name == "LPT"
    assert default.scheduler_spec(even, decode.BACKEND).name == "Transient"


def test_a_balanced_launch_plans_a_cta_for_each_chunk():
    """Where the splits follow the lengths the launch plans `kv_slots / num_sms` CTAs a
    multiprocessor (at most as many as fit): a uniform batch's work tiles, about
    `kv_slots`, then fill every multiprocessor evenly. The default scheduler's grid follows
    (LPT: num_sms x ctas_per_sm); a fixed split keeps every CTA that fits."""
    call = CallSizes(32, 32, 8, 1, 8192, 1, 8192, 32, False, 0.1, query_rows=1,
                     cache_capacity=8192, num_splits=MAX_KV_SPLITS,
                     kv_slots=CHUNKS_PER_SM * SMS)
    kern = PROGRAM["causal"]
    balanced = kern.config(gqa_group=4, cache=CacheLayout(1, 0, 32, balanced=True))
    even = kern.config(gqa_group=4, cache=CacheLayout(1, 0, 32))
    design = decode.BACKEND
    assert design.resident_ctas(balanced, call, SMS, 4) == CHUNKS_PER_SM
    assert design.resident_ctas(balanced, call, SMS, 1) == 1
    assert design.resident_ctas(even, call, SMS, 4) == 4
    host = kern.launcher.host_scheduler(balanced, design)
    grid = host.grid(*design.work_space(balanced, call), SMS,
                     design.resident_ctas(balanced, call, SMS, 4))
    assert grid == (CHUNKS_PER_SM * SMS, 1, 1)


def test_short_caches_take_the_hosts_split_count():
    """A call whose sequences hold at most `BALANCED_MIN_KEYS` keys (the cache's capacity)
    does not split by length: there the splits kernel and combines cost more than a long
    sequence's tail can; nor does one that fixes `num_splits`."""
    kern = PROGRAM["causal"]
    assert splits_follow_lengths(kern, None, BALANCED_MIN_KEYS + 1)
    assert not splits_follow_lengths(kern, None, BALANCED_MIN_KEYS)
    assert not splits_follow_lengths(kern, None, 1120)
    assert not splits_follow_lengths(kern, 4, 65536)
    assert not splits_follow_lengths(PROGRAM["transient"], None, 65536)


SPLITS_RULE = """
scheduler Splits() {
    may_advance = true
    schedule = DEFAULT
    grid_dim(batch_size, max_num_prompt_tiles) = (max(max_num_prompt_tiles * num_heads * batch_size, 1), 1, 1)
    kv_splits(batch_size, max_seq_len) = 2
    initial_state(slots, ts) = State(idx = block_idx.x, slots = slots, max_idx = ts.num_valid_work())
    get_current_work_info(ts, state) = ts.valid_work_info(state.idx, schedule, 0)
    advance(ts, state, pipeline_idx) = none
    unsafe_seq_info(ts, state) = ts.seq_info(ts.valid_work_info(state.idx, schedule, 0))
}
"""


@pytest.mark.parametrize("scheduler", ["LPT", "Queued", "Persistent"])
def test_the_schedulers_cover_the_split_work_exactly_once(scheduler):
    """The work space a balanced launch hands its scheduler: per (sequence, K/V head) the
    sequence's own (query-row tile x split) tiles, ragged; each exactly once."""
    lens = heavy_tail(24, seed=3)
    q_tiles, splits = splits_of(lens, 2, slots=40)
    counts = (q_tiles * splits).tolist()
    program = mhadsl.compile('import "std/schedulers.mha"', name="std").checked
    result = simulate(program, SchedulerSpec(scheduler, (), 1, 4), Batch(counts, 8, 1, True),
                      ctas=11, cost="uniform")
    assert result.covered_exactly_once and result.terminated
    assert result.tiles == 8 * sum(counts)


def test_cli_simulates_the_splits_that_follow_the_lengths(capsys):
    from mhadsl.cli import main
    from helpers import REPO
    lens = [1500, 1200, 70_000, 900, 2000, 50_000]
    rc = main(["simulate", str(REPO / "mhadsl/std/schedulers.mha"), "--scheduler", "LPT",
               "--seqlens", ",".join(map(str, lens)), "--heads", "8", "--gqa", "4",
               "--kv-splits", "auto", "--ctas", "132", "--num-sms", "132", "--json"])
    out, err = capsys.readouterr()
    _, splits = splits_of(lens, slots=CHUNKS_PER_SM * 132, capacity=max(lens), max_q_tiles=1)
    # 1,966 KV tiles x 8 K/V heads over 264 chunks: 60 tiles; 1,094 / 60 and 782 / 60
    assert CHUNKS_PER_SM == 2 and splits.tolist() == [1, 1, 18, 1, 1, 13]
    assert f"splits by length (264 chunks, 64-row KV tiles): {', '.join(map(str, splits))}" \
        in err
    summary = json.loads(out)
    assert rc == 0 and summary["covered_exactly_once"] and summary["tiles"] == 8 * sum(splits)
    # each work tile costs its split's KV tiles: the batch's, in all, and LPT's longest
    # first ends near the bound on 132 multiprocessors
    assert summary["total_work"] == 8 * sum(-(-n // 64) for n in lens)
    assert summary["efficiency"] > 0.85


@needs_ptxas
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_a_traced_balanced_build_assembles_without_spills(arch):
    """`mhadsl trace --kv-splits auto` runs the traced build of the same layout."""
    kern = mhadsl.compile(SOURCE, name="decode_balanced_trace")["causal"]
    kern.trace = True
    build = kern.build(arch, gqa_group=4, cache=CacheLayout(1, 64, 64, balanced=True))
    kernels = build.assembled.kernels
    assert set(kernels) == {decode.KERNEL_NAME, decode.SPLITS_NAME}
    assert all(k.spill_stores == 0 and k.spill_loads == 0 for k in kernels.values())
    assert build.ptx != PROGRAM["causal"].build(  # (the records' stores)
        arch, gqa_group=4, cache=CacheLayout(1, 64, 64, balanced=True)).ptx


def test_cli_simulates_fixed_splits_at_their_real_cost(capsys):
    """`--kv-splits N` costs each split the KV tiles of its chunk of the sequence (the
    planner's: the longest cache over N, in whole KV tiles; a split past the sequence
    costs nothing): on a heavy tail one split a sequence ends with its longest, where the
    splits by length end near the bound."""
    from mhadsl.cli import main
    from helpers import REPO
    lens = [1500, 1200, 70_000, 900, 50_000]
    ends = {}
    for splits in ("1", "4", "auto"):
        rc = main(["simulate", str(REPO / "mhadsl/std/schedulers.mha"), "--scheduler", "LPT",
                   "--seqlens", ",".join(map(str, lens)), "--heads", "8", "--gqa", "4",
                   "--kv-splits", splits, "--ctas", "132", "--json"])
        summary = json.loads(capsys.readouterr().out)
        assert rc == 0 and summary["covered_exactly_once"]
        assert summary["total_work"] == 8 * sum(-(-n // 64) for n in lens)
        ends[splits] = summary["makespan"]
    assert ends["1"] == -(-70_000 // 64)  # the longest sequence, whole
    assert ends["4"] == -(-70_000 // 4 // 64)  # a quarter of it (17,500 keys: 274 tiles)
    assert ends["auto"] < 0.5 * ends["4"]
