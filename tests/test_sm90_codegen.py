"""The Hopper backend ("sm90") on the CPU: every example lowers to sm_90a PTX with TMA and
wgmma, assembles with ptxas without spills or wgmma serialisation (C7519), honours
setmaxnreg; what it cannot run is reported by `problems` (selection falls back to sm80)."""
import re
from dataclasses import replace

import pytest

import mhadsl
from helpers import REPO, STD, checked
from mhadsl.front.attention_spec import resolve_attention
from mhadsl.abi import CallSizes
from mhadsl.build import KernelRequest, build_kernel, plan
from mhadsl.codegen import backends
from mhadsl.codegen.assemble import find_ptxas
from mhadsl.front.diagnostics import MhaError
from mhadsl.codegen.backends import Layout, select_backend
from mhadsl.codegen.backends.sm90 import BACKEND, KERNEL_NAME, REGISTERS, WIDE_KV_MIN_KEYS, \
    HopperConfig, shared_bytes

needs_ptxas = pytest.mark.skipif(find_ptxas() is None, reason="needs ptxas")
EXAMPLES = [(f, n) for f in ("plain.mha", "causal.mha", "sliding_window.mha", "softcap.mha",
                             "alibi.mha", "bottom_right_causal.mha", "gqa.mha")
            for n in mhadsl.compile(REPO / "examples" / f).attentions]


def build(file: str, name: str, layout: Layout = Layout()):
    program = mhadsl.compile(REPO / "examples" / file)
    return build_kernel(program.checked, KernelRequest(name, "sm_90a", "sm90", layout))


def ptx_isa(ptx: str) -> tuple[int, int]:
    major, minor = re.search(r"^\.version (\d+)\.(\d+)", ptx, re.M).groups()
    return int(major), int(minor)


@needs_ptxas
@pytest.mark.parametrize("file, name", EXAMPLES)
@pytest.mark.parametrize("layout", [Layout(), Layout(2, True, True)], ids=["dense", "ragged"])
def test_every_example_assembles_for_sm90a_without_spills(file, name, layout):
    kb = build(file, name, layout)
    assert kb.backend == "sm90" and ".target sm_90a" in kb.ptx
    assert ptx_isa(kb.ptx) <= (9, 0)
    producer, consumer = REGISTERS[kb.config.consumer_groups]
    for needed in ("wgmma.mma_async.sync.aligned.m64n", "cp.async.bulk.tensor.4d",
                   "mbarrier.try_wait.parity", f"setmaxnreg.dec.sync.aligned.u32 {producer}",
                   f"setmaxnreg.inc.sync.aligned.u32 {consumer}"):
        assert needed in " ".join(kb.ptx.split()), needed
    assert ".extern .func" not in kb.ptx  # an unknown intrinsic name
    resources = kb.assembled.kernels[KERNEL_NAME]
    assert resources.spill_stores == resources.spill_loads == 0
    assert "C7519" not in kb.assembled.log and "C7508" not in kb.assembled.log
    # the entry cap setmaxnreg needs: the SM's 64K registers over the CTA's threads, 1 CTA/SM
    assert resources.registers == 65536 // kb.config.threads // 8 * 8
    # head dim 64 runs three consumer warpgroups on 192 rows where that stays spill-free
    three = kb.config.head_dim == 64 and not layout.ragged
    assert kb.config.block_m == (192 if three else 128)


@needs_ptxas
def test_tensor_maps_are_grid_constant_parameters():
    ptx = build("causal.mha", "causal_fwd").ptx
    maps = re.findall(rf"\.param \.align \d+ \.b8 {KERNEL_NAME}_param_(\d+)\[128\]", ptx)
    first = len(backends.backend("sm80").abi.params)
    assert [int(i) for i in maps] == [first + k for k in range(4)]  # q, k, v, o maps


def test_kernel_parameters_add_four_tensor_maps_to_sm80s():
    names = [p.name for p in BACKEND.abi.params]
    sm80 = [p.name for p in backends.backend("sm80").abi.params]
    assert names == sm80 + ["q_map", "k_map", "v_map", "o_map"]
    shape = BACKEND.scheduled(HopperConfig())
    assert shape.threads == 384 and shape.shared_bytes == shared_bytes(HopperConfig())
    assert shape.shared_bytes <= backends.SHARED_MEMORY_LIMIT["sm_90a"]


@pytest.mark.parametrize("settings, fault", [
    ("head_dim = 64  warps = 4", "warps = 4"),
    ("head_dim = 64  tile = (64, 64)", "64 query rows"),
])
def test_what_the_design_cannot_run_is_a_problem(settings, fault):
    options = resolve_attention(checked(STD + f"attention a {{ {settings} }}").attentions["a"])
    problems = BACKEND.problems(options, "sm_90a")
    assert any(fault in p.message for p in problems), problems
    assert not backends.backend("sm80").problems(options, "sm_90a") or "warps" in settings
    assert BACKEND.problems(options, "sm_80")  # no sm_90a, no sm90 kernel


