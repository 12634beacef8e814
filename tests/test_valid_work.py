"""Ragged work without waste: `ts.num_valid_work()` / `ts.valid_work_info(...)` number only
the valid tiles, the std schedulers spend no index on a tile past a sequence's end, and the
tile index the device builds has the meaning written once in `mhadsl.analysis.valid_work`."""
import ctypes
import random

import numpy as np
import pytest

from helpers import STD, checked
from mhadsl.abi import tile_index_words
from mhadsl.analysis.valid_work import tile_counts, tile_index, valid_work_order
from mhadsl.codegen.assemble import assemble, find_ptxas
from mhadsl.codegen.scheduler import SchedulerSpec
from mhadsl.codegen.target import emit_ptx, gpu_target, new_module, optimize
from mhadsl.codegen.tile_index import KERNEL_NAME, build_tile_index_kernel
from mhadsl.codegen.valid_work import WIDE_SEARCH
from mhadsl.analysis.simulate import (
    Batch, HostScheduler, _Env, _SeqInfo, _State, _TileSummary, simulate,
)

ORDERS = ("DEFAULT", "PROMPT_ROTATE", "LONGEST_FIRST", "INTERLEAVED")
MUST_SHOW = [0, 1, 127, 128, 129, 3000, 8192]
SKEWED = [8192, 4096, 2048, 1024, 512, 256, 128, 64] * 2  # the benchmarks' skewed ragged batch


def test_tile_index_layout_by_hand():
    # counts 2, 0, 3, 3: ranked 2, 3, 0, 1 (ties by batch index); LONGEST_FIRST's blocks:
    # rank 0 alone reaches no level (3 = 3), ranks 0-1 reach level 2 (2 tiles),
    # ranks 0-2 levels 0-1 (6 tiles), all four none.
    assert tile_index([2, 0, 3, 3]).tolist() == [0, 2, 2, 5, 8,  2, 3, 0, 1,  0, 0, 2, 8, 8]
    assert len(tile_index([])) == tile_index_words(0) == 2
    assert tile_counts([0, 1, 128, 129, -5], 128).tolist() == [0, 1, 1, 2, 0]


def test_the_definition_by_hand():
    assert valid_work_order([2, 0, 1], 2, "DEFAULT") == [
        (0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 2), (0, 1, 2)]
    assert valid_work_order([2, 0, 1], 2, "PROMPT_ROTATE")[:4] == [
        (0, 0, 0), (1, 0, 0), (1, 1, 0), (0, 1, 0)]
    assert valid_work_order([2, 0, 1], 2, "LONGEST_FIRST") == [
        (1, 0, 0), (1, 1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 2), (0, 1, 2)]
    assert valid_work_order([2, 0, 1], 2, "LONGEST_FIRST", heads_per_section=1) == [
        (1, 0, 0), (0, 0, 0), (0, 0, 2), (1, 1, 0), (0, 1, 0), (0, 1, 2)]
    assert valid_work_order([2, 0, 3], 2, "INTERLEAVED") == [
        (0, 0, 2), (0, 1, 2), (0, 0, 0), (0, 1, 0), (1, 0, 2), (1, 1, 2), (1, 0, 0),
        (1, 1, 0), (2, 0, 2), (2, 1, 2)]
    assert valid_work_order([2, 0, 1], 2, "INTERLEAVED", heads_per_section=1) == [
        (0, 0, 0), (0, 0, 2), (1, 0, 0), (0, 1, 0), (0, 1, 2), (1, 1, 0)]


def stride_order(program, batch: Batch, order: str, section: int, ways: int = 2) -> list:
    """The tiles one static persistent CTA visits: every valid index, in order (`ways`:
    the tile index search's, `RaggedIndex.search`)."""
    spec = SchedulerSpec("Persistent", (("num_ctas", 1), ("order", order),
                                        ("heads_per_section", section)), batch.tile,
                         search_ways=ways)
    result = simulate(program, spec, batch, ctas=1)
    assert result.covered_exactly_once, result.message
    return result.visits.get(0, [])


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("ragged", [True, False])
def test_valid_work_info_is_its_definition(order, ragged):
    """Under each tile index search (a ragged launch's: binary, and the wide one the sm90
    and decode designs take, `WIDE_SEARCH`)."""
    program = checked(STD)
    lens = MUST_SHOW if ragged else [300] * 3
    for heads, section in ((5, 0), (5, 1), (5, 2), (5, 5), (5, 9), (1, 0), (4, 3)):
        batch = Batch(lens, heads=heads, tile=128, ragged=ragged)
        want = [(q * 128, h, b) for q, h, b in
                valid_work_order(tile_counts(lens, 128), heads, order, section)]
        for ways in (2, WIDE_SEARCH) if ragged else (2,):
            assert stride_order(program, batch, order, section, ways) == want, \
                (heads, section, ways)


