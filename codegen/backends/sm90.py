"""The Hopper (sm_90a) attention kernel: TMA + mbarrier + wgmma, warp-specialised.

A CTA has a producer warpgroup and two consumer warpgroups (three for head dim 64's 192-row
tile). The producer (`setmaxnreg.dec`) issues every copy by TMA into 128-byte-swizzled shared
memory: Q once per work tile, K and V into a ring of `stages` stages, with `full` and `empty`
mbarriers per stage for K and for V apart (the overlap of S and P V needs them released
apart). Each consumer (`setmaxnreg.inc`) owns 64 query rows and, per KV tile, computes
S = Q K^T by wgmma (Q from shared memory, or from registers: `Q_IN_REGISTERS_HEAD_DIMS`),
the online softmax in registers (log2 domain) and O += P V with P from S's accumulators. As
in FlashAttention-3, S of tile n is issued with P V of tile n-1; the consumers take no
ping-pong turns. The softmax variants are `HopperConfig` flags, each explained there.

Both roles run the scheduler's work loop, each in its own branch (so `setmaxnreg` takes
effect); where `handoff.runs_apart` allows, the producer hands each next work index over by
mbarrier (`handoff.Handoff`) and loads the next work tile while the consumers finish this
one. KV tiles the `classify` hook proves empty are never loaded; partial ones get a
per-element mask. Tensor maps are 4-D, (B, S, H, D), or (1, total, H, D) when ragged, with a
64-column (128-byte) box. O is stored by TMA per consumer warpgroup, except a ragged
sequence's partial warpgroups, which write from registers. Tiles and tuning constants:
`DEFAULT_TILES` and below (measurements: benchmarks/log/HOPPER_NOTES.md).

It stays one module: the producer and consumer warpgroups meet at one shared-memory layout
(`_Layout`) and its mbarriers, and the tuning tables choose between the kernel's variants;
apart, each part would need the others' offsets and flags.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from llvmlite import ir

from mhadsl.abi import CallSizes, KernelABI, Param, TensorMap
from mhadsl.analysis.classify import SHORT_BAND_TILES
from mhadsl.codegen import hopper, nvptx, signature, warp
from mhadsl.codegen.backends import (
    FORWARD_PARAMS, SHARED_MEMORY_LIMIT, Backend, ExprHooks, KernelArgs, KernelBuild, KernelSource,
    KernelLaunch, Layout, Problem, common_problems, ir_loop, masked_unless,
    rename_new_functions, spill_free_build,
)
from mhadsl.codegen.backends.blocks import WorkTile, last_index
from mhadsl.codegen.nvptx import SHARED, f32, i32, i64
from mhadsl.codegen.handoff import Handoff, init_handoff
from mhadsl.codegen.target import Target, new_module
from mhadsl.codegen.valid_work import WIDE_SEARCH
from mhadsl.codegen.work_loop import count_exit, init_role_votes

KERNEL_NAME = "mha_fwd_sm90"
SMEM_SYMBOL = "mha_fwd_sm90_smem"
HEAD_DIMS = (64, 128, 256)
GROUP_ROWS = 64  # query rows per consumer warpgroup (wgmma's M)
# (producer, consumer) registers per thread by consumer warpgroups: all 64K registers of the
# SM, one CTA per SM (the producer keeps what its copies and the scheduler need)
REGISTERS = {2: (40, 232), 3: (32, 160)}
BOX_COLUMNS = 64  # head-dim columns per TMA box: 128 bytes, the swizzle's row
SWIZZLE_SLACK = hopper.SWIZZLE_ATOM_BYTES  # for rounding the dynamic base up to 1024 bytes


@dataclass(frozen=True)
class HopperConfig:
    """Everything that selects a build (hashable; part of the cache key)."""

    dtype: str = "bf16"
    head_dim: int = 128
    block_m: int = 128  # 64 rows per consumer warpgroup: two (or three, head dim 64)
    block_n: int = 128
    stages: int = 2
    gqa_group: int = 1
    return_lse: bool = False
    ragged: bool = False
    q_in_registers: bool = False  # S = Q K^T with Q's A fragments in registers
    # the softmax of KV tile n held under P V of n-1 (`hopper.hold_next_wait_below`): masked
    # builds; unmasked ones hold only the rows' maxima there, the exponentials following the
    # wait (fastest measured: benchmarks/log/HOPPER_NOTES.md)
    softmax_under_pv: bool = False
    # rows keep their max until it grows by more than 2**warp.RESCALE_THRESHOLD, and a warp
    # rescales O only where one of its rows moved it (`warp.online_softmax_row`)
    lazy_rescale: bool = False
    # the KV loop carries P's packed fragments, packed right after P V's wait and fenced,
    # instead of P in f32: unfenced, LLVM sinks the packing to the next KV tile's top
    # (a phi of packs becomes a pack of phis), just before the wgmmas that take it
    carry_packed_p: bool = False
    # with `lazy_rescale`: alpha stays a log2 until P V's wait, its exponential and the old
    # sum's rescale taken under the rescale's branch (`warp.online_softmax_row`)
    defer_alpha: bool = False
    # a mask that keeps one run of keys per row (`ExprHooks.kv_limits`) masks a partial tile
    # by a bit of a per-row word a value (`warp.kept_fragment_bits`), else by its compares
    bit_mask: bool = False
    # the consumer warpgroup's index read through lane 0 (`warp.uniform`), so ptxas holds it
    # and the shared-memory descriptors made from it in uniform registers
    uniform_group: bool = False
    # a consumer warpgroup none of whose rows lies inside the sequence (a sequence's last
    # tile) only waits and arrives through the KV loop (`_ConsumerTile.drain`), leaving the
    # tensor cores and the MUFU to the others; under a mask each warpgroup classifies the KV
    # tiles over its own rows: it only waits and arrives through those past its rows' last
    # kept tile, and masks per element only the tiles partial for its rows:
    # DRAIN_IDLE_CONSUMER_GROUPS
    drain_idle_groups: bool = False

    @property
    def consumer_groups(self) -> int:
        return self.block_m // GROUP_ROWS

    @property
    def consumer_threads(self) -> int:
        return self.consumer_groups * hopper.WARPGROUP_THREADS

    @property
    def threads(self) -> int:
        return hopper.WARPGROUP_THREADS + self.consumer_threads

    @property
    def o_store_per_group(self) -> bool:
        """Whether each consumer warpgroup stores its own rows of O by TMA, with no barrier
        across warpgroups (so they keep their offset into the next work tile); not where O is
        staged over V's ring, which every consumer must have finished reading first."""
        return not self.o_over_v

    @property
    def o_box_rows(self) -> int:
        """The rows of O's TMA box: a consumer warpgroup's, or the whole tile's."""
        return GROUP_ROWS if self.o_store_per_group else self.block_m

    @property
    def boxes(self) -> int:
        return self.head_dim // BOX_COLUMNS

    @property
    def q_bytes(self) -> int:
        return self.block_m * self.head_dim * warp.ELEMENT_BYTES

    @property
    def kv_tile_bytes(self) -> int:
        return self.block_n * self.head_dim * warp.ELEMENT_BYTES

    @property
    def stages_o(self) -> bool:
        """Whether O is staged in shared memory and stored by TMA: every dense build, and a
        ragged one where O's own tile fits (its warpgroups whose 64 rows all lie inside the
        sequence store so; the others, and every row of a ragged build without the tile,
        from registers: a box would cross into the next sequence)."""
        return not self.ragged or _layout_bytes(self, own_o_bytes=self.q_bytes) <= \
            SHARED_MEMORY_LIMIT["sm_90a"]

    @property
    def o_over_v(self) -> bool:
        """Whether a dense build stages O over V's ring instead of in its own tile: only
        where its own tile would not fit in shared memory (FlashAttention-3 does the same);
        the producer then loads a work tile's first V once the previous tile's O store has
        read the staging tile. Not in ragged builds (`stages_o`)."""
        own = _layout_bytes(self, own_o_bytes=self.q_bytes)
        return (not self.ragged and own > SHARED_MEMORY_LIMIT["sm_90a"]
                and self.stages * self.kv_tile_bytes >= self.q_bytes)

    def problems(self) -> list[Problem]:
        found = common_problems(self)
        if self.head_dim not in HEAD_DIMS:
            found.append(Problem(("head_dim",), f"head_dim {self.head_dim}: the sm90 kernel "
                                                "runs head dims 64, 128 and 256"))
        if self.block_m not in (128, 192):
            found.append(Problem(("tile",), f"a tile of {self.block_m} query rows: the sm90 "
                                            "kernel's two or three consumer warpgroups take "
                                            "128 or 192"))
        elif self.block_m == 192 and self.head_dim != 64:
            found.append(Problem(("tile",), f"a tile of 192 query rows at head dim "
                                            f"{self.head_dim}: three consumer warpgroups have "
                                            "the registers for head dim 64 only"))
        if self.block_n % 16 or not 16 <= self.block_n <= 256:
            found.append(Problem(("tile",), f"the KV tile ({self.block_n}) must be a multiple "
                                            "of 16 from 16 to 256"))
        if not 1 <= self.stages <= 8:
            found.append(Problem(("stages",), f"stages = {self.stages}: the sm90 kernel takes "
                                              "1 to 8 K/V stages"))
        return found


