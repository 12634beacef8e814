"""The Hopper backward design without a GPU (codegen/backends/backward_sm90.py): which calls
it runs, its configs' problems and shared memory, its ABI (tensor maps first), its builds
assembling without spills, its producer and consumer warpgroups, its hand-over to the sm80
design's build (and that build read back from the cache as the sm80 design's), and the
wgmma operand forms it adds."""
import ctypes
import math
import re
import struct
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from llvmlite import ir

import mhadsl
from helpers import EXAMPLES, fake_launcher
from mhadsl.host import backward as host
from mhadsl.abi import CallSizes
from mhadsl.codegen import hopper, nvptx
from mhadsl.codegen.assemble import find_ptxas
from mhadsl.codegen.backends import SHARED_MEMORY_LIMIT, Layout, backend_for_arch
from mhadsl.codegen.backends import backward_sm90 as H
from mhadsl.codegen.backends.backward import ROW_TILE, BackwardConfig
from mhadsl.runtime import driver, tensors, tile_index
from test_hostile_tensors import D, SOURCE
from test_launch_host_path import kernel, stand_in  # noqa: F401 (a fixture)

needs_ptxas = pytest.mark.skipif(find_ptxas() is None, reason="ptxas not found")
_SOFTCAP = "score(s, b, h, q_idx, kv_idx) = 30.0 * tanh(s / 30.0)"
CAUSAL = EXAMPLES[0].parent / "causal.mha"


def _options(source: str):
    return mhadsl.compile(source)["t"].options


def _config(head_dim: int = 128, **fields) -> H.HopperBackwardConfig:
    """The config of a declaration of this head dim (its tile and stages: `declared_tile`),
    with `fields` changed."""
    return H.HopperBackwardConfig("bf16", head_dim, **{**H.declared_tile(head_dim), **fields})


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("layout, arch, expected", [
    (Layout(backward=True), "sm_90a", "backward_sm90"),
    (Layout(gqa_group=4, backward=True), "sm_90a", "backward_sm90"),
    (Layout(ragged=True, backward=True), "sm_90a", "backward_sm90"),
    (Layout(gqa_group=4, ragged=True, backward=True), "sm_90a", "backward_sm90"),
    (Layout(deterministic=True, backward=True), "sm_90a", "backward_sm90"),
    (Layout(ragged=True, deterministic=True, backward=True), "sm_90a", "backward_sm90"),
    (Layout(backward=True), "sm_80", "backward"),
    (Layout(ragged=True, backward=True), "sm_80", "backward"),
])
def test_the_hopper_design_runs_calls_dense_or_ragged_on_sm90a(layout, arch, expected,
                                                                head_dim):
    options = _options(f"attention t {{ dtype = bf16  head_dim = {head_dim} }}")
    assert backend_for_arch(arch, None, options, "backward", layout).name == expected


def test_at_head_dim_256_the_warpgroups_share_64_kv_rows_and_split_their_columns():
    """A head dim 256 declaration's config: K/V tiles of 64 rows that both consumer
    warpgroups work on, each owning 128 of dK's and dV's columns (64 + 64 accumulators a
    thread), dQ's 64 x 128 part computed 64 columns at a time, one stage of Q and dO;
    head dims 64 and 128 keep a warpgroup's 64 rows each with all their columns. A head
    dim the design has no tile for is a problem of the config."""
    options = _options("attention t { dtype = bf16  head_dim = 256 }")
    assert not H.BACKEND.problems(options, "sm_90a")
    config = H.declared_config(options, Layout(backward=True))
    assert config == _config(256)
    # the scheduler hands out K/V tiles of 64 rows
    assert H.BACKEND.scheduler_shape(config) == (64, 1)
    call = CallSizes(2, 4, 2, 300, 300, 300, 300, 600, False, 1.0)
    assert H.BACKEND.work_space(config, call) == (2, 5, 300, 2)
    assert (config.block_m, config.block_n, config.stages) == (64, 64, 1)
    assert config.splits_kv_columns and config.kv_columns == 128
    assert hopper.accumulator_count(2 * config.kv_columns) == 128  # dK and dV together
    assert (config.dq_tile, config.dq_chunk, config.dq_chunks) == ((64, 128), 64, 2)
    assert config.frees_stage_in_parts and config.empty_barriers == 2
    for d in (64, 128):
        narrow = _config(d)
        assert (narrow.block_n, narrow.stages, narrow.kv_columns) == (128, 2, d)
        assert not narrow.splits_kv_columns and narrow.dq_chunks == 1
        assert not narrow.frees_stage_in_parts and narrow.empty_barriers == 1
    assert H.HopperBackwardConfig(head_dim=96).problems()[0].settings == ("head_dim",)


def test_at_head_dim_256_the_warpgroups_split_s_and_dps_query_columns():
    """At head dim 256 warpgroup g computes S^T and dP^T for query columns 32 g.. of the
    step's 64 (FlashAttention-3's split), and dV's GEMM reads P^T from a shared tile of its
    own (64 K/V rows x 64 query columns, 16-bit, at a swizzle atom), which head dims 64 and
    128 (P^T in registers) do not have: their layout is the same as without it. One tile,
    which one stage makes race-free; the layout fits a CTA's shared memory."""
    wide = _config(256)
    assert wide.score_columns == 32
    offsets = H._offsets(wide)
    assert offsets["p_bytes"] == 64 * 64 * 2 and offsets["p"] % 1024 == 0
    assert offsets["p"] >= offsets["ds"] + 2 * offsets["ds_bytes"]  # (past both dS^T tiles)
    assert offsets["stats"] == offsets["p"] + offsets["p_bytes"]
    assert H.shared_bytes(wide) == 222752 <= SHARED_MEMORY_LIMIT["sm_90a"]
    assert replace(wide, stages=2).problems()[0].settings == ("stages",)
    for d in (64, 128):
        narrow = _config(d)
        assert narrow.score_columns == narrow.block_m
        offsets = H._offsets(narrow)
        assert offsets["p_bytes"] == 0
        assert offsets["stats"] == offsets["ds"] + 2 * offsets["ds_bytes"]


def test_config_problems_and_shared_memory():
    assert not H.HopperBackwardConfig().problems()
    assert not H.HopperBackwardConfig(head_dim=64).problems()
    # the K/V tile: 64 rows at head dim 256 (both warpgroups'), 128 elsewhere
    assert H.HopperBackwardConfig(head_dim=256).problems()[0].settings == ("tile",)
    assert H.HopperBackwardConfig(block_n=64).problems()[0].settings == ("tile",)
    # two dQ writers take the steps in turn in deterministic mode only
    assert not H.HopperBackwardConfig(deterministic=True, dq_writers=2).problems()
    assert H.HopperBackwardConfig(dq_writers=2).problems()[0].settings == ("dq_writers",)
    assert H.HopperBackwardConfig(deterministic=True, dq_writers=3).problems()
    # at head dim 256 one stage fits, two do not (32 KB more of each of Q and dO)
    wide = _config(256)
    assert not wide.problems()
    assert H.shared_bytes(wide) <= SHARED_MEMORY_LIMIT["sm_90a"]
    assert H.shared_bytes(replace(wide, stages=2)) > SHARED_MEMORY_LIMIT["sm_90a"]
    assert replace(wide, stages=2).problems()[0].settings == ("stages",)
    assert H.BACKEND.scheduled(wide).threads == 384
    offsets = H._offsets(wide)
    assert offsets["dq_bytes"] == 4 * 64 * 256  # both warpgroups' 64 x 128 floats
    assert offsets["k"] % 1024 == offsets["v"] % 1024 == offsets["stage0"] % 1024 \
        == offsets["ds"] % 1024 == 0  # (the swizzle's atom)
    assert offsets["counts"] - offsets["bars"] == 8 * (1 + 1 + 2)  # K/V, full, 2 empty
    assert H.HopperBackwardConfig(block_m=32).problems()[0].settings == ("tile",)
    assert H.HopperBackwardConfig(head_dim=64, block_m=128, stages=1).problems()[0].settings \
        == ("stages",)
    assert not H.HopperBackwardConfig(stages=1).problems()  # (64-row steps: S^T not ahead)
    # three stages fit at 64 query rows, not at 128 (the GPU refused that launch)
    assert not H.HopperBackwardConfig(stages=3).problems()
    assert H.shared_bytes(H.HopperBackwardConfig(head_dim=64, block_m=128, stages=3)) \
        > SHARED_MEMORY_LIMIT["sm_90a"]
    assert H.HopperBackwardConfig(head_dim=64, block_m=128, stages=3).problems()[0].settings \
        == ("stages",)
    assert not H.HopperBackwardConfig(ragged=True).problems()
    assert not H.HopperBackwardConfig(deterministic=True).problems()
    assert not H.HopperBackwardConfig(ragged=True, deterministic=True).problems()
    for d in (64, 128):
        config = H.HopperBackwardConfig(head_dim=d)
        assert H.shared_bytes(config) <= SHARED_MEMORY_LIMIT["sm_90a"]
        assert H.BACKEND.scheduled(config).threads == 384  # a producer, two consumers


def test_the_tensor_maps_come_first_at_multiples_of_128_bytes():
    maps = [p for p in H.ABI if p.kind == "tensor_map"]
    assert [p.name for p in H.ABI][:4] == ["q_map", "k_map", "v_map", "dout_map"]
    assert [H.ABI.offsets[p.name] for p in maps] == [0, 128, 256, 384]
    abis = {k.name: k.abi for k in H.BACKEND.kernels(H.HopperBackwardConfig())}
    assert abis[H.MAIN] is H.ABI and abis[H.PREPROCESS] is abis[H.POSTPROCESS] is not H.ABI