DENSE_MAP = STD + """
scheduler DenseMap(order: Schedule = DEFAULT) {
    may_advance = true
    schedule = order
    grid_dim(batch_size, max_num_prompt_tiles) = (1, 1, 1)
    initial_state(slots, ts) = State(idx = 0, slots = slots, max_idx = ts.num_work())
    get_current_work_info(ts, state) = ts.work_info(state.idx, schedule)
    advance(ts, state, pipeline_idx) {
        state.idx += 1
        if state.idx >= state.max_idx { return none }
        return ts.seq_info(ts.work_info(state.idx, schedule))
    }
    unsafe_seq_info(ts, state) = ts.seq_info(ts.work_info(state.idx, schedule))
}
"""


def test_an_advance_that_returns_none_leaves_a_zeroed_seq_info():
    """Not the values the rule never set: on the GPU undefined ones keep the work loop's
    registers of the last tile's SeqInfo live across the whole tile body."""
    sched = HostScheduler(checked(DENSE_MAP), SchedulerSpec("DenseMap", (), 128))
    env = _Env(None, 1)
    env.fuel = 1 << 20
    ts = _TileSummary(1, 3, 300, 2)
    slots = (ctypes.c_uint32 * 2)()
    state = _State(5, ctypes.addressof(slots), 6)
    seq = _SeqInfo(*[0xFFFFFFFF] * 5)
    assert not sched.advance(ctypes.byref(env), ctypes.byref(ts), ctypes.byref(state), 0,
                             ctypes.byref(seq))
    assert [getattr(seq, f) for f, _ in _SeqInfo._fields_] == [0] * 5


@pytest.mark.parametrize("order", ORDERS)
def test_dense_valid_orders_are_the_work_info_orders(order):
    """On a dense batch the valid space is the whole space, in `ts.work_info`'s order
    (LONGEST_FIRST: the query tile slowest from the last, then batch, head fastest;
    INTERLEAVED: from the first)."""
    program = checked(DENSE_MAP)
    batch = Batch([300] * 3, heads=4, tile=128, ragged=False)
    dense = simulate(program, SchedulerSpec("DenseMap", (("order", order),), 128), batch, ctas=1)
    assert dense.visits[0] == stride_order(program, batch, order, 0)
    if order == "LONGEST_FIRST":
        assert dense.visits[0][:5] == [(256, 0, 0), (256, 1, 0), (256, 2, 0), (256, 3, 0),
                                       (256, 0, 1)]
    if order == "INTERLEAVED":
        assert dense.visits[0][:5] == [(0, 0, 0), (0, 1, 0), (0, 2, 0), (0, 3, 0), (0, 0, 1)]


def queue_steps(name: str, batch: Batch, args=()) -> tuple[list[bool], int]:
    """Drive one CTA of a queued scheduler alone: whether each advance's SeqInfo is a valid
    tile, and how many atomics it took from the queue in all."""
    program = checked(STD)
    sched = HostScheduler(program, SchedulerSpec(name, args, batch.tile))
    counter = ctypes.c_uint32(0)
    offsets = np.concatenate(([0], np.cumsum(batch.seqlens))).astype(np.int32)
    index = tile_index(batch.tiles_per_seq)
    env = _Env(ctypes.addressof(counter), 1)
    env.grid_dim[:] = (1, 1, 1)
    ts = _TileSummary(len(batch.seqlens), batch.max_num_prompt_tiles, max(batch.seqlens),
                      batch.heads, offsets.ctypes.data, index.ctypes.data)
    slots = (ctypes.c_uint32 * 2)()
    state = _State(0, ctypes.addressof(slots), batch.num_tiles)
    seq, valid = _SeqInfo(), []
    for step in range(2 * batch.num_tiles + 2):
        env.fuel = 1 << 20
        if not sched.advance(ctypes.byref(env), ctypes.byref(ts), ctypes.byref(state),
                             step % 2, ctypes.byref(seq)):
            break
        valid.append(seq.seq_len > seq.prompt_offset)
    return valid, counter.value