def test_supported_declarations_have_no_problems():
    for d in (64, 128, 256):
        options = resolve_attention(checked(STD + f"attention a {{ head_dim = {d} }}")
                                    .attentions["a"])
        assert BACKEND.problems(options, "sm_90a") == []


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_hopper_devices_run_sm90_where_it_runs_the_declaration(head_dim):
    options = resolve_attention(checked(STD + f"attention a {{ head_dim = {head_dim} }}")
                                .attentions["a"])
    backend, target = select_backend((9, 0), options=options)
    assert (backend.name, target.arch) == ("sm90", "sm_90a")
    assert select_backend((9, 0), "sm80", options)[0].name == "sm80"  # forced
    for other in ((8, 0), (8, 9), (10, 0), (12, 0)):
        assert select_backend(other, options=options)[0].name == "sm80"
    with pytest.raises(ValueError, match="builds for sm_90a, not sm_80"):
        select_backend((8, 0), "sm90")


@needs_ptxas
def test_roles_run_apart_where_the_scheduler_lets_them():
    """Queued's advance has no `while`: after the first step the producer and the consumers
    step through the handoff's mbarriers, with no CTA-wide barrier (so the producer can load
    the next work tile while the consumers finish this one). examples/queued_rotate.mha's
    MyQueued loops in its advance: its roles step together, CTA-wide."""
    from mhadsl.codegen.handoff import runs_apart
    program = mhadsl.compile(f'import "std/schedulers.mha"\nimport "{REPO}/examples/'
                             'queued_rotate.mha"\n').checked
    assert [n for n, d in program.schedulers.items() if not runs_apart(program, d)] == \
        ["MyQueued"]

    def cta_barriers(scheduler: str) -> list[str]:
        source = (f'import "std/schedulers.mha"\nimport "{REPO}/examples/queued_rotate.mha"\n'
                  f"attention a {{ head_dim = 64  scheduler = {scheduler}() }}\n")
        kb = build_kernel(checked(source), KernelRequest("a", "sm_90a", "sm90"))
        assert kb.assembled.kernels[KERNEL_NAME].spill_stores == 0
        return re.findall(r"^\s*(barrier\.sync\s+0|barrier\.red\.or\.pred\s+%p\d+, 0)",
                          kb.ptx, re.M)

    apart, together = cta_barriers("Queued"), cta_barriers("MyQueued")
    assert len(apart) == 2  # the first step's vote, once per role
    assert len(together) > len(apart)  # each step's barrier and vote, per role


@needs_ptxas
def test_consumers_take_the_producers_decoding_where_roles_run_apart():
    """Running apart, the producer's advance publishes its decoding of each step (the valid
    work item: a search over the tile index; the sequence's offsets) in the handoff's
    memo, and the consumers' advance reads it back where the key matches instead of
    decoding again, also where a `fn` the advance calls decodes (Adaptive). Lock-step roles
    (MyQueued) never read it, so LLVM drops it whole."""
    def memo_uses(scheduler: str) -> dict[str, int]:
        source = (f'import "std/schedulers.mha"\nimport "{REPO}/examples/queued_rotate.mha"\n'
                  f"attention a {{ head_dim = 64  scheduler = {scheduler}() }}\n")
        kb = build_kernel(checked(source), KernelRequest("a", "sm_90a", "sm90",
                                                         Layout(2, True, True)))
        assert kb.assembled.kernels[KERNEL_NAME].spill_stores == 0
        lines = [line for line in kb.ptx.splitlines() if "mhadsl_$_memo_$_" in line]
        return {op: sum(line.split()[0].startswith(op) for line in lines)
                for op in ("st.shared", "ld.shared", "mov")}

    apart, together = memo_uses("Queued"), memo_uses("MyQueued")
    assert together == {"st.shared": 0, "ld.shared": 0, "mov": 0}, together
    # both entries' flags cleared at the start, then addressed by pipeline slot
    assert apart == {"st.shared": 4, "ld.shared": 0, "mov": 2}, apart
    assert memo_uses("Adaptive") == apart


@needs_ptxas
def test_the_producer_warp_meets_before_it_searches_its_kv_range_together():
    """The producer's first thread loads a work tile's K and V while its warp's other lanes
    go on; under Persistent (no barrier in its advance) they ran work tiles ahead, and one
    tile's lanes searching beside another's shared their ballots: a KV range wrong for the
    loader, its loads out of step with the consumers, the kernel hung on the H200 (ragged
    causal, 8192 keys). The warp meets (`bar.warp.sync`) before its search, in each work
    tile: in the work loop's body, after the producer's setmaxnreg, before the search's
    first ballot."""
    source = (f"{STD}\nattention a {{ dtype = bf16  head_dim = 128  scheduler = Persistent()\n"
              "    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }")
    kb = build_kernel(checked(source), KernelRequest("a", "sm_90a", "sm90",
                                                     Layout(2, True, True)))
    assert kb.assembled.kernels[KERNEL_NAME].spill_stores == 0
    producer = kb.ptx[kb.ptx.index("setmaxnreg.dec"):]
    assert producer.count("bar.warp.sync") == 1
    sync, ballot = producer.index("bar.warp.sync"), producer.index("vote.sync.ballot")
    assert sync < ballot
    # inside the loop: a branch back from after the ballot jumps to at or before the sync
    labels = {m.group(1): m.start() for m in re.finditer(r"^(\$\w+):", producer, re.M)}
    back = [labels[m.group(1)] for m in re.finditer(r"bra(?:\.uni)?\s+(\$\w+);", producer)
            if m.start() > ballot and labels.get(m.group(1), -1) >= 0]
    assert any(target <= sync for target in back)