def shared_bytes(config: HopperConfig) -> int:
    """Slack for rounding the base up to 1024 bytes, Q, the K ring, the V ring, O's own
    staging tile (dense builds, unless O is staged over V's ring), the mbarriers."""
    return _layout_bytes(config, _own_o_bytes(config))


def _layout_bytes(config: HopperConfig, own_o_bytes: int) -> int:
    return (SWIZZLE_SLACK + config.q_bytes + 2 * config.stages * config.kv_tile_bytes
            + own_o_bytes + _barrier_bytes(config))


def _own_o_bytes(config: HopperConfig) -> int:
    return config.q_bytes if config.stages_o and not config.o_over_v else 0


def _barrier_bytes(config: HopperConfig) -> int:
    return (3 + 4 * config.stages) * hopper.MBARRIER_BYTES


# The box of each map is read from here by the kernel (its copies and the bytes its barriers
# expect) and by the host (the map it encodes).
ABI = KernelABI(*FORWARD_PARAMS, *(
    Param(f"{t}_map", "tensor_map", TensorMap(t, rows, BOX_COLUMNS), meaning)
    for t, rows, meaning in (
        ("q", "block_m", "CUtensorMap over q as (B,Sq,Hq,D) (ragged: (1,total_q,Hq,D)), box (1,BM,1,64), 128-byte swizzle"),
        ("k", "block_n", "CUtensorMap over k as (B,Sk,Hkv,D) (ragged: (1,total_k,Hkv,D)), box (1,BN,1,64)"),
        ("v", "block_n", "CUtensorMap over v, as k_map"),
        ("o", "o_box_rows", "CUtensorMap over o, as q_map (a dense build stores O by it)"))))


def _copy_bytes(tensor_map: str, config: HopperConfig) -> int:
    """Bytes a tile's copies by `tensor_map` move: its box (from the ABI, as the host encodes
    it) once per 64 columns."""
    return ABI[tensor_map].binding.box_bytes(config) * config.boxes


# ============================================================================ small IR helpers
def _thread_idx(b):
    """%tid.x through an opaque asm, so nothing derived from it stays live across tiles."""
    return nvptx.opaque_special_register(b, "tid.x")


def _counted(b, slot: ir.Value) -> tuple[ir.Value, Callable]:
    """The value of an i32 counter (an alloca) and a function that bumps it."""
    value = b.load(slot, typ=i32)
    return value, lambda bb: bb.store(bb.add(value, i32(1)), slot)


class _Layout:
    """Shared-memory addresses: base rounded up to 1024 B, then Q, the K ring, the V ring,
    O's own staging tile (where it has one: `HopperConfig.o_over_v`), the mbarriers."""

    def __init__(self, config: HopperConfig, smem: ir.GlobalVariable):
        self.c, self.smem = config, smem

    def base(self, b) -> ir.Value:
        raw = hopper.shared_address(b, self.smem)
        pad = b.and_(b.sub(i32(0), raw), i32(hopper.SWIZZLE_ATOM_BYTES - 1))
        return warp.smem_ptr(b, self.smem, pad)

    def at(self, b, offset: ir.Value | int) -> ir.Value:
        offset = i32(offset) if isinstance(offset, int) else offset
        return warp.smem_ptr(b, self.base(b), offset)

    def q_box(self, b, box: int, row: int | ir.Value = 0) -> ir.Value:
        """Q's box `box` (64 columns), from row `row` (a 64-row warpgroup half)."""
        off = i32(box * self.c.block_m * hopper.SWIZZLE_BYTES)
        if isinstance(row, int):
            return self.at(b, b.add(off, i32(row * hopper.SWIZZLE_BYTES)))
        return self.at(b, b.add(off, b.mul(row, i32(hopper.SWIZZLE_BYTES))))

    def kv_tile(self, b, which: str, stage: ir.Value, extra: int = 0) -> ir.Value:
        c = self.c
        off = c.q_bytes + (c.stages * c.kv_tile_bytes if which == "v" else 0) + extra
        return self.at(b, b.add(i32(off), b.mul(stage, i32(c.kv_tile_bytes))))

    def o_box(self, b, box: int) -> ir.Value:
        """O's staging box `box` (64 columns, BM rows, swizzled as Q's): over V's ring, or
        its own tile after it."""
        c = self.c
        ring = c.q_bytes + c.stages * c.kv_tile_bytes * (1 if c.o_over_v else 2)
        return self.at(b, ring + box * c.block_m * hopper.SWIZZLE_BYTES)

    def barrier(self, b, index: ir.Value | int) -> ir.Value:
        c = self.c
        start = c.q_bytes + 2 * c.stages * c.kv_tile_bytes + _own_o_bytes(c)
        index = i32(index) if isinstance(index, int) else index
        return self.at(b, b.add(i32(start), b.mul(index, i32(hopper.MBARRIER_BYTES))))

    # barrier 0: q_full; then per stage k_full, v_full, k_empty, v_empty; then q_empty,
    # o_free (O's staging tile read by its store: `HopperConfig.o_over_v`)
    def q_full(self, b):
        return self.barrier(b, 0)

    def q_empty(self, b):
        return self.barrier(b, 1 + 4 * self.c.stages)

    def o_free(self, b):
        return self.barrier(b, 2 + 4 * self.c.stages)

    def full(self, b, which: str, stage):
        return self.barrier(b, b.add(i32(1 + "kv".index(which) * self.c.stages), stage))

    def empty(self, b, which: str, stage):
        return self.barrier(b, b.add(i32(1 + (2 + "kv".index(which)) * self.c.stages), stage))


