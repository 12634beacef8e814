"""Attention kernel designs ("backends") behind one interface, and their registry.

A backend is one kernel design. It says
- which GPU targets it builds for (`targets`) and what a declaration may ask of it
  (`problems`: the one place its constraints live; `mhadsl check` asks it too),
- its configurations for a declaration and a call's layout (`configs`, best first),
- the kernels a call runs, in launch order, each with its parameters (`mhadsl.abi`), CTA
  shape and grid (`kernels`): one scheduled kernel whose grid is its scheduler's over the
  design's work space (`work_space`), and any others on fixed grids,
- what a call binds beyond the sizes every design shares (`call_values`) and the scratch
  memory it needs (`scratch`),
- and it builds its kernels (`build`) from the declaration's mask/score hooks and the
  scheduler's work loop (`KernelSource`).

Adding a design: a new module in this package defining `BACKEND`, and its name in `REGISTRY`
(in preference order: the first registered backend that builds for a target wins). What
every design derives alike lives here (the choice of a spill-free build,
`spill_free_build`) and in `blocks` (a work tile's rows and the declaration's mask, score and
tile classification on it).

Targets follow the device's compute capability (`select_target`): `sm_90a` code runs only
on 9.0, so 9.0 gets sm_90a cubins; 8.x gets sm_80 cubins; any later GPU (10.x, 12.x, ...)
gets sm_80 PTX, which the driver compiles for itself when it loads the module.
"""
from __future__ import annotations

import functools
import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

from llvmlite import ir

from mhadsl.abi import (
    CallSizes, CallValue, KernelABI, Param, Pointer, Stride, Workspace, with_operands,
)
from mhadsl.codegen import hopper, warp
from mhadsl.codegen.assemble import Assembled, assemble, find_ptxas
from mhadsl.codegen.nvptx import i32
from mhadsl.codegen.target import Target, emit_ptx, optimize

# module names here, preferred first
REGISTRY = ("sm80", "sm90", "decode", "backward", "backward_sm90")

# Dynamic shared memory one CTA may opt in to, per build target (CUDA's per-block limits
# of the A100 and H100/H200 class; smaller 8.x parts have less and fail at launch).
SHARED_MEMORY_LIMIT = {"sm_80": 163 * 1024, "sm_90a": 227 * 1024}


# ============================================================================ targets
@dataclass(frozen=True)
class DeviceTarget:
    """What to build for one device: the LLVM/ptxas arch, and what the runtime loads."""

    arch: str  # "sm_80" | "sm_90a"
    load: str  # "cubin" (ptxas output) or "ptx" (the driver JIT-compiles it)


def select_target(compute_capability: tuple[int, int]) -> DeviceTarget:
    major, _ = compute_capability
    if tuple(compute_capability) == (9, 0):
        return DeviceTarget("sm_90a", "cubin")  # sm_90a code runs on 9.0 only
    if major == 8:
        return DeviceTarget("sm_80", "cubin")  # SASS is compatible within a major version
    if major >= 9:
        return DeviceTarget("sm_80", "ptx")  # newer GPUs JIT sm_80 PTX
    raise ValueError(f"compute capability {major}.{compute_capability[1]} is not supported: "
                     "mhadsl kernels need 8.0 or newer")


def backend(name: str) -> Backend:
    """The registered backend called `name`."""
    if name not in REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; registered: "
                         f"{', '.join(REGISTRY)}")
    return importlib.import_module(f"{__name__}.{name}").BACKEND


def backends(workload: str = "prefill") -> list[Backend]:
    """The registered designs of a workload ("prefill": a call with K and V; "decode": a
    call against a KV cache; "backward": the gradients of a prefill call)."""
    return [b for b in map(backend, REGISTRY) if b.workload == workload]


# The designs a target runs a declaration with when nothing forces one, preferred first (the
# first that runs the declaration wins): on compute capability 9.0 the Hopper design
# (faster than sm80 on the H200: benchmarks/log/BENCHMARKS_LOG.md), and sm80 for what it
# cannot run (head dim 256, tiles it does not take); `backend="sm80"` forces the other.
PREFERENCE = {"sm_90a": ("sm90", "sm80")}
# The same for the backward pass: on 9.0 the TMA + wgmma design where it runs the declaration
# and the call's layout (`Backend.runs_layout`), else the sm80-style one, which runs them all.
BACKWARD_PREFERENCE = {"sm_90a": ("backward_sm90", "backward")}


