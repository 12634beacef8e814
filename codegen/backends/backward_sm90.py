"""The Hopper (sm_90a) backward pass: TMA + mbarrier + wgmma, warp-specialised.

The same three kernels as `codegen.backends.backward` (preprocess, main, postprocess: the
row kernels are that module's, over this design's scratch buffers, which keep one block per
query tile: the stats and dQ's accumulator below, which `_Rows` zeroes and reads 16 bytes a
thread, the postprocess through a shared tile of its rows; a split GQA group adds a fourth,
below), with a main kernel `mha_bwd` built for Hopper in FlashAttention-3's layout:

- a CTA of three warpgroups (384 threads) owns one K/V tile of `block_n` = 128 rows of one
  (batch, K/V head), handed out by the declaration's scheduler (the same work space as the
  sm80 design: `backward.scheduler_view`; a split group's: below). Warpgroup 0 is the
  producer (`setmaxnreg.dec` to 24 registers), warpgroups 1 and 2 the consumers
  (`setmaxnreg.inc` to 240); consumer g owns K/V rows 64g..64g+63. At head dim 256
  (`splits_kv_columns`) the tile has 64 rows and both consumers work on all of them,
  consumer g owning head-dim columns 128g.. of their dK and dV: 64 + 64 f32 registers a
  thread, where all 256 columns would take 256;
  of a step's S^T and dP^T it computes query columns 32g.. only (`score_columns`,
  FlashAttention-3's split), so that neither computes what the other does;
  Both roles run the scheduler's work loop, each in its own branch, and meet at each work
  tile's CTA barriers (which park its values in shared memory), never per query step;
- the producer's first warp loads K and V by TMA once per work tile (128-byte swizzle, one
  box per 64 head-dim columns), then, for each query tile (`block_m` = 64 rows; 128 at
  head dim 64, as FlashAttention-4 steps, with 64 as the fallback where that build
  spills) of every query head of the GQA group that the mask's classification does not
  prove empty, waits
  until a stage of the ring (`stages`) is empty and loads the step's Q and dO into it by
  TMA and the tile's stats block (its LSE and delta rows, which the preprocess wrote with
  zeros past the sequence) by one bulk copy, all by lane 0 on the stage's full mbarrier.
  At head dim 256 shared memory holds one stage, which the consumers free in two parts
  (`frees_stage_in_parts`): dO and the stats once dV's GEMM is done, Q once dK's is;
- per step each consumer warpgroup classifies the step's pair of tiles (full, or masked
  per element; its parked reads before the GEMMs), waits until the stage is full and
  computes by wgmma:
  S^T = K Q^T (at 128-row steps issued a step ahead, under the step before's dK GEMM:
  `s_ahead`) and dP^T = V dO^T (both operands K-major in shared memory), P^T =
  exp2(S^T scale log2e - LSE) with the score hook and the mask on partial tiles (the sm80
  design's `_probabilities`), dS^T = P^T (dP^T - delta) (with the score's derivative),
  then dV += P^T dO with P^T as the register A operand and dO as an MN-major B operand
  (the forward's P V form). dS^T goes to shared memory (16-bit, swizzled, one tile per
  step parity) and, after a named barrier of the two consumers (dQ's GEMM reads both
  warpgroups' parts of dS^T), warpgroup g issues its part of dQ (`dq_tile`:
  head-dim columns g D/2.. of a 64-row tile, query rows 64 g.. of a 128-row tile) = dS K
  (dS^T a transposed, M-major shared A operand, K an MN-major B operand; in chunks of 64
  columns, `dq_chunk`), then dK += dS^T Q (dS^T from registers). At head dim 256 a
  consumer's S^T and dP^T are m64n32 (B: Q's and dO's rows 32g.., whole swizzle atoms
  into each box), and it stores its 32 columns of P^T, to a tile of its own laid out as
  dS^T's, and of dS^T; after the barrier (every column of both is in) dV's and dK's GEMMs
  take them from shared memory as K-major A operands over all 64 query rows (dV's issued
  before dQ's, dK's after). One P^T tile suffices: a step writes it once its stage is
  full, and the producer loads the stage's dO only once every consumer thread has freed
  the step before's (`frees_stage_in_parts`), each after its warpgroup's dV GEMM, the
  tile's only reader, is done. Under dK's GEMM it stores its dQ values (the
  first chunk's) to its staging tile in register order, once the writer has freed the
  tile, computes and stores any further chunk once dK is done, and arrives on the tile's
  full barrier; once dK is done every consumer thread arrives on the stage's empty
  mbarrier. With two dS^T tiles, a consumer writes the next step's while the other still
  reads this one's. A GEMM over the head dim (S^T, dP^T) makes its descriptors 8 k-steps
  at a time (`_k_major_runs`): at head dim 256 all 32 at once spilled before the consumers
  split S^T's query columns;
- the producer's second warp, the writer, walks the same steps: it frees each staging
  tile once its last bulk reduce-add has read it, then adds each tile, once written, into
  the fp32 accumulator with one bulk reduce-add (`dq_accum_position`: the accumulator
  keeps each query tile's values in register order, and the row kernels read and zero it
  there), FlashAttention-4's schedule. The consumers never wait for a bulk copy;
- dK (times the softmax scale) and dV are stored from registers at the end of the work tile,
  16 bytes a thread after each accumulator row's quad trades its pairs (`warp.quad_transpose`)
  (a split group adds them instead: below).

dQ's reduction is what limits it. dQ is staged in shared memory under dK's GEMM and added
by the writer warp with one bulk reduce-add per tile into blocks in register order: adding
from registers (`red.global.add.v2/.v4.f32`), a consumer thread issuing the reduce-add, or a
row-major accumulator are all slower. The staging stores are the remaining cost, as they
compete for shared memory's bandwidth; a third stage does not pay (measurements:
benchmarks/log/BENCHMARKS_LOG.md).

A wide GQA group's query heads are split over CTAs (`HopperBackwardConfig.split_group`),
FlashAttention-4's way: a work tile is then one (K/V tile, query head, sequence), the
scheduler's heads the query heads (`scheduler_view`; the K/V head is h // gqa_group), and
its steps that one head's query tiles. At its end the work tile adds its dK and dV, unscaled,
into fp32 accumulators in k's layout (`kv_accum_offset`) straight from the registers, a pair
of columns per `red.global.add.v2.f32` (a quad adds a row's 32 bytes; once per work tile,
so nothing is staged, and it takes no more registers than the store); the preprocess zeroes
the accumulators (a group's query heads' CTAs share their K/V head's rows) and a fourth
kernel, `mha_bwd_kv_postprocess` (`KV_POSTPROCESS`), turns them into dK (times the softmax
scale) and dV, one CTA per tile of ROW_TILE K/V rows, K/V head and sequence, never past a
sequence's rows. The rule (`declared_config`, `splits_group`): atomic calls at head dims
64 and 128 split from SPLIT_GROUP_MIN = 6 query heads per K/V head. A work tile that walks
every query head of its group is gqa_group times one head's: at 48:8 (group 6) the longest causal
one is half an SM's average load, the schedule cannot balance, and this kernel took 2.11 ms
where FlashAttention-4's split one took 1.67 ms (B2 H48:8 S4096 D128 causal, H100), while at
32:8 (group 4) the two were level. A split costs gqa_group times the work tiles (each
loading its K/V tile) and, per element of dK and dV, an fp32 value zeroed, added into
gqa_group times and read back; a group of one never splits. In deterministic mode, whose
scheduler hands out each K/V head's longest tile last (below), a whole group makes that
tail gqa_group times longer, so it splits from DETERMINISTIC_SPLIT_GROUP_MIN = 4, and dK's
and dV's adds come in a fixed order too (`_kv_turn`): a u32 count per K/V tile (at its
first row's place among k's (row, head) pairs: `kv_row_index`, zeroed by the preprocess)
says how many of the group's query heads have added; a work tile's first consumer thread
waits until it equals the tile's place in the group, the consumers add, meet, and the
first raises it (release at GPU scope). A query head's CTAs come after the previous head's
under the ordered schedulers, so it only waits for work handed out before its own.
`benchmarks/backward_split_group.py` times both builds of the same calls (the thresholds
are monkeypatched there). A split build that spills in every IR
shape gives way to the same configs without the split (`BackwardSM90.configs`).

Deterministic mode (`BackwardConfig.deterministic`) keeps this kernel and fixes the order of
each query tile's dQ adds, FlashAttention-3's way: the stats block of a (query tile, head)
ends with a count of the K/V tiles that have added into it (zeroed by the preprocess); the
writer warp waits until the count equals this K/V tile's place (`_dq_place`: the K/V
tiles after it that the mask's classification keeps for the query tile), adds, and releases
the count once its adds are complete. Where the GQA group is split over CTAs, two writer
warps take the query steps in turn (`_write_dq_in_turn`), so one waits for its adds while
the other adds the next step's; elsewhere, and where that build spills, one writer releases
the count at its next step, after it has freed the staging tiles (`_write_dq`). (Two
writers measured +7-9 % on split groups, -4-15 % elsewhere: benchmarks/log.) Last K/V tile
first: under a causal mask those reach their first query tile first. A CTA only waits for
tiles handed out before its own where the scheduler hands out each head's K/V tiles in order
(`ORDERED_SCHEDULERS` in `ORDERED_SCHEDULES`, `adds_in_order`); under any other,
deterministic calls run the sm80-style design. Without a mask every K/V tile adds into
every query tile: a head's K/V tiles handed out together wait for one another at each one,
which the INTERLEAVED order (the unmasked default) spaces apart. A wait past
`abi.DQ_ORDER_WAIT_NS` records a fault and stops waiting.

It runs dense and ragged layouts at head dims 64, 128 and 256. Ragged tensors are mapped as the
forward's (`codegen.backends.sm90`): (1, total rows, H, D), a sequence's rows `start + row`
of batch 0 (`hopper.map_batch`). A box that crosses a sequence's end holds the next
sequence's rows where a dense build's holds zeros: the keys there are masked as the dense
tail's are (P^T = 0), the query rows get P^T = 0 (-inf in the stats) and zero delta,
and no gradient row past the end is written, so those rows add exact zeros as long as they
hold finite values (0 * inf is NaN inside a GEMM; the forward's ragged build shares this).

It stays one module: the main kernel's roles (producer, consumers, writer) meet at one
shared-memory layout (`_offsets`) and one set of barriers, which dividing it would spread
over several files.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from llvmlite import ir

from mhadsl import abi
from mhadsl.abi import CallSizes, KernelABI, Param, Pointer, TensorMap
from mhadsl.codegen import faults, hopper, nvptx, warp
from mhadsl.codegen.assemble import find_ptxas
from mhadsl.codegen.backends import (
    SHARED_MEMORY_LIMIT, ExprHooks, KernelArgs, KernelBuild, KernelSource, KernelLaunch,
    Layout, Problem, common_problems, ir_loop, rename_new_functions, spill_free_build,
)
from mhadsl.codegen.backends import backward as sm80
from mhadsl.codegen.backends.backward import (
    MAIN, POSTPROCESS, PREPROCESS, ROW_THREADS, ROW_TILE, WORK_TILE_FIELDS, BackwardConfig,
    _emit_postprocess, _emit_preprocess, _gep, _lse_offset, _Lanes, _MainKernel, _parked,
    _RowKernel, _TileKernel,
)
from mhadsl.codegen.backends.blocks import sequence_rows
from mhadsl.codegen.nvptx import SHARED, f32, i32, i64
from mhadsl.codegen.work_loop import count_exit, role_vote_flags
from mhadsl.codegen.target import Target

SMEM_SYMBOL = "mha_bwd_sm90_smem"
HEAD_DIMS = (64, 128, 256)
GROUP_ROWS = 64  # K/V rows per warpgroup (wgmma's M)
WIDE_HEAD_DIM = 256  # where the consumers share their K/V rows and split dK's, dV's columns
STATS = ("neg_lse", "delta")  # a query tile's stats block's rows, in order
WRITER_WARP = 1  # the producer warpgroup's warp that adds dQ into the accumulator
DQ_PARTIES = hopper.WARPGROUP_THREADS + 32  # a dQ staging tile's barriers: warpgroup, writer
BOX_COLUMNS = 64  # head-dim columns per TMA box: 128 bytes, the swizzle's row
# k-steps of a head-dim GEMM (S^T, dP^T) whose descriptors are made together (`_k_major_runs`)
DESCRIPTOR_RUN = 8
SW = hopper.SWIZZLE_BYTES
SWIZZLE_SLACK = hopper.SWIZZLE_ATOM_BYTES
# (producer, consumer) registers per thread after setmaxnreg: 24 + 2 x 240 of the 512 per
# thread of a warpgroup of one CTA per SM
REGISTERS = (24, 240)
# deterministic mode's second choice: its writer warp also counts its K/V tile's place and
# waits on the query tile's count, which spills at 24 registers under a mask that reads the
# lengths (bottom-right causal)
WRITER_REGISTERS = (40, 232)
# query heads per K/V head from which an atomic build splits the group's query heads over
# CTAs (`HopperBackwardConfig.split_group`, chosen by `declared_config`; the module's
# docstring says why)
SPLIT_GROUP_MIN = 6
# the same in deterministic mode, whose scheduler hands out each K/V head's longest tile
# last (`_dq_place`): a whole group's makes that tail gqa_group times longer
DETERMINISTIC_SPLIT_GROUP_MIN = 4
# the kernel of a split group that turns its dK and dV accumulators into dK and dV
KV_POSTPROCESS = "mha_bwd_kv_postprocess"


@dataclass(frozen=True)
class HopperBackwardConfig(BackwardConfig):
    """A build of the Hopper backward (the sm80 config's fields; `num_warps` counts the
    consumers' warps)."""

    block_m: int = 64
    block_n: int = 128
    num_warps: int = 8
    stages: int = 2
    # dP^T's GEMM issued with S^T's, P^T computed under it; without, after P^T (fewer live
    # registers: a score rule's G beside P^T)
    overlap_dp: bool = True
    registers: tuple[int, int] = REGISTERS  # (producer, consumer) after setmaxnreg
    # a work tile is one query head's share of a K/V tile: the scheduler's heads are query
    # heads, and dK and dV are added into fp32 accumulators that `KV_POSTPROCESS` converts
    # (gqa_group > 1; deterministic mode adds them in the group's order: `_kv_turn`)
    split_group: bool = False
    # the producer's warps that add dQ: a deterministic split group's first choice is two,
    # taking the query steps in turn, so one waits for its adds to complete (and releases
    # their count) while the other adds the next step's (`_write_dq_in_turn`)
    dq_writers: int = 1

    @property
    def s_ahead(self) -> bool:
        """Whether a step's S^T = K Q^T is issued a step ahead, under the step before's dK
        GEMM, so that the tensor pipe has it queued across the step boundary: only at 128-row
        steps (head dim 64), where it measured faster; at 64-row steps it is slower, as the
        step waits for it with the -LSE read early already in its registers."""
        return self.block_m == 2 * GROUP_ROWS

    @property
    def threads(self) -> int:
        return hopper.WARPGROUP_THREADS + 32 * self.num_warps  # the producer, the consumers

    @property
    def boxes(self) -> int:
        return self.head_dim // BOX_COLUMNS

    @property
    def splits_kv_columns(self) -> bool:
        """Whether both consumer warpgroups work on the same GROUP_ROWS K/V rows, warpgroup
        g owning head-dim columns g D/2.. of their dK and dV (`kv_columns`): at head dim 256,
        where 64 rows x D of both in fp32 would take 256 registers a thread. Else warpgroup
        g owns K/V rows 64 g.. and every column of theirs."""
        return self.block_n == GROUP_ROWS

    @property
    def score_columns(self) -> int:
        """Query columns of a step's S^T and dP^T (and so P^T, dS^T) that one consumer
        warpgroup computes (their wgmmas' N): where the warpgroups share their K/V rows
        (`splits_kv_columns`) warpgroup g computes columns g block_m / 2.. (FlashAttention-3's
        head dim 256 split: neither computes what the other does), else all of them, for
        its own K/V rows."""
        return self.block_m // 2 if self.splits_kv_columns else self.block_m

    @property
    def kv_columns(self) -> int:
        """Head-dim columns of dK and dV that one consumer warpgroup accumulates."""
        return self.head_dim // 2 if self.splits_kv_columns else self.head_dim

    @property
    def tiles_per_warp(self) -> int:
        """16-row m-tiles of K/V rows per consumer warp: a quarter of its warpgroup's 64
        (wgmma's M), whether or not the warpgroups share them."""
        return GROUP_ROWS // 4 // 16

    @property
    def frees_stage_in_parts(self) -> bool:
        """Whether the consumers free a stage's dO and stats once dV's GEMM is done and its
        Q once dK's is, each part on an empty mbarrier of its own: with one stage (head dim
        256) the producer then loads the next step's dO, and its Q, under the step's last
        GEMMs, where it would wait for the whole step."""
        return self.stages == 1

    @property
    def empty_barriers(self) -> int:
        """A stage's empty mbarriers (`frees_stage_in_parts`)."""
        return 2 if self.frees_stage_in_parts else 1

    @property
    def dq_chunk(self) -> int:
        """dQ's columns per GEMM (wgmma's N): a warpgroup's part (`dq_tile`) in chunks of a
        TMA box of K at most, each chunk's 32 accumulators staged before the next is
        computed (a part of 128 columns at once would hold 64 beside dK and dV)."""
        return min(self.dq_tile[1], BOX_COLUMNS)

    @property
    def dq_chunks(self) -> int:
        return self.dq_tile[1] // self.dq_chunk

    @property
    def dq_tile(self) -> tuple[int, int]:
        """(rows, columns) of a query tile's dQ that one consumer warpgroup computes: the
        tile's columns split in two at 64 query rows, its rows at 128 (FlashAttention-4's
        head dim 64 tile)."""
        if self.block_m == 2 * GROUP_ROWS:
            return GROUP_ROWS, self.head_dim
        return self.block_m, self.head_dim // 2

    def dq_origin(self, group: int) -> tuple[int, int]:
        """(row, column) of warpgroup `group`'s part of a query tile's dQ."""
        rows, cols = self.dq_tile
        return (group * rows, 0) if rows < self.block_m else (0, group * cols)

    @property
    def stats_bytes(self) -> int:
        """A query tile's stats block (`STATS`, block_m floats each)."""
        return 4 * len(STATS) * self.block_m

    @property
    def block_floats(self) -> int:
        """Floats from one block of the stats buffer to the next: the stats, and in
        deterministic mode the block's dQ count (a u32, padded to 16 bytes)."""
        return len(STATS) * self.block_m + (4 if self.deterministic else 0)

    @property
    def accumulates_dq(self) -> bool:
        return True  # (deterministic mode too, in a fixed order: `_HopperMain._write_dq`)

    @property
    def kv_bytes(self) -> int:
        return self.block_n * self.row_bytes

    @property
    def q_bytes(self) -> int:
        return self.block_m * self.row_bytes

    def problems(self) -> list[Problem]:
        found = common_problems(self)
        if self.head_dim not in HEAD_DIMS:
            found.append(Problem(("head_dim",), (
                f"the sm90 backward runs head_dim {', '.join(map(str, HEAD_DIMS))}, not "
                f"{self.head_dim}")))
        if (self.block_m not in (64, 128) or self.block_n != kv_tile_rows(self.head_dim)
                or self.num_warps != 8 or (self.block_m == 128 and self.head_dim != 64)):
            found.append(Problem(("tile",), "the sm90 backward steps 64 query rows (128 at head "
                                            "dim 64) over K/V tiles of 128 rows (64 at head "
                                            "dim 256) with two consumer warpgroups"))
        if self.split_group and self.gqa_group == 1:
            found.append(Problem(("split_group",), "the sm90 backward splits a GQA group's "
                                                   "query heads over CTAs only where there "
                                                   "are more than one per K/V head"))
        if self.dq_writers not in (1, 2) or (self.dq_writers == 2 and not self.deterministic):
            found.append(Problem(("dq_writers",), "the sm90 backward adds dQ with one writer "
                                                  "warp, or two in deterministic mode"))
        if self.splits_kv_columns and self.stages != 1:
            # its one P^T tile is race-free through the one stage's empty mbarrier (`_offsets`)
            found.append(Problem(("stages",), "the sm90 backward has one stage at head dim 256"))
        if self.s_ahead and self.stages < 2:
            # a step issues the next one's S^T while it still holds its own stage
            found.append(Problem(("stages",), "the sm90 backward's ring has at least 2 stages "
                                              "at 128 query rows"))
        if not found and shared_bytes(self) > SHARED_MEMORY_LIMIT["sm_90a"]:
            found.append(Problem(("stages",), (
                f"the sm90 backward's {self.stages} stages need {shared_bytes(self)} bytes of "
                f"shared memory; a CTA has {SHARED_MEMORY_LIMIT['sm_90a']}")))
        return found


def kv_tile_rows(head_dim: int) -> int:
    """K/V rows of a work tile: a warpgroup's each, or at head dim 256 one set shared by
    both (`splits_kv_columns`)."""
    return GROUP_ROWS if head_dim == WIDE_HEAD_DIM else 2 * GROUP_ROWS


# shared memory, from the base rounded up to 1024 bytes
def _offsets(c: HopperBackwardConfig) -> dict[str, int]:
    k = 0
    v = k + c.kv_bytes
    stage0 = v + c.kv_bytes
    stage_bytes = 2 * c.q_bytes  # Q, dO
    ds = stage0 + c.stages * stage_bytes
    ds_bytes = c.block_n * c.block_m * 2
    p = ds + 2 * ds_bytes  # dS^T: a tile per step parity
    # P^T's tile, where the warpgroups split the query columns (`score_columns`): one, as
    # a step writes it only after its stage is full, which the producer loads only once
    # both warpgroups' dV GEMMs of the step before, its only readers, are done and they
    # freed dO (`frees_stage_in_parts`, one stage)
    p_bytes = ds_bytes if c.splits_kv_columns else 0
    stats = p + p_bytes
    dq = stats + c.stages * c.stats_bytes  # per stage: the tile's stats block
    dq_bytes = 4 * c.block_m * c.head_dim  # dQ's staging tile: a part per warpgroup
    bars = dq + dq_bytes
    # K/V's mbarrier; per stage full, empty (`empty_barriers`); deterministic mode: each
    # writer's count to release once its adds are complete (`_write_dq`,
    # `_write_dq_in_turn`; in shared memory, as the producer's registers are few)
    counts = bars + (1 + (1 + c.empty_barriers) * c.stages) * hopper.MBARRIER_BYTES
    end = counts + (8 * c.dq_writers if c.deterministic else 0)
    return dict(k=k, v=v, stage0=stage0, stage_bytes=stage_bytes, ds=ds, ds_bytes=ds_bytes,
                p=p, p_bytes=p_bytes, stats=stats, dq=dq, dq_bytes=dq_bytes, bars=bars,
                counts=counts, end=end)


def shared_bytes(config: HopperBackwardConfig) -> int:
    return SWIZZLE_SLACK + _offsets(config)["end"]


# ============================================================================ per query tile
# Two scratch buffers hold one block per (query tile of block_m rows, query head), blocks
# ordered (tile, head); a sequence's tiles start at block row (start + b block_m) // block_m,
# ragged, or b ceil(Sq / block_m), dense, so no two sequences share a tile:
# - dQ's fp32 accumulator (`dq_accum`): block_m x D values in the consumers' register order,
#   which makes a warpgroup's half one contiguous run (`dq_accum_position`);
# - the stats (`delta`): the tile's -LSE log2(e) (from the forward's LSE; -inf where a row
#   keeps no key and past the sequence, so P = 0 there without a test per element) then its
#   delta (zero past the sequence), block_m floats each: one bulk copy per query step.
def dq_accum_position(config: HopperBackwardConfig, row: int, col: int) -> int:
    """The float of (row, col) of a query tile within its block: part g (`dq_tile`,
    `dq_origin`) is warpgroup g's, and accumulator j of its thread t
    (`hopper.accumulator_position`) sits at 4 (128 (j // 4) + t) + j % 4 of the part."""
    rows, cols = config.dq_tile
    g = row // rows + col // cols  # (one of the two is 0)
    r, c = row % rows, col % cols
    t = 32 * (r // 16) + 4 * (r % 8) + (c % 8) // 2
    return g * rows * cols + 4 * (hopper.WARPGROUP_THREADS * (c // 8) + t) \
        + 2 * ((r % 16) // 8) + c % 2


def dq_chunk_vector(config: HopperBackwardConfig, chunk: int, k: int) -> int:
    """The place among a thread's 16-byte vectors of its warpgroup's part of dQ (the
    staging tile's and the accumulator block's: `dq_accum_position`) of vector k
    (accumulators 4k..4k+3) of its chunk `chunk` (`dq_chunk`): the chunks' accumulators
    follow one another, as one wgmma over the part's columns would hold them."""
    return chunk * hopper.accumulator_count(config.dq_chunk) // 4 + k


def ds_slices(config: HopperBackwardConfig, group: int) -> range:
    """The 16-column slices of the step's query columns of dS^T (and P^T) that warpgroup
    `group` computes and stores (for its K/V rows): all of them, or where the warpgroups
    share their K/V rows (`splits_kv_columns`) its half (`score_columns`)."""
    slices = config.block_m // 16
    if not config.splits_kv_columns:
        return range(slices)
    return range(group * slices // 2, (group + 1) * slices // 2)


def own_column(b, config: HopperBackwardConfig, group) -> ir.Value:
    """The first head-dim column of warpgroup `group`'s dK and dV (`kv_columns`; `group`
    an i32, or a callable giving it where it is needed)."""
    if not config.splits_kv_columns:
        return i32(0)
    return b.mul(group() if callable(group) else group, i32(config.kv_columns))


def own_column_byte(b, config: HopperBackwardConfig, group, rows: int) -> ir.Value:
    """Byte offset of warpgroup `group`'s first dK and dV column (`own_column`) in a tile
    of `rows` rows in TMA boxes: Q's and dO's, the B operands of its dK and dV GEMMs."""
    if not config.splits_kv_columns:
        return i32(0)
    return b.mul(group, i32(config.kv_columns // BOX_COLUMNS * rows * SW))


def score_row_byte(b, config: HopperBackwardConfig, group) -> ir.Value:
    """Byte offset in Q's and dO's tiles (TMA boxes of block_m rows) of warpgroup `group`'s
    first query row of S^T and dP^T, where the warpgroups split them (`score_columns`): as
    many 128-byte rows into each box, a whole number of the swizzle's 8-row atoms, so that
    the K-major B operands of its GEMMs start there as at a box's first row."""
    return b.mul(group, i32(config.score_columns * SW))


def dq_column_byte(b, config: HopperBackwardConfig, group, chunk: int) -> ir.Value:
    """Byte offset in K's tile (TMA boxes of block_n rows) of the first column of chunk
    `chunk` of warpgroup `group`'s part of dQ (`dq_origin`, `dq_chunk`), the B operand of
    its dQ GEMM: the chunk's box of the part's columns (every column where the parts split
    the tile's rows), or at head dim 64 and 64 query rows half a box (64 bytes into each
    swizzled row, as a K-major slice starts 32 k bytes in)."""
    rows, cols = config.dq_tile
    box = config.block_n * SW
    if rows < config.block_m:
        return i32(chunk * box)
    if cols < BOX_COLUMNS:
        return b.mul(group, i32(cols * 2))
    return b.add(b.mul(group, i32(cols // BOX_COLUMNS * box)), i32(chunk * box))


def _block(b, config: HopperBackwardConfig, args, bidx, start, row, head) -> ir.Value:
    """The block (i64) of query row `row` of sequence bidx (its rows from `start` of all
    when ragged) and query head `head`."""
    bm = config.block_m
    if config.ragged:
        first = b.udiv(b.add(start, b.mul(bidx, i32(bm))), i32(bm))
    else:
        first = b.mul(bidx, b.udiv(b.add(args.seqlen_q, i32(bm - 1)), i32(bm)))
    tile = b.add(first, b.udiv(row, i32(bm)))
    return b.add(b.mul(b.zext(tile, i64), b.zext(args.num_heads, i64)), b.zext(head, i64))


def _accum_offset(b, config: HopperBackwardConfig, args, bidx, start, row, head,
                  col) -> ir.Value:
    """The float offset (i64) of dQ's (row, head, col) of sequence bidx: its block, then
    `dq_accum_position`. Columns col and col + 1 (col even) are adjacent, and a part's
    origin (`dq_origin`) begins that warpgroup's run."""
    bm = config.block_m
    rows, cols = config.dq_tile
    in_tile = b.urem(row, i32(bm))
    g = b.add(b.udiv(in_tile, i32(rows)), b.udiv(col, i32(cols)))
    r, c = b.urem(in_tile, i32(rows)), b.urem(col, i32(cols))
    r16 = b.and_(r, i32(15))
    t = b.add(b.add(b.shl(b.lshr(r, i32(4)), i32(5)), b.shl(b.and_(r16, i32(7)), i32(2))),
              b.lshr(b.and_(c, i32(7)), i32(1)))
    within = b.add(b.mul(g, i32(rows * cols)),
                   b.add(b.shl(b.add(b.mul(b.lshr(c, i32(3)), i32(hopper.WARPGROUP_THREADS)),
                                     t), i32(2)),
                         b.add(b.shl(b.lshr(r16, i32(3)), i32(1)), b.and_(c, i32(1)))))
    block = _block(b, config, args, bidx, start, row, head)
    return b.add(b.mul(block, i64(bm * config.head_dim)), b.zext(within, i64))


def _stats_offset(b, config: HopperBackwardConfig, args, bidx, start, row, head,
                  which: str) -> ir.Value:
    """The float offset (i64) of query row `row`'s LSE or delta (`which`); at a tile's first
    row, its LSE begins the block's bulk copy."""
    bm = config.block_m
    block = _block(b, config, args, bidx, start, row, head)
    first = b.mul(block, i64(config.block_floats))
    return b.add(first, b.zext(b.add(b.urem(row, i32(bm)), i32(STATS.index(which) * bm)), i64))


def _count_offset(b, config: HopperBackwardConfig, args, bidx, start, row, head) -> ir.Value:
    """The word offset (i64) of the dQ count of query row `row`'s block (deterministic mode):
    how many K/V tiles have added their dQ into the block's accumulator, which the
    preprocess zeroes."""
    block = _block(b, config, args, bidx, start, row, head)
    return b.add(b.mul(block, i64(config.block_floats)), i64(len(STATS) * config.block_m))


def vector_origin(b, config: HopperBackwardConfig, thread, i: int) -> tuple[ir.Value, ir.Value]:
    """(row, column) within a row CTA's run of the accumulator (`_Rows`) of the first value
    of row-kernel thread `thread`'s 4-float vector i, which holds (row, column), (row,
    column + 1) and the same of row + 8 (`dq_accum_position`): the run's parts (`dq_tile`)
    split its columns, and the vector is accumulators 4 j..4 j + 3 of warpgroup thread
    `thread` in its part."""
    cols = config.dq_tile[1]
    part, j = divmod(i, cols // 8)
    row, col = hopper.accumulator_row_col(b, thread, 4 * j)
    return row, b.add(col, i32(part * cols))


class _Rows(_RowKernel):
    """The row kernels over this design's scratch buffers (per query tile)."""

    def _tile_end(self, b) -> ir.Value:
        """The end of the sequence's last query tile: the blocks a step reads whole."""
        bm = self.c.block_m
        return b.mul(b.udiv(b.add(self.seqlen, i32(bm - 1)), i32(bm)), i32(bm))

    def store_delta(self, b, row, valid, delta) -> None:
        """Row `row`'s stats (by the row's first lane) up to the end of its tile (a bulk
        copy reads whole tiles): -LSE log2(e) (`_neg_lse`: -inf past the sequence) and
        delta (zero past it)."""
        with b.if_then(b.and_(b.icmp_signed("<", row, self._tile_end(b)),
                              b.icmp_unsigned("==", self.chunk, i32(0)))):
            def forward_lse(b):
                off = _lse_offset(b, self.a, self.bidx, self.h, b.add(self.start, row))
                return [b.load(_gep(b, self.a.lse, off, f32), typ=f32)]
            (lse,) = warp.guarded(b, valid, forward_lse, [warp.fconst(0.0)])
            neg_lse = _TileKernel._neg_lse(b, lse, row, self.seqlen)
            for which, value in zip(STATS, (neg_lse, b.select(valid, delta, warp.fconst(0.0)))):
                off = _stats_offset(b, self.c, self.a, self.bidx, self.start, row, self.h,
                                    which)
                b.store(value, _gep(b, self.a.delta, off, f32), align=4)
            if self.c.deterministic:  # a tile's first row zeroes its dQ count
                with b.if_then(b.icmp_unsigned("==", b.urem(row, i32(self.c.block_m)), i32(0))):
                    off = _count_offset(b, self.c, self.a, self.bidx, self.start, row, self.h)
                    b.store(i32(0), _gep(b, self.a.delta, off, i32), align=4)

    # A row CTA's ROW_TILE rows are one contiguous run of the accumulator (a block, or the
    # part of one that a warpgroup computes: `dq_tile`), in register order; its 128 threads
    # (a warpgroup's count) walk it 16 bytes each: thread t's vector i holds accumulators
    # 4i..4i+3 of warpgroup thread t, rows r and r + 8 at columns c and c + 1
    # (`dq_accum_position`, `vector_origin`).
    def _run(self, b) -> tuple[ir.Value, ir.Value]:
        """(the CTA's first row, the float offset (i64) of its run)."""
        assert self.c.dq_tile[0] == ROW_TILE and ROW_THREADS == hopper.WARPGROUP_THREADS
        first = b.mul(self.tile, i32(ROW_TILE))
        return first, _accum_offset(b, self.c, self.a, self.bidx, self.start, first, self.h,
                                    i32(0))

    def _vectors(self, b, run) -> list[ir.Value]:
        """Pointers to the thread's 4-float vectors of the run, in order."""
        count = ROW_TILE * self.c.head_dim // (4 * ROW_THREADS)
        return [_gep(b, self.a.dq_accum,
                     b.add(run, b.zext(b.shl(b.add(self.tid, i32(ROW_THREADS * i)), i32(2)),
                                       i64)), f32) for i in range(count)]

    def zero_accumulator(self, b) -> None:
        """The run zeroed, up to the end of the sequence's last query tile (the bulk
        reduce-adds add whole tiles)."""
        first, run = self._run(b)
        with b.if_then(b.icmp_signed("<", first, self._tile_end(b))):
            for ptr in self._vectors(b, run):
                b.store(ir.Constant(ir.VectorType(f32, 4), [0.0] * 4), ptr, align=16)

    @staticmethod
    def staging_pitch(config: HopperBackwardConfig) -> int:
        """Bytes per row of the postprocess's shared tile of dQ (q's dtype): 16 past the
        row, so that a warp's eight rows of a vector fall on distinct banks."""
        return 2 * config.head_dim + 16

    def write_dq(self, b) -> None:
        """dQ of the CTA's rows = the accumulator times the softmax scale: each vector's two
        rows of two columns into a shared tile of the rows, then each row's 16-byte chunks
        to dQ (`_RowKernel.rows`), so that both global sides are whole lines."""
        pitch = self.staging_pitch(self.c)
        base = b.ptrtoint(b.module.get_global(SMEM_SYMBOL), i32)

        def shared(b, row_in_tile, byte):
            return b.inttoptr(b.add(base, b.add(b.mul(row_in_tile, i32(pitch)), byte)),
                              nvptx.ptr(SHARED))
        first, run = self._run(b)
        with b.if_then(b.icmp_signed("<", first, self.seqlen)):
            for i, ptr in enumerate(self._vectors(b, run)):
                part = b.load(ptr, typ=ir.VectorType(f32, 4), align=16)
                x = [b.fmul(b.extract_element(part, i32(e)), self.a.softmax_scale)
                     for e in range(4)]
                r, col = vector_origin(b, self.c, self.tid, i)
                for half in range(2):
                    b.store(warp.pack2(b, self.c.dtype, x[2 * half], x[2 * half + 1]),
                            shared(b, b.add(r, i32(8 * half)), b.shl(col, i32(1))), align=4)
        nvptx.barrier_all(b)

        def row(b, r, valid):
            with b.if_then(valid):
                chunk = b.load(shared(b, b.sub(r, first), b.shl(self.chunk, i32(4))),
                               typ=ir.VectorType(i32, 4), align=16)
                b.store(chunk, self.chunk_ptr(b, "dq", r, nvptx.i16), align=16)
        self.rows(b, row)


# ============================================================================ per K/V row
# A split group's dK and dV accumulators (`HopperBackwardConfig.split_group`) hold fp32 in
# k's layout: k's rows (B Sk dense, total_k ragged, the rows outside every sequence never
# touched), Hkv heads of head_dim floats each. The preprocess zeroes a sequence's rows, the
# main kernel adds each work tile's rows, `KV_POSTPROCESS` converts them.
def kv_row_index(b, config: HopperBackwardConfig, args, bidx, row, head) -> ir.Value:
    """The index (i64) of K/V row `row` of sequence bidx (counted from the start of all
    rows when ragged, as `_row_offset` counts) and K/V head `head` among k's (row, head)
    pairs: a deterministic split group's count of a K/V tile sits at its first row's."""
    rows = b.zext(row, i64)
    if not config.ragged:
        rows = b.add(b.mul(b.zext(bidx, i64), b.zext(args.seqlen_k, i64)), rows)
    return b.add(b.mul(rows, b.zext(args.kv_heads, i64)), b.zext(head, i64))


def kv_accum_offset(b, config: HopperBackwardConfig, args, bidx, row, head) -> ir.Value:
    """The float offset (i64) of column 0 of K/V row `row` of sequence bidx and K/V head
    `head` in dK's and dV's accumulators (`kv_row_index`)."""
    return b.mul(kv_row_index(b, config, args, bidx, row, head), i64(config.head_dim))


class _KVRows(_RowKernel):
    """The row kernels' walk over a sequence's K/V rows for a split group's accumulators
    (`kv_accum_offset`): tiles of ROW_TILE rows, a thread a 16-byte chunk of a row's 16-bit
    values (8 floats of an accumulator's), as `_RowKernel`'s."""

    def __init__(self, b, config: HopperBackwardConfig, args: KernelArgs):
        super().__init__(b, config, args)
        self.start, self.seqlen = sequence_rows(b, config.ragged, args.cu_seqlens_k,
                                                args.seqlen_k, self.bidx)

    def _vectors(self, b, name: str, head, row) -> list[ir.Value]:
        """Pointers to the thread's two 4-float vectors of row `row` of K/V head `head` in
        accumulator `name`."""
        off = kv_accum_offset(b, self.c, self.a, self.bidx, b.add(self.start, row), head)
        first = _gep(b, self.a[name], b.add(off, b.zext(b.shl(self.chunk, i32(3)), i64)), f32)
        return [first, _gep(b, first, i64(4), f32)]

    def zero_accumulators(self, b) -> None:
        """(The preprocess: a CTA per query tile x, query head h and sequence.) The CTA's
        share of its sequence's rows of K/V head h // gqa_group zeroed in both accumulators:
        row tiles x gqa_group + h % gqa_group, then every gridDim.x gqa_group-th, so that
        all of the group's CTAs share the rows; in deterministic mode the K/V tiles' counts
        too."""
        group = i32(self.c.gqa_group)
        head = b.udiv(self.h, group)
        stride = b.mul(nvptx.special_register(b, "grid_dim", "x"), group)
        tiles = b.udiv(b.add(self.seqlen, i32(ROW_TILE - 1)), i32(ROW_TILE))
        zero = ir.Constant(ir.VectorType(f32, 4), [0.0] * 4)

        def row(b, r, valid):
            with b.if_then(valid):
                for name in ("dk_accum", "dv_accum"):
                    for ptr in self._vectors(b, name, head, r):
                        b.store(zero, ptr, align=16)
                if self.c.deterministic:  # a K/V tile's first row zeroes its count
                    first = b.icmp_unsigned("==", b.urem(r, i32(self.c.block_n)), i32(0))
                    with b.if_then(b.and_(first, b.icmp_unsigned("==", self.chunk, i32(0)))):
                        index = kv_row_index(b, self.c, self.a, self.bidx,
                                             b.add(self.start, r), head)
                        b.store(i32(0), _gep(b, self.a.kv_count, index, i32), align=4)

        def body(b, tile, _):
            self.rows(b, row, tile)
            return b.add(tile, stride), []
        ir_loop(b, b.add(b.mul(self.tile, group), b.urem(self.h, group)), tiles, [], body)

    def write_kv(self, b) -> None:
        """(`KV_POSTPROCESS`: a CTA per row tile, K/V head and sequence.) dK = its
        accumulator times the softmax scale and dV = its accumulator, in k's dtype, for the
        CTA's rows of the sequence."""
        def row(b, r, valid):
            with b.if_then(valid):
                for name, scale in (("dk", self.a.softmax_scale), ("dv", None)):
                    x = []
                    for ptr in self._vectors(b, f"{name}_accum", self.h, r):
                        part = b.load(ptr, typ=ir.VectorType(f32, 4), align=16)
                        x += [b.extract_element(part, i32(e)) for e in range(4)]
                    if scale is not None:
                        x = [b.fmul(v, scale) for v in x]
                    out = warp.vector(b, [warp.pack2(b, self.c.dtype, x[2 * e], x[2 * e + 1])
                                          for e in range(4)])
                    b.store(out, self.chunk_ptr(b, name, r, nvptx.i16), align=16)
        self.rows(b, row)


# The main kernel's parameters: the tensor maps first (LLVM 22 emits a byval map `.align 128`;
# first, every one sits at a multiple of 128 bytes, where the ABI's rule puts it too), then
# the sm80 design's.
ABI = KernelABI(*(
    Param(f"{t}_map", "tensor_map", TensorMap(t, rows, BOX_COLUMNS), meaning)
    for t, rows, meaning in (
        ("q", "block_m", "CUtensorMap over q as (B,Sq,Hq,D) (ragged: (1,total_q,Hq,D)), box "
                         "(1,BM,1,64), 128-byte swizzle"),
        ("k", "block_n", "CUtensorMap over k as (B,Sk,Hkv,D) (ragged: (1,total_k,Hkv,D)), box "
                         "(1,BN,1,64)"),
        ("v", "block_n", "CUtensorMap over v, as k_map"),
        ("dout", "block_m", "CUtensorMap over dO, as q_map"))), *sm80.ABI)
# A split group's accumulators (`kv_accum_offset`): the last parameters of its preprocess,
# main kernel and `KV_POSTPROCESS` (whose others are the sm80 design's).
KV_ACCUMULATORS = tuple(
    Param(f"{t}_accum", "ptr", Pointer(f"{t}_accum"), f"fp32 {t} accumulator of a split "
          "group: k's rows (B*Sk dense, total_k ragged) x Hkv x D", align=16)
    for t in ("dk", "dv"))
# A deterministic split group's counts (`kv_row_index`), after the accumulators.
KV_COUNT = Param("kv_count", "ptr", Pointer("kv_count"), "u32 per K/V row and head of a "
                 "deterministic split group: at a K/V tile's first row, how many of the "
                 "group's query heads have added into its dK and dV", align=4)
SPLIT_ABI = KernelABI(*ABI, *KV_ACCUMULATORS)
ORDERED_SPLIT_ABI = KernelABI(*SPLIT_ABI, KV_COUNT)
KV_ROWS_ABI = KernelABI(*sm80.ABI, *KV_ACCUMULATORS)


def _split_params(config: HopperBackwardConfig) -> tuple[Param, ...]:
    """The parameters a split group adds to the preprocess and the main kernel."""
    if not config.split_group:
        return ()
    return KV_ACCUMULATORS + ((KV_COUNT,) if config.deterministic else ())


def main_abi(config: HopperBackwardConfig) -> KernelABI:
    if not config.split_group:
        return ABI
    return ORDERED_SPLIT_ABI if config.deterministic else SPLIT_ABI


def preprocess_abi(config: HopperBackwardConfig) -> KernelABI:
    abi = sm80.preprocess_abi(config)
    return KernelABI(*abi, *_split_params(config)) if config.split_group else abi


def _dq_barrier(b, first: int, group, parity: ir.Value | None) -> ir.Value:
    """The named barrier of warpgroup `group`'s dQ staging tile (DQ_FULL_BARRIER or
    DQ_EMPTY_BARRIER: `first`); with two writers, that of a query step of `parity`."""
    if parity is None:
        return b.add(group, i32(first))
    group = i32(group) if isinstance(group, int) else group
    return b.add(b.add(i32(first), group), b.mul(parity, i32(nvptx.DQ_ODD_STEPS)))


def _st_shared_v4f32(b, address: ir.Value, values: list[ir.Value]) -> None:
    b.asm(ir.FunctionType(nvptx.void, [i32] + [f32] * 4),
          "st.shared.v4.f32 [$0], {$1, $2, $3, $4};", "r,f,f,f,f,~{memory}",
          [address, *values], True)


def _st_shared_b32(b, address: ir.Value, value: ir.Value) -> None:
    b.asm(ir.FunctionType(nvptx.void, [i32, i32]), "st.shared.b32 [$0], $1;",
          "r,r,~{memory}", [address, value], True)


def _red_add_v2_f32(b, address: ir.Value, offset: int, values: list[ir.Value]) -> None:
    """`red.global.add.v2.f32` of two floats at global address `address` (i64) plus
    `offset` bytes."""
    b.asm(ir.FunctionType(nvptx.void, [i64, f32, f32]),
          f"red.global.add.v2.f32 [$0+{offset}], {{$1, $2}};", "l,f,f", [address, *values],
          True)


def _ld_shared_v2f32(b, address: ir.Value) -> list[ir.Value]:
    res = b.asm(ir.FunctionType(ir.LiteralStructType([f32, f32]), [i32]),
                "ld.shared.v2.f32 {$0, $1}, [$2];", "=f,=f,r,~{memory}", [address], True)
    return [b.extract_value(res, i) for i in range(2)]


def _hoist_allocas(fn: ir.Function) -> None:
    """Every alloca into the entry block, where SROA makes registers of it: the work loops
    emitted in the role branches leave theirs in those branches (in local memory)."""
    entry = fn.entry_basic_block
    for block in fn.blocks[1:]:
        for inst in [i for i in block.instructions if isinstance(i, ir.AllocaInstr)]:
            block.instructions.remove(inst)
            inst.parent = entry
            entry.instructions.insert(0, inst)


class _HopperMain(_MainKernel):
    """`mha_bwd` on Hopper (the module's docstring). The work tile's values are parked in
    shared memory as in the sm80 design (`backward._parked`)."""

    def __init__(self, config: HopperBackwardConfig, hooks: ExprHooks, args: KernelArgs,
                 smem: ir.GlobalVariable, scheduler: str = ""):
        _TileKernel.__init__(self, config, hooks, args, smem)
        self.scheduler = scheduler  # (named by a deterministic order fault)
        self.tile_rows = (config.block_m, config.block_n)
        self.off = _offsets(config)
        if config.split_group:
            self.work_tile_fields = WORK_TILE_FIELDS + ("hq",)

    aligned_barriers = False  # the roles meet at the work tile's barriers from their branches
    hq = _parked("hq")  # a split group's work tile's query head (`_work_tile_heads`)

    # ------------------------------------------------------------------ addresses
    def _base(self, b) -> ir.Value:
        raw = b.ptrtoint(self.smem, i32)
        return b.and_(b.add(raw, i32(SWIZZLE_SLACK - 1)), i32(-SWIZZLE_SLACK))

    def _addr(self, b, offset) -> ir.Value:
        """The 32-bit shared address `offset` (int or i32) bytes past the aligned base."""
        offset = i32(offset) if isinstance(offset, int) else offset
        return b.add(self._base(b), offset)

    def _ptr(self, b, offset) -> ir.Value:
        return b.inttoptr(self._addr(b, offset), nvptx.ptr(SHARED))

    @property
    def _reloads_base(self) -> bool:
        """Whether a head-dim GEMM makes its descriptors in several runs (`_k_major_runs`)."""
        return self.c.head_dim // 16 > DESCRIPTOR_RUN

    def _base_word(self, b) -> ir.Value:
        """The 32-bit shared address of the word holding the aligned base (`_base`), which
        thread 0 writes at the start (`_init_barriers`)."""
        return b.ptrtoint(nvptx.shared_array(b.module, "mha_bwd_sm90.base",
                                             ir.ArrayType(i32, 1)), i32)

    def _reloaded_ptr(self, b, offset) -> ir.Value:
        """`_ptr` from the base read back from shared memory where it stands
        (`nvptx.reload_shared`): ptxas cannot make what derives from it any earlier."""
        offset = i32(offset) if isinstance(offset, int) else offset
        return b.inttoptr(b.add(nvptx.reload_shared(b, self._base_word(b)), offset),
                          nvptx.ptr(SHARED))

    def _bar(self, b, index) -> ir.Value:
        """mbarrier `index`: 0 K and V's, 1 + stage a stage's full, 1 + stages + stage its
        empty (its Q's where it is freed in parts: `frees_stage_in_parts`), then 1 + 2 stages
        + stage its dO's and stats' empty."""
        index = i32(index) if isinstance(index, int) else index
        return self._ptr(b, b.add(i32(self.off["bars"]), b.mul(index, i32(8))))

    def _full(self, b, stage) -> ir.Value:
        return self._bar(b, b.add(stage, i32(1)))

    def _empty(self, b, stage) -> ir.Value:
        return self._bar(b, b.add(stage, i32(1 + self.c.stages)))

    def _dout_empty(self, b, stage) -> ir.Value:
        return self._bar(b, b.add(stage, i32(1 + 2 * self.c.stages)))

    def _stage_off(self, b, stage, which: str) -> ir.Value:
        """Offset of Q or dO ("q", "dout") of `stage`, or of one of its stats rows (`STATS`)."""
        o, c = self.off, self.c
        if which in ("q", "dout"):
            extra = 0 if which == "q" else c.q_bytes
            return b.add(i32(o["stage0"] + extra), b.mul(stage, i32(o["stage_bytes"])))
        extra = 4 * c.block_m * STATS.index(which)
        return b.add(i32(o["stats"] + extra), b.mul(stage, i32(c.stats_bytes)))

    def _map_batch(self) -> ir.Value:
        """The work tile's batch coordinate in the tensor maps."""
        return hopper.map_batch(self.c.ragged, lambda: self.bidx)

    def _tid(self, b):
        """The thread's index among the consumers' (%tid.x - 128)."""
        tid = nvptx.opaque_special_register(b, "tid.x")
        return b.sub(tid, i32(hopper.WARPGROUP_THREADS))

    @staticmethod
    def _group_thread(b, tid):
        """The index in its consumer warpgroup of consumer thread `tid` (`_tid`)."""
        return b.and_(tid, i32(hopper.WARPGROUP_THREADS - 1))

    def _lanes(self, b, tid=None) -> _Lanes:
        """The lanes of consumer thread `tid` (`_tid`; by default this thread): warp w's
        K/V rows are 16 (w mod 4).. of its warpgroup's (`_own_rows`)."""
        tid = self._tid(b) if tid is None else tid
        lanes = _Lanes(b, self.c, tid)
        if self.c.splits_kv_columns:
            lanes.warp_row = self._warp_row(b, tid)
        return lanes

    def _warp_row(self, b, tid) -> ir.Value:
        """The first K/V row of consumer thread `tid`'s warp (warps w and w + 4 share
        theirs where the warpgroups share their rows)."""
        warp_id = b.lshr(tid, i32(5))
        if self.c.splits_kv_columns:
            warp_id = b.and_(warp_id, i32(3))
        return b.shl(warp_id, i32(4))

    def _own_rows(self, b, group) -> ir.Value:
        """Byte offset in each box of K and V of warpgroup `group`'s K/V rows
        (`splits_kv_columns`: the same rows for both)."""
        if self.c.splits_kv_columns:
            return i32(0)
        return b.mul(group, i32(GROUP_ROWS * SW))

    # ------------------------------------------------------------------ the work tile
    def _work_tile_heads(self, b, head) -> dict[str, ir.Value]:
        """A split group's scheduler hands out query heads: the work tile's (`hq`) and its
        group's K/V head (`hk`)."""
        if not self.c.split_group:
            return super()._work_tile_heads(b, head)
        return dict(hk=b.udiv(head, i32(self.c.gqa_group)), hq=head)

    def _query_steps(self):
        """The work tile's steps (`_MainKernel._query_steps`): a split group's are its query
        head's query tiles."""
        if not self.c.split_group:
            return super()._query_steps()
        c = self.c

        def steps(b):
            return b.udiv(b.add(self.seqlen_q, i32(c.block_m - 1)), i32(c.block_m))

        def pair_of(b, s):
            return self.hq, b.mul(s, i32(c.block_m)), self.kv0
        return steps, pair_of

    # ------------------------------------------------------------------ the kernel
    def emit(self, b, work_loop) -> None:
        """The producer warpgroup (after `setmaxnreg.dec`) and the consumers (`inc`) each
        run the scheduler's work loop in their own branch, together at each work tile."""
        c = self.c
        self.builder = b
        self.step_count = b.alloca(i32, name="step_count")
        self.tile_count = b.alloca(i32, name="tile_count")
        b.store(i32(0), self.step_count)
        b.store(i32(0), self.tile_count)
        if c.dq_writers == 2:  # (the writers' own: the loader's runs ahead of theirs)
            self.writer_steps = b.alloca(i32, name="writer_steps")
            b.store(i32(0), self.writer_steps)
        # full: the first producer lane's expect_tx; empty: every consumer thread
        self._init_barriers(b, [1] + [1] * c.stages
                            + [2 * hopper.WARPGROUP_THREADS] * c.stages * c.empty_barriers)
        module = b.module
        tid = nvptx.special_register(b, "thread_idx", "x")
        producer_registers, consumer_registers = c.registers
        with b.if_else(b.icmp_unsigned("<", tid, i32(hopper.WARPGROUP_THREADS))) as (
                producer, consumer):
            with producer:
                hopper.setmaxnreg(b, producer_registers, increase=False)
                if c.dq_writers == 2:  # the odd writer frees the staging tiles for step 0
                    odd_writer = b.icmp_unsigned("==", b.lshr(tid, i32(5)), i32(WRITER_WARP + 1))
                    with b.if_then(odd_writer):
                        for g in range(2):
                            nvptx.barrier_arrive(b, i32(nvptx.DQ_EMPTY_BARRIER + g), DQ_PARTIES)
                args = KernelArgs(self.a.function, main_abi(c), c, opaque_env=c.opaque_env,
                                  divergent_roles=True, trace_thread=None)  # consumers record
                before = set(module.globals)
                work_loop(b, scheduler_view(args), self._producer_tile)
                rename_new_functions(module, before, ".producer")
                # dQ's last bulk reduce-adds have read the staging tiles and are done
                with b.if_then(self._writer_lane(b)):
                    hopper.bulk_wait_group(b, 0)
            with consumer:
                hopper.setmaxnreg(b, consumer_registers, increase=True)
                args = KernelArgs(self.a.function, main_abi(c), c, opaque_env=c.opaque_env,
                                  divergent_roles=True, trace_thread=hopper.WARPGROUP_THREADS)
                work_loop(b, scheduler_view(args), self._consumer_tile)
                if c.dq_writers == 2:  # the last step's writer freed the tiles for none
                    group = b.lshr(self._tid(b), i32(7))
                    parity = b.and_(b.load(self.step_count, typ=i32), i32(1))
                    nvptx.barrier_named(b, _dq_barrier(b, nvptx.DQ_EMPTY_BARRIER, group, parity),
                                        DQ_PARTIES, aligned=False)
        count_exit(b, self.a.queue)
        _hoist_allocas(b.function)

    def _init_barriers(self, b, counts: list[int]) -> None:
        """Thread 0 prefetches the tensor maps and initialises mbarrier i with counts[i]
        arrivals, by predicated instructions: a branch here would put the work loop's
        allocas outside the entry block, where they stay in local memory."""
        tid = nvptx.special_register(b, "thread_idx", "x")
        maps = [hopper.tensor_map_address(b, self.a[name])
                for name in ("q_map", "k_map", "v_map", "dout_map")]
        bars = [hopper.shared_address(b, self._bar(b, index)) for index in range(len(counts))]
        text = ["{.reg .pred p;", "setp.eq.u32 p, $0, 0;"]
        text += [f"@p prefetch.tensormap [${1 + i}];" for i in range(len(maps))]
        text += [f"@p mbarrier.init.shared::cta.b64 [${1 + len(maps) + i}], {n};"
                 for i, n in enumerate(counts)]
        # the flags of the roles' votes (`work_loop.divergent_vote`) start at zero
        votes = 1 + len(maps) + len(bars)
        text += [f"@p st.shared.u32 [${votes}], 0;", f"@p st.shared.u32 [${votes}+4], 0;"]
        words = [*bars, role_vote_flags(b)]  # (32-bit operands)
        if self._reloads_base:  # the base `_reloaded_ptr` reads back
            text += [f"@p st.shared.u32 [${votes + 1}], ${votes + 2};"]
            words += [self._base_word(b), self._base(b)]
        text += ["@p fence.mbarrier_init.release.cluster;", "}"]
        b.asm(ir.FunctionType(nvptx.void, [i32] + [i64] * len(maps) + [i32] * len(words)),
              " ".join(text), ",".join(["r"] + ["l"] * len(maps) + ["r"] * len(words)
                                       + ["~{memory}"]),
              [tid, *maps, *words], True)
        nvptx.barrier_all(b)

    def _ring_slot(self, b, count=None):
        """(the step's count, its stage, the stage's phase) in the ring, from the role's
        step counter (it runs on across work tiles), or of ring position `count`."""
        if count is None:
            count = b.load(self.step_count, typ=i32)
        stages = i32(self.c.stages)
        return count, b.urem(count, stages), b.and_(b.udiv(count, stages), i32(1))

    def _producer_tile(self, b, seq) -> None:
        """The producer's first warp: K and V of the work tile by TMA, then per query step,
        once the consumers freed its stage, Q, dO and the stats (`_load_step`). Its second
        warp, the writer, adds each step's dQ into the accumulator (`_write_dq`; in
        deterministic mode the second and third warps, a step each in turn:
        `_write_dq_in_turn`)."""
        c, a = self.c, self.a
        self._start_work_tile(b, seq)
        tid = nvptx.opaque_special_register(b, "tid.x")
        with b.if_else(b.icmp_unsigned("<", tid, i32(32))) as (loader, other):
            with loader:
                with b.if_then(b.icmp_unsigned("==", tid, i32(0))):
                    bar = self._bar(b, 0)
                    hopper.mbarrier_arrive_expect_tx(b, bar, 2 * c.kv_bytes)
                    row = b.add(self.k_start, self.kv0)
                    for which in ("k", "v"):
                        tmap = hopper.tensor_map_address(b, a[f"{which}_map"])
                        for box in range(c.boxes):
                            dst = self._ptr(b, self.off[which] + box * c.block_n * SW)
                            hopper.tma_load(b, dst, tmap,
                                            [self._map_batch(), row, self.hk,
                                             i32(box * BOX_COLUMNS)], bar)

                def load(b, pair):
                    count, stage, phase = self._ring_slot(b)
                    self._load_step(b, pair, stage, phase)
                    b.store(b.add(count, i32(1)), self.step_count)

                self._each_step(b, load)
            with other:
                with b.if_then(b.icmp_unsigned("<", tid, i32(32 * (WRITER_WARP + c.dq_writers)))):
                    if c.dq_writers == 2:
                        self._each_step(b, self._write_dq_in_turn)
                    else:
                        if c.deterministic:
                            with b.if_then(self._writer_lane(b)):
                                b.store(i64(0), self._pending_count(b))
                        self._each_step(b, lambda b, pair: self._write_dq(b, *pair()))
                        if c.deterministic:
                            self._release_pending_count(b)

    def _each_step(self, b, visit) -> None:
        """visit(b, pair) for each of the work tile's steps `_next_step` keeps (the
        consumers' loop walks the same ones); pair() gives the step's (query head, q0) where
        the visit asks for them."""
        steps_of, pair_of = self._query_steps()
        steps = steps_of(b)

        def body(b, s, _):
            visit(b, lambda: pair_of(b, s)[:2])
            return self._next_step(b, b.add(s, i32(1)), steps, pair_of), []

        ir_loop(b, self._next_step(b, i32(0), steps, pair_of), steps, [], body)

    def _load_step(self, b, pair, stage, phase) -> None:
        """The producer's first warp: once the consumers have freed `stage` (the phase of
        its empty mbarriers before `phase`; its parts in turn where they free it in parts:
        `frees_stage_in_parts`), its first lane loads Q and dO of the step's query tile
        (`pair()`: the query head, q0) by TMA, and the tile's stats block (its LSE and delta
        rows, zeros past the sequence: `STATS`) by one bulk copy, all completing on the
        stage's full mbarrier."""
        c, a = self.c, self.a
        parts = ([(("dout", "stats"), self._dout_empty(b, stage)), (("q",), self._empty(b, stage))]
                 if c.frees_stage_in_parts else [(("q", "dout", "stats"), self._empty(b, stage))])
        for first, (names, empty) in zip((True, False), parts):
            hopper.mbarrier_wait(b, empty, b.xor(phase, i32(1)))
            h, q0 = pair()
            lane = nvptx.opaque_special_register(b, "tid.x")  # (the first warp's)
            q_row = b.add(self.q_start, q0)
            full = self._full(b, stage)
            with b.if_then(b.icmp_unsigned("==", lane, i32(0))):
                if first:
                    hopper.mbarrier_arrive_expect_tx(b, full, 2 * c.q_bytes + c.stats_bytes)
                for which in names:
                    if which == "stats":
                        stats = _stats_offset(b, c, a, self.bidx, self.q_start, q0, h, STATS[0])
                        hopper.bulk_load(b, self._ptr(b, self._stage_off(b, stage, STATS[0])),
                                         _gep(b, a.delta, stats, f32), c.stats_bytes, full)
                        continue
                    tmap = hopper.tensor_map_address(b, a[f"{which}_map"])
                    base = self._stage_off(b, stage, which)
                    for box in range(c.boxes):
                        dst = self._ptr(b, b.add(base, i32(box * c.block_m * SW)))
                        hopper.tma_load(b, dst, tmap, [self._map_batch(), q_row, h,
                                                       i32(box * BOX_COLUMNS)], full)

    def _consumer_tile(self, b, seq) -> None:
        """The consumers: per query step, once its stage is full, `_step` (which frees the
        stage); dK and dV stored at the end of the work tile (added where the build splits
        its group: `_add_own`)."""
        c, a = self.c, self.a
        self._start_work_tile(b, seq)
        tiles = b.load(self.tile_count, typ=i32)
        hopper.mbarrier_wait(b, self._bar(b, 0), b.and_(tiles, i32(1)))
        b.store(b.add(tiles, i32(1)), self.tile_count)
        steps_of, pair_of = self._query_steps()
        steps = steps_of(b)

        n_acc = hopper.accumulator_count(c.kv_columns)

        def body(b, s, carried):
            count, stage, phase = self._ring_slot(b)
            nxt = self._next_step(b, b.add(s, i32(1)), steps, pair_of)

            def issue_next_s():
                return self._issue_s_ahead(b, b.icmp_signed("<", nxt, steps),
                                           b.add(count, i32(1)))

            if not c.s_ahead:
                hopper.mbarrier_wait(b, self._full(b, stage), phase)
            h, q0, _ = pair_of(b, s)
            dk, dv, s_next = self._step(
                b, h, q0, stage, list(carried[:n_acc]), list(carried[n_acc:2 * n_acc]),
                list(carried[2 * n_acc:]), b.and_(count, i32(1)),
                issue_next_s if c.s_ahead else None)
            b.store(b.add(count, i32(1)), self.step_count)
            return nxt, dk + dv + s_next

        # (dK's and dV's zeros first: none may be written while the first S^T is in flight)
        init = hopper.fence_operands(b, [warp.fconst(0.0)] * (2 * n_acc))
        first = self._next_step(b, i32(0), steps, pair_of)
        if c.s_ahead:
            init += self._issue_s_ahead(b, b.icmp_signed("<", first, steps),
                                        b.load(self.step_count, typ=i32))
        final = ir_loop(b, first, steps, init, body)
        if c.s_ahead:
            hopper.wgmma_wait_group(b, 0)  # the S^T issued past the last step, unused
        kv_row, rows_valid = b.add(self.k_start, self.kv0), b.sub(self.seqlen_k, self.kv0)
        column = own_column(b, c, lambda: b.lshr(self._tid(b), i32(7)))
        if c.split_group:  # (dK's softmax scale: `KV_POSTPROCESS`'s)
            count = self._kv_turn(b, kv_row) if c.deterministic else None
            self._add_own(b, a.dk_accum, kv_row, rows_valid, final[:n_acc], column)
            self._add_own(b, a.dv_accum, kv_row, rows_valid, final[n_acc:2 * n_acc], column)
            if count is not None:
                # every consumer's adds, then the count (`_kv_turn`)
                nvptx.barrier_named(b, nvptx.DS_BARRIER, 2 * hopper.WARPGROUP_THREADS,
                                    aligned=False)
                with b.if_then(b.icmp_unsigned("==", self._tid(b), i32(0))):
                    hopper.release_count(b, count)
        else:
            self._store_own(b, "dk", self.hk, kv_row, rows_valid, final[:n_acc],
                            a.softmax_scale, column)
            self._store_own(b, "dv", self.hk, kv_row, rows_valid, final[n_acc:2 * n_acc], None,
                            column)

    def _kv_turn(self, b, kv_row) -> ir.Value:
        """A deterministic split group's order of dK's and dV's adds into a K/V tile's
        accumulator rows: the group's query heads in turn. The first consumer thread waits
        until the tile's count (`kv_row_index` of its first row) says every query head of
        the group before this one has added (under an ordered scheduler: handed out
        before this one), then the consumers meet; returns the count, which goes up once
        they have all added."""
        c = self.c
        count = _gep(b, self.a.kv_count, kv_row_index(b, c, self.a, self.bidx, kv_row,
                                                      self.hk), i32)
        with b.if_then(b.icmp_unsigned("==", self._tid(b), i32(0))):
            self._wait_for_turn(b, count, b.urem(self.hq, i32(c.gqa_group)))
        nvptx.barrier_named(b, nvptx.DS_BARRIER, 2 * hopper.WARPGROUP_THREADS, aligned=False)
        return count

    def _add_own(self, b, accum, first_row, rows_valid, flat, first_column) -> None:
        """A split group's `_store_own`: the warp's accumulator `flat` (its rows of dK or dV,
        unscaled) added into rows first_row.. of the work tile's K/V head in the fp32
        accumulator `accum` (`kv_accum_offset`), those below rows_valid, columns
        first_column.. (an i32): a thread's two columns of an 8-column tile by one
        `red.global.add.v2.f32`, so that a quad adds a row's 32 bytes."""
        lanes = self._lanes(b)
        assert self.c.tiles_per_warp == 1
        for r in range(2):
            row = lanes.own_row(b, 0, r)
            with b.if_then(b.icmp_signed("<", row, rows_valid)):
                off = kv_accum_offset(b, self.c, self.a, self.bidx, b.add(first_row, row),
                                      self.hk)
                column = b.add(b.shl(lanes.t, i32(1)), first_column)
                address = b.ptrtoint(_gep(b, accum, b.add(off, b.zext(column, i64)), f32), i64)
                for j in range(len(flat) // 4):
                    _red_add_v2_f32(b, address, 32 * j, flat[4 * j + 2 * r: 4 * j + 2 * r + 2])

    def _columns(self, b, stage, which: str, lanes, first=None) -> list[list[ir.Value]]:
        """This thread's query columns' -LSE log2(e) or delta (`STATS`): [n-tile][e & 1],
        of its warpgroup's columns (`score_columns`) from column `first` (i32) on, or from
        0."""
        start = b.add(self._addr(b, self._stage_off(b, stage, which)), b.shl(lanes.t, i32(3)))
        if first is not None:
            start = b.add(start, b.shl(first, i32(2)))
        return [_ld_shared_v2f32(b, b.add(start, i32(32 * j)))
                for j in range(self.c.score_columns // 8)]

    def _k_major(self, rows: int, columns: int | None = None) -> list[int]:
        """Byte offsets of the 16-column slices of a K-major tile of `rows` rows and
        `columns` columns (the head dim by default), in TMA boxes of 64 columns."""
        columns = self.c.head_dim if columns is None else columns
        return [box * rows * SW + off
                for box, off in (divmod(32 * k, SW) for k in range(columns // 16))]

    def _k_major_runs(self, b, kv_off, q_off) -> list:
        """The descriptors per k-step of a head-dim GEMM (S^T = K Q^T, dP^T = V dO^T) of the
        K/V rows at `kv_off` and the query tile at `q_off` (K-major both), in runs of
        DESCRIPTOR_RUN k-steps: the first run's pairs, then per later run a callable that
        makes them where they are issued, from the base read back from shared memory
        (`_reloaded_ptr`). From one base ptxas makes all of a GEMM's descriptors before its
        first wgmma: at head dim 256, 32 of them, which spilled before the consumers split
        S^T's query columns (`score_columns`)."""
        c = self.c
        kv_slices, q_slices = self._k_major(c.block_n), self._k_major(c.block_m)

        def run(ptr, first):
            return list(zip(
                hopper.smem_descriptors(b, ptr(b, kv_off), kv_slices[first:first + DESCRIPTOR_RUN]),
                hopper.smem_descriptors(b, ptr(b, q_off), q_slices[first:first + DESCRIPTOR_RUN])))
        return [run(self._ptr, 0)] + [lambda first=first: run(self._reloaded_ptr, first)
                                      for first in range(DESCRIPTOR_RUN, len(kv_slices),
                                                         DESCRIPTOR_RUN)]

    def _k_major_gemm(self, b, runs) -> list[ir.Value]:
        """The wgmmas of a head-dim GEMM from `_k_major_runs` (m64n{score_columns})."""
        acc = None
        for run in runs:
            for kv_desc, q_desc in (run() if callable(run) else run):
                acc = hopper.wgmma(b, self.c.dtype, self.c.score_columns, kv_desc, q_desc, acc)
        return acc

    def _s_operands(self, b, own, q_off) -> list:
        """S^T = K Q^T's descriptors (`_k_major_runs`): the warpgroup's K/V rows (`own`
        bytes into K), the Q tile at `q_off`."""
        return self._k_major_runs(b, b.add(i32(self.off["k"]), own), q_off)

    def _issue_s(self, b, operands) -> list[ir.Value]:
        """S^T = K Q^T from `_s_operands` as its own wgmma group."""
        hopper.wgmma_fence(b)
        s = self._k_major_gemm(b, operands)
        hopper.wgmma_commit_group(b)
        return s

    def _issue_s_ahead(self, b, exists, count) -> list[ir.Value]:
        """S^T of the step at ring position `count`, issued a step ahead (`s_ahead`) once
        its stage is full. Where there is no such step (`exists` false) it multiplies K by
        K instead, a valid operand that is never freed under it, and nobody reads it."""
        _, stage, phase = self._ring_slot(b, count)
        with b.if_then(exists):
            hopper.mbarrier_wait(b, self._full(b, stage), phase)
        own = self._own_rows(b, b.lshr(self._tid(b), i32(7)))
        return self._issue_s(b, self._s_operands(
            b, own, b.select(exists, self._stage_off(b, stage, "q"), i32(self.off["k"]))))

    def _step(self, b, h, q0, stage, dk, dv, s, ds_buffer, issue_next_s):
        """One query tile of head h, its inputs in `stage` (full), dS^T in tile `ds_buffer`
        (the step's count, mod 2): dV, dK updated, dQ added into the accumulator; frees the
        stage. With `s_ahead`, the step's S^T is `s`, in flight, and `issue_next_s` issues
        the next step's under dK's GEMM. Returns (dK, dV, the next S^T or nothing). Where
        the warpgroups split the query columns (`score_columns`), P^T and dS^T go to shared
        memory, and dV's and dK's GEMMs read them there once both warpgroups' are in."""
        c, dt = self.c, self.c.dtype
        BM, BN = c.block_m, c.block_n
        o = self.off
        tid = self._tid(b)
        group = b.lshr(tid, i32(7))
        lanes = self._lanes(b, tid)
        kv0 = self.kv0
        split = c.splits_kv_columns
        # the warpgroup's first query column of S^T (`score_columns`)
        first = b.mul(group, i32(c.score_columns)) if split else None
        q_first = b.add(q0, first) if split else q0

        def q_idx(i, j, e):
            return b.add(q_first, lanes.step_column(b, j, e))

        def kv_idx(i, j, e):
            return b.add(kv0, lanes.own_row(b, i, e >> 1))

        # the pair of tiles classified before the GEMMs: the work tile's values it reads are
        # parked (volatile shared loads, `_parked`), which, read where P^T is computed,
        # stalled it behind S^T's wait
        always = self._classify(b, h, q0, kv0)[1]
        own = self._own_rows(b, group)
        q_off, do_off = self._stage_off(b, stage, "q"), self._stage_off(b, stage, "dout")
        s_q_off, s_do_off = q_off, do_off
        if split:  # S^T's and dP^T's B operands: the warpgroup's rows of Q and dO
            rows = score_row_byte(b, c, group)
            s_q_off, s_do_off = b.add(q_off, rows), b.add(do_off, rows)

        s_operands = None if c.s_ahead else self._s_operands(b, own, s_q_off)
        # the step's -LSE: read before its GEMMs at 64 query rows, where behind their
        # shared-memory traffic the load stalled P's first FFMA (ncu's largest consumer stall);
        # at 128 rows its registers held across the GEMMs cost more
        lse_early = BM <= 64
        neg_lse = self._columns(b, stage, "neg_lse", lanes, first) if lse_early else None
        if not c.s_ahead:
            s = self._issue_s(b, s_operands)

        def issue_dp():
            dp = self._k_major_gemm(b, self._k_major_runs(b, b.add(i32(o["v"]), own),
                                                          s_do_off))
            hopper.wgmma_commit_group(b)
            return dp

        if c.s_ahead:
            # a wait for all groups: ptxas cannot follow a group count across the loop's
            # back edge (it serialises the wgmmas, C7514)
            hopper.wgmma_wait_group(b, 0)
            s = hopper.fence_operands(b, s)
            if c.overlap_dp:
                hopper.wgmma_fence(b)
                dp = issue_dp()
        else:
            if c.overlap_dp:
                dp = issue_dp()
                hopper.wgmma_wait_group(b, 1)
            else:
                hopper.wgmma_wait_group(b, 0)
            s = hopper.fence_operands(b, s)

        # P^T (and G with a score rule), under dP^T's GEMM
        if not lse_early:
            neg_lse = self._columns(b, stage, "neg_lse", lanes, first)
        n_tiles = c.score_columns // 8
        S = [[s[4 * j: 4 * j + 4] for j in range(n_tiles)]]
        packed_p, G = self._probabilities(b, h, q0, kv0, S, q_idx, kv_idx,
                                          lambda i, j, e: neg_lse[j][e & 1], always)
        if split:  # the warpgroup's columns of P^T to its tile (dV's A operand)
            g8, row_byte = self._tile_row(b, tid)
            self._store_own_slices(b, group, b.add(self._addr(b, o["p"]), row_byte), g8,
                                   packed_p[0])
        if not c.overlap_dp:
            hopper.wgmma_fence(b)
            dp = issue_dp()
        hopper.wgmma_wait_group(b, 0)
        dp = hopper.fence_operands(b, dp)

        mn_slices = [16 * k * SW for k in range(BM // 16)]
        own_boxes = None
        if not split:
            # dV += P^T dO: P^T the register A operand, dO an MN-major B operand
            frags = [x for slice_ in packed_p[0] for x in slice_]
            flat = hopper.fence_operands(b, dv + frags)
            dv, frags = flat[:len(dv)], flat[len(dv):]
            own_boxes = own_column_byte(b, c, group, BM)  # (of dO and Q)
            do_mn = hopper.smem_descriptors(b, self._ptr(b, b.add(do_off, own_boxes)),
                                            mn_slices, leading_bytes=BM * SW)
            hopper.wgmma_fence(b)
            for k, desc in enumerate(do_mn):
                dv = hopper.wgmma(b, dt, c.kv_columns, frags[4 * k: 4 * k + 4], desc, dv,
                                  trans_b=True)
            hopper.wgmma_commit_group(b)

        # dS^T = P^T (dP^T - delta)
        delta = self._columns(b, stage, "delta", lanes, first)
        dP_delta = [[[b.fsub(dp[4 * j + e], delta[j][e & 1]) for e in range(4)]
                     for j in range(n_tiles)]]
        if G is None:
            # dS^T = P^T (dP^T - delta) in 16-bit pairs: P^T is in them already (dV's A
            # operand), so this packs dP^T - delta and multiplies two at a time, where
            # unpacking P^T to f32 and packing dS^T cost two instructions per element more
            ds_packed = [[warp.mul2(b, dt, p, d) for p, d in zip(ps, ds)]
                         for ps, ds in zip(packed_p[0], self._pack(b, dP_delta)[0])]
        else:
            ds_packed = self._pack(b, self._ds(b, packed_p, G, dP_delta))[0]

        # dS^T (16-bit) to shared memory (`_store_slices`)
        if not split:
            g8, row_byte = self._tile_row(b, tid)
        ds_off = b.add(i32(o["ds"]), b.mul(ds_buffer, i32(o["ds_bytes"])))
        ds_base = b.add(self._addr(b, ds_off), row_byte)
        if split:
            self._store_own_slices(b, group, ds_base, g8, ds_packed)
        else:
            self._store_slices(b, ds_base, g8, ds_packed, ds_slices(c, 0))

        # the warpgroup's part of dQ (`dq_tile`) = dS K: every warpgroup's dS^T rows are in
        # (and where the warpgroups split the query columns, every column of P^T and dS^T)
        hopper.fence_proxy_async(b)
        nvptx.barrier_named(b, nvptx.DS_BARRIER, 2 * hopper.WARPGROUP_THREADS)
        if split:  # dV += P^T dO, P^T from shared memory
            own_boxes = own_column_byte(b, c, group, BM)  # (of dO and Q)
            dv = self._shared_a_gemm(b, dv, i32(o["p"]), b.add(do_off, own_boxes))
        dq = self._issue_dq(b, group, ds_off, 0)

        # dK += dS^T Q, after dQ's GEMM: dQ is staged under it
        if split:  # (dS^T from shared memory)
            dk = self._shared_a_gemm(b, dk, ds_off, b.add(q_off, own_boxes))
        else:
            frags = [x for slice_ in ds_packed for x in slice_]
            flat = hopper.fence_operands(b, dk + frags)
            dk, frags = flat[:len(dk)], flat[len(dk):]
            q_mn = hopper.smem_descriptors(b, self._ptr(b, b.add(q_off, own_boxes)), mn_slices,
                                           leading_bytes=BM * SW)
            hopper.wgmma_fence(b)
            for k, desc in enumerate(q_mn):
                dk = hopper.wgmma(b, dt, c.kv_columns, frags[4 * k: 4 * k + 4], desc, dk,
                                  trans_b=True)
            hopper.wgmma_commit_group(b)
        # dV's and dQ's (first chunk's) groups are done: with one stage, the step's last
        # reads of dO and the stats and (where the warpgroups split the query columns) of
        # P^T's tile, which the next step writes only once its stage is full
        hopper.wgmma_wait_group(b, 1)
        if c.frees_stage_in_parts:  # dO and the stats are read
            hopper.mbarrier_arrive(b, self._dout_empty(b, stage))
        self._stage_dq(b, group, hopper.fence_operands(b, dq), 0, ds_buffer)
        q_freed = False
        for chunk in range(1, c.dq_chunks):
            # after dK's GEMM: a chunk issued under it serialises the wgmmas (ptxas C7512,
            # too few registers)
            hopper.wgmma_wait_group(b, 0)
            flat = hopper.fence_operands(b, dk + dv)
            dk, dv = flat[:len(dk)], flat[len(dk):]
            if c.frees_stage_in_parts and not q_freed:  # dK's GEMM has read Q
                hopper.mbarrier_arrive(b, self._empty(b, stage))
                q_freed = True
            dq = self._issue_dq(b, group, ds_off, chunk)
            hopper.wgmma_wait_group(b, 0)
            self._stage_dq(b, group, hopper.fence_operands(b, dq), chunk, ds_buffer)
        s_next = issue_next_s() if issue_next_s else []
        hopper.wgmma_wait_group(b, 1 if issue_next_s else 0)  # all but the next S^T's
        flat = hopper.fence_operands(b, dk + dv)
        dk, dv = flat[:len(dk)], flat[len(dk):]
        if not q_freed:  # Q (and dO and the stats) are read: the producer's again
            hopper.mbarrier_arrive(b, self._empty(b, stage))
        return dk, dv, s_next

    def _tile_row(self, b, tid) -> tuple[ir.Value, ir.Value]:
        """(g8, the byte offset of its first value) of consumer thread `tid` in a 16-bit
        tile of K/V rows x query columns (dS^T's, P^T's: `_store_slices`)."""
        lane = b.and_(tid, i32(31))
        g8 = b.lshr(lane, i32(2))
        row_byte = b.add(b.mul(b.add(self._warp_row(b, tid), g8), i32(SW)),
                         b.shl(b.and_(lane, i32(3)), i32(2)))
        return g8, row_byte

    def _store_slices(self, b, base, g8, packed, slices: range) -> None:
        """The 16-column slices `slices` of the step's query columns of a 16-bit tile (A
        operands, [slice - slices.start][4]: `_pack`) to shared memory at `base` + the
        thread's `_tile_row`: row = the warpgroup's K/V row, in boxes of 64 query columns
        (128 bytes, swizzled: chunk n-tile xor row % 8; box b at b block_n rows)."""
        for k in slices:
            for x, (r, nt) in zip(packed[k - slices.start], ((0, 2 * k), (1, 2 * k),
                                                             (0, 2 * k + 1), (1, 2 * k + 1))):
                box, nt = divmod(nt, BOX_COLUMNS // 8)
                chunk = b.shl(b.xor(g8, i32(nt)), i32(4))
                _st_shared_b32(b, b.add(b.add(base, chunk),
                                        i32((8 * r + box * self.c.block_n) * SW)), x)

    def _store_own_slices(self, b, group, base, g8, packed) -> None:
        """`_store_slices` of warpgroup `group`'s slices (`ds_slices`), where the
        warpgroups share their K/V rows: its query columns (`score_columns`) or its half of
        dS^T's."""
        with b.if_else(b.icmp_unsigned("==", group, i32(0))) as (first, second):
            with first:
                self._store_slices(b, base, g8, packed, ds_slices(self.c, 0))
            with second:
                self._store_slices(b, base, g8, packed, ds_slices(self.c, 1))

    def _shared_a_gemm(self, b, acc, tile_off, b_off) -> list[ir.Value]:
        """acc += T B over the step's query rows as a wgmma group of its own (m64n{kv_columns},
        block_m / 16 k-steps), where the warpgroups split the query columns: T the P^T or
        dS^T tile at `tile_off` (`_store_slices`, a K-major A operand), B the warpgroup's
        columns of dO or Q at `b_off` (MN-major)."""
        c = self.c
        acc = hopper.fence_operands(b, acc)
        t_descs = hopper.smem_descriptors(b, self._ptr(b, tile_off),
                                          self._k_major(c.block_n, c.block_m))
        b_descs = hopper.smem_descriptors(b, self._ptr(b, b_off),
                                          [16 * k * SW for k in range(c.block_m // 16)],
                                          leading_bytes=c.block_m * SW)
        hopper.wgmma_fence(b)
        for t_desc, b_desc in zip(t_descs, b_descs):
            acc = hopper.wgmma(b, c.dtype, c.kv_columns, t_desc, b_desc, acc, trans_b=True)
        hopper.wgmma_commit_group(b)
        return acc

    def _issue_dq(self, b, group, ds_off, chunk: int) -> list[ir.Value]:
        """Columns chunk dq_chunk.. of the warpgroup's part of dQ (`dq_tile`, `dq_origin`) =
        dS K as a wgmma group of its own: dS^T (the tile at `ds_off`) a transposed, M-major
        shared A operand, K an MN-major B operand."""
        c, o = self.c, self.off
        BM, BN = c.block_m, c.block_n
        dq_rows = c.dq_tile[0]
        # dS's rows: at 128 query rows, dS^T's box g (64 query columns)
        row_box = b.mul(group, i32(BN * SW if dq_rows < BM else 0))
        ds_descs = hopper.smem_descriptors(b, self._ptr(b, b.add(ds_off, row_box)),
                                           [16 * k * SW for k in range(BN // 16)],
                                           leading_bytes=BN * SW)
        col_byte = dq_column_byte(b, c, group, chunk)
        k_mn = hopper.smem_descriptors(b, self._ptr(b, b.add(i32(o["k"]), col_byte)),
                                       [16 * k * SW for k in range(BN // 16)],
                                       leading_bytes=BN * SW)
        hopper.wgmma_fence(b)
        dq = None
        for dsd, kd in zip(ds_descs, k_mn):
            dq = hopper.wgmma(b, c.dtype, c.dq_chunk, dsd, kd, dq, trans_a=True, trans_b=True)
        hopper.wgmma_commit_group(b)
        return dq

    def _stage_dq(self, b, group, dq, chunk: int, parity):
        """Chunk `chunk` of this warpgroup's dQ values (`_issue_dq`) into its staging tile
        in register order (the chunks' accumulators follow one another there), the first
        once the writer warp's last bulk reduce-add has read the tile; after the last the
        writer adds the tile into the accumulator (`_write_dq`; the barriers of the step's
        `parity` where two writers take the steps in turn: `_write_dq_in_turn`)."""
        thread = self._group_thread(b, self._tid(b))
        parity = parity if self.c.dq_writers == 2 else None
        if chunk == 0:
            nvptx.barrier_named(b, _dq_barrier(b, nvptx.DQ_EMPTY_BARRIER, group, parity),
                                DQ_PARTIES, aligned=False)
        start = b.add(self._addr(b, self._dq_tile(b, group)), b.shl(thread, i32(4)))
        for k in range(len(dq) // 4):
            vector = dq_chunk_vector(self.c, chunk, k)
            _st_shared_v4f32(b, b.add(start, i32(16 * hopper.WARPGROUP_THREADS * vector)),
                             dq[4 * k: 4 * k + 4])
        if chunk == self.c.dq_chunks - 1:
            hopper.fence_proxy_async(b)
            nvptx.barrier_arrive(b, _dq_barrier(b, nvptx.DQ_FULL_BARRIER, group, parity),
                                 DQ_PARTIES)

    @staticmethod
    def _writer_lane(b) -> ir.Value:
        """Whether this thread is the writer warp's first lane, the issuer of its bulk
        reduce-adds (bulk groups are per thread)."""
        tid = nvptx.opaque_special_register(b, "tid.x")
        return b.icmp_unsigned("==", tid, i32(WRITER_WARP * 32))

    @property
    def _dq_part_bytes(self) -> int:
        """A warpgroup's part of dQ's staging tile (`dq_tile`)."""
        return self.off["dq_bytes"] // 2

    def _dq_tile(self, b, group) -> ir.Value:
        """Offset of warpgroup `group`'s dQ staging tile (int group or i32)."""
        group = i32(group) if isinstance(group, int) else group
        return b.add(i32(self.off["dq"]), b.mul(group, i32(self._dq_part_bytes)))

    def _write_dq(self, b, h, q0) -> None:
        """The writer warp's part of a step: it frees each staging tile once its last bulk
        reduce-add has read it, then adds each, once written, into the accumulator's block
        of the query tile at q0 of head h with one bulk reduce-add (`dq_accum_position`),
        issued by its first lane. In deterministic mode (with one writer) the block's adds
        come in a fixed order: the first lane waits until the block's count says every K/V
        tile before this one has added (`_dq_place`), and counts this one's add once it is
        done: at the next step, once the staging tiles are free (the consumers stage the next
        dQ while the adds complete), or at the work tile's end (`_release_pending_count`)."""
        c = self.c
        lane0 = self._writer_lane(b)
        for g in range(2):  # the groups are committed in order: g's is the (2 - g)-th last
            with b.if_then(lane0):
                hopper.bulk_wait_group_read(b, 1 - g)
            nvptx.barrier_arrive(b, i32(nvptx.DQ_EMPTY_BARRIER + g), DQ_PARTIES)
        if c.deterministic:
            self._release_pending_count(b)
            count = _gep(b, self.a.delta, _count_offset(b, c, self.a, self.bidx, self.q_start,
                                                        q0, h), i32)
            place = self._dq_place(b, h, q0)
            with b.if_then(lane0):
                # (the adds seen before this one's bulk adds)
                self._wait_for_turn(b, count, place,
                                    then=lambda: hopper.fence_proxy_async_global(b))
        for g in range(2):
            nvptx.barrier_named(b, i32(nvptx.DQ_FULL_BARRIER + g), DQ_PARTIES, aligned=False)
            with b.if_then(lane0):
                self._add_dq_part(b, h, q0, g)
        if c.deterministic:
            with b.if_then(lane0):
                b.store(b.ptrtoint(count, i64), self._pending_count(b))

    def _add_dq_part(self, b, h, q0, g: int) -> None:
        """Warpgroup g's staging tile added into the accumulator's block of the query tile
        at q0 of head h (this thread: a writer warp's first lane)."""
        c = self.c
        row, col = c.dq_origin(g)
        run = _accum_offset(b, c, self.a, self.bidx, self.q_start, b.add(q0, i32(row)), h,
                            i32(col))
        hopper.bulk_reduce_add_f32(b, _gep(b, self.a.dq_accum, run, f32),
                                   self._ptr(b, self._dq_tile(b, g)), self._dq_part_bytes)
        hopper.bulk_commit_group(b)

    def _write_dq_in_turn(self, b, pair) -> None:
        """Deterministic mode's writers take the query steps in turn (the first warp the
        even ones, by the role's step count, which runs on across work tiles). A writer's
        step: its first lane waits until the block's count says every K/V tile before this
        one has added (`_dq_place`), adds each staging tile once written, frees it (the
        next step's barriers) once the adds have read it, and counts this K/V tile's add
        once they are complete, while the other writer takes the next step. The odd steps'
        barriers are the even steps' + DQ_ODD_STEPS; the odd writer frees the tiles for
        the first step (`emit`), and the consumers meet the last step's freeing after
        their work loop."""
        c = self.c
        step = b.load(self.writer_steps, typ=i32)
        b.store(b.add(step, i32(1)), self.writer_steps)
        parity = b.and_(step, i32(1))
        tid = nvptx.opaque_special_register(b, "tid.x")
        writer = b.sub(b.lshr(tid, i32(5)), i32(WRITER_WARP))
        with b.if_then(b.icmp_unsigned("==", parity, writer)):
            h, q0 = pair()
            lane0 = b.icmp_unsigned("==", b.and_(tid, i32(31)), i32(0))
            count = _gep(b, self.a.delta, _count_offset(b, c, self.a, self.bidx, self.q_start,
                                                        q0, h), i32)
            parked = b.add(i32(self.off["counts"]), b.shl(writer, i32(3)))
            place = self._dq_place(b, h, q0)
            with b.if_then(lane0):
                b.store(b.ptrtoint(count, i64), b.inttoptr(self._addr(b, parked),
                                                          i64.as_pointer(SHARED)))
                # (the adds seen before this one's bulk adds)
                self._wait_for_turn(b, count, place,
                                    then=lambda: hopper.fence_proxy_async_global(b))
            for g in range(2):
                nvptx.barrier_named(b, _dq_barrier(b, nvptx.DQ_FULL_BARRIER, g, parity),
                                    DQ_PARTIES, aligned=False)
                with b.if_then(lane0):
                    self._add_dq_part(b, h, q0, g)
            for g in range(2):  # (the groups are committed in order, as in `_write_dq`)
                with b.if_then(lane0):
                    hopper.bulk_wait_group_read(b, 1 - g)
                nvptx.barrier_arrive(b, _dq_barrier(b, nvptx.DQ_EMPTY_BARRIER, g,
                                                    b.xor(parity, i32(1))), DQ_PARTIES)
            with b.if_then(lane0):
                count = nvptx.reload_shared(b, self._addr(b, parked), 64)
                hopper.bulk_writes_released(b, b.inttoptr(count, self.a.delta.type))

    def _pending_count(self, b) -> ir.Value:
        """The shared word holding the address of the count the last step's adds release
        (0: none), deterministic mode's with one writer."""
        return self._ptr(b, self.off["counts"])

    def _release_pending_count(self, b) -> None:
        """The writer's first lane: once the last step's adds are done, their count goes up
        (`hopper.bulk_writes_released`), if a step left one."""
        with b.if_then(self._writer_lane(b)):
            pending = b.load(self._pending_count(b), typ=i64)
            with b.if_then(b.icmp_unsigned("!=", pending, i64(0))):
                hopper.bulk_writes_released(b, b.inttoptr(pending, self.a.delta.type))
                b.store(i64(0), self._pending_count(b))

    def _wait_for_turn(self, b, count, place, then=lambda: None) -> None:
        """Deterministic mode's wait (this thread) until global u32 `count` equals `place`
        (`hopper.wait_for_count`), then `then()`; a wait that gives up after
        abi.DQ_ORDER_WAIT_NS records a DQ_ORDER_WAIT fault naming the scheduler."""
        record = faults.word(b, self.a.queue, abi.RECORD_WORD)
        late = hopper.wait_for_count(b, count, place, abi.DQ_ORDER_WAIT_NS, record)
        then()
        with b.if_then(late, likely=False):
            faults.record_fault(b, self.a.queue, i32(abi.fault_code(
                abi.DQ_ORDER_WAIT, "advance")), abi.scheduler_id(self.scheduler))

    def _dq_place(self, b, h, q0) -> ir.Value:
        """This K/V tile's place among those that add into the query tile at q0 of head h
        (deterministic mode): how many of the sequence's K/V tiles after it the mask's
        classification keeps for that query tile, as `_next_step` does in their CTAs.
        Prompt tile t is K/V tile n - 1 - t (`sm80.scheduler_view`), so a scheduler that
        hands out each head's prompt tiles in order (`ORDERED_SCHEDULERS`) has handed those
        out before this one. The writer warp's lanes count 32 K/V tiles at a time."""
        c = self.c
        n = b.udiv(self.kv0, i32(c.block_n))
        tiles = b.udiv(b.add(self.seqlen_k, i32(c.block_n - 1)), i32(c.block_n))
        if self.hooks.classify is None:
            return b.sub(b.sub(tiles, n), i32(1))
        lane = b.and_(nvptx.opaque_special_register(b, "tid.x"), i32(31))

        def count(b, j, kept):
            keeps = self._classify(b, h, q0, b.mul(j, i32(c.block_n)))[0]
            return b.add(j, i32(32)), [b.add(kept[0], b.zext(keeps, i32))]
        kept, = ir_loop(b, b.add(b.add(n, i32(1)), lane), tiles, [i32(0)], count)
        return warp.warp_sum(b, kept)


# ============================================================================ module
def scheduler_view(args: KernelArgs) -> KernelArgs:
    """The main kernel's work space as its scheduler sees it: the sm80 design's
    (`backward.scheduler_view`: K/V tiles of K/V heads), but a split group's heads are its
    query heads (`HopperBackwardConfig.split_group`)."""
    view = sm80.scheduler_view(args)
    if args.config.split_group:
        view.num_heads = args.num_heads
    return view


def build_module(config: HopperBackwardConfig, hooks: ExprHooks | None, target: Target,
                 work_loop, scheduler: str = "") -> ir.Module:
    """The three kernels, and `KV_POSTPROCESS` where the build splits its group; `scheduler`
    names the work loop's scheduler (a fault record names it)."""
    if found := config.problems():
        raise ValueError("invalid HopperBackwardConfig: " + "; ".join(p.message for p in found))
    # (its shared memory is rounded up to 1024 bytes at run time)
    module, smem, hooks = sm80.backward_module(
        f"mha_bwd_sm90_{config.dtype}_d{config.head_dim}", hooks, target, SMEM_SYMBOL)
    rows_abi = preprocess_abi(config)
    fn, b = sm80.kernel_function(module, PREPROCESS, ROW_THREADS, hooks, rows_abi)
    args = KernelArgs(fn, rows_abi, config)
    _emit_preprocess(b, config, args, hooks, _Rows)
    if config.split_group:
        _KVRows(b, config, args).zero_accumulators(b)
    b.ret_void()
    abi = main_abi(config)
    fn, b = sm80.kernel_function(module, MAIN, config.threads, hooks, abi)
    _HopperMain(config, hooks, KernelArgs(fn, abi, config, opaque_env=config.opaque_env),
                smem, scheduler).emit(b, work_loop)
    b.ret_void()
    fn, b = sm80.kernel_function(module, POSTPROCESS, ROW_THREADS, hooks, sm80.ABI)
    _emit_postprocess(b, config, KernelArgs(fn, sm80.ABI, config), _Rows)
    b.ret_void()
    if config.split_group:
        fn, b = sm80.kernel_function(module, KV_POSTPROCESS, ROW_THREADS, hooks, KV_ROWS_ABI)
        _KVRows(b, config, KernelArgs(fn, KV_ROWS_ABI, config)).write_kv(b)
        b.ret_void()
    return module


class BackwardSM90(sm80.BackwardDesign):
    """The backward pass on Hopper: TMA + wgmma (the module's docstring)."""

    name = "backward_sm90"
    targets = ("sm_90a",)
    abi = ABI
    config_type = HopperBackwardConfig

    def problems(self, options, arch: str) -> list[Problem]:
        found = [p for p in declared_config(options, Layout()).problems()]
        if arch not in self.targets:
            found.append(Problem((), f"the sm90 backward builds for sm_90a, not {arch}"))
        return found

    def runs_layout(self, layout: Layout) -> bool:
        return not layout.operand_grads

    def configs(self, options, layout: Layout) -> tuple[HopperBackwardConfig, ...]:
        """The declaration's config in its IR shapes: P^T under dP^T's GEMM or after it, the
        scheduler's inputs rederived per step or held; a split group's (deterministic: with
        two dQ writers, then one), then the same without the split. Few, as a build that
        fits none falls back to the sm80 design's only after trying them all."""
        config = declared_config(options, layout)
        tiles = dict.fromkeys((config.block_m, 64))  # (128 query rows at head dim 64 first)
        splits = (REGISTERS, WRITER_REGISTERS) if config.deterministic else (REGISTERS,)

        def writers(split: bool) -> tuple[int, ...]:  # (two only pay on a split group)
            return (2, 1) if config.deterministic and split else (1,)
        return tuple(replace(config, split_group=split, block_m=rows, opaque_env=opaque,
                             overlap_dp=overlap, registers=registers, dq_writers=n)
                     for split in dict.fromkeys((config.split_group, False))
                     for n in writers(split) for registers in splits for rows in tiles
                     for overlap in (True, False) for opaque in (True, False))

    def scheduler_shape(self, config: HopperBackwardConfig) -> tuple[int, int]:
        """K/V tiles of block_n rows; a split group's heads are query heads, gqa_group of
        them per K/V head (`scheduler_view`)."""
        return config.block_n, config.gqa_group if config.split_group else 1

    def work_space(self, config: HopperBackwardConfig,
                   call: CallSizes) -> tuple[int, int, int, int]:
        """The K/V tiles of the K/V heads, or of the query heads where the build splits
        its group (`scheduler_view`)."""
        space = super().work_space(config, call)
        return (*space[:3], call.heads) if config.split_group else space

    def kernels(self, config: HopperBackwardConfig) -> tuple[KernelLaunch, ...]:
        """The preprocess, the main kernel and the postprocess, then where the build splits
        its group `KV_POSTPROCESS`, a CTA per tile of ROW_TILE K/V rows, K/V head and
        sequence; the preprocess and postprocess take the sm80 design's parameters (and
        a split group's accumulators: `preprocess_abi`) and cover every row of a sequence's
        last query tile (a stats block is read whole, so rows past the sequence need their
        -inf and zero)."""
        def rows(call: CallSizes) -> tuple[int, int, int]:
            bm = config.block_m
            return sm80.row_grid(call, -(-call.max_seqlen_q // bm) * bm)

        def kv_rows(call: CallSizes) -> tuple[int, int, int]:
            return max(1, -(-call.max_seqlen_k // ROW_TILE)), call.kv_heads, call.batch

        launches = (KernelLaunch(PREPROCESS, preprocess_abi(config), ROW_THREADS, 0, rows),
                    KernelLaunch(MAIN, main_abi(config), config.threads, shared_bytes(config)),
                    KernelLaunch(POSTPROCESS, sm80.ABI, ROW_THREADS,
                                 ROW_TILE * _Rows.staging_pitch(config), rows))
        if not config.split_group:
            return launches
        return (*launches, KernelLaunch(KV_POSTPROCESS, KV_ROWS_ABI, ROW_THREADS, 0, kv_rows))

    def scratch(self, config: HopperBackwardConfig, call: CallSizes) -> dict[str, int]:
        """The fp32 dQ accumulator and the stats blocks (-LSE and delta), each in blocks of
        a query tile of a head (`dq_accum_position`, `_stats_offset`); where the build
        splits its group, dK's and dV's fp32 accumulators in k's layout (`kv_accum_offset`)."""
        bm = config.block_m
        tiles = (call.total_q + call.batch * bm) // bm if config.ragged else \
            call.batch * -(-call.seqlen_q // bm)
        found = {"dq_accum": 4 * tiles * call.heads * bm * config.head_dim,
                 "delta": 4 * tiles * call.heads * config.block_floats,
                 **sm80.sink_scratch(config, call)}
        if config.split_group:
            kv_rows = call.total_k if config.ragged else call.batch * call.seqlen_k
            found["dk_accum"] = found["dv_accum"] = \
                4 * kv_rows * call.kv_heads * config.head_dim
            if config.deterministic:
                found["kv_count"] = 4 * kv_rows * call.kv_heads
        return found

    def build(self, source: KernelSource, configs, target: Target) -> KernelBuild:
        """The first of `configs` that assembles without spills and without a stack frame
        (at the register cap, ptxas may keep a value in local memory without counting it
        as a spill), else `spill_free_build`'s choice."""
        if configs[0].deterministic and not adds_in_order(source.scheduler):
            return sm80.BACKEND.build(source, sm80.BACKEND.configs_for(configs[0]), target)

        def make(c):
            return lambda: build_module(c, source.hooks, target,
                                        source.work_loop(*self.scheduler_shape(c)),
                                        source.scheduler[0])
        if find_ptxas() is None:
            return spill_free_build(self.name, target, [(configs[0], make(configs[0]))])
        for c in configs:
            build = spill_free_build(self.name, target, [(c, make(c))])
            if all(k.spills == 0 and k.stack_bytes == 0 for k in build.assembled.kernels.values()):
                return build
        # none fits the registers (a score rule's G beside P^T, say): the sm80-style design's
        # build, which the host launches as that design's (`KernelBuild.backend`)
        return sm80.BACKEND.build(source, sm80.BACKEND.configs_for(configs[0]), target)


# The standard schedulers that hand out each (sequence, K/V head)'s prompt tiles in order
# in their DEFAULT and INTERLEAVED orders (a queue's index, or a persistent CTA's index and its
# strides), which deterministic mode's dQ order follows (`_HopperMain._dq_place`).
ORDERED_SCHEDULERS = ("Queued", "Persistent")
ORDERED_SCHEDULES = ("DEFAULT", "INTERLEAVED")


def adds_in_order(scheduler: tuple[str, tuple]) -> bool:
    """Whether deterministic mode can add dQ in the order `scheduler` ((name, arguments))
    hands out K/V tiles; else the sm80-style design runs it (`mha_bwd_dq`)."""
    name, args = scheduler
    return name in ORDERED_SCHEDULERS \
        and dict(args).get("order", "DEFAULT") in ORDERED_SCHEDULES


def declared_tile(head_dim: int) -> dict[str, int]:
    """The tile and stages a declaration of this head dim builds: 128 query rows a step at
    head dim 64, 64 elsewhere; K/V tiles of `kv_tile_rows`; at head dim 256 one stage of Q
    and dO, as K, V (32 KB each), dS^T, P^T and dQ's staging tile (64 KB) leave no room for
    a second."""
    return dict(block_m=2 * GROUP_ROWS if head_dim == 64 else GROUP_ROWS,
                block_n=kv_tile_rows(head_dim), stages=1 if head_dim == WIDE_HEAD_DIM else 2)


def declared_config(options, layout: Layout) -> HopperBackwardConfig:
    return HopperBackwardConfig(options.dtype, options.head_dim, gqa_group=layout.gqa_group,
                                ragged=layout.ragged, deterministic=layout.deterministic,
                                sink=options.sink is not None,
                                split_group=splits_group(layout, options.head_dim),
                                **declared_tile(options.head_dim))


def splits_group(layout: Layout, head_dim: int) -> bool:
    """Whether a call of `layout` splits its GQA group's query heads over CTAs
    (`HopperBackwardConfig.split_group`): from SPLIT_GROUP_MIN query heads per K/V head,
    DETERMINISTIC_SPLIT_GROUP_MIN in deterministic mode (the module's docstring); not at
    head dim 256 (no GPU test covers a split build there)."""
    least = DETERMINISTIC_SPLIT_GROUP_MIN if layout.deterministic else SPLIT_GROUP_MIN
    return layout.gqa_group > 1 and layout.gqa_group >= least and head_dim != WIDE_HEAD_DIM


BACKEND = BackwardSM90()