# ============================================================================ per work tile
class _Tile(WorkTile):
    """A work tile (`WorkTile`), with its tensor-map batch and the KV loop both roles run."""

    finds_range_together = True

    def __init__(self, b, c: HopperConfig, args: KernelArgs, hooks: ExprHooks, seq):
        super().__init__(b, c, args, hooks, seq)
        self.map_batch = hopper.map_batch(c.ragged, lambda: self.bidx)

    def kv_loop(self, b, carried: list[ir.Value], step: Callable, start: ir.Value,
                end: ir.Value) -> list[ir.Value]:
        """for n over the non-empty KV tiles in [start, end): carried = step(b, n, carried);
        returns the final values of `carried` (loop-carried phis)."""
        def body(bb, n, values):
            if not self.hooks.classify_loads:
                values = step(bb, n, values)  # (before the next tile's search, in the IR too)
                return self.next_nonempty(bb, bb.add(n, i32(1)), end), values
            # a classification that loads (a call's tile classes) is asked of tile n + 1
            # before tile n's step, so its load runs under the step's GEMMs; only where
            # that tile is empty does the search wait for loads after the step
            ahead = bb.add(n, i32(1))
            ahead_may = self.may_keep(bb, ahead)
            values = step(bb, n, values)
            return masked_unless(bb, ahead_may, [ahead], lambda bm: [
                self.next_nonempty(bm, bm.add(ahead, i32(1)), end)])[0], values
        return ir_loop(b, self.next_nonempty(b, start, end), end, carried, body)