def backend_for_arch(arch: str, requested: str | None = None, options=None,
                     workload: str = "prefill", layout: Layout | None = None) -> Backend:
    """`requested` (it must build for `arch`), else the preferred backend for `arch` that
    runs declaration `options` (`AttentionOptions`; any, without them), else the first
    registered one of the workload that builds for `arch`. The CLI, the API and a device all
    choose here."""
    if requested is not None and backend(requested).workload != workload:
        requested = None  # a forced prefill design does not change how a cache call runs
    if requested is not None:
        chosen = backend(requested)
        if arch not in chosen.targets:
            raise ValueError(f"attention backend {requested!r} builds for "
                             f"{', '.join(chosen.targets)}, not {arch}")
        return chosen
    preference = {"prefill": PREFERENCE, "backward": BACKWARD_PREFERENCE}.get(workload, {})
    for name in preference.get(arch, ()):
        design = backend(name)
        if options is not None and not design.problems(options, arch) and (
                layout is None or design.runs_layout(layout)):
            return design
    for candidate in backends(workload):
        if arch in candidate.targets:
            return candidate
    raise ValueError(f"no attention backend builds for {arch}")


def select_backend(compute_capability: tuple[int, int], requested: str | None = None,
                   options=None, workload: str = "prefill") -> tuple[Backend, DeviceTarget]:
    """The design and target a device of this compute capability runs declaration
    `options` (`AttentionOptions`) with; without `options`, the target's first backend."""
    target = select_target(compute_capability)
    return backend_for_arch(target.arch, requested, options, workload), target


# ============================================================================ the interface
@dataclass(frozen=True)
class CacheLayout:
    """What a call against a KV cache fixes at build time."""

    query_rows: int = 1  # query rows per sequence (dense q); 0: ragged q (cu_seqlens_q)
    page_size: int = 0  # 0: a contiguous cache
    block_n: int = 64  # KV rows per KV tile, which the call's planner picks for its shape
    appends: bool = False  # the call writes the step's k_new/v_new rows into the cache first
    fp8: bool = False  # the cache is float8_e4m3fn, with a scale per tensor (k_scale, v_scale)
    balanced: bool = False  # each sequence's KV splits follow the lengths, on the device


@dataclass(frozen=True)
class Layout:
    """What a call fixes at build time (batch size and lengths are run-time values)."""

    gqa_group: int = 1  # Hq // Hkv
    ragged: bool = False  # lengths from cu_seqlens
    return_lse: bool = False
    cache: CacheLayout | None = None  # a decode call's cache (None: q, k, v)
    backward: bool = False  # the backward pass's kernels
    deterministic: bool = False  # the backward's, bitwise repeatable (no dQ atomics)
    # the backward's kernels add the gradients of the f32 tensors the score reads too
    # (`ExprHooks.scatter_reads`)
    operand_grads: bool = False
    # the call's i32 operands make the mask a short band of keys, which the declaration's
    # constants alone do not (a run-time window: `classify.short_band`)
    short_band: bool = False
    # a dense call of too few keys for the design's wide KV tile to pay: the build leaves
    # that tile out (`Backend.call_layout`)
    narrow_kv: bool = False

    @property
    def workload(self) -> str:
        return "backward" if self.backward else "prefill" if self.cache is None else "decode"

    @property
    def splits_by_length(self) -> bool:
        """A decode call's KV splits follow its lengths (`CacheLayout.balanced`)."""
        return self.cache is not None and self.cache.balanced


@dataclass(frozen=True)
class Problem:
    """Why a backend cannot build a declaration: the settings at fault ("tile", "warps",
    ...; reported at the first the declaration sets) and a message in their terms."""

    settings: tuple[str, ...]
    message: str