@needs_ptxas
@pytest.mark.parametrize("head_dim, uniform", [(64, True), (128, False)])
def test_head_dim_64_consumers_read_their_warpgroup_index_through_lane_0(head_dim, uniform):
    """With three consumer warpgroups (head dim 64's 192-row tiles) each one's index comes
    through `shfl.sync.idx` from lane 0 (`uniform_group`), so ptxas keeps Q's descriptors in
    uniform registers; two warpgroups (head dims 128 and 256, slower with it, and head dim
    64's 128-row tiles) keep the thread index's."""
    program = mhadsl.compile(f"{STD}\nattention a {{ dtype = bf16  head_dim = {head_dim} }}")
    kb = build_kernel(program.checked, KernelRequest("a", "sm_90a", "sm90", Layout()))
    assert kb.config.uniform_group == uniform
    assert kb.assembled.kernels[KERNEL_NAME].spill_stores == 0
    consumers = kb.ptx[kb.ptx.index("setmaxnreg.inc"):]
    assert ("shfl.sync.idx.b32" in consumers) == uniform
    # each build is listed with it first, then without (where it spills: a chunked mask)
    configs = BACKEND.configs(program["a"].options, Layout())
    assert [c.uniform_group for c in configs if c.consumer_groups == 3] == \
        [True, False] * (sum(c.consumer_groups == 3 for c in configs) // 2)
    assert not any(c.uniform_group for c in configs if c.consumer_groups != 3)


CAUSAL = "mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx"


@needs_ptxas
@pytest.mark.parametrize("mask", ["", CAUSAL], ids=["plain", "causal"])
def test_a_warpgroup_with_no_row_inside_the_sequence_only_drains_the_kv_loop(mask, monkeypatch,
                                                                            tmp_path):
    """With three consumer warpgroups (192-row tiles), one whose 64 rows all lie past the
    sequence (the last query tile of a sequence of 4096 holds 64 rows) goes through the KV
    loop on its waits and arrivals alone, with no wgmma (`drain_idle_groups`); two
    warpgroups (head dim 128) keep one loop. Under a mask each warpgroup also searches for
    its own rows' last kept KV tile and drains the tiles past it."""
    from mhadsl.codegen.backends import sm90
    from mhadsl.runtime import cache
    program = mhadsl.compile(f"{STD}\nattention a {{ dtype = bf16  head_dim = 64  {mask}\n"
                             "    scheduler = LPT() }\n"
                             f"attention b {{ dtype = bf16  head_dim = 128  {mask} }}")

    def consumers(name, store=None):
        kb = build_kernel(program.checked, KernelRequest(name, "sm_90a", "sm90", Layout()),
                          store)
        assert kb.assembled.kernels[KERNEL_NAME].spill_stores == 0
        return kb.config.drain_idle_groups, kb.ptx[kb.ptx.index("setmaxnreg.inc"):]
    drains, drained = consumers("a")
    assert drains and not consumers("b")[0]
    monkeypatch.setattr(sm90, "DRAIN_IDLE_CONSUMER_GROUPS", 0)
    drains, looped = consumers("a", cache.CompileCache(tmp_path))
    assert not drains
    # the drain: waits and arrivals of its own (LLVM copies some), the branch to it decided
    # through lane 0, and not one wgmma more
    for what in ("mbarrier.arrive", "mbarrier.try_wait"):
        assert drained.count(what) > looped.count(what)
    assert drained.count("shfl.sync.idx") == looped.count("shfl.sync.idx") + 1
    assert drained.count("wgmma.mma_async") == looped.count("wgmma.mma_async")
    # the warp's searches (a ballot each): the KV range's, the idle drain's copy of it, and
    # under a mask the warpgroup's own end
    searches = looped.count("vote.sync.ballot")
    assert drained.count("vote.sync.ballot") == 2 * searches + (1 if mask else 0)


@pytest.mark.parametrize("body, apart", [
    ("state.slots[pipeline_idx] = state.idx + grid_dim.x\n"
     "state.idx = state.slots[pipeline_idx]", True),
    ("state.slots[0] = state.idx + grid_dim.x\nstate.idx = state.slots[0]", False),
    ("state.slots[pipeline_idx + 1] = 7\nstate.idx += grid_dim.x", False),
    ("let pipeline_idx = 0\nstate.idx = state.slots[pipeline_idx]", False),
], ids=["this step's slot", "slot 0", "the other slot", "shadowed"])
def test_roles_run_apart_only_on_this_steps_slot(body, apart):
    """Running apart, the producer writes the next step's slot while the consumers read
    this step's: an advance that touches any other slot keeps the roles in lock-step."""
    from mhadsl.codegen.handoff import runs_apart
    from test_simulate import persistent_variant
    program = checked(persistent_variant(body))
    assert runs_apart(program, program.schedulers["Wrong"]) == apart


@needs_ptxas
def test_o_is_stored_by_tma_but_a_ragged_tiles_warpgroups_past_the_sequence():
    """A dense tile's rows past the tensor's end are outside the map, so a TMA store may
    write whole boxes; a ragged tile's would fall into the next sequence, so there only
    warpgroups whose 64 rows all lie inside it store by TMA, the others from registers."""
    def stores(layout):
        kb = build("causal.mha", "causal_fwd", layout)
        ptx = " ".join(kb.ptx.split())
        assert "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group" in ptx
        assert "cp.async.bulk.wait_group.read 0" in ptx
        assert kb.config.stages_o
        assert shared_bytes(kb.config) <= backends.SHARED_MEMORY_LIMIT["sm_90a"]
        return ptx.count("st.global.b32"), kb.config.head_dim
    dense, head_dim = stores(Layout())
    ragged, _ = stores(Layout(2, True, False))
    assert ragged == dense + 2 * head_dim // 8  # a thread's two rows, 16-bit pairs


@needs_ptxas
def test_a_ragged_tiles_warpgroups_choose_their_o_store_through_lane_0():
    """The choice between the TMA store and registers is the same for a warpgroup's lanes;
    decided on the sequence's length as loaded, ptxas took it for divergent and from then on
    held the KV ring's counters in vector registers, every later KV loop reconverging at its
    branches. So the ragged consumers read it with one `shfl.sync.idx` more than the dense ones."""
    def reads(layout):
        kb = build("causal.mha", "causal_fwd", layout)
        assert kb.assembled.kernels[KERNEL_NAME].spill_stores == 0
        return kb.ptx[kb.ptx.index("setmaxnreg.inc"):].count("shfl.sync.idx")
    assert reads(Layout(ragged=True)) == reads(Layout()) + 1


def test_o_is_staged_over_vs_ring_only_where_its_own_tile_would_not_fit():
    limit = backends.SHARED_MEMORY_LIMIT["sm_90a"]
    d256 = HopperConfig(head_dim=256, block_n=64)
    assert d256.o_over_v and shared_bytes(d256) <= limit  # own tile: 257 KiB
    assert not HopperConfig(head_dim=256, block_n=48).o_over_v  # V's ring holds 96 rows
    assert not HopperConfig().o_over_v  # D128: O has its own tile, as it fits
    assert HopperConfig(stages=3).o_over_v and shared_bytes(HopperConfig(stages=3)) <= limit
    ragged = HopperConfig(head_dim=256, block_n=64, ragged=True)
    assert not ragged.o_over_v  # its own tile would not fit: no staging at all
    assert not ragged.stages_o and shared_bytes(ragged) == shared_bytes(d256)
    ragged_d128 = HopperConfig(ragged=True)  # stages O in its own tile, as a dense build
    assert ragged_d128.stages_o and shared_bytes(ragged_d128) == shared_bytes(HopperConfig())


@needs_ptxas
@pytest.mark.parametrize("mask, keys, over_v", [("", 80, True), (
    "mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx", 80, True)], ids=["plain", "causal"])
def test_d256_dense_builds_take_the_widest_spill_free_kv_tile(mask, keys, over_v):
    program = mhadsl.compile(f'{STD}\nattention a {{ dtype = bf16  head_dim = 256 {mask} }}')
    kb = build_kernel(program.checked, KernelRequest("a", "sm_90a", "sm90", Layout()))
    assert (kb.config.block_n, kb.config.o_over_v) == (keys, over_v)
    resources = kb.assembled.kernels[KERNEL_NAME]
    assert resources.spill_stores == resources.spill_loads == 0
    # the store's read is awaited before the next tile's epilogue and the CTA's exit, and
    # with O over V's ring also right after the store, for the producer's next V
    waits = " ".join(kb.ptx.split()).count("cp.async.bulk.wait_group.read 0")
    assert waits == (3 if over_v else 2)


@pytest.mark.parametrize("head_dim, mask, declared, stages", [
    (128, "q_idx - kv_idx < 256", "", 3),  # a short band: the producer runs further ahead
    (64, "q_idx - kv_idx < 256", "", 3),
    (256, "q_idx - kv_idx < 256", "", 2),  # three stages do not fit at head dim 256
    (128, "q_idx - kv_idx < 256", "stages = 2", 2),  # declared
    (128, "q_idx - kv_idx < 4096", "", 2),  # a band of 33 KV tiles
    (128, "true", "", 2)])
def test_short_band_masks_take_three_stages_where_they_fit(head_dim, mask, declared, stages):
    program = mhadsl.compile(f"{STD}\nattention a {{ dtype = bf16  head_dim = {head_dim} "
                             f"mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx && {mask} "
                             f"{declared} }}")
    planned = plan(program.checked, KernelRequest("a", "sm_90a", "sm90", Layout()))
    assert planned.configs[0].stages == stages
    assert all(shared_bytes(c) <= backends.SHARED_MEMORY_LIMIT["sm_90a"]
               for c in planned.configs)


@pytest.mark.parametrize("head_dim, declared, tile", [
    (128, "stages = 3", (128, 128)),  # the 144-key tile of a plain build does not fit
    (128, "stages = 4", (128, 64)), (256, "stages = 3", (128, 48)),
    (64, "stages = 8", (128, 64)), (128, "stages = 2", (128, 144))])
def test_declared_stages_take_the_default_tiles_they_fit_beside(head_dim, declared, tile):
    """Stages a declaration sets without a tile are built with the first of the design's
    tiles that fits beside them (a plain build without its wide KV tile, where that does not
    fit); a declared tile that does not fit is still refused."""
    program = mhadsl.compile(f"{STD}\nattention a {{ dtype = bf16  head_dim = {head_dim} "
                             f"{declared} }}")
    planned = plan(program.checked, KernelRequest("a", "sm_90a", "sm90", Layout()))
    assert (planned.configs[0].block_m, planned.configs[0].block_n) == tile
    assert all(shared_bytes(c) <= backends.SHARED_MEMORY_LIMIT["sm_90a"]
               for c in planned.configs)
    siblings = BACKEND.sibling_layouts(program["a"].options, Layout())
    assert bool(siblings) == (tile[1] == 144)
    with pytest.raises(MhaError, match="shared memory|stages"):
        mhadsl.compile(f"{STD}\nattention a {{ head_dim = 128  tile = (128, 128)  "
                       f"stages = 4 }}")


@pytest.mark.parametrize("head_dim, mask, ragged, stages", [
    (64, "", False, 4), (64, "mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx", False, 4),
    (64, "mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx", True, 4),
    (128, "mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx", False, 2), (256, "", False, 2)])
def test_head_dim_64_takes_four_stages_where_they_fit(head_dim, mask, ragged, stages):
    """Head dim 64's K/V tiles leave room for four stages beside Q and O (faster on the
    H200); head dims 128 and 256 have room for two."""
    program = mhadsl.compile(f"{STD}\nattention a {{ dtype = bf16  head_dim = {head_dim} "
                             f"{mask} }}")
    planned = plan(program.checked, KernelRequest("a", "sm_90a", "sm90",
                                                   Layout(1, ragged, False)))
    assert planned.configs[0].stages == stages
    assert all(shared_bytes(c) <= backends.SHARED_MEMORY_LIMIT["sm_90a"]
               for c in planned.configs)


@needs_ptxas
@pytest.mark.parametrize("mask, tile", [
    ("mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx", (128, 128)), ("", (128, 144))])
def test_a_warp_rescales_o_only_where_one_of_its_rows_moved_its_max(mask, tile):
    """Each tile is tried with `lazy_rescale` first (rows keep their max until it grows by
    more than 2**8; one warp vote decides whether the warp's O accumulators are rescaled),
    then the same tile without it (where it spills); head dim 128's default tiles take it
    spill-free, plain 128 x 144 too since P V's wait is held below the rows' maxima."""
    program = mhadsl.compile(f"{STD}\nattention a {{ dtype = bf16  head_dim = 128 {mask} }}")
    configs = BACKEND.configs(program["a"].options, Layout())
    assert [c.lazy_rescale for c in configs] == [True, False] * (len(configs) // 2)
    assert all(replace(lazy, lazy_rescale=False) == eager
               for lazy, eager in zip(configs[::2], configs[1::2]))
    kb = build_kernel(program.checked, KernelRequest("a", "sm_90a", "sm90", Layout()))
    assert (kb.config.block_m, kb.config.block_n) == tile and kb.config.lazy_rescale
    assert kb.assembled.kernels[KERNEL_NAME].spills == 0
    assert kb.ptx.count("vote.sync.any.pred") == 1


@needs_ptxas
@pytest.mark.parametrize("head_dim, per_group", [(64, True), (128, True), (256, False)])
def test_each_consumer_warpgroup_stores_its_own_rows_of_o_unless_o_is_over_v(head_dim, per_group):
    program = mhadsl.compile(f"{STD}\nattention a {{ dtype = bf16  head_dim = {head_dim} "
                             "mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }")
    kb = build_kernel(program.checked, KernelRequest("a", "sm_90a", "sm90", Layout()))
    assert kb.config.o_store_per_group == per_group == (not kb.config.o_over_v)
    ptx = " ".join(kb.ptx.split())
    consumers = kb.config.consumer_threads
    # the epilogue's named barriers: the warpgroup's own (its id in a register), or all
    # consumers' (id 2)
    assert (re.search(r"bar\.sync %r\d+, 128;", ptx) is not None) == per_group
    assert (f"bar.sync 2, {consumers};" in ptx) == (not per_group)
    box_rows = 64 if per_group else kb.config.block_m
    assert BACKEND.abi["o_map"].binding.box(kb.config) == (1, box_rows, 1, 64)


@needs_ptxas
def test_a_192_row_tile_runs_three_consumer_warpgroups():
    program = mhadsl.compile(STD + "attention a { dtype = bf16  head_dim = 64  tile = (192, 128) }")
    assert BACKEND.problems(program["a"].options, "sm_90a") == []
    too_wide = HopperConfig(head_dim=128, block_m=192).problems()
    assert any("head dim 64 only" in p.message for p in too_wide), too_wide
    kb = build_kernel(program.checked, KernelRequest("a", "sm_90a", "sm90", Layout()))
    assert BACKEND.scheduled(kb.config).threads == 512
    ptx = " ".join(kb.ptx.split())
    for needed in (".maxntid 512", "setmaxnreg.dec.sync.aligned.u32 32",
                   "setmaxnreg.inc.sync.aligned.u32 160"):
        assert needed in ptx, needed
    resources = kb.assembled.kernels[KERNEL_NAME]
    assert resources.spill_stores == resources.spill_loads == 0
    assert resources.registers == 128  # the entry cap: 512 threads, one CTA per SM


@needs_ptxas
@pytest.mark.parametrize("file, name, head_dim", [
    ("plain.mha", "plain_fwd", 128), ("causal.mha", "causal_fwd", 128),
    ("gqa.mha", "gqa_causal", 128)])
@pytest.mark.parametrize("layout", [Layout(), Layout(2, True, True)], ids=["dense", "ragged"])
def test_head_dim_128_takes_q_from_registers(file, name, head_dim, layout):
    """S = Q K^T reads Q from registers (8 ldmatrix.x4 per work tile, one per 16 columns)
    and K from shared memory; Q's tile is released right after the loads, before any S."""
    kb = build(file, name, layout)
    assert kb.config.head_dim == head_dim and kb.config.q_in_registers
    ptx = " ".join(kb.ptx.split())
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == head_dim // 16
    # S's wgmmas: {A: four registers}, K's descriptor; P V's: {P's four registers}, V's
    register_a = re.findall(r"m64n(\d+)k16\.f32\.bf16\.bf16 \{[^}]*\}, \{%r\d+,%r\d+,%r\d+,%r\d+\}"
                            r", %rd\d+, d, 1,1,(\d)", ptx)
    assert {trans_b for _, trans_b in register_a} == {"0", "1"}  # S (K-major K) and P V
    last_load = ptx.rindex("ldmatrix")
    release = ptx.index("mbarrier.arrive.shared::cta.b64", last_load)
    assert last_load < release < ptx.index("wgmma.mma_async", last_load)
    assert ptx.index("wgmma.mma_async") > last_load  # no GEMM before Q's loads


def test_q_in_registers_is_tried_first_only_where_it_can_fit():
    """Head dim 128 lists every tile with Q in registers, then each from shared memory (for
    a declaration whose tiles all spill so); 64 and 256 never hold Q's fragments."""
    for head_dim, expect in ((64, [False]), (128, [True, False]), (256, [False])):
        program = mhadsl.compile(f"{STD}\nattention a {{ dtype = bf16  head_dim = {head_dim} }}")
        configs = BACKEND.configs(program["a"].options, Layout())
        builds = list(dict.fromkeys((c.block_m, c.block_n, c.stages, c.lazy_rescale,
                                     c.uniform_group) for c in configs))
        assert [c.q_in_registers for c in configs] == [q for q in expect for _ in builds]


@needs_ptxas
@pytest.mark.parametrize("mask, layout, keys", [
    ("", Layout(), 144), ("", Layout(2, False, True), 144), ("", Layout(1, True), 128),
    ("mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx", Layout(), 128)],
    ids=["plain", "plain-gqa-lse", "plain-ragged", "causal"])
def test_unmasked_dense_head_dim_128_takes_144_keys(mask, layout, keys):
    """No mask to evaluate, a dense build: the wider KV tile, spill-free with Q in registers;
    a mask or a ragged batch (their partial tiles) keeps 128."""
    program = mhadsl.compile(f'{STD}\nattention a {{ dtype = bf16  head_dim = 128 {mask} }}')
    kb = build_kernel(program.checked, KernelRequest("a", "sm_90a", "sm90", layout))
    assert (kb.config.block_n, kb.config.q_in_registers) == (keys, True)
    resources = kb.assembled.kernels[KERNEL_NAME]
    assert resources.spill_stores == resources.spill_loads == 0


@pytest.mark.parametrize("keys", [1, 512, 1024, 2048, WIDE_KV_MIN_KEYS - 1, WIDE_KV_MIN_KEYS,
                                  4096, 16384])
def test_a_dense_call_of_few_keys_takes_128_key_tiles(keys):
    """The wide unmasked KV tile (144 keys) pays only on long calls: a call of fewer keys
    selects the build without it (`Layout.narrow_kv`), the same build but for the tile."""
    narrow = keys < WIDE_KV_MIN_KEYS
    options = mhadsl.compile(f"{STD}\nattention a {{ dtype = bf16  head_dim = 128 }}")["a"].options
    call = CallSizes(2, 16, 16, keys, keys, keys, keys, 2 * keys, False, 1.0)
    layout = BACKEND.call_layout(options, Layout(), call)
    assert layout == Layout(narrow_kv=narrow)
    first = BACKEND.configs(options, layout)[0]
    assert first.block_n == (128 if narrow else 144)
    assert first == replace(BACKEND.configs(options, Layout())[0], block_n=first.block_n)
    assert BACKEND.sibling_layouts(options, Layout()) == (Layout(narrow_kv=True),)
    assert BACKEND.sibling_layouts(options, Layout(narrow_kv=True)) == ()


@pytest.mark.parametrize("declaration, layout", [
    ("mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx", Layout()), ("tile = (128, 144)", Layout()),
    ("", Layout(1, True))], ids=["causal", "declared-tile", "ragged"])
def test_only_a_build_that_would_take_the_wide_tile_has_a_narrow_sibling(declaration, layout):
    options = mhadsl.compile(
        f"{STD}\nattention a {{ dtype = bf16  head_dim = 128 {declaration} }}")["a"].options
    call = CallSizes(2, 16, 16, 512, 512, 512, 512, 1024, layout.ragged, 1.0)
    assert BACKEND.call_layout(options, layout, call) == layout
    assert BACKEND.sibling_layouts(options, layout) == ()
    assert backends.backend("sm80").call_layout(options, Layout(), call) == Layout()


@pytest.mark.parametrize("declaration, request_args", [
    ("", {"arch": "sm_80"}), ("", {"backend": "sm80"}), ("", {"ragged": True}),
    ("", {"backward": True}), ("tile = (128, 144)", {}),
    ("mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx", {})],
    ids=["sm_80", "sm80-forced", "ragged", "backward", "declared-tile", "causal"])
def test_a_narrow_build_no_call_selects_is_refused(declaration, request_args):
    """`Kernel.build(narrow_kv=True)` makes what a plain dense call of few keys runs on
    sm90; for any other build it is a ValueError, never the same build under another key."""
    kern = mhadsl.compile(f"{STD}\nattention a {{ dtype = bf16  head_dim = 128 {declaration} }}")["a"]
    with pytest.raises(ValueError, match="narrow_kv"):
        kern.build(narrow_kv=True, **request_args)
    plain = mhadsl.compile(f"{STD}\nattention p {{ dtype = bf16  head_dim = 128 }}")["p"]
    assert plain.config(narrow_kv=True).block_n == 128


@pytest.mark.parametrize("backend", ["sm80", "sm90"])
def test_the_scheduler_is_built_for_the_launchs_gqa_group(backend):
    """`gqa_group` is a constant of the build (its Layout), as `tile_m` is: the scheduler's
    functions are specialised for it, and LPT's sections count K/V heads with it."""
    program = mhadsl.compile(REPO / "examples" / "causal.mha")
    names = {}
    for group in (1, 4):
        kb = build_kernel(program.checked, KernelRequest("causal_fwd", "sm_90a", backend,
                                                         Layout(group)))
        names[group] = set(re.findall(r'@"(LPT\.\d+\.\d+\.)', kb.llvm))
    assert names == {1: {"LPT.128.1."}, 4: {"LPT.128.4."}}


@needs_ptxas
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mask, run", [
    ("kv_idx <= q_idx", True), ("kv_idx <= q_idx && q_idx - kv_idx < 256", True),
    ("kv_idx <= q_idx && q_idx / 512 == kv_idx / 512", False)],
    ids=["causal", "window", "chunked"])