@needs_ptxas
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_causal_build_assembles_without_spills(head_dim, monkeypatch, tmp_path):
    """Causal at head dims 64 (128 query rows per step) and 128 (64): wgmma, dQ by one bulk
    reduce-add per warpgroup and step of its part's bytes (64 x 64 floats: at head dim 64
    the tile's rows split between the warpgroups, at 128 its columns), nothing added from
    registers."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    source = ('import "std/schedulers.mha"\nattention t { dtype = bf16  head_dim = '
              f'{head_dim}\n mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }}')
    build = mhadsl.compile(source)["t"].backward_build("sm_90a")
    assert build.backend == "backward_sm90"
    reduces = re.findall(r"cp\.reduce\.async\.bulk\.global\.shared::cta\.bulk_group\.add\.f32"
                         r"\s+\[%rd\d+\], \[%r\d+\], (\d+);", build.ptx)
    assert build.config.block_m == 128 * 64 // head_dim
    assert build.config.dq_tile == (64, 64)
    assert reduces == [str(4 * 64 * 64)] * 2  # the writer warp's, one per warpgroup
    assert not re.search(r"\b(red|atom)\.global\.add\.(v\d\.)?f32", build.ptx)
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in build.ptx
    for resources in build.assembled.kernels.values():
        assert resources.spills == 0 and resources.stack_bytes == 0, resources
    assert "C7519" not in build.assembled.log  # no injected warpgroup.arrive


def _entry(ptx: str, name: str) -> str:
    """Kernel `name`'s PTX."""
    text = ptx[ptx.index(f".entry {name}("):]
    return text[:text.index("\n}\n")]


def _register_a_wgmmas(ptx: str) -> int:
    """The wgmmas whose A operand is in registers ({4 registers}, not a descriptor)."""
    return len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.\w+\.\w+\s+\{[^}]*\},"
                          r"\s*\{", ptx))


@needs_ptxas
@pytest.mark.parametrize("causal", [False, True])
def test_the_head_dim_256_build_is_the_hopper_designs_without_spills(causal, monkeypatch,
                                                                     tmp_path):
    """Head dim 256 builds the Hopper design, not the sm80 fallback, without spills or a
    stack frame, ptxas neither ignoring setmaxnreg (C7508) nor serialising the wgmmas
    (C7512, C7519). Per step each consumer warpgroup issues S^T and dP^T over the head dim
    for its half of the query columns (16 k-steps each, 64 K/V rows x 32 query columns) as
    m64n32k16, dQ's part in two chunks of 64 columns (4 k-steps each: the tile's 64 K/V
    rows) as m64n64k16, dV and dK over its 128 columns (4 k-steps each: the step's 64
    query rows) as m64n128k16, with P^T and dS^T from shared memory (descriptors: no
    register A operand); the writer adds each warpgroup's 64 x 128 floats of dQ with one
    bulk reduce-add."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    build = mhadsl.compile(_source(256, causal))["t"].backward_build("sm_90a")
    assert build.backend == "backward_sm90" and build.config == _config(256)
    main = _entry(build.ptx, H.MAIN)
    shapes = Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)\.", main))
    assert shapes == {"m64n32k16": 16 + 16, "m64n64k16": 2 * 4, "m64n128k16": 4 + 4}
    assert _register_a_wgmmas(main) == 0
    reduces = re.findall(r"cp\.reduce\.async\.bulk\.global\.shared::cta\.bulk_group\.add\.f32"
                         r"\s+\[%rd\d+\], \[%r\d+\], (\d+);", main)
    assert reduces == [str(4 * 64 * 128)] * 2
    for resources in build.assembled.kernels.values():
        assert resources.spills == 0 and resources.stack_bytes == 0, resources
    for warning in ("C7508", "C7512", "C7519"):
        assert warning not in build.assembled.log, warning


@needs_ptxas
@pytest.mark.parametrize("score", ["", _SOFTCAP], ids=["causal", "softcap"])
@pytest.mark.parametrize("layout", [dict(deterministic=True), dict(gqa_group=4),
                                    dict(ragged=True, deterministic=True),
                                    dict(ragged=True, gqa_group=2)],
                         ids=["deterministic", "gqa", "ragged-deterministic", "ragged-gqa"])
def test_every_head_dim_256_build_splits_s_without_spills(layout, score, monkeypatch,
                                                           tmp_path):
    """Deterministic, GQA and ragged builds at head dim 256, with and without a score rule
    (G = P^T dscore/ds beside P^T): the Hopper design's, each warpgroup's S^T and dP^T over
    its 32 query columns, dV's and dK's A operands from shared memory, without spills or a
    stack frame."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    source = ('import "std/schedulers.mha"\nattention t { dtype = fp16  head_dim = 256 '
              f'mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx {score} }}')
    build = mhadsl.compile(source)["t"].backward_build("sm_90a", **layout)
    assert build.backend == "backward_sm90" and build.config.score_columns == 32
    main = _entry(build.ptx, H.MAIN)
    shapes = Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)\.", main))
    assert shapes == {"m64n32k16": 16 + 16, "m64n64k16": 2 * 4, "m64n128k16": 4 + 4}
    assert _register_a_wgmmas(main) == 0
    for name, resources in build.assembled.kernels.items():
        assert resources.spills == 0 and resources.stack_bytes == 0, (name, resources)


@needs_ptxas
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_a_producer_warpgroup_feeds_two_consumers(head_dim, tmp_path, monkeypatch):
    """FlashAttention-3's layout: the producer gives registers back and loads each query
    step by its first lane (TMA of Q and dO, one bulk copy of the tile's LSE and delta,
    all on the stage's full mbarrier, no per-lane copies); the consumers take registers,
    meet at one named barrier per step (dS^T is complete), free the stage and stage dQ
    between two barriers shared with the producer's writer warp: they wait until it frees
    their staging tile (its last reduce-add has read it) and only arrive once it is
    written; the writer waits for the reads of each warpgroup's last reduce-add in turn."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    source = ('import "std/schedulers.mha"\nattention t { dtype = bf16  head_dim = '
              f'{head_dim}\n mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }}')
    build = mhadsl.compile(source)["t"].backward_build("sm_90a", gqa_group=4)
    assert build.backend == "backward_sm90"
    producer, consumers = H.REGISTERS
    for text in (f"setmaxnreg.dec.sync.aligned.u32 \t{producer};",
                 f"setmaxnreg.inc.sync.aligned.u32 \t{consumers};",
                 f"bar.sync \t{nvptx.DS_BARRIER}, 256;",
                 "mbarrier.arrive.shared::cta.b64", "st.shared.v4.f32",
                 "cp.async.bulk.wait_group.read 1;", "cp.async.bulk.wait_group.read 0;",
                 "cp.async.bulk.wait_group 0;"):
        assert text in build.ptx, text
    parties = H.DQ_PARTIES
    for g in range(2):  # the writer's side
        assert f"barrier.arrive \t{nvptx.DQ_EMPTY_BARRIER + g}, {parties};" in build.ptx
        assert f"barrier.sync \t{nvptx.DQ_FULL_BARRIER + g}, {parties};" in build.ptx
    # the consumers' side (the warpgroup's barrier by register)
    assert re.search(rf"barrier\.sync \t%r\d+, {parties};", build.ptx)
    assert re.search(rf"barrier\.arrive \t%r\d+, {parties};", build.ptx)
    bm = build.config.block_m
    stats_bytes = 4 * len(H.STATS) * bm
    copies = re.findall(r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::"
                        r"bytes\s+\[%r\d+\], \[%rd\d+\], (\d+), \[%r\d+\];", build.ptx)
    assert copies == [str(stats_bytes)]
    expect = 2 * bm * 2 * head_dim + stats_bytes  # Q, dO and the stats of a step
    assert any("expect_tx" in line and f"i32 {expect})" in line
               for line in build.llvm.splitlines())
    assert "cp.async.ca" not in build.ptx and "cp.async.mbarrier" not in build.ptx
    assert "C7508" not in build.assembled.log  # setmaxnreg honoured
    main = build.assembled.kernels["mha_bwd"]
    assert main.spills == 0 and main.stack_bytes == 0, main


@needs_ptxas
def test_a_build_the_hopper_design_cannot_fit_is_the_sm80_designs(monkeypatch, tmp_path):
    """With the consumers held to 160 registers, softcap's G beside P^T spills in every IR
    shape: the backend hands over to the sm80 design's build, which the cache gives back as
    that design's (its config type), so the host launches its kernels."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(H, "REGISTERS", (24, 160))
    kern = mhadsl.compile(EXAMPLES[0].parent / "softcap.mha")["softcap_causal"]
    first = kern.backward_build("sm_90a")
    again = mhadsl.compile(EXAMPLES[0].parent / "softcap.mha")["softcap_causal"] \
        .backward_build("sm_90a")
    for build in (first, again):
        assert build.backend == "backward"
        assert type(build.config) is BackwardConfig
    assert again.cached and again.config == first.config


def _source(head_dim: int, causal: bool) -> str:
    mask = "\n mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx" if causal else ""
    return (f'import "std/schedulers.mha"\nattention t {{ dtype = bf16  head_dim = {head_dim}'
            f'{mask} }}')


@needs_ptxas
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa_group", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_the_ragged_build_assembles_without_spills(head_dim, gqa_group, causal, monkeypatch,
                                                   tmp_path):
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    build = mhadsl.compile(_source(head_dim, causal))["t"].backward_build(
        "sm_90a", gqa_group=gqa_group, ragged=True)
    assert build.backend == "backward_sm90" and build.config.ragged
    assert build.config.block_n == H.kv_tile_rows(head_dim)
    for name, resources in build.assembled.kernels.items():
        assert resources.spills == 0 and resources.stack_bytes == 0, (name, resources)
    for warning in ("C7508", "C7519"):  # setmaxnreg honoured; no injected warpgroup.arrive
        assert warning not in build.assembled.log