@pytest.mark.parametrize("name, args", [("Queued", ()), ("LPT", ()),
                                        ("Queued", (("order", "PROMPT_ROTATE"),)),
                                        ("LPT", (("heads_per_section", 4),))])
@pytest.mark.parametrize("lens", [SKEWED, MUST_SHOW, [0, 0, 1]])
def test_every_queue_atomic_is_a_valid_tile(name, args, lens):
    """Three quarters of the skewed batch's dense indices lie past a sequence's end; the
    queue hands out none of them: one atomic per remaining tile, and one to stop."""
    batch = Batch(lens, heads=16, tile=128, ragged=True)
    valid, atomics = queue_steps(name, batch, args)
    assert all(valid) and len(valid) == batch.num_tiles - 1  # index 0 was the CTA's first
    assert atomics == batch.num_tiles
    if lens is SKEWED:
        assert batch.num_tiles * 4 == batch.max_num_prompt_tiles * 16 * len(lens)


def test_longest_first_takes_the_last_tiles_of_the_longest_sequences_first():
    batch = Batch(SKEWED, heads=16, tile=128, ragged=True)
    order = stride_order(checked(STD), batch, "LONGEST_FIRST", 0)
    assert order[:32] == [(63 * 128, h, b) for b in (0, 8) for h in range(16)]
    levels = [offset for offset, _, _ in order]
    assert levels == sorted(levels, reverse=True)  # costliest first under a causal mask
    # one tile each (128 and 64 rows): ranked by batch index
    assert order[-16 * 4:] == [(0, h, b) for b in (6, 7, 14, 15) for h in range(16)]


@pytest.mark.parametrize("ways", [2, 3, WIDE_SEARCH])
@pytest.mark.parametrize("name", ["Persistent", "Queued", "LPT"])
def test_ten_thousand_sequences_exactly_once(name, ways):
    rng = random.Random(10_000)
    lens = [rng.choice([0, 1, 64, 127, 129, rng.randrange(1, 3000)]) for _ in range(10_000)]
    batch = Batch(lens, heads=2, tile=128, ragged=True)
    result = simulate(checked(STD), SchedulerSpec(name, (), 128, search_ways=ways), batch,
                      ctas=132)
    assert result.covered_exactly_once, result.message
    assert result.tiles == batch.num_tiles


@pytest.mark.parametrize("name", ["Persistent", "Queued", "LPT"])
@pytest.mark.parametrize("section", [1, 3])
def test_head_sections_cover_every_tile_once(name, section):
    rng = random.Random(section)
    program = checked(STD)
    for _ in range(4):
        lens = [rng.choice([0, 1, rng.randrange(1, 5000)]) for _ in range(rng.randrange(1, 9))]
        batch = Batch(lens, heads=rng.randrange(1, 9), tile=rng.choice([64, 128]), ragged=True)
        spec = SchedulerSpec(name, (("heads_per_section", section),), batch.tile)
        result = simulate(program, spec, batch, ctas=rng.randrange(1, 40))
        assert result.covered_exactly_once, (lens, result.message)


@pytest.mark.parametrize("lens, ragged, section", [
    ([4096] * 4, False, 2),    # 16384 key rows per head: two heads fill 32768
    ([1024] * 8, False, 4),    # 8192 per head: four
    (SKEWED, True, 2),         # 32768 per head (tiles rounded up): one, raised to two
    ([96] * 300, True, 16),    # one head's rows alone exceed it: one section of all
    ([96] * 256, True, 2),     # exactly the budget: two
])
def test_lpt_sizes_its_head_sections_by_l2(lens, ragged, section):
    """LPT's default sections hold as many heads as 32768 key rows of K and V allow (the
    rows of a head: its valid query tiles'), at least two, or all heads where not even one
    head's fit; an explicit heads_per_section overrides it."""
    program = checked(STD)
    batch = Batch(lens, heads=16, tile=128, ragged=ragged)
    counts = tile_counts(lens, 128)
    for args, want in (((), section), ((("heads_per_section", 16),), 16),
                       ((("l2_rows", 1 << 20),), 16)):
        spec = SchedulerSpec("LPT", (("num_ctas", 1),) + args, 128)
        result = simulate(program, spec, batch, ctas=1)
        assert result.covered_exactly_once, result.message
        expected = [(q * 128, h, b) for q, h, b in
                    valid_work_order(counts, 16, "LONGEST_FIRST", want)]
        assert result.visits[0] == expected, (args, want)