class _ConsumerTile:
    """One consumer warpgroup's KV loop over a work tile: S = Q K^T, the online softmax,
    O += P V."""

    def __init__(self, kernel: "_Kernel", b, args, t: _Tile, group, row0, col0, sl2, kv_count,
                 q_frags: list | None):
        self.k, self.c, self.mem, self.b = kernel, kernel.c, kernel.mem, b
        self.args, self.t, self.group, self.row0, self.col0 = args, t, group, row0, col0
        self.sl2, self.kv_count = sl2, kv_count
        self.q_frags = q_frags  # Q's A fragments (`HopperConfig.q_in_registers`), else None
        # the query rows the KV tiles are classified over: this warpgroup's own
        # (`drain_idle_groups` under a mask), else None for the work tile's
        self.rows = None
        if self.c.drain_idle_groups and t.hooks.classify is not None:
            q_lo = b.add(t.q0, b.shl(group, i32(6)))
            self.rows = q_lo, last_index(b, q_lo, GROUP_ROWS, t.seqlen_q)

    # -------------------------------------------------------------- building blocks
    def stage(self, bb):
        """(stage, phase, bump) of the next KV tile in the ring."""
        count, bump = _counted(bb, self.kv_count)
        stage = bb.urem(count, i32(self.c.stages))
        return stage, bb.and_(bb.udiv(count, i32(self.c.stages)), i32(1)), bump

    def issue_s(self, bb, stage):
        """S = Q K^T of `stage`, committed (not waited for)."""
        c, mem = self.c, self.mem
        steps = [divmod(32 * k, hopper.SWIZZLE_BYTES) for k in range(c.head_dim // 16)]
        q_operands = self.q_frags or hopper.smem_descriptors(
            bb, mem.q_box(bb, 0, bb.shl(self.group, i32(6))),
            [box * c.block_m * hopper.SWIZZLE_BYTES + offset for box, offset in steps])
        k_descs = hopper.smem_descriptors(
            bb, mem.kv_tile(bb, "k", stage),
            [box * c.block_n * hopper.SWIZZLE_BYTES + offset for box, offset in steps])
        s = None
        for q_operand, k_desc in zip(q_operands, k_descs):
            s = hopper.wgmma(bb, c.dtype, c.block_n, q_operand, k_desc, s)
        hopper.wgmma_commit_group(bb)
        return s

    def issue_pv(self, bb, frags, o, stage):
        """O += P V of `stage` (P: the flat list of A fragments), committed (not waited
        for)."""
        c, mem = self.c, self.mem
        frags = [frags[4 * k: 4 * k + 4] for k in range(c.block_n // 16)]
        v_descs = hopper.smem_descriptors(
            bb, mem.kv_tile(bb, "v", stage),
            [16 * k * hopper.SWIZZLE_BYTES for k in range(c.block_n // 16)],
            leading_bytes=c.block_n * hopper.SWIZZLE_BYTES)
        for k, v_desc in enumerate(v_descs):
            o = hopper.wgmma(bb, c.dtype, c.head_dim, frags[k], v_desc, o, trans_b=True)
        hopper.wgmma_commit_group(bb)
        return o

    def early_class(self, bb, n):
        """Whether every pair of KV tile n is kept, where the classification loads it (a
        call's tile classes): asked before the tile's S is issued, so the load runs under
        the wgmma instead of after its wait; None elsewhere (`_scores` asks)."""
        if not self.k.hooks.classify_loads:
            return None
        return self.t.classify(bb, n, self.rows)[1]

    def softmax(self, bb, n, s, m_old, l_old, always=None):
        """The score hook and mask on S of KV tile n (`always`: `early_class`), then the
        online softmax (log2 domain) over this thread's two rows: (P in f32, m, l, alpha)."""
        s = self.k._scores(bb, self.args, self.t, n, s, self.row0, self.col0, self.rows,
                           always)
        m_new, l_new, alpha, p = [None, None], [None, None], [None, None], list(s)
        for r in range(2):
            mine = [j for j in range(len(s)) if (j // 2) % 2 == r]
            row_p, m_new[r], l_new[r], alpha[r] = warp.online_softmax_row(
                bb, [s[j] for j in mine], m_old[r], l_old[r], self.sl2,
                warp.RESCALE_THRESHOLD if self.c.lazy_rescale else 0.0, self.c.defer_alpha)
            for j, value in zip(mine, row_p):
                p[j] = value
        return p, m_new, l_new, alpha

    def pack(self, bb, p):
        """P (f32) as the A fragments of P V, four per 16 keys."""
        return [x for k in range(len(p) // 8) for x in hopper.a_fragment(bb, self.c.dtype, p, k)]

    @staticmethod
    def row_of(j: int) -> int:
        """The row (of this thread's two) of O accumulator j."""
        return (j // 2) % 2

    def start_values(self, bb):
        zero, ninf = warp.fconst(0.0), warp.fconst(warp.NEG_INF)
        return hopper.fence_operands(bb, [zero] * hopper.accumulator_count(self.c.head_dim)), \
            [ninf, ninf], [zero, zero]

    def split(self, values):
        """(o, m, l, P fragments, alpha, the rest) from a flat list of loop-carried values."""
        n_o = hopper.accumulator_count(self.c.head_dim)
        o, m, l = values[:n_o], values[n_o:n_o + 2], values[n_o + 2:n_o + 4]
        n_p = self.c.block_n // 4
        p_end = n_o + 4 + n_p
        return o, m, l, values[n_o + 4:p_end], values[p_end:p_end + 2], values[p_end + 2:]

    def rescale_and_issue_pv(self, bb, o, alpha, frags, stage):
        """O *= alpha (the last softmax's correction), then O += P V of `stage`: the rescale
        runs under the S GEMM just issued (FlashAttention-3's order), not after the P V
        wait; the rescaled accumulators go through the wgmma fence again. A `lazy_rescale`
        build rescaled O already (`warp.rescale_where_moved`)."""
        if not self.c.lazy_rescale:
            o = hopper.fence_operands(bb, warp.rescale_rows(bb, o, alpha, self.row_of))
        hopper.wgmma_fence(bb)
        return self.issue_pv(bb, frags, o, stage)

    # -------------------------------------------------------------- the loops
    def drain(self):
        """The KV loop of a warpgroup none of whose rows lies inside the sequence: each KV
        tile's waits and arrivals in the ring's order, so the stages turn as for the others,
        with no GEMM and no softmax to share the tensor cores and the MUFU with them.
        Returns zero accumulators and sums for the epilogue (which writes no row of it)."""
        self.drain_range(*self.t.kv_range(self.b))
        return self.start_values(self.b)

    def drain_range(self, first, end):
        """The waits and arrivals alone of the KV tiles in [first, end)."""
        b, mem, t = self.b, self.mem, self.t

        def step(bb, n, carried):
            stage, phase, bump = self.stage(bb)
            for which in "kv":
                hopper.mbarrier_wait(bb, mem.full(bb, which, stage), phase)
                hopper.mbarrier_arrive(bb, mem.empty(bb, which, stage))
            bump(bb)
            return carried
        t.kv_loop(b, [], step, first, end)

    def loop(self):
        """The KV tiles, FlashAttention-3's order: S of KV tile n is issued with P V of
        tile n-1, so S(n) and P V(n-1) run back to back on the tensor cores (the last tile's
        P V follows the loop)."""
        b, mem, t = self.b, self.mem, self.t
        o0, m0, l0 = self.start_values(b)
        first, tile_end = t.kv_range(b)
        end = tile_end  # this warpgroup's: past its rows' last kept tile, it only drains
        if self.rows is not None:
            end = t.kept_end(b, first, tile_end, lambda bb, n: t.classify(bb, n, self.rows)[0])
        entry = b.block
        head_bb, done_bb = (b.function.append_basic_block(f"kv.{x}") for x in ("first", "done"))
        b.cbranch(b.icmp_signed("<", first, end), head_bb, done_bb)

        b.position_at_end(head_bb)  # the first KV tile: S and softmax alone
        always = self.early_class(b, first)
        stage, phase, bump = self.stage(b)
        hopper.mbarrier_wait(b, mem.full(b, "k", stage), phase)
        hopper.wgmma_fence(b)
        s = self.issue_s(b, stage)
        hopper.wgmma_wait_group(b, 0)
        s = hopper.fence_operands(b, s)
        hopper.mbarrier_arrive(b, mem.empty(b, "k", stage))
        p, m, l, alpha = self.softmax(b, first, s, m0, l0, always)
        frags = self.pack(b, p)
        bump(b)

        def step(bb, n, state):
            o, m_old, l_old, frags, alpha, (p_stage, p_phase) = self.split(state)
            always = self.early_class(bb, n)
            stage, phase, bump = self.stage(bb)
            hopper.mbarrier_wait(bb, mem.full(bb, "k", stage), phase)
            # V of the previous tile came with its K, long ago; waiting for it here keeps
            # both GEMMs in one block (a wait between them gets C7519)
            hopper.mbarrier_wait(bb, mem.full(bb, "v", p_stage), p_phase)
            flat = hopper.fence_operands(bb, o + frags)
            o, frags = flat[:len(o)], flat[len(o):]
            hopper.wgmma_fence(bb)
            s = self.issue_s(bb, stage)
            o = self.rescale_and_issue_pv(bb, o, alpha, frags, p_stage)
            hopper.wgmma_wait_group(bb, 1)
            s = hopper.fence_operands(bb, s)
            hopper.mbarrier_arrive(bb, mem.empty(bb, "k", stage))
            p, m_new, l_new, alpha = self.softmax(bb, n, s, m_old, l_old, always)
            # unheld, ptxas hoists P V's wait above the whole softmax
            hopper.hold_next_wait_below(bb, l_new if self.c.softmax_under_pv else m_new)
            hopper.wgmma_wait_group(bb, 0)
            # P is packed after the wait: packing it while the last P's fragments are in
            # flight serialises the wgmmas (C7513)
            flat = hopper.fence_operands(bb, o + p)
            o, frags = flat[:len(o)], self.pack(bb, flat[len(o):])
            if self.c.carry_packed_p:
                frags = hopper.fence_operands(bb, frags)
            hopper.mbarrier_arrive(bb, mem.empty(bb, "v", p_stage))
            if self.c.defer_alpha:  # the old sums rescaled with O (l_new: this tile's sums)
                n_o = len(o)
                flat = warp.rescale_where_moved(
                    bb, o + l_old, alpha, lambda j: self.row_of(j) if j < n_o else j - n_o,
                    exponent=True)
                o = hopper.fence_operands(bb, flat[:n_o])
                l_new = [bb.fadd(old, tile) for old, tile in zip(flat[n_o:], l_new)]
            elif self.c.lazy_rescale:  # the rescale, after P V's wait and rarely taken
                o = hopper.fence_operands(bb, warp.rescale_where_moved(bb, o, alpha,
                                                                       self.row_of))
            bump(bb)
            return o + m_new + l_new + frags + alpha + [stage, phase]

        after = t.kv_loop(b, o0 + m + l + frags + alpha + [stage, phase], step,
                          b.add(first, i32(1)), end)
        o, m, l, frags, alpha, (p_stage, p_phase) = self.split(after)
        hopper.mbarrier_wait(b, mem.full(b, "v", p_stage), p_phase)  # the last tile's P V
        flat = hopper.fence_operands(b, o + frags)
        o, frags = flat[:len(o)], flat[len(o):]
        o = self.rescale_and_issue_pv(b, o, alpha, frags, p_stage)
        hopper.wgmma_wait_group(b, 0)
        o = hopper.fence_operands(b, o)
        hopper.mbarrier_arrive(b, mem.empty(b, "v", p_stage))
        last = b.block
        b.branch(done_bb)

        b.position_at_end(done_bb)
        merged = warp.merge(b, o0 + m0 + l0, entry, o + m + l, last)
        if self.rows is not None:  # the tiles past this warpgroup's rows' last kept one
            self.drain_range(end, tile_end)
        return merged[:len(o)], merged[len(o):len(o) + 2], merged[len(o) + 2:]


class _Kernel:
    def __init__(self, config: HopperConfig, hooks: ExprHooks, fn: ir.Function,
                 smem: ir.GlobalVariable):
        self.c, self.hooks, self.fn = config, hooks, fn
        self.mem = _Layout(config, smem)

    # ------------------------------------------------------------------ producer
    def producer_tile(self, b, args: KernelArgs, kv_count: ir.Value, tile_count: ir.Value,
                      seq) -> None:
        with b.if_then(b.icmp_unsigned("<", _thread_idx(b), i32(32))):
            # the warp's lanes meet before they search its KV range together: under a
            # scheduler with no barrier in its advance, the other lanes would otherwise run
            # work tiles ahead of the first, still loading, and share its ballots
            warp.sync_lanes(b)
            t = _Tile(b, self.c, args, self.hooks, seq)
            kv_range = t.kv_range(b)
            with b.if_then(b.icmp_unsigned("==", _thread_idx(b), i32(0))):
                self._producer_loads(b, args, t, kv_range, kv_count, tile_count)

    def _producer_loads(self, b, args: KernelArgs, t: _Tile, kv_range: tuple,
                        kv_count: ir.Value, tile_count: ir.Value) -> None:
        """Q, then K and V of each non-empty KV tile in `kv_range`, by TMA (the producer's
        first thread)."""
        c, mem = self.c, self.mem
        q_map, k_map, v_map = (hopper.tensor_map_address(b, args[n])
                               for n in ("q_map", "k_map", "v_map"))
        # the consumers' last S of the previous work tile has read Q (the producer may be
        # a work tile ahead of them: `handoff.Handoff`)
        loaded, bump_loaded = _counted(b, tile_count)
        previous_parity = b.xor(b.and_(loaded, i32(1)), i32(1))
        hopper.mbarrier_wait(b, mem.q_empty(b), previous_parity)
        bump_loaded(b)
        q_full = mem.q_full(b)
        hopper.mbarrier_arrive_expect_tx(b, q_full, _copy_bytes("q_map", c))
        row = b.add(t.q_start, t.q0)
        for box in range(c.boxes):
            hopper.tma_load(b, mem.q_box(b, box), q_map,
                            [t.map_batch, row, t.h, i32(box * BOX_COLUMNS)], q_full)

        def load(bb, n, carried):
            count, bump = _counted(bb, kv_count)
            stage = bb.urem(count, i32(c.stages))
            phase = bb.and_(bb.udiv(count, i32(c.stages)), i32(1))
            kv_row = bb.add(t.k_start, bb.mul(n, i32(c.block_n)))
            for which, tmap in (("k", k_map), ("v", v_map)):
                # the previous tile's O has left V's ring (at once after the first V)
                if which == "v" and c.o_over_v:
                    hopper.mbarrier_wait(bb, mem.o_free(bb), previous_parity)
                hopper.mbarrier_wait(bb, mem.empty(bb, which, stage), bb.xor(phase, i32(1)))
                bar = mem.full(bb, which, stage)
                hopper.mbarrier_arrive_expect_tx(bb, bar, _copy_bytes(f"{which}_map", c))
                for box in range(c.boxes):
                    dst = mem.kv_tile(bb, which, stage, box * c.block_n * hopper.SWIZZLE_BYTES)
                    hopper.tma_load(bb, dst, tmap,
                                    [t.map_batch, kv_row, t.hk, i32(box * BOX_COLUMNS)], bar)
            bump(bb)
            return []
        t.kv_loop(b, [], load, *kv_range)

    # ------------------------------------------------------------------ consumers
    def consumer_tile(self, b, args: KernelArgs, kv_count: ir.Value, tile_count: ir.Value,
                      seq) -> None:
        c, mem, hooks = self.c, self.mem, self.hooks
        t = _Tile(b, c, args, hooks, seq)
        tid = _thread_idx(b)
        group = b.sub(b.lshr(tid, i32(7)), i32(1))  # consumer warpgroup: rows 64 group..
        if c.uniform_group:
            group = warp.uniform(b, group)
        thread = b.and_(tid, i32(hopper.WARPGROUP_THREADS - 1))
        lane = b.and_(thread, i32(31))
        # this thread's two rows within the tile (accumulator rows r = 0, 1)
        row0 = b.add(b.shl(group, i32(6)),
                     b.add(b.shl(b.lshr(thread, i32(5)), i32(4)), b.lshr(lane, i32(2))))
        col0 = b.shl(b.and_(lane, i32(3)), i32(1))

        tiles, bump_tiles = _counted(b, tile_count)
        hopper.mbarrier_wait(b, mem.q_full(b), b.and_(tiles, i32(1)))
        bump_tiles(b)

        sl2 = t.rules.scale_log2(b, args.softmax_scale)
        q_frags = None
        if c.q_in_registers:  # Q's tile may take the next work tile's rows at once
            q_frags = self._q_fragments(b, group, thread)
            hopper.mbarrier_arrive(b, mem.q_empty(b))
        tile = _ConsumerTile(self, b, args, t, group, row0, col0, sl2, kv_count, q_frags)
        if c.drain_idle_groups:  # (the branch through lane 0: ptxas sees it uniform, so the
            # wgmmas under it stay uniform)
            has_rows = warp.uniform_flag(
                b, b.icmp_signed(">", b.sub(t.seqlen_q, t.q0), b.shl(group, i32(6))))
            flat = warp.either(b, has_rows, lambda bb: sum(tile.loop(), []),
                               lambda bb: sum(tile.drain(), []))
            n_o = hopper.accumulator_count(c.head_dim)
            o, m, l = flat[:n_o], flat[n_o:n_o + 2], flat[n_o + 2:]
        else:
            o, m, l = tile.loop()
        if not c.q_in_registers:
            hopper.mbarrier_arrive(b, mem.q_empty(b))  # every S of this tile is done
        self._epilogue(b, args, t, o, m, l, sl2, row0, col0, group)

    def _q_fragments(self, b, group, thread) -> list[list[ir.Value]]:
        """The warpgroup's 64 Q rows as wgmma A fragments, one per 16 head-dim columns, by
        ldmatrix from the swizzled tile: lane l gives the address of row l % 8 of 8 x 8
        matrix l // 8 (rows +8 for matrices 1 and 3, columns +8 for 2 and 3), so the four
        registers are the fragment's a0..a3."""
        lane = b.and_(thread, i32(31))
        matrix = b.lshr(lane, i32(3))
        warp_row = b.add(b.shl(group, i32(6)), b.shl(b.lshr(thread, i32(5)), i32(4)))
        row = b.add(warp_row, b.add(b.shl(b.and_(matrix, i32(1)), i32(3)), b.and_(lane, i32(7))))
        frags = []
        for k in range(self.c.head_dim // 16):
            box, first_chunk = divmod(2 * k, hopper.SWIZZLE_BYTES // 16)
            chunk = b.add(i32(first_chunk), b.lshr(matrix, i32(1)))
            offset = b.shl(warp.swizzle_chunk(b, chunk, row), i32(4))
            frags.append(warp.ldmatrix_x4(b, warp.smem_ptr(b, self.mem.q_box(b, box, row),
                                                           offset)))
        return frags

    def _scores(self, b, args, t: _Tile, n, s, row0, col0, rows=None, always=None):
        """The score hook, then the mask on tiles partial for the query rows `rows` (the
        work tile's where None; a branch; S merges in phis); `always`: whether the tile is
        full, where the caller asked already."""
        hooks, c = self.hooks, self.c
        kv_base = b.mul(n, i32(c.block_n))

        def q_idx(j):
            return b.add(t.q0, b.add(row0, i32(8 * ((j // 2) % 2))))

        def kv_idx(j):
            return b.add(kv_base, b.add(col0, i32(8 * (j // 4) + j % 2)))

        if hooks.score is not None:
            s = [t.scored(b, b.fmul(v, args.softmax_scale), q_idx(j), kv_idx(j))
                 for j, v in enumerate(s)]
        if always is None:
            _, always = t.classify(b, n, rows)
        if hooks.kv_limits is not None and c.bit_mask:  # a run of keys a row: mask and bounds
            def by_limits(bb):  # (value j: row (j // 2) % 2, fragment index 2 (j // 4) + j % 2)
                rows = [warp.kept_fragment_bits(bb, *t.row_keys(
                    bb, bb.add(t.q0, bb.add(row0, i32(8 * r))), bb.add(kv_base, col0)),
                    c.block_n // 4) for r in range(2)]
                return [warp.keep_bit(bb, v, rows[(j // 2) % 2], 2 * (j // 4) + j % 2)
                        for j, v in enumerate(s)]
            return masked_unless(b, always, s, by_limits)
        if hooks.mask is None:  # a tile past the sequence's end: its bounds alone
            return masked_unless(b, always, s, lambda bb: [
                t.masked(bb, v, q_idx(j), kv_idx(j)) for j, v in enumerate(s)])
        # the mask on partial tiles, the sequence's bounds apart on its last tile only (one
        # compare and select an element fewer on the diagonal's tiles)
        s = masked_unless(b, always, s, lambda bb: [
            t.masked(bb, v, q_idx(j), kv_idx(j), bounds=False) for j, v in enumerate(s)])
        return masked_unless(b, t.in_bounds(b, n), s, lambda bb: [
            t.masked(bb, v, q_idx(j), kv_idx(j), mask=False) for j, v in enumerate(s)])

    def _store_o_by_tma(self, b, args, t: _Tile, o, invs, row0, col0, group):
        """O / l into the staging tile (128-byte swizzle, as TMA reads it), then one TMA
        store per 64-column box by the storer: each consumer warpgroup's first thread for its
        own rows (`o_store_per_group`), else the first consumer thread for the whole tile. The
        storer first waits until its previous store has read the tile (`bulk_wait_group_read`)."""
        c, mem = self.c, self.mem
        per_group = c.o_store_per_group
        if per_group:  # a named barrier per warpgroup (ids from CONSUMER_EPILOGUE_BARRIER)
            lead = b.shl(b.add(group, i32(1)), i32(7))
            barrier = b.add(group, i32(nvptx.CONSUMER_EPILOGUE_BARRIER))
            threads = hopper.WARPGROUP_THREADS
        else:
            lead, barrier = i32(hopper.WARPGROUP_THREADS), nvptx.CONSUMER_EPILOGUE_BARRIER
            threads = c.consumer_threads
        storer = b.icmp_unsigned("==", _thread_idx(b), lead)
        with b.if_then(storer):
            hopper.bulk_wait_group_read(b, 0)
        nvptx.barrier_named(b, barrier, threads)
        for r in range(2):
            row = b.add(row0, i32(8 * r))
            swizzle = b.and_(row, i32(7))
            for jb in range(c.head_dim // 8):
                box, chunk = divmod(jb, hopper.SWIZZLE_BYTES // 16)
                j = 4 * jb + 2 * r
                value = warp.pack2(b, c.dtype, b.fmul(o[j], invs[r]), b.fmul(o[j + 1], invs[r]))
                offset = b.add(b.mul(row, i32(hopper.SWIZZLE_BYTES)),
                               b.add(b.shl(b.xor(i32(chunk), swizzle), i32(4)),
                                     b.shl(col0, i32(1))))
                warp.store(b, value, warp.smem_ptr(b, mem.o_box(b, box), offset), align=4)
        hopper.fence_proxy_async(b)
        nvptx.barrier_named(b, barrier, threads)
        with b.if_then(storer):
            o_map = hopper.tensor_map_address(b, args["o_map"])
            for box in range(c.boxes):
                src, row = mem.o_box(b, box), b.add(t.q_start, t.q0)
                if per_group:  # its warpgroup's 64 rows of the box
                    first = b.shl(group, i32(6))
                    src = warp.smem_ptr(b, src, b.mul(first, i32(hopper.SWIZZLE_BYTES)))
                    row = b.add(row, first)
                hopper.tma_store(b, o_map, [t.map_batch, row, t.h, i32(box * BOX_COLUMNS)], src)
            hopper.bulk_commit_group(b)
            if c.o_over_v:  # V's ring is the producer's again once the store has read it
                hopper.bulk_wait_group_read(b, 0)
                hopper.mbarrier_arrive(b, mem.o_free(b))

    def _store_o_row(self, b, args, t: _Tile, o, inv, r, row, col0):
        """This thread's part of O / l's row `row` (accumulator row r), from registers."""
        c = self.c
        seq_row = b.sext(b.add(t.q_start, b.add(t.q0, row)), i64)
        base = b.add(b.add(b.mul(b.sext(t.bidx, i64), args.o_stride_batch),
                           b.mul(seq_row, args.o_stride_row)),
                     b.mul(b.sext(t.h, i64), args.o_stride_head))
        base = b.add(base, b.zext(col0, i64))
        for jb in range(c.head_dim // 8):
            j = 4 * jb + 2 * r
            value = warp.pack2(b, c.dtype, b.fmul(o[j], inv), b.fmul(o[j + 1], inv))
            ptr = b.gep(args.o, [b.add(base, i64(8 * jb))], inbounds=True,
                        source_etype=nvptx.i16)
            warp.store(b, value, ptr, align=4)

    def _epilogue(self, b, args, t: _Tile, o, m, l, sl2, row0, col0, group):
        """O / l to global memory (rows inside the sequence only) and the LSE. O is staged in
        shared memory and stored by TMA (`HopperConfig.stages_o`; rows past the tensor are
        not written), so the consumers hand the store to the copy engine and go on; in a
        ragged build only by warpgroups whose rows all lie inside the sequence (a box would
        cross into the next sequence's rows): the others store from registers."""
        c = self.c
        rows_q = b.sub(t.seqlen_q, t.q0)
        lane_col = b.and_(_thread_idx(b), i32(3))
        sink = t.rules.sink_log2(b, t.h)
        invs, lses = zip(*(t.rules.finish_row(b, m[r], sl2, l[r], sink) for r in range(2)))
        rows = [b.add(row0, i32(8 * r)) for r in range(2)]
        inside = [b.icmp_signed("<", row, rows_q) for row in rows]

        def by_registers():
            for r in range(2):
                with b.if_then(inside[r]):
                    self._store_o_row(b, args, t, o, invs[r], r, rows[r], col0)
        if not c.ragged:
            self._store_o_by_tma(b, args, t, o, invs, row0, col0, group)
        elif not c.stages_o:
            by_registers()
        else:  # uniform over the warpgroup, as the store's named barrier needs; read
            # through lane 0, as ptxas otherwise takes the branch for divergent and keeps the
            # KV ring's counters in vector registers from then on (every later KV loop then
            # reconverges at its branches and moves wgmma operands to uniform registers)
            group_inside = warp.uniform_flag(
                b, b.icmp_signed(">=", rows_q, b.shl(b.add(group, i32(1)), i32(6))))
            with b.if_else(group_inside) as (by_tma, by_rows):
                with by_tma:
                    self._store_o_by_tma(b, args, t, o, invs, row0, col0, group)
                with by_rows:
                    by_registers()
        if not c.return_lse:
            return
        for r in range(2):
            with b.if_then(b.and_(inside[r], b.icmp_unsigned("==", lane_col, i32(0)))):
                val = lses[r]()
                off = b.add(b.add(b.mul(b.sext(t.bidx, i64), args.lse_stride_batch),
                                  b.mul(b.sext(t.h, i64), args.lse_stride_head)),
                            b.sext(b.add(t.q_start, b.add(t.q0, rows[r])), i64))
                b.store(val, b.gep(args.lse, [off], inbounds=True, source_etype=f32),
                        align=4)


# ============================================================================ module
def build_module(config: HopperConfig, hooks: ExprHooks | None, target: Target,
                 work_loop: Callable) -> ir.Module:
    hooks = hooks or ExprHooks()
    role_threads = (hopper.WARPGROUP_THREADS, config.consumer_threads)  # producer, consumers
    producer_registers, consumer_registers = REGISTERS[config.consumer_groups]
    module = new_module(f"mha_sm90_{config.dtype}_d{config.head_dim}", target)
    # (one CTA a multiprocessor: a register cap at entry, as setmaxnreg needs)
    fn, params = signature.kernel(module, hooks.kernel_abi(ABI), KERNEL_NAME, config.threads,
                                  1)
    smem = ir.GlobalVariable(module, ir.ArrayType(nvptx.i8, 0), SMEM_SYMBOL, addrspace=SHARED)
    smem.linkage = "external"
    smem.align = 128  # rounded up to 1024 at run time (see _Layout.base)
    kernel = _Kernel(config, hooks, fn, smem)
    mem = kernel.mem

    b = ir.IRBuilder(fn.append_basic_block("entry"))
    kv_count = b.alloca(i32, name="kv_count")
    tile_count = b.alloca(i32, name="tile_count")
    b.store(i32(0), kv_count)
    b.store(i32(0), tile_count)
    tid = nvptx.special_register(b, "thread_idx", "x")
    with b.if_then(b.icmp_unsigned("==", tid, i32(0))):
        for name in ("q_map", "k_map", "v_map"):
            hopper.prefetch_tensor_map(b, hopper.tensor_map_address(b, params[name]))
    with b.if_then(b.icmp_unsigned("==", tid, i32(0))):
        hopper.mbarrier_init(b, mem.q_full(b), 1)
        hopper.mbarrier_init(b, mem.q_empty(b), config.consumer_threads)
        hopper.mbarrier_init(b, mem.o_free(b), 1)
        init_handoff(b, *role_threads)
        init_role_votes(b)  # (the roles' first vote: `work_loop.divergent_vote`)
        for stage in range(config.stages):
            for which in "kv":
                hopper.mbarrier_init(b, mem.full(b, which, i32(stage)), 1)
                hopper.mbarrier_init(b, mem.empty(b, which, i32(stage)),
                                     config.consumer_threads)
        hopper.fence_mbarrier_init(b)
    nvptx.barrier_all(b)
    is_producer = b.icmp_unsigned("<", tid, i32(hopper.WARPGROUP_THREADS))
    with b.if_else(is_producer) as (producer, consumer):
        with producer:
            hopper.setmaxnreg(b, producer_registers, increase=False)
            args = KernelArgs(fn, ABI, config, opaque_env=True,
                              divergent_roles=True, trace_thread=None,  # consumers record
                              handoff=Handoff("producer", *role_threads))
            before = set(module.globals)
            work_loop(b, args, lambda bb, seq: kernel.producer_tile(bb, args, kv_count,
                                                                     tile_count, seq))
            rename_new_functions(module, before, ".producer")
        with consumer:
            hopper.setmaxnreg(b, consumer_registers, increase=True)
            cargs = KernelArgs(fn, ABI, config, opaque_env=True,
                               divergent_roles=True, trace_thread=hopper.WARPGROUP_THREADS,
                               handoff=Handoff("consumer", *role_threads))
            work_loop(b, cargs, lambda bb, seq: kernel.consumer_tile(bb, cargs, kv_count,
                                                                      tile_count, seq))
            if config.stages_o:  # the last O stores have read their tile before the exit
                if config.o_store_per_group:  # each warpgroup's first thread
                    storer = b.icmp_unsigned(
                        "==", b.and_(tid, i32(hopper.WARPGROUP_THREADS - 1)), i32(0))
                else:
                    storer = b.icmp_unsigned("==", tid, i32(hopper.WARPGROUP_THREADS))
                with b.if_then(storer):
                    hopper.bulk_wait_group_read(b, 0)
    if cargs.counts_exits:
        count_exit(b, params["queue"])
    b.ret_void()
    return module


# ============================================================================ the backend
# The tiles (query rows, KV keys) a declaration without `tile` tries, best first, until one
# assembles without spills: fastest measured on the H200 (benchmarks/log/BENCHMARKS_LOG.md).
# Head dim 64 runs three consumer warpgroups on 192 rows where that stays spill-free; a plain
# ragged build's O store from registers leaves no room for them at 160 registers. Head dim
# 256 holds 128 O accumulators per thread, which leaves room for an 80-key S tile at the
# 40/232 register split; a dense build then stages O over V's ring, as its own tile would
# not fit.
DEFAULT_TILES = {64: ((192, 128), (192, 112), (128, 128), (128, 64)),
                 128: ((128, 128), (128, 64)),
                 256: ((128, 80), (128, 64), (128, 48), (128, 32))}
# Tried first by a dense declaration without a mask: a wider KV tile, fewer softmax and
# barrier rounds per key. At head dim 128, 144 keys with Q in registers (160 and 176 spill):
# faster on the H200 without a mask, slower under one (benchmarks/log/BENCHMARKS_LOG.md).
UNMASKED_DENSE_TILES = {128: ((128, 144),)}
# ... for calls of at least WIDE_KV_MIN_KEYS keys: a call of fewer takes the build without
# it (`Layout.narrow_kv`), faster on the H100 by 2-9 % from 512 to 2,048 keys (at 512 and
# 1,024 keys 144-key tiles are no fewer than 128-key ones and 12.5 % of their keys lie past
# the end), slower by 2.5 % at 2,560, 1-4 % from 3,584 and 4 % at 8,192 and 16,384.
WIDE_KV_MIN_KEYS = 2560


# The head dims whose S GEMM takes Q from registers (loaded once per work tile), every tile
# tried so before any with Q from shared memory: it takes Q's reads off shared memory,
# which the S GEMM shares with K's reads and the copies in flight, and frees Q's tile for the
# next work tile's rows at once (faster on the H200 at head dim 128). Head dim 64's three
# consumer warpgroups (160 registers) and head dim 256's 128 O accumulators spill with Q's
# fragments held.
Q_IN_REGISTERS_HEAD_DIMS = (128,)

# A mask whose mid-sequence query tiles visit at most SHORT_BAND_TILES KV tiles of 128 keys
# (a sliding window: `AttentionOptions.kv_band`) gets BAND_STAGES K/V stages where they fit:
# with so few KV tiles per work tile the producer's lead into the next work tile is what
# hides its loads. 3 stages: fastest measured on the H200 for a 256-key window (a causal
# mask keeps 2).
BAND_STAGES = 3
# Head dims whose K/V tiles are small enough for more stages beside Q and O (head dim 64:
# 32 KiB a stage), and how many: 4 stages, fastest measured on the H200 (5 are no faster).
DEEP_STAGES = {64: 4}
# `lazy_rescale`: a row keeps its running max until a tile's scores exceed it by more than
# 2**warp.RESCALE_THRESHOLD (P then stays below 256, which every dtype holds), so
# after a row's first tiles a warp rarely rescales its O accumulators: the softmax's
# instructions, not the MUFU's exponentials, bound the consumer (so computing some of the
# exponentials by polynomial on the FMA pipe does not pay). Each tile tries it first; plain
# D128's 128 x 144 spills with it and keeps that tile without it, which is faster than
# 128 x 128 with it.


# `carry_packed_p`: the dense unmasked builds whose KV loop carries P packed: head dim 128,
# the only one where it measured faster on the H200.
PACKED_P_UNMASKED_HEAD_DIMS = (128,)

# `defer_alpha`: the head dims whose `lazy_rescale` builds take alpha's two exponentials a
# KV tile (and the old sums' rescale) off the softmax into the rarely taken rescale. At head
# dim 64 the exponentials balance the GEMMs (a 192 x 128 tile's 24576 on the MUFU against
# its tensor work, both about 1536 cycles a tile and SM); outputs are equal to the bit.
DEFER_ALPHA_HEAD_DIMS = (64,)

# `uniform_group`: the builds whose consumers read their warpgroup's index through lane 0:
# those with three consumer warpgroups (head dim 64's 192-row tiles). Computed from the
# thread index, ptxas keeps it in vector registers, and Q's descriptors made from
# it, and each S wgmma would wait for an R2UR of its descriptor. With two warpgroups (head
# dims 128 and 256) it measured slower on the H200, so they keep the thread index.
UNIFORM_GROUP_CONSUMER_GROUPS = 3

# `drain_idle_groups`: the builds with this many consumer warpgroups (head dim 64, whose
# last query tile of a sequence of 4096 holds 64 rows of 192). With two warpgroups the
# branch and its merge cost more than an idle warpgroup saves (measured on the H200), so
# they keep none. Outputs are equal to the bit.
DRAIN_IDLE_CONSUMER_GROUPS = 3

# `bit_mask`: where a mask keeps one run of keys per row, the head dims, besides every short
# band (`SHORT_BAND_TILES`), that mask a partial tile by bits rather than compares: faster
# on the H200 only there; at head dims 128 and 256 the compares are as fast or faster.
BIT_MASK_HEAD_DIMS = (64,)


def declared_configs(options, layout: Layout = Layout()) -> tuple[HopperConfig, ...]:
    """The builds the declaration allows, best first: its tile if it declares one, else the
    default tiles of its head dim (any other head dim: the first, for `check` to reject;
    `UNMASKED_DENSE_TILES` first for a dense build without a mask), with Q in registers
    first (`Q_IN_REGISTERS_HEAD_DIMS`, in `_q_and_tiles`'s order); the stages
    are 2 unless declared, the mask is a short band (`BAND_STAGES`) or the head dim takes
    more (`DEEP_STAGES`); each build with `lazy_rescale` first (`defer_alpha` at
    `DEFER_ALPHA_HEAD_DIMS`), then without; a dense build without a mask carries P packed at
    `PACKED_P_UNMASKED_HEAD_DIMS`; the mask by bits at `BIT_MASK_HEAD_DIMS` and on short
    bands; with `UNIFORM_GROUP_CONSUMER_GROUPS` consumer warpgroups each build with
    `uniform_group` first, then without, and every one with `drain_idle_groups`
    (`DRAIN_IDLE_CONSUMER_GROUPS`); only those that fit in shared memory where any does.
    Not validated further."""
    if options.block_m is not None:
        tiles = ((options.block_m, options.block_n),)
    else:
        tiles = DEFAULT_TILES.get(options.head_dim, DEFAULT_TILES[128])
        if _wide_kv_tile(options, layout) and not layout.narrow_kv:
            tiles = UNMASKED_DENSE_TILES[options.head_dim] + tiles
        tiles = tuple((m, n) for m, n in tiles if not (layout.ragged and m > 2 * GROUP_ROWS))
    base = replace(HopperConfig(options.dtype, options.head_dim), gqa_group=layout.gqa_group,
                   return_lse=layout.return_lse, ragged=layout.ragged)
    q_choices = (True, False) if options.head_dim in Q_IN_REGISTERS_HEAD_DIMS else (False,)
    carry_packed_p = (options.mask is None and not layout.ragged
                      and options.head_dim in PACKED_P_UNMASKED_HEAD_DIMS)
    bit_mask = options.head_dim in BIT_MASK_HEAD_DIMS or _short_band(options)
    defer_alpha = options.head_dim in DEFER_ALPHA_HEAD_DIMS
    configs = tuple(replace(config, stages=stages, lazy_rescale=lazy,
                            defer_alpha=lazy and defer_alpha, uniform_group=uniform,
                            drain_idle_groups=config.consumer_groups
                            == DRAIN_IDLE_CONSUMER_GROUPS)
                    for config in (replace(base, block_m=m, block_n=n, q_in_registers=q,
                                           softmax_under_pv=options.mask is not None,
                                           carry_packed_p=carry_packed_p, bit_mask=bit_mask)
                                   for q, (m, n) in _q_and_tiles(options, q_choices, tiles))
                    for stages in _stage_choices(options, config) for lazy in (True, False)
                    for uniform in ((True, False) if config.consumer_groups
                                    == UNIFORM_GROUP_CONSUMER_GROUPS else (False,)))
    # declared stages take the default tiles they fit beside (none left: the first, for
    # `check` to reject)
    fitting = tuple(c for c in configs if shared_bytes(c) <= SHARED_MEMORY_LIMIT["sm_90a"])
    return fitting or configs


def _wide_kv_tile(options, layout: Layout) -> int | None:
    """The KV tile of `UNMASKED_DENSE_TILES` a build of this declaration and layout tries
    first, if any: a dense forward without a mask or a declared tile, where the tile fits
    in shared memory with the declared stages."""
    wide = UNMASKED_DENSE_TILES.get(options.head_dim)
    if wide and options.mask is None and options.block_m is None and not layout.ragged \
            and layout.workload == "prefill":
        (m, n), = wide
        config = replace(HopperConfig(options.dtype, options.head_dim), block_m=m, block_n=n)
        if shared_bytes(replace(config, stages=options.stages or config.stages)) <= \
                SHARED_MEMORY_LIMIT["sm_90a"]:
            return n
    return None


def _q_and_tiles(options, q_choices: tuple[bool, ...], tiles: tuple) -> list:
    """(Q in registers, tile) in the order to try: every tile with Q in registers first;
    where the declaration reads tensor operands (their reads hold registers at every
    element), each tile with Q either way before the next tile (on an H100 a relative-bias
    table's 128 x 128 tile with Q in shared memory ran 10 % faster than 128 x 64 with Q
    in registers, where 128 x 128 with Q in registers spills)."""
    if any(o.axes for o in options.operands):
        return [(q, tile) for tile in tiles for q in q_choices]
    return [(q, tile) for q in q_choices for tile in tiles]


def _short_band(options) -> bool:
    """Whether the mask is a band of at most SHORT_BAND_TILES KV tiles a query tile (a
    window)."""
    return options.kv_band is not None and options.kv_band <= SHORT_BAND_TILES


def _stage_choices(options, config: HopperConfig) -> tuple[int, ...]:
    """The declared stages; else BAND_STAGES first where the mask is a short band, else the
    head dim's DEEP_STAGES, where they fit in shared memory; then the default."""
    if options.stages is not None:
        return (options.stages,)
    first = BAND_STAGES if _short_band(options) else DEEP_STAGES.get(config.head_dim)
    if first and shared_bytes(replace(config, stages=first)) <= SHARED_MEMORY_LIMIT["sm_90a"]:
        return (first, HopperConfig.stages)
    return (HopperConfig.stages,)


def compile_kernel(source: KernelSource, configs: tuple[HopperConfig, ...],
                   target: Target) -> KernelBuild:
    """The first config that assembles without spills (else the one with the fewest)."""
    return spill_free_build(BACKEND.name, target, [
        (c, lambda c=c: build_module(c, source.hooks, target,
                                     source.work_loop(c.block_m, c.gqa_group,
                                                      search_ways=WIDE_SEARCH)))
        for c in configs])


class SM90(Backend):
    """Warp-specialised TMA + wgmma kernel for Hopper (compute capability 9.0)."""

    name = "sm90"
    targets = ("sm_90a",)
    abi = ABI
    config_type = HopperConfig
    producer_ahead = True  # `handoff.Handoff`

    def problems(self, options, arch: str) -> list[Problem]:
        config = declared_configs(options)[0]
        found = config.problems()
        if options.warps is not None and options.warps != config.threads // 32:
            found.append(Problem(("warps",), (
                f"warps = {options.warps}: the sm90 kernel runs {config.threads // 32} at "
                f"this tile (a producer and {config.consumer_groups} consumer warpgroups)")))
        if arch not in self.targets:
            found.append(Problem((), f"the sm90 kernel builds for sm_90a, not {arch}"))
        limit = SHARED_MEMORY_LIMIT.get(arch, 0)
        if not found and shared_bytes(config) > limit:
            found.append(Problem(("tile", "stages"), (
                f"the tile needs {shared_bytes(config) // 1024} KiB of shared memory; {arch} "
                f"allows {limit // 1024} KiB")))
        return found

    def configs(self, options, layout: Layout) -> tuple[HopperConfig, ...]:
        return declared_configs(options, layout)

    def call_layout(self, options, layout: Layout, call: CallSizes) -> Layout:
        if _wide_kv_tile(options, layout) and call.max_seqlen_k < WIDE_KV_MIN_KEYS:
            return replace(layout, narrow_kv=True)
        return layout

    def sibling_layouts(self, options, layout: Layout) -> tuple[Layout, ...]:
        if _wide_kv_tile(options, layout) and not layout.narrow_kv:
            return (replace(layout, narrow_kv=True),)
        return ()

    def kernels(self, config: HopperConfig) -> tuple[KernelLaunch, ...]:
        return (KernelLaunch(KERNEL_NAME, ABI, config.threads, shared_bytes(config)),)

    def build(self, source: KernelSource, configs: tuple[HopperConfig, ...],
              target: Target) -> KernelBuild:
        return compile_kernel(source, configs, target)


BACKEND = SM90()