def _tensor_copies(llvm: str) -> list[list[str]]:
    """The operands of each 4-D TMA load in the IR: shared address, map, then the
    coordinates innermost first (column, head, row, batch), then the mbarrier."""
    return [found.split(", ") for found in re.findall(
        r'"cp\.async\.bulk\.tensor\.4d[^"]*", "[^"]*"\(([^)]*)\)', llvm)]


@pytest.mark.parametrize("ragged", [False, True])
def test_a_ragged_build_reads_its_sequences_from_batch_0_of_the_tensor_maps(ragged, monkeypatch,
                                                                           tmp_path):
    """Ragged tensors are mapped as (1, total rows, H, D) (`runtime.launch.map_request`):
    every copy's batch coordinate is the constant 0; a dense build's is the sequence's."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    build = mhadsl.compile(_source(128, True))["t"].backward_build("sm_90a", gqa_group=2,
                                                                   ragged=ragged)
    assert build.backend == "backward_sm90"
    batches = [operands[5] for operands in _tensor_copies(build.llvm)]
    assert len(batches) == 8  # K, V, Q, dO: two boxes of 64 columns each
    assert [b == "i32 0" for b in batches] == [ragged] * len(batches)


class _TorchLike:
    """What `mhadsl.host.backward` plans a launch from: a contiguous tensor's shape, strides and
    dtype."""

    def __init__(self, shape: tuple[int, ...], dtype: str = "torch.float16"):
        self.shape, self.dtype = shape, dtype

    def stride(self) -> tuple[int, ...]:
        return tensors.contiguous_strides(self.shape)


WIDE = """import "std/schedulers.mha"
attention d256 { dtype = fp16  head_dim = 256  scheduler = Queued()
                 mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
"""


@pytest.fixture
def wide_kernel(monkeypatch):
    yield from stand_in(monkeypatch, mhadsl.compile(WIDE)["d256"])


@pytest.mark.parametrize("stand_in_kernel, source, d", [("kernel", SOURCE, D),
                                                        ("wide_kernel", WIDE, 256)])
def test_a_ragged_call_maps_all_rows_in_the_boxes_its_copies_expect(stand_in_kernel, source, d,
                                                                    request, monkeypatch,
                                                                    tmp_path):
    """The host's plans for a ragged call of the Hopper design: tensor maps over
    (1, total rows, H, D) whose boxes fill exactly the bytes the kernel's copies expect on
    their mbarriers, and the tile index built just before the main kernel over the K/V
    tiles of cu_seqlens_k (no other)."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    kernel = request.getfixturevalue(stand_in_kernel)
    build = mhadsl.compile(source)[kernel.name].backward_build("sm_90a", gqa_group=2,
                                                               ragged=True)
    config = build.config
    assert build.backend == "backward_sm90" and config.ragged
    blocks, indexed = {}, []
    abis = {k.name: k.abi for k in H.BACKEND.kernels(config)}

    def function(name):
        def launch(grid, threads, shared_bytes, stream, params):
            blocks[name] = ctypes.string_at(ctypes.cast(params, ctypes.POINTER(
                ctypes.c_void_p))[0], abis[name].size)
        return SimpleNamespace(max_active_blocks=lambda *a: 1, launcher=fake_launcher(launch),
                               set_max_dynamic_shared=lambda nbytes: None)
    monkeypatch.setattr(kernel.launcher, "build", lambda layout, arch: build)
    monkeypatch.setattr(driver.Module, "from_cubin", staticmethod(
        lambda cubin, device=None: SimpleNamespace(function=function)))

    def index_plan(index_kernel, batch, tile_m, device):
        def prepare(offsets, stream):
            indexed.append((offsets, batch, tile_m, sorted(blocks)))
            return 0xABC000
        return SimpleNamespace(prepare=prepare)
    monkeypatch.setattr(tile_index, "plan", index_plan)
    total_q, total_k, heads, kv_heads = 14, 9, 4, 2
    shapes = {"q": (total_q, heads, d), "o": (total_q, heads, d), "dout": (total_q, heads, d),
              "dq": (total_q, heads, d), "k": (total_k, kv_heads, d), "v": (total_k, kv_heads, d),
              "dk": (total_k, kv_heads, d), "dv": (total_k, kv_heads, d)}
    call = SimpleNamespace(sizes=CallSizes(3, heads, kv_heads, 0, 0, 9, 7, total_q, True,
                                           0.125))
    plans, _ = host._plans(kernel, call, {n: _TorchLike(s) for n, s in shapes.items()}, 0,
                           False)
    addresses = {name: (i + 1) << 32 for i, name in enumerate(
        [*shapes, "lse", "delta", "dq_accum", "cu_seqlens_q", "cu_seqlens_k"])}
    for plan in plans:
        plan.launch(addresses, 0)
    assert indexed == [(addresses["cu_seqlens_k"], 3, config.block_n, [H.PREPROCESS])]
    main = blocks[H.MAIN]
    expected = set()
    for p in (p for p in H.ABI if p.kind == "tensor_map"):
        tensor = p.name.removesuffix("_map")
        address, *words = struct.unpack_from("<9Q", main, H.ABI.offsets[p.name])
        box, dims = words[:4], words[4:]  # innermost first: D, H, rows, batch
        rows, heads_of = (total_q, heads) if tensor in ("q", "dout") else (total_k, kv_heads)
        assert address == addresses[tensor] and dims == [d, heads_of, rows, 1], p.name
        assert box == [H.BOX_COLUMNS, 1, getattr(config, p.binding.rows), 1], p.name
        expected.add(math.prod(box) * 2 * config.boxes)  # bytes of one tile of the tensor
    assert expected == {config.q_bytes, config.kv_bytes}
    # the kernel's expect_tx: K and V's tiles together, a step's Q and dO together with its
    # stats block
    announced = {int(n) for n in re.findall(
        r'"mbarrier\.arrive\.expect_tx[^"]*", "[^"]*"\(i32 %"[^"]+", i32 (\d+)\)', build.llvm)}
    assert announced == {2 * config.q_bytes + 4 * len(H.STATS) * config.block_m,
                         2 * config.kv_bytes}
    assert struct.unpack_from("<Q", main, H.ABI.offsets["tile_index"])[0] == 0xABC000


def test_wgmma_takes_a_transposed_shared_a_operand():
    module = ir.Module()
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [ir.IntType(64)] * 2), "f")
    b = ir.IRBuilder(fn.append_basic_block())
    hopper.wgmma(b, "bf16", 64, fn.args[0], fn.args[1], None, trans_b=True, trans_a=True)
    b.ret_void()
    assert "d, 1,1,1,1;" in str(module)
    with pytest.raises(ValueError, match="transpose"):
        hopper.wgmma(b, "bf16", 64, [fn.args[0]] * 4, fn.args[1], trans_a=True)