def common_problems(config) -> list[Problem]:
    """The checks every design's config shares: the element type and the head ratio."""
    found = []
    if config.dtype not in warp.DTYPES:
        found.append(Problem(("dtype",), f"dtype {config.dtype} is not one of "
                                         f"{', '.join(warp.DTYPES)}"))
    if config.gqa_group < 1:
        found.append(Problem(("gqa",), "the query:KV head ratio must be at least 1"))
    return found


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel of a build as the host launches it (`Backend.kernels`): its name and
    parameters, threads per CTA (x only), dynamic shared memory per CTA, and its grid for a
    call (`CallSizes` -> (x, y, z)); None: the scheduled kernel, whose grid is its
    scheduler's `grid_dim` over the design's work space."""

    name: str
    abi: KernelABI
    threads: int
    shared_bytes: int
    grid: Callable[[CallSizes], tuple[int, int, int]] | None = None


# The parameters of every forward attention kernel, in order (a design adds its own after
# them: `abi.KernelABI`).
FORWARD_PARAMS: tuple[Param, ...] = (
    Param("q", "ptr", Pointer("q"), "queries, dtype elements; dense (B,Sq,Hq,D) / ragged (total_q,Hq,D); last dim contiguous, 16-byte aligned rows", align=16),
    Param("k", "ptr", Pointer("k"), "keys, dense (B,Sk,Hkv,D) / ragged (total_k,Hkv,D)", align=16),
    Param("v", "ptr", Pointer("v"), "values, same layout as k", align=16),
    Param("o", "ptr", Pointer("o"), "output, same layout as q (written for valid rows only)", align=16),
    Param("lse", "ptr", Pointer("lse"), "float32 log-sum-exp (natural log) or null when return_lse is off; element (b,h,row) at b*lse_stride_batch + h*lse_stride_head + start_of_seq + row", align=4),
    Param("cu_seqlens_q", "ptr", Pointer("cu_seqlens_q"), "int32 (B+1) query row offsets (ragged), else null", align=4),
    Param("cu_seqlens_k", "ptr", Pointer("cu_seqlens_k"), "int32 (B+1) key row offsets (ragged), else null", align=4),
    *(Param(f"{t}_stride_{axis}", "i64", Stride(t, axis), f"elements from one {axis} of {t} to the next" + (" (0 when ragged)" if axis == "batch" else ""))
      for t in "qkvo" for axis in ("batch", "row", "head")),
    Param("lse_stride_batch", "i64", CallValue("lse_stride_batch"), "floats between batches of lse: Hq*Sq dense, 0 ragged"),
    Param("lse_stride_head", "i64", CallValue("lse_stride_head"), "floats between heads of lse: Sq dense, total_q ragged"),
    Param("batch", "i32", CallValue("batch"), "number of sequences B"),
    Param("num_heads", "i32", CallValue("num_heads"), "query heads Hq (= gqa_group * Hkv)"),
    Param("max_seqlen_q", "i32", CallValue("max_seqlen_q"), "longest query sequence (dense: seqlen_q)"),
    Param("max_seqlen_k", "i32", CallValue("max_seqlen_k"), "longest key sequence (dense: seqlen_k)"),
    Param("seqlen_q", "i32", CallValue("seqlen_q"), "dense query length (ignored when ragged)"),
    Param("seqlen_k", "i32", CallValue("seqlen_k"), "dense key length (ignored when ragged)"),
    Param("softmax_scale", "f32", CallValue("softmax_scale"), "scale applied to q.k before the score hook / softmax"),
    Param("queue", "ptr", Workspace("queue"), "per-stream u32 workspace: the work-queue counter, then the scheduler fault record (mhadsl/abi.py); never null", align=4),
    Param("num_sms", "i32", CallValue("num_sms"), "multiprocessors on the device (persistent grid size)"),
    Param("ctas_per_sm", "i32", CallValue("ctas_per_sm"), "CTAs of this kernel that fit on one multiprocessor"),
    Param("tile_index", "ptr", Workspace("tile_index"), "u32 tile index of a ragged launch (codegen/tile_index.py: per-sequence tile prefix sums, longest-first ranks), built on the device from cu_seqlens_q before the launch; null when dense", align=4),
)


@dataclass(frozen=True)
class ExprHooks:
    """Callables from the front end that emit the mask and score expressions.

    mask(builder, b, h, q_idx, kv_idx, seqlen_q, seqlen_k) -> i1 (true = keep); None = no mask.
    score(builder, s, b, h, q_idx, kv_idx[, seqlen_q, seqlen_k]) -> f32; `s` is the *scaled*
        score (q.k * scale); the lengths where `score_reads_lengths`; None = identity.
    sink(builder, b, h, seqlen_q, seqlen_k) -> f32: the row's sink logit (natural log, in the
        units of the scored logits), which joins the softmax denominator of every row of
        query head h of sequence b; None = no sink.
    classify(builder, b, h, q_lo, q_hi, kv_lo, kv_hi, seqlen_q, seqlen_k, q_rows=None,
        kv_rows=None, ops=None, extents=None, cells=True, q_tile=None) -> (may_be_true: i1,
        always_true: i1) over the inclusive index box (`q_rows`, `kv_rows`: its rows and
        keys from q_lo and kv_lo at most, constants, where the caller knows them; `ops`: the
        analysis's IR backend, `mhadsl.analysis.classify.IrOps`; `extents`: the sequence's,
        as the mask's; `cells` False: without the call's tile classes where it reads them;
        `q_tile`: `block_classes.lookup`'s);
        None = every tile may be true and is full (for `mask=None`) or partial (with a mask).
    derivative(builder, s, b, h, q_idx, kv_idx[, ...]) -> f32: d score / d s at the scaled score `s`
        (the backward pass's; `codegen.kernel.backward_hooks`); None = no score rule.
    kv_limits(builder, b, h, q_idx, seqlen_q, seqlen_k) -> (first kept key or None, last
        kept key or None) of the row, i32, where the mask keeps one run of keys per row
        (`mhadsl.analysis.kv_limits`: causal, a sliding window); None = any other mask.
    scatter_reads(builder, pairs, b, h[, seqlen_q, seqlen_k]): the share of the gradients of
        the f32 tensors the score rule reads (`Layout.operand_grads`) of this thread's pairs
        of one tile, each (dz, s, q_idx, kv_idx): dz (the gradient of the pair's scored
        logit) times d score / d the element each read picks, at the scaled score `s`, added
        into that element where the read lies inside its tensor (`codegen.kernel`); every
        lane of the warp calls it; None = the build adds no operand's gradient.
    All index arguments are i32 values: q_idx and kv_idx count from the start of the sequence.
    operands: the parameters of the declaration's operands (`mhadsl.abi.operand_params`),
        which every kernel of the build takes after its design's own (`kernel_abi`): the
        hooks read them from the kernel's arguments.
    positions: an operand has a `queries` or `keys` axis; then mask, score, derivative, the
        read hooks and sink take `extents=` (the sequence's first query row, query rows,
        first key, keys: `blocks.TileRules`), where such an axis is read.
    """

    mask: Callable | None = None
    score: Callable | None = None
    classify: Callable | None = None
    classify_loads: bool = False  # classify loads (a call's tile classes): ask it early
    mask_uses_head: bool = False  # the mask reads `h` (its tile classes differ per head)
    score_reads_lengths: bool = False  # the score reads seqlen_q or seqlen_k
    sink: Callable | None = None
    derivative: Callable | None = None
    kv_limits: Callable | None = None
    operands: tuple[Param, ...] = ()
    positions: bool = False
    scatter_reads: Callable | None = None

    def kernel_abi(self, abi: KernelABI) -> KernelABI:
        """The parameters of a design's kernel that applies these hooks: its own, then the
        operands'."""
        return with_operands(abi, self.operands)


@dataclass
class TileSeq:
    """What a work loop hands the tile body per work tile (the scheduler's SeqInfo): i32."""

    seq_len: ir.Value
    start_of_seq: ir.Value
    prompt_offset: ir.Value
    head_idx: ir.Value
    prompt_idx: ir.Value
    # with `KernelArgs.advance_in_tile`: the scheduler step, which the tile takes once, as
    # early as it likes (the loop takes it after the tile where the tile did not)
    advance: Callable[[ir.IRBuilder], None] | None = None


class KernelArgs:
    """The kernel's parameters as IR values (an attribute per parameter name), handed to
    the work loop with the build's config. The loop sets `persistent` when a CTA runs many
    tiles; `opaque_env` asks it to rederive the scheduler's inputs per step; `divergent_roles`
    says the kernel runs the loop once per role branch (warp specialisation), so its CTA-wide
    barriers must not be `.aligned`; `handoff` (`codegen.handoff.Handoff`), which side of
    the handoff this role's loop is where the scheduler lets the roles run apart. The loop
    sets `counts_exits` where its scheduler takes work from the queue counter: then the
    kernel's threads count themselves out (`work_loop.count_exit`), the last resetting the
    counter for the next launch; a kernel whose scheduler never reads it skips the count,
    which lengthens every CTA's tail. In a
    traced build (`mhadsl trace`) thread `trace_thread` records the loop's work items; None:
    this loop records none (another role's loop does). `zero_after_none`: the scheduler's
    last advance (`return none`) stores a zero SeqInfo, so no register of the last tile's
    SeqInfo stays live across a tile body (what register-bound builds need); False leaves it
    undefined, where ptxas then allocates better (the decode build). `advance_in_tile`: the
    tile takes the scheduler step itself (`TileSeq.advance`), and the loop counts the CTA's
    exit where the step finds no more work (`work_loop.emit_work_loop`), not after the loop."""

    def __init__(self, fn: ir.Function, abi: KernelABI, config: object,
                 opaque_env: bool = False, divergent_roles: bool = False,
                 trace_thread: int | None = 0, handoff=None, zero_after_none: bool = True,
                 advance_in_tile: bool = False):
        self.function, self.config, self.opaque_env = fn, config, opaque_env
        self.divergent_roles, self.handoff = divergent_roles, handoff
        self.zero_after_none = zero_after_none
        self.advance_in_tile = advance_in_tile
        self.trace_thread = trace_thread
        self.persistent = False
        self.counts_exits = True  # (a loop that is not a scheduler's: count, to be safe)
        for p, arg in zip(abi, fn.args):
            setattr(self, p.name, arg)

    def __getitem__(self, name: str) -> ir.Value:
        return getattr(self, name)


# work_loop(builder, args: KernelArgs, body) calls body(builder, TileSeq) once per work tile.
WorkLoop = Callable[[ir.IRBuilder, KernelArgs, Callable], None]


@dataclass(frozen=True)
class KernelSource:
    """What a declaration gives a backend: its hooks, and the scheduler's work loop for a
    tile height and GQA group (the config's `block_m` and `gqa_group`; `search_ways`: a
    ragged launch's tile index search, `RaggedIndex.search`); `trace`: the loop
    records its work items (`mhadsl trace`), and a design may record more (decode: its
    combines); `scheduler`: which scheduler that loop runs."""

    hooks: ExprHooks
    work_loop: Callable[..., WorkLoop]  # (tile_m, gqa_group, search_ways = 2)
    trace: bool = False
    scheduler: tuple[str, tuple] = ("", ())  # the scheduler's (name, arguments)


@dataclass(frozen=True)
class KernelBuild:
    backend: str
    arch: str
    llvm: str
    ptx: str
    assembled: Assembled | None  # None when no ptxas is at hand
    config: object  # the backend's config the build settled on
    cached: bool = False  # loaded from the on-disk cache rather than generated

    @functools.cached_property
    def grid_dependent(self) -> bool:
        return hopper.waits_for_prior_grids(self.ptx)


class Backend(ABC):
    """One attention kernel design. Its configs are frozen dataclasses with at least
    `block_m` (query rows per work tile: the scheduler's tile height)."""

    name: str
    workload: str = "prefill"  # which calls it runs (`Layout.workload`)
    targets: tuple[str, ...]  # arches it builds for
    abi: KernelABI  # the kernel's parameters, in order, for the kernel and the host alike
    config_type: type
    # whether a producer takes each next work index a work tile ahead of the consumers,
    # where the scheduler lets its roles run apart (`handoff.runs_apart`): its queue
    # atomics are then off the consumers' path (the simulator charges them nothing)
    producer_ahead: bool = False

    @abstractmethod
    def problems(self, options, arch: str) -> list[Problem]:
        """Everything that keeps this design from running declaration `options`
        (`AttentionOptions`) on `arch`; empty when it can."""

    @abstractmethod
    def configs(self, options, layout: Layout) -> tuple:
        """The builds to try for the declaration and a call's layout, best first."""

    # a ragged call's scheduled kernel numbers the tiles of these row offsets (its tile index)
    tile_offsets = "cu_seqlens_q"

    @abstractmethod
    def kernels(self, config) -> tuple[KernelLaunch, ...]:
        """The kernels a call of a build of `config` runs, in launch order."""

    def scheduled(self, config) -> KernelLaunch:
        """The kernel the scheduler drives."""
        return next(k for k in self.kernels(config) if k.grid is None)

    def work_space(self, config, call: CallSizes) -> tuple[int, int, int, int]:
        """What the scheduled kernel's scheduler sees of a call (its `grid_dim`'s inputs):
        (sequences, prompt tiles of the longest, its length, heads); by default query
        tiles of query heads."""
        return (call.batch, -(-call.max_seqlen_q // config.block_m), call.max_seqlen_q,
                call.heads)

    def call_values(self, config, call: CallSizes) -> dict[str, int]:
        """The design's own `CallValue`s for a call, beyond `CallSizes.values`."""
        return {}

    def resident_ctas(self, config, call: CallSizes, num_sms: int, fit: int) -> int:
        """The scheduled kernel's CTAs a multiprocessor that a call plans for (the value of
        `ctas_per_sm`, host and device alike), of the `fit` that fit on one: all of them."""
        return fit

    def scratch(self, config, call: CallSizes) -> dict[str, int]:
        """Bytes of each scratch buffer (a `Pointer` or `Workspace` parameter the call does
        not pass) a call needs."""
        return {}

    def call_layout(self, options, layout: "Layout", call: CallSizes) -> "Layout":
        """The layout a call of `layout` with these sizes runs, where the design picks its
        build by them too (`Layout.narrow_kv`); by default `layout`."""
        return layout

    def sibling_layouts(self, options, layout: "Layout") -> tuple["Layout", ...]:
        """The other layouts `call_layout` may give calls of `layout`, loaded with it so that
        a call of new sizes never builds; by default none."""
        return ()

    def runs_layout(self, layout: "Layout") -> bool:
        """Whether the design runs a call of this layout (beyond what `problems` says of the
        declaration); a design that does not is passed over in its target's preference."""
        return True

    def scheduler_of(self, options, config) -> tuple[str, tuple]:
        """The scheduler (name, arguments) that drives a build of `config` of declaration
        `options`: the one it names for the design's workload, else that workload's
        default (`AttentionOptions.scheduler_for`)."""
        return options.scheduler_for(self.workload)

    def scheduler_shape(self, config) -> tuple[int, int]:
        """(tile height, query heads per head) of the work space the design hands its
        scheduler: by default a work tile is a query tile of a query head."""
        return config.block_m, config.gqa_group

    @abstractmethod
    def build(self, source: KernelSource, configs: tuple, target: Target) -> KernelBuild:
        """LLVM IR, PTX and (with ptxas) the cubin, from the first config that works."""


def declaration_problems(options) -> list[Problem]:
    """Empty when some backend runs the declaration on some target; else each backend's
    problems on the target where it comes closest (each message names its design, so a
    user learns what every design refuses)."""
    found = [min((b.problems(options, arch) for arch in b.targets), key=len)
             for b in backends()]
    if any(not p for p in found):
        return []
    return list({(p.settings, p.message): p for problems in found for p in problems}.values())


def ir_loop(b: ir.IRBuilder, start: ir.Value, end: ir.Value, carried: list[ir.Value], body):
    """for i in [start, end): carried = body(b, i, carried) -> (next i, carried); returns the
    final carried values."""
    fn = b.function
    pre = b.block
    hdr, blk, done = (fn.append_basic_block(f"loop.{s}") for s in ("hdr", "body", "done"))
    b.branch(hdr)
    b.position_at_end(hdr)
    i = b.phi(i32)
    i.add_incoming(start, pre)
    phis = [b.phi(v.type) for v in carried]
    for phi, v in zip(phis, carried):
        phi.add_incoming(v, pre)
    b.cbranch(b.icmp_signed("<", i, end), blk, done)
    b.position_at_end(blk)
    nxt, values = body(b, i, phis)
    latch = b.block
    i.add_incoming(nxt, latch)
    for phi, v in zip(phis, values):
        phi.add_incoming(v, latch)
    b.branch(hdr)
    b.position_at_end(done)
    return phis


class RowCopies:
    """What a config whose CTA copies `head_dim`-wide rows in 16-byte chunks, all `threads`
    threads a pass, derives (a mixin of the designs' configs)."""

    head_dim: int
    threads: int

    @property
    def row_bytes(self) -> int:
        return self.head_dim * warp.ELEMENT_BYTES

    @property
    def chunks_per_row(self) -> int:
        return self.head_dim // 8

    @property
    def rows_per_pass(self) -> int:
        """Rows one CTA-wide pass of 16-byte copies covers."""
        return self.threads // self.chunks_per_row


def masked_unless(b: ir.IRBuilder, always: ir.Value, values: list[ir.Value],
                  mask: Callable[[ir.IRBuilder], list[ir.Value]]) -> list[ir.Value]:
    """`values` where `always` (the classification proves every pair of the tile kept),
    else `mask(b)` (the values masked, in the same order): the per-element mask runs on
    partial tiles only, and the two meet in phis. (Also any other values computed only
    where a condition does not hold: `WorkTile`'s KV range.)"""
    before = b.block
    mask_bb = b.function.append_basic_block("kv.mask")
    merged_bb = b.function.append_basic_block("kv.masked")
    b.cbranch(always, merged_bb, mask_bb)
    b.position_at_end(mask_bb)
    masked = mask(b)
    mask_end = b.block
    b.branch(merged_bb)
    b.position_at_end(merged_bb)
    return warp.merge(b, values, before, masked, mask_end)


def rename_new_functions(module: ir.Module, before: set[str], suffix: str) -> None:
    """Give the functions a work loop just emitted another name, so the second role's loop
    (warp specialisation: `KernelArgs.divergent_roles`) can emit its own copies (shared-memory globals, such as the scheduler's index
    slots, keep theirs: both roles must use the same ones)."""
    for name in sorted(set(module.globals) - before):
        fn = module.globals[name]
        if isinstance(fn, ir.Function) and not fn.is_declaration:  # intrinsics keep theirs
            del module.globals[name]
            module.scope._useset.discard(name)  # llvmlite has no rename: free the old name
            fn.name = name + suffix
            module.globals[fn.name] = fn


def spill_free_build(backend: str, target: Target,
                     candidates: list[tuple[object, Callable[[], ir.Module]]],
                     grid_dependent: bool = True) -> KernelBuild:
    """The first candidate (config, module maker) that assembles without spills, else the
    one with the fewest; ptxas's allocation near the register cap is chaotic, so backends
    list equivalent IR shapes and fallback tiles. Without ptxas: the first, unassembled.
    `grid_dependent`: whether the kernels launch while the grid before them drains, where
    the target can (`Target.grid_dependent`)."""
    have_ptxas = find_ptxas() is not None
    best = None
    for config, make_module in candidates if have_ptxas else candidates[:1]:
        module = make_module()
        if grid_dependent:
            hopper.begin_after_prior_grids(module, target)
        ptx = emit_ptx(optimize(module, target), target)
        assembled = assemble(ptx, target.arch) if have_ptxas else None
        build = KernelBuild(backend, target.arch, str(module), ptx, assembled, config)
        spills = sum(k.spills for k in assembled.kernels.values()) if assembled else 0
        if best is None or spills < best[0]:
            best = (spills, build)
        if spills == 0:
            break
    return best[1]