@pytest.mark.parametrize("lens, ragged, group, section", [
    ([4096] * 4, False, 1, 2),   # two heads' K and V fill the budget
    ([4096] * 4, False, 4, 8),   # ... two K/V heads: eight query heads read them
    ([4096] * 4, False, 16, 16),  # MQA: one K/V head for all, capped at the heads there are
    (SKEWED, True, 4, 4),        # one K/V head's rows fit: its four query heads
    ([96] * 300, True, 4, 16),   # not even one fits: all heads, as without GQA
])
def test_lpt_sections_count_kv_heads_under_gqa(lens, ragged, group, section):
    """Under GQA a section's K and V are its K/V heads' (`gqa_group` query heads each), so
    the L2 budget holds `gqa_group` times the query heads."""
    program = checked(STD)
    batch = Batch(lens, heads=16, tile=128, ragged=ragged)
    spec = SchedulerSpec("LPT", (("num_ctas", 1),), 128, gqa_group=group)
    result = simulate(program, spec, batch, ctas=1)
    assert result.covered_exactly_once, result.message
    expected = [(q * 128, h, b) for q, h, b in
                valid_work_order(tile_counts(lens, 128), 16, "LONGEST_FIRST", section)]
    assert result.visits[0] == expected


def test_lpt_balances_the_skewed_batch():
    batch = Batch(SKEWED, heads=16, tile=128, ragged=True)
    program = checked(STD)
    whole = simulate(program, SchedulerSpec("LPT", (("heads_per_section", 16),), 128), batch,
                     ctas=132)
    queued = simulate(program, SchedulerSpec("Queued", (), 128), batch, ctas=132)
    assert whole.covered_exactly_once and queued.covered_exactly_once
    assert whole.efficiency > 0.99 and whole.makespan < queued.makespan
    # L2-sized sections give up a little balance for L2's sake; one head each (all the L2
    # budget holds here) would leave the last section's 64-tile items a tail
    sections = simulate(program, SchedulerSpec("LPT", (), 128), batch, ctas=132)
    one_head = simulate(program, SchedulerSpec("LPT", (("heads_per_section", 1),), 128),
                        batch, ctas=132)
    assert sections.covered_exactly_once and sections.efficiency > 0.97
    assert sections.makespan < one_head.makespan


@pytest.mark.skipif(find_ptxas() is None, reason="needs ptxas")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_tile_index_kernel_assembles_without_spills(arch):
    target = gpu_target(arch)
    module = new_module("tile_index", target)
    build_tile_index_kernel(module)
    resources = assemble(emit_ptx(optimize(module, target), target), arch).kernels[KERNEL_NAME]
    assert resources.spills == 0 and resources.stack_bytes == 0


def test_the_tile_index_kernel_is_built_through_the_compile_cache(tmp_path, monkeypatch):
    """The runtime is handed the kernel's PTX (`build_tile_index`): the same as the kernel
    built directly, and loaded from the cache once built."""
    from mhadsl.build import build_tile_index
    from mhadsl.codegen import tile_index as index_kernel
    from mhadsl.runtime.cache import CompileCache
    target = gpu_target("sm_80")
    module = new_module("tile_index", target)
    build_tile_index_kernel(module)
    store = CompileCache(tmp_path)
    built = build_tile_index("sm_80", store)
    assert built.ptx == emit_ptx(optimize(module, target), target)
    assert (built.name, built.threads, built.abi) == (KERNEL_NAME, index_kernel.THREADS,
                                                      index_kernel.ABI)
    monkeypatch.setattr(index_kernel, "build_tile_index_kernel",
                        lambda module: pytest.fail("built again"))
    assert build_tile_index("sm_80", store) == built