@pytest.mark.parametrize("head_dim, block_m", [(64, 64), (128, 64), (64, 128), (256, 64)])
def test_dq_accumulator_blocks_hold_the_warpgroups_registers_in_order(head_dim, block_m):
    """Within a query tile's block, warpgroup g's accumulator j of thread t (its wgmma
    position within its part of dQ, `dq_origin`) sits at g * part + 4 (128 (j // 4) + t) +
    j % 4: where `_stage_dq`'s st.shared.v4 puts it in the staging tile, so one bulk copy
    of the tile adds it in place; and every (row, column) of the tile has a place of its
    own. The parts split the tile's columns at 64 rows and its rows at 128."""
    config = _config(head_dim, block_m=block_m)
    assert not config.problems()
    rows, cols = config.dq_tile
    assert (rows, cols) == ((64, head_dim) if block_m == 128 else (64, head_dim // 2))
    seen = set()
    for g in range(2):
        row0, col0 = config.dq_origin(g)
        for t in range(hopper.WARPGROUP_THREADS):
            for j in range(hopper.accumulator_count(cols)):
                row, col = hopper.accumulator_position(t, j)
                place = H.dq_accum_position(config, row0 + row, col0 + col)
                assert place == g * rows * cols + 4 * (128 * (j // 4) + t) + j % 4
                seen.add(place)
    assert seen == set(range(config.block_m * head_dim))


@pytest.mark.parametrize("head_dim, block_m", [(64, 64), (128, 64), (64, 128), (256, 64)])
def test_dq_chunks_follow_one_another_in_their_warpgroups_part(head_dim, block_m):
    """A warpgroup computes its part of dQ `dq_chunk` columns at a time (two chunks of 64
    at head dim 256, one elsewhere): accumulator j of thread t of chunk h holds the
    part's column h dq_chunk + its wgmma column, and `_stage_dq` stores its 16-byte vector
    (`dq_chunk_vector`) where `dq_accum_position` keeps that (row, column); the chunks
    cover the part once."""
    config = _config(head_dim, block_m=block_m)
    rows, cols = config.dq_tile
    assert config.dq_chunks * config.dq_chunk == cols
    for g in range(2):
        row0, col0 = config.dq_origin(g)
        seen = set()
        for chunk in range(config.dq_chunks):
            for t in range(hopper.WARPGROUP_THREADS):
                for j in range(hopper.accumulator_count(config.dq_chunk)):
                    row, col = hopper.accumulator_position(t, j)
                    place = H.dq_accum_position(config, row0 + row,
                                                col0 + chunk * config.dq_chunk + col)
                    vector = H.dq_chunk_vector(config, chunk, j // 4)
                    assert place == g * rows * cols + 4 * (128 * vector + t) + j % 4
                    seen.add(place)
        assert seen == set(range(g * rows * cols, (g + 1) * rows * cols))


def _host_column_bytes(config):
    """(`own_column`, `own_column_byte` of Q's and dO's tiles, `dq_column_byte` of each of
    dQ's chunks) compiled for the host: group -> int each."""
    from mhadsl.codegen.target import HostJit
    module = ir.Module("columns")
    makers = {"own": lambda b, g: H.own_column(b, config, g),
              "own_byte": lambda b, g: H.own_column_byte(b, config, g, config.block_m),
              "score_byte": lambda b, g: H.score_row_byte(b, config, g),
              **{f"dq_byte{h}": lambda b, g, h=h: H.dq_column_byte(b, config, g, h)
                 for h in range(config.dq_chunks)}}
    for name, make in makers.items():
        fn = ir.Function(module, ir.FunctionType(nvptx.i32, [nvptx.i32]), name)
        b = ir.IRBuilder(fn.append_basic_block())
        b.ret(make(b, fn.args[0]))
    jit = HostJit(str(module))
    calls = {name: ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int32)(jit.address(name))
             for name in makers}
    return jit, calls


def _box_byte(column: int, rows: int) -> int:
    """The byte offset of head-dim column `column` in a tile of `rows` rows that TMA wrote
    in boxes of 64 columns (128 bytes a row, box after box)."""
    return column // H.BOX_COLUMNS * rows * H.SW + column % H.BOX_COLUMNS * 2


@pytest.mark.parametrize("head_dim, block_m", [(64, 64), (128, 64), (64, 128), (256, 64)])
def test_each_warpgroups_gemms_read_the_columns_it_owns(head_dim, block_m):
    """The B operands' starts, run on the host: warpgroup g's dV and dK GEMMs read dO's and
    Q's columns from its first own column on (`own_column_byte`: where `own_column`, the
    first column it stores, lies in their boxes), and the GEMM of its dQ chunk h reads K's
    from its part's column (`dq_origin`, where the accumulator keeps it) + h dq_chunk on.
    At head dim 256 the warpgroups' dK and dV columns are the head's two halves; elsewhere
    each warpgroup has all of them (for its own K/V rows)."""
    config = _config(head_dim, block_m=block_m)
    _jit, calls = _host_column_bytes(config)
    owned = []
    for g in range(2):
        own = calls["own"](g)
        owned.append(set(range(own, own + config.kv_columns)))
        assert calls["own_byte"](g) == _box_byte(own, config.block_m)
        for h in range(config.dq_chunks):
            column = config.dq_origin(g)[1] + h * config.dq_chunk
            assert calls[f"dq_byte{h}"](g) == _box_byte(column, config.block_n), (g, h)
    if head_dim == 256:
        assert owned == [set(range(128)), set(range(128, 256))]
    else:
        assert owned == [set(range(head_dim))] * 2


def test_at_head_dim_256_each_warpgroups_s_reads_its_query_rows():
    """The B operands of warpgroup g's S^T and dP^T at head dim 256, run on the host: Q's
    and dO's rows 32 g.. (`score_row_byte`), that many 128-byte rows into each of their
    boxes of 64 rows (every k-step's slice, `_k_major`, is the box's, offset by it), a
    multiple of the 128-byte swizzle's 1024-byte atom, so that the swizzle reads as at a
    box's first row; the warpgroups' rows are the tile's two halves."""
    config = _config(256)
    _jit, calls = _host_column_bytes(config)
    rows = []
    for g in range(2):
        offset = calls["score_byte"](g)
        assert offset % hopper.SWIZZLE_ATOM_BYTES == 0 and offset < config.block_m * H.SW
        first = offset // H.SW
        rows.append(set(range(first, first + config.score_columns)))
    assert rows == [set(range(32)), set(range(32, 64))]


@pytest.mark.parametrize("head_dim, block_m", [(64, 64), (128, 64), (64, 128), (256, 64)])
def test_the_warpgroups_store_every_slice_of_ds_once(head_dim, block_m):
    """dS^T's 16-column slices (of the step's query rows) each warpgroup stores
    (`ds_slices`): at head dim 256, where both hold all of dS^T for the same K/V rows, one
    half each; elsewhere each all of them, for its own K/V rows."""
    config = _config(head_dim, block_m=block_m)
    slices = [set(H.ds_slices(config, g)) for g in range(2)]
    every = set(range(block_m // 16))
    if head_dim == 256:
        assert slices[0] | slices[1] == every and not slices[0] & slices[1]
        assert len(slices[0]) == len(slices[1])
    else:
        assert slices == [every, every]


def test_128_query_rows_only_at_head_dim_64():
    assert H.HopperBackwardConfig("bf16", 128, block_m=128).problems()[0].settings == ("tile",)
    assert not H.HopperBackwardConfig("bf16", 64, block_m=128).problems()


def _host_accum_offset(config):
    """`_accum_offset` compiled for the host: (bidx, start, row, head, col, seqlen_q,
    num_heads) -> float offset."""
    from mhadsl.codegen.target import HostJit
    module = ir.Module("accum")
    fn = ir.Function(module, ir.FunctionType(nvptx.i64, [nvptx.i32] * 7), "accum_offset")
    b = ir.IRBuilder(fn.append_basic_block())
    bidx, start, row, head, col, seqlen_q, num_heads = fn.args
    args = SimpleNamespace(seqlen_q=seqlen_q, num_heads=num_heads)
    b.ret(H._accum_offset(b, config, args, bidx, start, row, head, col))
    jit = HostJit(str(module))
    call = ctypes.CFUNCTYPE(ctypes.c_int64, *[ctypes.c_int32] * 7)(jit.address("accum_offset"))
    call.jit = jit  # (keeps the engine alive)
    return call



def _scratch_floats(config, lengths: list[int], heads: int) -> dict[str, int]:
    """The design's scratch buffers (`Backend.scratch`) in floats, for sequences of
    `lengths` (dense: all of the first's length)."""
    call = CallSizes(len(lengths), heads, heads, lengths[0], 0, max(lengths), 0, sum(lengths),
                     config.ragged, 1.0)
    return {name: nbytes // 4 for name, nbytes in H.BACKEND.scratch(config, call).items()}

@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("block_m", [64, 128])
def test_dq_accumulator_places_every_sequences_rows_apart_within_its_size(ragged, block_m):
    """The kernel's and the row kernels' addressing (`_accum_offset`, run on the host):
    a tile's block is its (tile, head) pair's, its values at `dq_accum_position`; no two
    (sequence, row, head, column) share a float, and all fit in the design's scratch (ragged:
    sequences of lengths 0, 1, 63, 64, 65, 127, 129, 130 back to back)."""
    config = H.HopperBackwardConfig("bf16", 64, ragged=ragged, block_m=block_m)
    offset = _host_accum_offset(config)
    heads, bm, D = 3, config.block_m, config.head_dim
    lengths = [0, 1, 63, 64, 65, 127, 129, 130] if ragged else [150] * 3
    starts = np.concatenate([[0], np.cumsum(lengths)])[:-1]
    size = _scratch_floats(config, lengths, heads)["dq_accum"]
    places = set()
    for bidx, (start, length) in enumerate(zip(starts, lengths)):
        first = (start + bidx * bm) // bm if ragged else bidx * -(-length // bm)
        for row in range(length):
            for h in range(heads):
                for col in range(0, D, 3):
                    got = offset(bidx, int(start), row, h, col, lengths[0], heads)
                    block = (first + row // bm) * heads + h
                    assert got == block * bm * D + H.dq_accum_position(config, row % bm, col)
                    assert 0 <= got < size and got not in places
                    places.add(got)


def _host_stats_offset(config, which):
    """`_stats_offset` (`_count_offset` for which="count") compiled for the host: (bidx,
    start, row, head, seqlen_q, num_heads) -> float (word) offset."""
    from mhadsl.codegen.target import HostJit
    module = ir.Module("stats")
    fn = ir.Function(module, ir.FunctionType(nvptx.i64, [nvptx.i32] * 6), "stats_offset")
    b = ir.IRBuilder(fn.append_basic_block())
    bidx, start, row, head, seqlen_q, num_heads = fn.args
    args = SimpleNamespace(seqlen_q=seqlen_q, num_heads=num_heads)
    b.ret(H._count_offset(b, config, args, bidx, start, row, head) if which == "count" else
          H._stats_offset(b, config, args, bidx, start, row, head, which))
    jit = HostJit(str(module))
    call = ctypes.CFUNCTYPE(ctypes.c_int64, *[ctypes.c_int32] * 6)(jit.address("stats_offset"))
    call.jit = jit
    return call


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("ragged", [False, True])
def test_a_query_tiles_stats_are_one_bulk_copy_of_their_own(ragged, deterministic):
    """The stats (`_stats_offset`, run on the host): a query tile's LSE rows then its delta
    rows, contiguous from the tile's first LSE (the step's one bulk copy of 2 block_m
    floats, 16-byte aligned), the rows past the sequence up to the tile's end included (the
    preprocess zeroes them); in deterministic mode each tile's dQ count (`_count_offset`)
    after them; no two (sequence, row, head, stat) share a float, and all fit in the
    design's scratch."""
    config = H.HopperBackwardConfig("bf16", 128, ragged=ragged, deterministic=deterministic)
    offsets = {which: _host_stats_offset(config, which)
               for which in H.STATS + (("count",) if deterministic else ())}
    heads, bm = 3, config.block_m
    lengths = [0, 1, 63, 64, 65, 130] if ragged else [70] * 3
    starts = np.concatenate([[0], np.cumsum(lengths)])[:-1]
    size = _scratch_floats(config, lengths, heads)["delta"]
    places = set()
    for bidx, (start, length) in enumerate(zip(starts, lengths)):
        for row in range(-(-length // bm) * bm):
            for h in range(heads):
                tile_start = offsets[H.STATS[0]](bidx, int(start), row - row % bm, h,
                                                 lengths[0], heads)
                assert tile_start % 4 == 0  # (a bulk copy's 16-byte alignment)
                for i, which in enumerate(H.STATS):
                    got = offsets[which](bidx, int(start), row, h, lengths[0], heads)
                    assert got == tile_start + i * bm + row % bm
                    assert 0 <= got < size and got not in places
                    places.add(got)
                if deterministic and row % bm == 0:
                    count = offsets["count"](bidx, int(start), row, h, lengths[0], heads)
                    assert count == tile_start + len(H.STATS) * bm
                    assert 0 <= count < size and count not in places
                    places.add(count)


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("max_seqlen_q", [0, 1, 64, 65, 3000])
def test_the_preprocess_writes_every_row_of_a_sequences_last_stats_block(block_m, max_seqlen_q):
    """A step's bulk copy reads its query tile's whole stats block, so the preprocess's grid
    (ROW_TILE rows per CTA) reaches the end of the longest sequence's last tile: the rows
    past the sequence get -inf and zero there, not stale memory (a 128-row tile over a
    64-row preprocess once gave NaN dK in ragged calls)."""
    config = H.HopperBackwardConfig("bf16", 64, ragged=True, block_m=block_m)
    call = CallSizes(5, 3, 3, 0, 0, max_seqlen_q, 0, 0, True, 1.0)
    tiles, heads, batch = next(k for k in H.BACKEND.kernels(config)
                               if k.name == H.PREPROCESS).grid(call)
    assert (heads, batch) == (3, 5)
    assert tiles * ROW_TILE >= -(-max_seqlen_q // block_m) * block_m


def _host_vector_origins(config, count):
    """`vector_origin` compiled for the host, one function per vector i: thread -> (row,
    column)."""
    from mhadsl.codegen.target import HostJit
    module = ir.Module("origins")
    for i in range(count):
        fn = ir.Function(module, ir.FunctionType(nvptx.i32, [nvptx.i32]), f"origin{i}")
        b = ir.IRBuilder(fn.append_basic_block())
        row, col = H.vector_origin(b, config, fn.args[0], i)
        b.ret(b.or_(b.shl(row, nvptx.i32(16)), col))
    jit = HostJit(str(module))
    calls = [ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int32)(jit.address(f"origin{i}"))
             for i in range(count)]
    return jit, [lambda t, f=f: divmod(f(t), 1 << 16) for f in calls]


@pytest.mark.parametrize("head_dim, block_m", [(64, 64), (128, 64), (64, 128), (256, 64)])
def test_the_row_kernels_walk_each_run_of_the_accumulator_16_bytes_a_thread(head_dim, block_m):
    """A row CTA's ROW_TILE rows are one contiguous run of the accumulator. Thread t's vector
    i, the 16 bytes at 4 (t + 128 i) of the run, holds (row, column), (row, column + 1) and
    the same of row + 8, with (row, column) its `vector_origin`: where `dq_accum_position`
    puts them, every place of the run once. In the postprocess's shared tile
    (`staging_pitch` bytes a row) a warp's 32 lanes store each half of a vector to 32
    distinct banks."""
    config = _config(head_dim, block_m=block_m)
    count = ROW_TILE * head_dim // (4 * hopper.WARPGROUP_THREADS)
    _jit, origins = _host_vector_origins(config, count)
    pitch = H._Rows.staging_pitch(config)
    for first in range(0, block_m, ROW_TILE):
        run = H.dq_accum_position(config, first, 0)
        seen = set()
        for i, origin in enumerate(origins):
            banks = [set(), set()]
            for t in range(hopper.WARPGROUP_THREADS):
                row, col = origin(t)
                for e in range(4):
                    place = H.dq_accum_position(config, first + row + 8 * (e // 2), col + e % 2)
                    assert place == run + 4 * (t + 128 * i) + e, (t, i, e)
                    seen.add(place)
                for half in range(2 if t < 32 else 0):
                    banks[half].add(((row + 8 * half) * pitch + 2 * col) // 4 % 32)
            assert banks == [set(range(32))] * 2
        assert seen == set(range(run, run + ROW_TILE * head_dim))


@pytest.mark.parametrize("head_dim", [128, 256])
def test_the_backward_moves_whole_16_byte_vectors(monkeypatch, tmp_path, head_dim):
    """The preprocess zeroes the accumulator, and the postprocess reads it and writes dQ, in
    16-byte vectors (two-float pieces of it make the row kernels several times slower); the
    main kernel writes dK and dV in 16-byte vectors too (its quads trade
    pairs: `warp.quad_transpose`), and nothing else: a thread two rows of its
    warpgroup's 128 columns of each (at head dim 256, half of the head)."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    kern = mhadsl.compile(f"attention p {{ dtype = bf16  head_dim = {head_dim} }}",
                          name="x")["p"]
    build = kern.backward_build("sm_90a")
    assert build.backend == "backward_sm90"

    def entry(name):
        return _entry(build.ptx, name)
    vectors = ROW_TILE * head_dim // (4 * hopper.WARPGROUP_THREADS)
    pre, post = entry(H.PREPROCESS), entry(H.POSTPROCESS)
    assert len(re.findall(r"st\.global\.v4\.(?:f32|b32)", pre)) == vectors
    assert not re.findall(r"st\.global\.v2", pre)
    assert len(re.findall(r"ld\.global(?:\.nc)?\.v4\.(?:f32|b32)", post)) == vectors
    assert re.findall(r"st\.global\.v4", post) and not re.findall(r"st\.global\.(?:b32|u32)", post)
    # dK and dV: two rows of 128 columns per thread, 8 columns a store
    stores = re.findall(r"st\.global[.\w]*", entry(H.MAIN))
    assert stores == ["st.global.v4.b32"] * (2 * 2 * 128 // 8 // 4)


@pytest.mark.parametrize("head_dim, score", [(128, ""), (64, ""), (256, ""), (128, _SOFTCAP)])
def test_a_step_multiplies_ds_in_16_bit_pairs(monkeypatch, tmp_path, head_dim, score):
    """Without a score rule a consumer computes dS^T = P^T (dP^T - delta) two values at a
    time in 16-bit pairs (`warp.mul2`: score_columns / 4 of them per thread and step: at
    head dim 256 its half of the query columns), from the P^T pairs dV's GEMM took, not by
    unpacking them to f32; with one, G = P^T dscore/ds takes the f32 path."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    build = mhadsl.compile(f"attention p {{ dtype = bf16  head_dim = {head_dim}  {score} }}",
                           name="x")["p"].backward_build("sm_90a")
    main = build.ptx[build.ptx.index(f".entry {H.MAIN}("):]
    main = main[:main.index("\n}\n")]
    pairs = len(re.findall(r"mul\.rn\.bf16x2", main))
    assert pairs == (0 if score else build.config.score_columns // 4)


def _main_events(head_dim):
    """The main kernel's build config and its PTX as runs of kinds: mbarrier waits
    (try_wait), -LSE/delta reads (two-float shared loads), wgmmas, `wgmma.wait_group N`
    (waitN) and mbarrier arrivals."""
    build = mhadsl.compile(f"attention p {{ dtype = bf16  head_dim = {head_dim} }}",
                           name="x")["p"].backward_build("sm_90a")
    ptx = build.ptx
    main = ptx[ptx.index(f".entry {H.MAIN}("):]
    events = []
    for line in main[:main.index("\n}\n")].splitlines():
        wait = re.search(r"wgmma\.wait_group\.sync\.aligned\s+(\d)", line)
        kind = ("try_wait" if "mbarrier.try_wait" in line
                else "lds" if "ld.shared.v2.f32" in line
                else "wgmma" if "wgmma.mma_async" in line
                else f"wait{wait.group(1)}" if wait
                else "arrive" if "mbarrier.arrive.shared" in line else None)
        if kind and events and events[-1][0] == kind:
            events[-1][1] += 1
        elif kind:
            events.append([kind, 1])
    return build.config, events


def _runs(events, n):
    return [events[i:i + n] for i in range(len(events) - n + 1)]


@pytest.mark.parametrize("head_dim, early", [(128, True), (64, False)])
def test_a_step_reads_its_lse_before_its_gemms_at_64_query_rows(monkeypatch, tmp_path,
                                                                head_dim, early):
    """Once a stage is full, a consumer at a 64-row query step (head dim 128) reads the step's
    -LSE (block_m / 8 two-float loads) before it issues S^T's and dP^T's GEMMs: issued after
    them, the loads waited behind their shared-memory traffic and stalled P's first FFMAs. At
    128 rows (head dim 64) the loads follow dP^T's GEMM (S^T's is issued a step ahead): their
    registers held across it cost more than the stall."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    config, events = _main_events(head_dim)
    assert config.block_m == (64 if early else 128)
    lse, k_steps = ["lds", config.block_m // 8], head_dim // 16
    expected = ([["try_wait", 1], lse, ["wgmma", 2 * k_steps]] if early
                else [["wait0", 1], ["wgmma", k_steps], lse])
    assert expected in _runs(events, 3), events


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_step_classifies_its_pair_of_tiles_before_its_gemms(monkeypatch, tmp_path, head_dim):
    """The classification reads the work tile's parked values (volatile shared loads): a
    step makes it before it issues its GEMMs (dP^T's at least), not where it computes P^T,
    whose masking branch would wait for those loads behind S^T's wait."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    events = []
    classify, probabilities, wgmma = (H._HopperMain._classify, H._HopperMain._probabilities,
                                      hopper.wgmma)
    monkeypatch.setattr(H._HopperMain, "_classify",
                        lambda *a, **k: events.append("classify") or classify(*a, **k))
    monkeypatch.setattr(H._HopperMain, "_probabilities",
                        lambda *a, **k: events.append("P") or probabilities(*a, **k))
    monkeypatch.setattr(hopper, "wgmma", lambda *a, **k: events.append("wgmma") or wgmma(*a, **k))
    mhadsl.compile(f"attention p {{ dtype = bf16  head_dim = {head_dim} }}",
                   name="x")["p"].backward_build("sm_90a")
    assert events.count("P") >= 1
    for i, event in enumerate(events):
        if event == "P":
            before = events[:i]
            assert "classify" in before, events
            assert "wgmma" in before[len(before) - 1 - before[::-1].index("classify"):], events


def _gemm_events(main: str) -> list[str]:
    """The main kernel's PTX as runs of kinds (repeats merged): wgmmas by shape and A operand
    ("m64n32k16" from shared memory, "m64n128k16.r" from registers), `wgmma.wait_group N`
    (waitN), exp2s, the consumers' 4-byte shared stores (16-bit pairs of P^T or dS^T, at
    32-bit addresses: `_st_shared_b32`), async-proxy fences and the consumers' named
    barrier (`nvptx.DS_BARRIER`)."""
    events = []
    for line in main.splitlines():
        gemm = re.search(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)\S*\s+\{[^}]*\},\s*(\{)?",
                         line)
        wait = re.search(r"wgmma\.wait_group\.sync\.aligned\s+(\d)", line)
        kind = (gemm.group(1) + (".r" if gemm.group(2) else "") if gemm
                else f"wait{wait.group(1)}" if wait
                else "ex2" if "ex2.approx" in line
                else "st.b32" if re.search(r"st\.shared\.b32\s+\[%r\d+\]", line)
                else "fence" if "fence.proxy.async" in line
                else "ds_barrier" if re.search(rf"bar\.sync\s+{nvptx.DS_BARRIER},", line)
                else None)
        if kind and (not events or events[-1] != kind):
            events.append(kind)
    return events


@pytest.mark.parametrize("head_dim", [128, 256])
def test_at_head_dim_256_dv_and_dk_read_p_and_ds_from_shared_memory(monkeypatch, tmp_path,
                                                                     head_dim):
    """At head dim 256 a consumer stores its columns of P^T (16-bit pairs) under dP^T's GEMM,
    once it has computed them (exp2), then its columns of dS^T; only after the async-proxy
    fence and the consumers' named barrier (both warpgroups' columns of both are in) it
    issues dV's GEMM, dQ's first chunk, then dK's, dV's and dK's A operands from shared
    memory. At head dim 128 dV's GEMM takes P^T from registers before the barrier, and dK's
    dS^T from registers after dQ's."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    build = mhadsl.compile(f"attention p {{ dtype = bf16  head_dim = {head_dim} }}",
                           name="x")["p"].backward_build("sm_90a")
    events = _gemm_events(_entry(build.ptx, H.MAIN))
    stores_p = ["ex2", "st.b32", "wait0"]
    after_barrier = (["st.b32", "fence", "ds_barrier", "m64n128k16", "m64n64k16", "m64n128k16",
                      "wait1"] if head_dim == 256
                     else ["wait0", "m64n128k16.r", "st.b32", "fence", "ds_barrier", "m64n64k16",
                           "m64n128k16.r", "wait1"])
    assert after_barrier in _runs(events, len(after_barrier)), events
    assert (stores_p in _runs(events, 3)) == (head_dim == 256), events
    assert ("m64n128k16.r" in events) == (head_dim != 256), events


@pytest.mark.parametrize("head_dim, ahead", [(64, True), (128, False)])
def test_at_128_query_rows_the_next_steps_s_is_issued_before_the_stage_is_freed(
        monkeypatch, tmp_path, head_dim, ahead):
    """At 128-row query steps (head dim 64) a consumer issues the next step's S^T = K Q^T
    under dK's GEMM, so that it is queued across the step boundary: the stage is freed (its
    empty mbarrier) once every group but that one is done (`wgmma.wait_group 1`), and the
    next step waits for all of them before it reads S^T (a group count ptxas can follow: no
    serialisation). At 64-row steps a step issues its own S^T, and frees the stage once all
    of its groups are done."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    config, events = _main_events(head_dim)
    assert config.s_ahead == ahead
    assert ([["wait1", 1], ["arrive", 1]] in _runs(events, 2)) == ahead, events
    assert ([["wait0", 1], ["arrive", 1]] in _runs(events, 2)) != ahead, events


@pytest.mark.parametrize("head_dim, parts", [(256, True), (128, False)])
def test_with_one_stage_a_step_frees_do_once_dv_is_done_and_q_once_dk_is(
        monkeypatch, tmp_path, head_dim, parts):
    """With one stage (head dim 256) the consumers free it in two parts, so that the
    producer loads the next step's dO, then its Q, under the step's last GEMMs: dO's (and
    the stats') empty mbarrier once dV's GEMM is done (`wgmma.wait_group 1` after dK's
    issue), Q's once dK's is (a wait for all groups), before dQ's second chunk's four
    wgmmas; the producer waits on each before it loads its part. With two stages a step
    frees its stage at its end, once."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    config, events = _main_events(head_dim)
    assert config.frees_stage_in_parts == parts
    assert ([["wait1", 1], ["arrive", 1], ["wait0", 1]] in _runs(events, 3)) == parts, events
    assert ([["wait0", 1], ["arrive", 1], ["wgmma", 4]] in _runs(events, 3)) == parts, events
    assert sum(n for kind, n in events if kind == "arrive") == (2 if parts else 1)


DETERMINISTIC = """import "std/schedulers.mha"
attention t { dtype = bf16  head_dim = %d  %s
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
"""


def test_a_deterministic_backward_adds_dq_in_a_fixed_order_on_hopper(monkeypatch, tmp_path):
    """Deterministic mode on sm_90a runs the Hopper design (Queued, the default there,
    hands out each head's K/V tiles in order): its writer warp waits for each query tile's
    count (acquire loads, backing off, given up after a bound or once a fault is recorded;
    the fault word and the clock read only once the first load misses),
    adds by bulk reduce-add, waits for the adds to complete and releases the count (at the
    next step, once it has freed the staging tiles for the consumers, or at the work tile's
    end); the preprocess zeroes the counts in the stats blocks. The atomic build has none
    of it."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    kern = mhadsl.compile(DETERMINISTIC % (128, ""))["t"]
    assert kern.options.scheduler_for("backward", deterministic=True) == ("Queued", ())
    exact = kern.backward_build("sm_90a", deterministic=True)
    atomic = kern.backward_build("sm_90a")
    assert exact.backend == atomic.backend == "backward_sm90"
    ordered_main, atomic_main = (b.ptx[b.ptx.index(f".entry {H.MAIN}("):]
                                 for b in (exact, atomic))
    for instruction in ("ld.acquire.gpu.global.u32", "nanosleep.u32", "%globaltimer",
                        "red.release.gpu.global.add.u32"):
        assert instruction in ordered_main and instruction not in atomic_main, instruction
    release = ordered_main.index("red.release.gpu.global.add.u32")
    done = ordered_main.rindex("cp.async.bulk.wait_group 0;", 0, release)
    assert ordered_main.index("fence.proxy.async.global", done) < release
    # a step frees both staging tiles, then releases the last step's count, then waits
    freed = re.search(rf"barrier\.arrive\s+{nvptx.DQ_EMPTY_BARRIER + 1},", ordered_main).start()
    assert ordered_main.index("red.release.gpu.global.add.u32", freed) < \
        ordered_main.index("ld.acquire.gpu.global.u32", freed)
    # a count already there costs one load: the fault word and the clock are read after a miss
    first_poll = ordered_main.index("ld.acquire.gpu.global.u32", freed)
    assert first_poll < ordered_main.index("ld.relaxed.gpu.global.u32", freed)
    assert first_poll < ordered_main.index("%globaltimer", freed)
    assert ordered_main.count("red.release.gpu.global.add.u32") == 2  # and at a tile's end
    assert ordered_main.count("cp.reduce.async.bulk.global") == 2  # a part per warpgroup
    scratch = H.BACKEND.scratch(exact.config, CallSizes(2, 4, 4, 100, 100, 100, 100, 200,
                                                         False, 1.0))
    atomic_scratch = H.BACKEND.scratch(atomic.config, CallSizes(2, 4, 4, 100, 100, 100, 100,
                                                                200, False, 1.0))
    blocks = 2 * 2 * 4  # (batch x query tiles of 64 rows) x heads
    assert scratch["delta"] - atomic_scratch["delta"] == 16 * blocks
    if find_ptxas() is not None:
        for resources in exact.assembled.kernels.values():
            assert resources.spills == 0 and resources.stack_bytes == 0, resources


@pytest.mark.parametrize("scheduler", ["scheduler = LPT()",
                                       "scheduler = Persistent(order = PROMPT_ROTATE)",
                                       "scheduler = Queued(order = LONGEST_FIRST)"])
def test_a_deterministic_backward_whose_scheduler_hands_out_tiles_out_of_order_is_sm80s(
        scheduler, monkeypatch, tmp_path):
    """Where the scheduler does not hand out each head's K/V tiles in order, the Hopper
    design's fixed order could wait for a tile queued behind the waiting one: the
    sm80-style design's deterministic kernels (`mha_bwd_dq`) run it."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    kern = mhadsl.compile(DETERMINISTIC % (64, scheduler))["t"]
    assert not H.adds_in_order(kern.options.scheduler_for("backward", deterministic=True))
    build = kern.backward_build("sm_90a", deterministic=True)
    assert build.backend == "backward" and "mha_bwd_dq" in build.ptx


@pytest.mark.parametrize("name,args", [
    (name, args) for name in H.ORDERED_SCHEDULERS
    for args in ((), (("order", "INTERLEAVED"),),
                 (("order", "INTERLEAVED"), ("heads_per_section", 1)),
                 (("order", "PROMPT_ROTATE"),), (("order", "LONGEST_FIRST"),))]
    + [("LPT", ())])
def test_the_ordered_schedulers_hand_out_each_heads_kv_tiles_in_order(name, args):
    """What deterministic mode on Hopper relies on, simulated: in the order the tiles are
    handed out (a queue's, or the CTAs' indices and strides) each (sequence, K/V head)'s
    prompt tiles come first to last (the last K/V tile first), and each sequence's K/V tile
    of one offset comes head by head in order (a split group's dK and dV order: the heads
    are then query heads, `_kv_turn`), over random ragged key lengths, in the DEFAULT and
    INTERLEAVED orders; PROMPT_ROTATE, LONGEST_FIRST and LPT (longest first) do not, which
    `adds_in_order` says."""
    from mhadsl.analysis.simulate import simulate
    from mhadsl.codegen.scheduler import SchedulerSpec
    from mhadsl.host.backward import backward_work
    std = mhadsl.compile('import "std/schedulers.mha"', name="std").checked
    rng = np.random.default_rng(7)
    in_order = True
    for _ in range(6):
        lengths = [int(n) for n in rng.choice([0, 1, 64, 65, 300, 1000, 2100], 5)]
        heads = int(rng.integers(1, 4))
        result = simulate(std, SchedulerSpec(name, args, 64, 1),
                          backward_work(lengths, heads), ctas=1)
        assert result.covered_exactly_once
        handed = [tile for cta in sorted(result.visits) for tile in result.visits[cta]]
        for pair in {(h, b) for _, h, b in handed}:
            offsets = [o for o, h, b in handed if (h, b) == pair]
            in_order &= offsets == sorted(offsets)
        for tile in {(o, b) for o, _, b in handed}:
            heads_in_turn = [h for o, h, b in handed if (o, b) == tile]
            in_order &= heads_in_turn == sorted(heads_in_turn)
    assert in_order == H.adds_in_order((name, args))


def test_an_order_wait_that_gives_up_is_a_scheduler_error_that_says_why():
    """The fault a deterministic CTA records when the tiles it waits for never add (a
    scheduler that hands them out after it, or more CTAs than fit at once)."""
    from mhadsl import abi
    from mhadsl.runtime import faults
    error = faults.SchedulerError(abi.fault_code(abi.DQ_ORDER_WAIT, "advance"),
                                  faults.scheduler_id("Queued"), 3)
    assert (error.scheduler, error.rule, error.cta) == ("Queued", "advance", 3)
    assert "deterministic backward" in str(error) and "waited 4 s" in str(error)


# ---------------------------------------------------------------- a split GQA group
def test_calls_split_groups_of_six_query_heads_or_more_four_when_deterministic(monkeypatch):
    """`declared_config`'s rule: an atomic call with SPLIT_GROUP_MIN (6) or more query heads
    per K/V head splits its group over CTAs, a deterministic one from
    DETERMINISTIC_SPLIT_GROUP_MIN (4); fewer do not, nor does head dim 256; the thresholds
    are the module's constants (a benchmark sets them to measure both). A split layout
    tries its split configs first, then the same without the split; a split config is a
    problem without GQA."""
    options = _options("attention t { dtype = bf16  head_dim = 128 }")

    def splits(group, deterministic=False):
        layout = Layout(gqa_group=group, backward=True, deterministic=deterministic)
        return H.declared_config(options, layout).split_group

    assert H.SPLIT_GROUP_MIN == 6
    assert [splits(g) for g in (1, 2, 4, 5, 6, 8, 16)] == [False] * 4 + [True] * 3
    assert H.DETERMINISTIC_SPLIT_GROUP_MIN == 4
    assert [splits(g, deterministic=True) for g in (1, 2, 3, 4, 6, 16)] == \
        [False] * 3 + [True] * 3
    wide = _options("attention t { dtype = bf16  head_dim = 256 }")
    for deterministic in (False, True):  # (no split at head dim 256)
        layout = Layout(gqa_group=8, backward=True, deterministic=deterministic)
        assert not H.declared_config(wide, layout).split_group
    monkeypatch.setattr(H, "SPLIT_GROUP_MIN", 2)
    assert [splits(g) for g in (1, 2, 4)] == [False, True, True]
    monkeypatch.setattr(H, "SPLIT_GROUP_MIN", 1)
    assert not splits(1)
    monkeypatch.setattr(H, "SPLIT_GROUP_MIN", 6)
    configs = H.BACKEND.configs(options, Layout(gqa_group=6, backward=True))
    assert [c.split_group for c in configs] == [True] * 4 + [False] * 4
    narrow = H.BACKEND.configs(options, Layout(gqa_group=4, backward=True))
    assert configs[4:] == tuple(replace(c, gqa_group=6) for c in narrow)
    assert not any(c.split_group for c in narrow)
    assert not _config(gqa_group=6, split_group=True).problems()
    assert not _config(gqa_group=6, split_group=True, deterministic=True).problems()
    for fields in (dict(gqa_group=1), dict(gqa_group=1, deterministic=True)):
        assert _config(split_group=True, **fields).problems()[0].settings == ("split_group",)


def test_a_split_groups_scheduler_hands_out_the_k_v_tiles_of_query_heads():
    """A split build's work space: the K/V tiles of every query head (its scheduler's
    heads: `scheduler_view`), gqa_group of them per K/V head; a build that does not split
    hands out those of the K/V heads."""
    split = _config(gqa_group=6, split_group=True)
    whole = _config(gqa_group=6)
    call = CallSizes(2, 12, 2, 300, 300, 300, 300, 600, False, 1.0)
    assert H.BACKEND.work_space(split, call) == (2, 3, 300, 12)
    assert H.BACKEND.work_space(whole, call) == (2, 3, 300, 2)
    assert H.BACKEND.scheduler_shape(split) == (128, 6)
    assert H.BACKEND.scheduler_shape(whole) == (128, 1)
    args = SimpleNamespace(num_heads="Hq", kv_heads="Hkv", seqlen_q="Sq", seqlen_k="Sk",
                           max_seqlen_q="max Sq", max_seqlen_k="max Sk",
                           cu_seqlens_q="cu_q", cu_seqlens_k="cu_k", config=split)
    view = H.scheduler_view(args)
    assert (view.num_heads, view.seqlen_q, view.max_seqlen_q, view.cu_seqlens_q) == \
        ("Hq", "Sk", "max Sk", "cu_k")
    args.config = whole
    assert H.scheduler_view(args).num_heads == "Hkv"


def _host_kv_accum_offset(config):
    """`kv_accum_offset` compiled for the host: (bidx, row, head, seqlen_k, kv_heads) ->
    float offset."""
    from mhadsl.codegen.target import HostJit
    module = ir.Module("kv_accum")
    fn = ir.Function(module, ir.FunctionType(nvptx.i64, [nvptx.i32] * 5), "kv_accum_offset")
    b = ir.IRBuilder(fn.append_basic_block())
    bidx, row, head, seqlen_k, kv_heads = fn.args
    b.ret(H.kv_accum_offset(b, config, SimpleNamespace(seqlen_k=seqlen_k, kv_heads=kv_heads),
                            bidx, row, head))
    jit = HostJit(str(module))
    call = ctypes.CFUNCTYPE(ctypes.c_int64, *[ctypes.c_int32] * 5)(
        jit.address("kv_accum_offset"))
    call.jit = jit
    return call


@pytest.mark.parametrize("ragged", [False, True])
def test_a_split_groups_dk_dv_accumulators_hold_ks_rows_in_fp32(ragged):
    """dK's and dV's accumulators of a split build (`kv_accum_offset`, run on the host):
    k's layout in fp32, (row, K/V head, column 0) at (row of all, head) head_dim floats
    apart, no two (sequence, row, head) the same, all within the scratch buffers (ragged:
    k's rows, spare rows before and after the sequences among them); a build that does not
    split has none."""
    config = _config(64, gqa_group=6, ragged=ragged, split_group=True)
    offset = _host_kv_accum_offset(config)
    kv_heads, d = 3, config.head_dim
    lengths = [0, 1, 63, 64, 65, 130] if ragged else [150] * 3
    before, after = (5, 7) if ragged else (0, 0)
    starts = before + np.concatenate([[0], np.cumsum(lengths)])[:-1]
    total_k = before + sum(lengths) + after
    call = CallSizes(len(lengths), 6 * kv_heads, kv_heads, lengths[0], lengths[0],
                     max(lengths), max(lengths), sum(lengths), ragged, 1.0, total_k=total_k)
    scratch = H.BACKEND.scratch(config, call)
    rows = total_k if ragged else len(lengths) * lengths[0]
    assert scratch["dk_accum"] == scratch["dv_accum"] == 4 * rows * kv_heads * d
    places = set()
    for bidx, (start, length) in enumerate(zip(starts, lengths)):
        for row in range(length):
            first = start + row if ragged else row
            for h in range(kv_heads):
                got = offset(bidx, int(first), h, lengths[0], kv_heads)
                row_of_all = start + row if ragged else bidx * lengths[0] + row
                assert got == (row_of_all * kv_heads + h) * d
                assert 0 <= got and got + d <= rows * kv_heads * d and got not in places
                places.add(got)
    assert not {"dk_accum", "dv_accum"} & set(H.BACKEND.scratch(replace(
        config, split_group=False), call))


def test_a_split_call_plans_query_heads_work_tiles_then_converts_dk_and_dv(kernel,
                                                                          monkeypatch):
    """Planned on the host (a stand-in 9.0 device, 132 multiprocessors): a dense call of 12
    query heads on 2 K/V heads launches the preprocess, the main kernel over the K/V tiles
    of the 12 query heads (Queued: a CTA per work tile, as they are fewer than the CTAs),
    dQ's postprocess, then `KV_POSTPROCESS` over the rows of the 2 K/V heads; the
    preprocess, the main kernel and `KV_POSTPROCESS` get the accumulators the call's
    scratch holds. 8 query heads on 2 (a group below SPLIT_GROUP_MIN) launch the main
    kernel over the K/V heads' tiles and no conversion."""
    def function(name):
        return SimpleNamespace(name=name, max_active_blocks=lambda *a: 1,
                               launcher=fake_launcher(lambda *a: None),
                               set_max_dynamic_shared=lambda nbytes: None)
    monkeypatch.setattr(driver.Module, "from_ptx", staticmethod(
        lambda ptx, device=None: SimpleNamespace(function=function)))
    batch, seqlen, kv_heads = 2, 300, 2
    launched = {}
    for heads in (12, 8):
        shapes = {n: (batch, seqlen, heads, D) for n in ("q", "o", "dout", "dq")}
        shapes.update((n, (batch, seqlen, kv_heads, D)) for n in ("k", "v", "dk", "dv"))
        call = SimpleNamespace(sizes=CallSizes(batch, heads, kv_heads, seqlen, seqlen, seqlen,
                                               seqlen, batch * seqlen, False, 0.125))
        plans, scratch = host._plans(kernel, call, {n: _TorchLike(s) for n, s in
                                                     shapes.items()}, 0, False)
        addresses = {name: (i + 1) << 32 for i, name in enumerate(
            [*shapes, "lse", *scratch])}
        for plan in plans:
            plan.launch(addresses, 0)
        launched[heads] = [(plan.function.name, plan.grid) for plan in plans]
        accumulators = {plan.function.name: [plan.block.words[plan.block.word(name)]
                                             for name in ("dk_accum", "dv_accum")]
                        for plan in plans if "dk_accum" in plan.block.abi.offsets}
        if heads == 12:
            assert scratch["dk_accum"] == scratch["dv_accum"] == \
                4 * batch * seqlen * kv_heads * D
            assert accumulators == dict.fromkeys(
                (H.PREPROCESS, H.MAIN, H.KV_POSTPROCESS),
                [addresses["dk_accum"], addresses["dv_accum"]])
        else:
            assert "dk_accum" not in scratch and not accumulators
    kv_tiles = -(-seqlen // 128)
    query_rows = -(-seqlen // 128) * 128 // ROW_TILE  # (whole 128-row steps at head dim 64)
    assert launched[12] == [(H.PREPROCESS, (query_rows, 12, batch)),
                            (H.MAIN, (kv_tiles * 12 * batch, 1, 1)),
                            (H.POSTPROCESS, (query_rows, 12, batch)),
                            (H.KV_POSTPROCESS, (-(-seqlen // ROW_TILE), kv_heads, batch))]
    assert launched[8] == [(H.PREPROCESS, (query_rows, 8, batch)),
                           (H.MAIN, (kv_tiles * kv_heads * batch, 1, 1)),
                           (H.POSTPROCESS, (query_rows, 8, batch))]


def _param_loads(ptx: str, name: str) -> set[int]:
    """The parameters (by index) kernel `name` reads."""
    return {int(i) for i in re.findall(rf"\[{name}_param_(\d+)\]", _entry(ptx, name))}


@needs_ptxas
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_split_build_adds_dk_and_dv_into_accumulators_without_spills(head_dim, ragged,
                                                                      monkeypatch, tmp_path):
    """A causal build at 6 query heads per K/V head is the Hopper design's split build,
    without spills or a stack frame: its main kernel adds dK and dV, each consumer
    thread's 2 rows of head_dim / 8 column pairs each by `red.global.add.v2.f32`, into the
    accumulators, which the preprocess (zeroing them) and `KV_POSTPROCESS` read too; at 4
    per K/V head the build stores dK and dV, adds nothing and has no such kernel."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    kern = mhadsl.compile(_source(head_dim, True))["t"]
    build = kern.backward_build("sm_90a", gqa_group=6, ragged=ragged)
    assert build.backend == "backward_sm90" and build.config.split_group
    for name, resources in build.assembled.kernels.items():
        assert resources.spills == 0 and resources.stack_bytes == 0, (name, resources)
    for warning in ("C7508", "C7512", "C7519"):
        assert warning not in build.assembled.log, warning
    adds = re.findall(r"red\.global\.add\.v2\.f32 \[%rd\d+\+(\d+)\]", build.ptx)
    assert Counter(adds) == {str(32 * j): 2 * 2 for j in range(head_dim // 8)}
    accumulators = {len(H.ABI.params), len(H.ABI.params) + 1}
    assert accumulators <= _param_loads(build.ptx, H.MAIN)
    for name in (H.PREPROCESS, H.KV_POSTPROCESS):  # (after the sm80 design's parameters)
        assert {len(H.sm80.ABI.params), len(H.sm80.ABI.params) + 1} <= \
            _param_loads(build.ptx, name), name
    whole = kern.backward_build("sm_90a", gqa_group=4, ragged=ragged)
    assert not whole.config.split_group
    assert "red.global" not in whole.ptx and f".entry {H.KV_POSTPROCESS}(" not in whole.ptx


@needs_ptxas
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_deterministic_split_build_adds_dk_and_dv_in_the_groups_order(head_dim, ragged,
                                                                       monkeypatch, tmp_path):
    """A deterministic causal build at 4 query heads per K/V head splits its group too,
    without spills or a stack frame: after its last GEMM the main kernel's first consumer
    thread waits for its K/V tile's count (an acquire loop more than the whole group's
    build, which has only dQ's), the consumers add dK and dV, meet at a barrier, and one
    raises the count after the last add; the preprocess gets the counts
    (`kv_count`, a u32 per K/V row and head, the last parameter) as the main kernel does,
    and the call's scratch holds them, which an atomic split build's does not."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    kern = mhadsl.compile(_source(head_dim, True))["t"]
    build = kern.backward_build("sm_90a", gqa_group=4, ragged=ragged, deterministic=True)
    assert build.backend == "backward_sm90"
    assert build.config.split_group and build.config.deterministic
    for name, resources in build.assembled.kernels.items():
        assert resources.spills == 0 and resources.stack_bytes == 0, (name, resources)
    monkeypatch.setattr(H, "DETERMINISTIC_SPLIT_GROUP_MIN", 5)  # (the cache's key holds none)
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path / "whole"))
    whole = mhadsl.compile(_source(head_dim, True))["t"].backward_build(
        "sm_90a", gqa_group=4, ragged=ragged, deterministic=True)
    assert whole.backend == "backward_sm90" and not whole.config.split_group
    main, whole_main = (b.ptx[b.ptx.index(f".entry {H.MAIN}("):] for b in (build, whole))
    acquire = "ld.acquire.gpu.global.u32"
    assert main.count(acquire) > whole_main.count(acquire)
    last_add = main.rindex("red.global.add.v2.f32")
    released = main.index("red.release.gpu.global.add.u32", last_add)
    assert re.search(rf"barrier\.sync\s+{nvptx.DS_BARRIER},", main[last_add:released])
    assert "ld.acquire.gpu.global.u32" in main[:main.index("red.global.add.v2.f32")]
    count = len(H.ORDERED_SPLIT_ABI.params) - 1
    assert H.ORDERED_SPLIT_ABI.params[count].name == "kv_count"
    assert count in _param_loads(build.ptx, H.MAIN)
    assert len(H.sm80.ABI.params) + 2 in _param_loads(build.ptx, H.PREPROCESS)
    call = CallSizes(2, 8, 2, 300, 300, 300, 300, 600, ragged, 1.0, total_k=600)
    scratch = H.BACKEND.scratch(build.config, call)
    assert scratch["kv_count"] == 4 * 600 * 2
    assert "kv_count" not in H.BACKEND.scratch(replace(build.config, deterministic=False), call)


@needs_ptxas
def test_a_deterministic_split_group_takes_two_dq_writers_where_they_fit(monkeypatch,
                                                                       tmp_path):
    """Where a deterministic build splits the GQA group over CTAs, its configs try two dQ
    writers first, then one (`configs`): the causal example's takes two (warps 1 and 2 of
    the producer: 96 threads), each waiting for its step's turn, adding, freeing both
    staging tiles (the next step's barriers) and then releasing its count; so does the
    document mask's (a per-call build, whose classification reads no document id); an
    unsplit group, one."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    kern = mhadsl.compile(DETERMINISTIC % (128, ""))["t"]
    configs = H.BACKEND.configs(kern.options, Layout(gqa_group=4, backward=True,
                                                     deterministic=True))
    split = [c.dq_writers for c in configs if c.split_group]
    assert split == [2] * (len(split) // 2) + [1] * (len(split) // 2) and split
    assert {c.dq_writers for c in configs if not c.split_group} == {1}
    assert {c.dq_writers for c in H.BACKEND.configs(kern.options,
                                                     Layout(deterministic=True))} == {1}
    two = kern.backward_build("sm_90a", deterministic=True, gqa_group=4)
    assert (two.backend, two.config.split_group, two.config.dq_writers) == (
        "backward_sm90", True, 2)
    main = two.ptx[two.ptx.index(f".entry {H.MAIN}("):]
    assert re.search(r"setp\.lt\.u32\s+%p\d+, %r\d+, 96;", main)
    waited = main.index("ld.acquire.gpu.global.u32")
    freed = main.index("barrier.arrive", waited)
    assert freed < main.index("red.release.gpu.global.add.u32", freed)
    docs = next(p for p in EXAMPLES if p.name == "document_mask.mha")
    per_call = mhadsl.compile(docs)["document_mask"].backward_build(
        "sm_90a", deterministic=True, gqa_group=4)
    assert (per_call.backend, per_call.config.split_group, per_call.config.dq_writers) == (
        "backward_sm90", True, 2)
    for build in (per_call, two):
        for resources in build.assembled.kernels.values():
            assert resources.spills == 0 and resources.stack_bytes == 0, resources