def test_a_diagonal_tile_inside_the_sequence_takes_one_select_an_element(head_dim, mask, run):
    """The mask runs on the tiles it may cut. Where it keeps one run of keys per row
    (`analysis.kv_limits`) at head dim 64 or in a short band (`bit_mask`), the mask and the
    sequence's bounds are one pass: one block of the KV loop selects -inf once per S
    element, each on a bit of the row's words (`warp.kept_fragment_bits`, which ptxas turns
    into R2P). Any other mask or build takes compares an element, the bounds apart on the
    last tile only."""
    program = mhadsl.compile(f"{STD}\nattention a {{ dtype = bf16  head_dim = {head_dim} "
                             f"mask(b, h, q_idx, kv_idx) = {mask} }}")
    kb = build_kernel(program.checked, KernelRequest("a", "sm_90a", "sm90", Layout()))
    if run:
        assert kb.config.bit_mask == (head_dim == 64 or "256" in mask)
        run = kb.config.bit_mask
    elements = kb.config.block_n // 2  # a thread's S values: two rows of block_n / 4
    ptx = kb.ptx
    loop = ptx[ptx.index("wgmma.wait_group.sync.aligned \t1;"):]
    loop = loop[:loop.index("wgmma.wait_group.sync.aligned \t0;")]
    blocks = re.split(r"\$L__BB\d+_\d+:", loop)
    selects = sorted(block.count("0fFF800000") for block in blocks)
    assert selects[-1] == elements and (selects[-2] < elements or not run)
    masking = max(blocks, key=lambda block: block.count("0fFF800000"))
    bit_tests = re.findall(r"and\.b32\s+%r\d+, %r\d+, (-?\d+);", masking)
    single_bits = [c for c in bit_tests if bin(int(c) & 0xFFFFFFFF).count("1") == 1]
    # (LLVM tests a word's top bit by its sign, and may shift for some others)
    assert (len(single_bits) >= elements * 3 // 4) == run, len(single_bits)
    assert kb.assembled.kernels[KERNEL_NAME].spills == 0


@needs_ptxas
@pytest.mark.parametrize("mask", ["", "mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx"],
                         ids=["plain", "causal"])
def test_head_dim_64_raises_alpha_to_a_power_only_where_a_row_moved_its_max(mask):
    """At head dim 64 (`DEFER_ALPHA_HEAD_DIMS`) a lazy-rescale build keeps alpha as its log2
    until P V's wait, and its two exponentials a KV tile run under the rescale's branch
    (with the old sums' rescale): the softmax runs one exponential an S element. At head
    dim 128 the two run in the softmax, every tile."""
    for head_dim, deferred in ((64, True), (128, False)):
        program = mhadsl.compile(f"{STD}\nattention a {{ dtype = bf16  head_dim = {head_dim} "
                                 f"{mask} }}")
        configs = BACKEND.configs(program["a"].options, Layout())
        assert [c.defer_alpha for c in configs] == [deferred and c.lazy_rescale
                                                    for c in configs]
        kb = build_kernel(program.checked, KernelRequest("a", "sm_90a", "sm90", Layout()))
        assert kb.config.defer_alpha == deferred
        elements = kb.config.block_n // 2
        ptx = kb.ptx
        softmax = ptx[ptx.index("wgmma.wait_group.sync.aligned \t1;"):]
        softmax, rescale = softmax.split("vote.sync.any.pred", 1)
        rescale = rescale[rescale.index(";", rescale.index("bra")) + 1:]  # the branch's body
        rescale = re.split(r"bra\.uni|\$L__BB\d+_\d+:", rescale, maxsplit=1)[0]
        assert softmax.count("ex2.approx") == elements + (0 if deferred else 2)
        assert rescale.count("ex2.approx") == (2 if deferred else 0)
        assert rescale.count("mul.rn.f32") >= kb.config.head_dim // 2
        assert kb.assembled.kernels[KERNEL_NAME].spills == 0


@needs_ptxas
@pytest.mark.parametrize("mask, held", [
    ("", "select"), ("mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx", "fadd")],
    ids=["plain", "causal"])
def test_p_v_wait_is_held_below_the_softmax_or_its_row_maxima(mask, held):
    """P V's wait is held (`hopper.hold_next_wait_below`, a store that never runs) below the
    whole softmax in a masked build: its operands are the rows' new sums (fadd); below the
    rows' maxima alone in an unmasked one (select: the lazy rescale's kept or new max)."""
    program = mhadsl.compile(f'{STD}\nattention a {{ dtype = bf16  head_dim = 128 {mask} }}')
    kb = build_kernel(program.checked, KernelRequest("a", "sm_90a", "sm90", Layout()))
    assert kb.config.softmax_under_pv == (held == "fadd") and kb.config.lazy_rescale
    stores = [line for line in kb.llvm.splitlines() if "@never st.shared" in line]
    assert len(stores) == 1
    operands = re.findall(r'float (%"?[\w.]+"?)', stores[0].split("~{memory}")[1])
    assert len(operands) == 2
    for operand in operands:
        definition = re.search(rf"^\s*{re.escape(operand)} = (\w+)", kb.llvm, re.M)
        assert definition and definition.group(1) == held, operand
    ptx = " ".join(kb.ptx.split())
    loop = ptx[ptx.index("wgmma.wait_group.sync.aligned 1;"):]
    loop = loop[:loop.index("wgmma.wait_group.sync.aligned 0;")]
    assert "@never st.shared.v2.f32" in loop
    resources = kb.assembled.kernels[KERNEL_NAME]
    assert resources.spill_stores == resources.spill_loads == 0
    assert not re.search(r"C75\d\d", kb.assembled.log), kb.assembled.log


@needs_ptxas
@pytest.mark.parametrize("head_dim, mask, layout, carried", [
    (128, "", Layout(), True),
    (128, "mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx", Layout(), False),
    (128, "", Layout(1, True, False), False),  # ragged
    (64, "", Layout(), False), (256, "", Layout(), False)],
    ids=["plain-d128", "causal-d128", "ragged-d128", "plain-d64", "plain-d256"])
def test_dense_unmasked_head_dim_128_carries_p_packed(head_dim, mask, layout, carried):
    """A `carry_packed_p` build packs P right after P V's wait (its fragments fenced, so
    LLVM cannot sink the packing to the next KV tile's top): the KV loop's stretch from P V's
    wait to the next wgmma fence holds all of P's conversions; elsewhere none (they sit at
    the top of the loop, before the next tile's wgmmas)."""
    program = mhadsl.compile(f"{STD}\nattention a {{ dtype = bf16  head_dim = {head_dim} "
                             f"{mask} }}")
    kb = build_kernel(program.checked, KernelRequest("a", "sm_90a", "sm90", layout))
    assert kb.config.carry_packed_p == carried
    ptx = " ".join(kb.ptx.split())
    after_s = ptx[ptx.index("wgmma.wait_group.sync.aligned 1;"):]
    after_pv = after_s[after_s.index("wgmma.wait_group.sync.aligned 0;"):]
    stretch = after_pv[:after_pv.index("wgmma.fence.sync.aligned;")]
    packs = stretch.count("cvt.rn.bf16x2.f32")
    assert packs == (kb.config.block_n // 4 if carried else 0), packs
    resources = kb.assembled.kernels[KERNEL_NAME]
    assert resources.spill_stores == resources.spill_loads == 0
