"""The decode design: a few query rows per sequence against a (paged) KV cache.

Decoding reads the whole KV cache once per step and computes little with it, so this design
is built around the copy: `cp.async` (16 B, any address, which a page gather needs) keeps
`stages` K/V tiles in flight per CTA, and `mma.sync` does the little math. It builds for
sm_80 and sm_90a alike.

The work tile (what the scheduler hands out, `TileSeq`) is decode's own:
- **GQA packing**: a tile's rows are the query heads that share one K/V head times the query
  rows (packed row r = query row r // group, head hk * group + r % group), so each K/V tile
  is read once per group, not once per query head. The scheduler's heads are K/V heads.
- **Split-KV**: the scheduler's "prompt tiles" are (query-row tile, KV split) pairs, split
  fastest, with a tile height of 1: prompt_offset = q_tile * splits + split. Fixed splits:
  num_splits a sequence, split s covering cache positions [s * kv_chunk, (s + 1) *
  kv_chunk). Splits that follow the lengths (`DecodeConfig.balanced`): `mha_decode_splits`
  (or, in a call that appends rows, `mha_decode_append`) first counts each sequence's from
  its own length and the batch's work (`SplitRule`) into a tile index, so the scheduler's
  work space is ragged and holds no empty split; a sequence's KV tiles are shared evenly
  by its splits. With one split the tile writes O; with more, each split writes its fp32
  partial O and LSE to the workspace, and the last split of a group to finish (a counter
  per group, which that split resets to 0, so CUDA-graph replays need no host work) merges
  them into O and the LSE.
- **Paged KV**: position p of sequence b lives in page `page_table[b, p // page_size]`, row
  p % page_size; a contiguous cache is the same with page b and no page size. The page
  entries a tile needs are read PAGE_LOOKAHEAD_ROWS KV rows ahead of its copies, while the
  tiles before it compute.
- The KV tile (32 or 64 rows) is the call planner's choice (`CacheLayout.block_n`): small
  two-warp CTAs, four per multiprocessor, where there are many 16-row work tiles.

Within a CTA, warp w owns 16 packed rows (w % warps_m) and a slice of each KV tile's columns
(w // warps_m); warps that share rows merge their softmax states through shared memory at the
end (FlashDecoding's split within the CTA, which keeps all warps busy on 16 rows).

The mask and score rules see cache positions: q_idx is the row's index among its sequence's
query rows, seqlen_q the sequence's query rows and seqlen_k its cache length (the rows are
the last positions of the cache, so `kv_idx <= q_idx + seqlen_k - seqlen_q` is causal).

It stays one module: the copy pipeline, the warps' merge and the splits' combine are one
kernel (`_Emitter`) over one shared-memory layout and one config, and the append and split
index kernels that run before it read that config and its parameters.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from llvmlite import ir

from mhadsl.abi import (
    TRACE_COMBINE, CallSizes, CallValue, Extent, KernelABI, Param, Pointer, Stride, Workspace,
    tile_index_words,
)
from mhadsl.codegen import hopper, nvptx, signature, tile_index, warp
from mhadsl.codegen.backends import (
    SHARED_MEMORY_LIMIT, Backend, CacheLayout, ExprHooks, KernelArgs, KernelBuild, KernelSource, KernelLaunch, Layout,
    Problem, RowCopies, TileSeq, common_problems, ir_loop, masked_unless, spill_free_build,
)
from mhadsl.codegen.backends.blocks import TileRules, last_index
from mhadsl.codegen.nvptx import GLOBAL, SHARED, f32, i32, i64
from mhadsl.codegen.trace_records import end_record, record_work_item
from mhadsl.codegen.target import Target, new_module
from mhadsl.codegen.valid_work import WIDE_SEARCH

KERNEL_NAME = "mha_decode"
SMEM_SYMBOL = "mha_decode_smem"
HEAD_DIMS = (64, 128, 256)
MAX_ROWS = 128  # packed rows per work tile
RAGGED_ROWS = 64  # packed rows per tile of a ragged (chunked-prefill) call
SHARED_BUDGET = 160 * 1024  # what one CTA may use on every target (sm_80 allows 163 KiB)
# KV tiles in flight per CTA: three leave room for two CTAs per multiprocessor on sm_90a,
# which measured faster than one CTA with four (benchmarks/log/BENCHMARKS_LOG.md, decode);
# an FP8 cache's tiles hold half the bytes, and twice as many in flight measured fastest
MAX_STAGES = 3
# how far ahead of its copies a tile's page entries are read, in KV rows: a page-table read
# (L2, under a saturated memory system) takes about as long as streaming that many rows
PAGE_LOOKAHEAD_ROWS = 128
# sm_90a, tiles of 64 packed rows or more: each warpgroup's 64 rows compute by wgmma
WGMMA_ROWS = 64  # packed rows per warpgroup (wgmma's M)
SMEM_ALIGN = 128  # the declared alignment of the dynamic shared memory
# the wgmma build rounds its shared-memory base up to the swizzle atom (1024 B) at run time
WGMMA_SLACK = hopper.SWIZZLE_ATOM_BYTES - SMEM_ALIGN
# floats after each row of a warp's partial O in the cross-warp merge: rows 8 floats (32
# banks / 4) apart, so the 8-byte stores of a warp's 8 rows x 4 lanes are conflict-free
MERGE_PAD = 8


# ============================================================================ configuration
def packed_rows(query_rows: int, gqa_group: int) -> int:
    """Packed rows per work tile (a multiple of 16) for `query_rows` per sequence (0:
    ragged) and the query heads of a K/V head."""
    if query_rows == 0:
        return RAGGED_ROWS
    return min(MAX_ROWS, -(-query_rows * gqa_group // 16) * 16)


@dataclass(frozen=True)
class DecodeConfig(RowCopies):
    """Everything that selects a decode build (hashable; part of the cache key)."""

    dtype: str = "bf16"
    head_dim: int = 128
    gqa_group: int = 1
    query_rows: int = 1  # query rows per sequence (dense); 0: ragged, from cu_seqlens_q
    page_size: int = 0  # 0: a contiguous cache
    return_lse: bool = False
    block_n: int = 64  # KV rows per KV tile
    stages: int = 4  # K/V tiles in flight (cp.async groups)
    page_lookahead: int = 2  # KV tiles between reading a tile's page entries and its copies
    # sm_90a only (`Decode.build` sets it where `wgmma_fits`): a warpgroup per 64 packed rows
    # computes S = Q K^T and O += P V by wgmma from 128-byte-swizzled shared memory, which
    # the cp.async copies fill in wgmma's layout
    wgmma: bool = False
    # the call writes the step's new K/V rows into the cache first (`mha_decode_append`),
    # at positions cache_seqlens[b]..., and attends over them too
    appends: bool = False
    # the cache holds float8_e4m3fn, scaled per tensor (`FP8_PARAMS`): K/V tiles of 1-byte
    # rows, turned into f16 in registers (`warp.e4m3_pair_to_f16`), both products in fp16
    fp8: bool = False
    # sm_90a only (`Decode.build` sets it with `fp8`): the conversion unit turns FP8 into
    # f16 (`warp.e4m3_quad_to_f16`), not integer steps
    fp8_cvt: bool = False
    # each sequence's splits follow its own length and the batch's (`mha_decode_splits`,
    # or the append, counts them on the device, `valid_work.balanced_splits` is their
    # meaning): the scheduler numbers only the (query-row tile, split) work tiles that exist
    balanced: bool = False

    # the scheduler's tile height: a work tile is one (query-row tile, split) pair
    block_m = 1

    @property
    def ragged(self) -> bool:
        """Whether the scheduler's work space is ragged (the balanced split's tile index),
        else dense (a sequence's unused splits exit at once)."""
        return self.balanced

    @property
    def rows(self) -> int:
        return packed_rows(self.query_rows, self.gqa_group)

    @property
    def warps_m(self) -> int:
        return self.rows // 16

    @property
    def num_warps(self) -> int:
        """Four, or as many as the rows need; warps that share rows split the KV tile's
        columns, 16 at least each."""
        return max(self.warps_m, min(4, self.warps_m * self.block_n // 16))

    @property
    def warps_n(self) -> int:
        return self.num_warps // self.warps_m

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def warp_cols(self) -> int:
        """KV columns of a tile each warp computes."""
        return self.block_n // self.warps_n

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of a K or V row in shared memory (a cache row as it is)."""
        return self.head_dim if self.fp8 else self.row_bytes

    @property
    def kv_rows_per_pass(self) -> int:
        """KV rows one CTA-wide pass of 16-byte copies covers."""
        return self.threads // (self.kv_row_bytes // 16)

    @property
    def mma_dtype(self) -> str:
        return "fp16" if self.fp8 else self.dtype

    @property
    def stage_bytes(self) -> int:
        return 2 * self.block_n * self.kv_row_bytes

    @property
    def merge_bytes(self) -> int:
        """The cross-warp merge: per warp, 16 rows of padded O, max and sum (fp32)."""
        return self.num_warps * 16 * (self.head_dim + MERGE_PAD + 2) * 4 \
            if self.warps_n > 1 else 0

    @property
    def shared_bytes(self) -> int:
        # then the split flag (16 B; in the wgmma build at the start of Q's tile, which no
        # warp reads when the flag is used: two CTAs of 64 rows at head dim 128 fit an
        # H200's multiprocessor to the byte with the slack)
        return self.rows * self.row_bytes + max(self.stages * self.stage_bytes,
                                                self.merge_bytes) + \
            (WGMMA_SLACK if self.wgmma else 16)

    @property
    def wgmma_fits(self) -> bool:
        """Whether the tile's rows are whole warpgroups (64 rows, 4 warps each, every warp
        over the whole KV tile) and the rounded-up shared memory fits an sm_90a CTA."""
        return (self.rows % WGMMA_ROWS == 0 and self.warps_n == 1 and not self.fp8
                and replace(self, wgmma=True).shared_bytes <= SHARED_MEMORY_LIMIT["sm_90a"])

    def problems(self) -> list[Problem]:
        found = common_problems(self)
        if self.head_dim not in HEAD_DIMS:
            found.append(Problem(("head_dim",), f"decode supports head_dim "
                                                f"{', '.join(map(str, HEAD_DIMS))}, got "
                                                f"{self.head_dim}"))
        elif self.warp_cols < 16 or self.block_n % self.kv_rows_per_pass:
            found.append(Problem(("tile",), f"a KV tile of {self.block_n} rows is too small "
                                            f"for {self.num_warps} warps"))
        elif self.shared_bytes > SHARED_BUDGET:
            found.append(Problem(("head_dim",), "the decode tiles need more shared memory "
                                                "than a CTA has"))
        return found

    @property
    def page_shift(self) -> int:
        return self.page_size.bit_length() - 1


def decode_config(options, layout: Layout) -> DecodeConfig:
    """The decode build for a declaration and a cache call's layout: its KV tile, as many
    stages in flight as shared memory holds, up to MAX_STAGES."""
    cache = layout.cache
    block_n = cache.block_n
    base = DecodeConfig(options.dtype, options.head_dim, layout.gqa_group, cache.query_rows,
                        cache.page_size, layout.return_lse, block_n, 1, fp8=cache.fp8)
    room = SHARED_BUDGET - 16 - base.rows * base.row_bytes
    most = MAX_STAGES * (2 if cache.fp8 else 1)
    return replace(base, stages=max(2, min(most, room // base.stage_bytes)),
                   page_lookahead=max(1, PAGE_LOOKAHEAD_ROWS // block_n),
                   appends=cache.appends, balanced=cache.balanced)


# ============================================================================ kernel parameters
ABI = KernelABI(
    Param("q", "ptr", Pointer("q"), "queries: dense (B, Sq, Hq, D) / ragged (total_q, Hq, D); 16-byte aligned rows", align=16),
    Param("k_cache", "ptr", Pointer("k_cache"), "keys: paged (num_pages, page_size, Hkv, D) / contiguous (B, capacity, Hkv, D)", align=16),
    Param("v_cache", "ptr", Pointer("v_cache"), "values, the layout of k_cache", align=16),
    Param("o", "ptr", Pointer("o"), "output, the layout of q", align=16),
    Param("lse", "ptr", Pointer("lse"), "float32 log-sum-exp (natural log), or null: element (b, h, row) at b*lse_stride_batch + h*lse_stride_head + first_row_of_b + row", align=4),
    Param("cache_seqlens", "ptr", Pointer("cache_seqlens"), "int32 (B): positions of each sequence's cache that hold keys", align=4),
    Param("page_table", "ptr", Pointer("page_table"), "int32 (B, max_pages) page of each page-size run of positions; null: contiguous", align=4),
    Param("query_offsets", "ptr", Pointer("cu_seqlens_q"), "int32 (B+1) query row offsets (ragged q: cu_seqlens_q), else null", align=4),
    Param("q_stride_batch", "i64", Stride("q", "batch"), "elements between sequences of q (0 ragged)"),
    Param("q_stride_row", "i64", Stride("q", "row"), "elements between query rows of q"),
    Param("q_stride_head", "i64", Stride("q", "head"), "elements between heads of q"),
    Param("o_stride_batch", "i64", Stride("o", "batch"), "elements between sequences of o (0 ragged)"),
    Param("o_stride_row", "i64", Stride("o", "row"), "elements between rows of o"),
    Param("o_stride_head", "i64", Stride("o", "head"), "elements between heads of o"),
    *(Param(f"{t}_stride_{axis}", "i64", Stride(f"{t}_cache", a), f"elements between {axis}s of {t}_cache")
      for t in "kv" for axis, a in (("page", "batch"), ("row", "row"), ("head", "head"))),
    Param("page_table_stride", "i64", CallValue("page_table_stride"), "entries between sequences of page_table (0 contiguous)"),
    Param("lse_stride_batch", "i64", CallValue("lse_stride_batch"), "floats between sequences of lse: Hq*Sq dense, 0 ragged"),
    Param("lse_stride_head", "i64", CallValue("lse_stride_head"), "floats between heads of lse: Sq dense, total_q ragged"),
    Param("batch", "i32", CallValue("batch"), "sequences B"),
    Param("num_heads", "i32", CallValue("kv_heads"), "K/V heads Hkv: the scheduler's heads (a tile packs the group's query heads)"),
    Param("query_rows", "i32", CallValue("query_rows"), "query rows per sequence (dense)"),
    Param("cache_capacity", "i32", CallValue("cache_capacity"), "positions a sequence's cache holds (max_pages * page_size, or the contiguous cache's length); longer cache_seqlens are clamped to it"),
    Param("q_tiles", "i32", CallValue("q_tiles"), "packed-row tiles per sequence"),
    Param("num_splits", "i32", CallValue("num_splits"), "KV splits per sequence"),
    Param("kv_chunk", "i32", CallValue("kv_chunk"), "cache positions per split, a multiple of the KV tile"),
    Param("work_tiles", "i32", CallValue("work_tiles"), "q_tiles * num_splits: the scheduler's prompt tiles"),
    Param("softmax_scale", "f32", CallValue("softmax_scale"), "scale applied to q.k before the score rule / softmax"),
    Param("partial_o", "ptr", Workspace("partial_o"), "fp32 (slots, rows, D) partial outputs of split groups: num_splits slots a group (balanced: a slot a work tile)", align=16),
    Param("partial_lse", "ptr", Workspace("partial_lse"), "fp32 (slots, rows) partial LSEs", align=4),
    Param("split_counters", "ptr", Workspace("split_counters"), "u32 per (batch, K/V head, q tile): splits finished; zero between launches", align=4),
    Param("queue", "ptr", Workspace("queue"), "per-stream u32 workspace: the work-queue counter and the scheduler fault record (mhadsl/abi.py)", align=4),
    Param("num_sms", "i32", CallValue("num_sms"), "multiprocessors on the device"),
    Param("ctas_per_sm", "i32", CallValue("ctas_per_sm"), "CTAs of this kernel that fit on one multiprocessor"),
)


# A call that appends the step's rows (`DecodeConfig.appends`): both of its kernels take
# these parameters after the decode kernel's.
APPEND_ABI = KernelABI(
    *ABI,
    *(Param(f"{t}_new", "ptr", Pointer(f"{t}_new"), f"the step's new {what}: q's layout with "
            "Hkv heads, a row per query row", align=16) for t, what in (("k", "keys"),
                                                                      ("v", "values"))),
    *(Param(f"{t}_new_stride_{axis}", "i64", Stride(f"{t}_new", axis),
            f"elements between {axis}s of {t}_new (batch: 0 ragged)")
      for t in "kv" for axis in ("batch", "row", "head")),
    Param("cache_pages", "i32", Extent("k_cache", 0), "pages of a paged cache (sequences of a "
          "contiguous one): a page-table entry outside them is not written"),
)
# An FP8 cache's scales (`DecodeConfig.fp8`): both kernels take them after the others.
FP8_PARAMS = tuple(
    Param(f"{t}_scale", "f32", CallValue(f"{t}_scale"), f"{what} = {t}_cache's element x "
          f"{t}_scale (float8_e4m3fn); the append stores its new rows / {t}_scale")
    for t, what in (("k", "keys"), ("v", "values")))
APPEND_NAME = "mha_decode_append"
APPEND_THREADS = 128
APPEND_ROW_BLOCKS = 64  # the append's grid is (batch, up to this many query rows)


# Splits that follow the lengths (`DecodeConfig.balanced`): every kernel of the call takes
# these after the others; `mha_decode_splits` writes the index the decode kernel reads.
BALANCE_PARAMS = (
    Param("split_index", "ptr", Workspace("split_index"), "u32 tile index of the (query-row "
          "tile x split) work tiles of each sequence (mhadsl.abi.tile_index_words(B) words), "
          "built on the device from the lengths by mha_decode_splits", align=4),
    Param("split_slots", "i32", CallValue("kv_slots"), "chunks the batch's work aims at (a "
          "few per multiprocessor: serving.CHUNKS_PER_SM)"),
)
SPLITS_NAME = "mha_decode_splits"
SPLITS_THREADS = tile_index.THREADS  # a warp per sequence
MIN_SPLIT_TILES = 4  # KV tiles a split covers at least (shorter ones cost more than they gain)
MAX_CHUNK_TILES = 1 << 30  # (keeps the splits' arithmetic in 32 bits)


def even_chunk(capacity: int, num_splits: int, block_n: int) -> int:
    """Cache positions a fixed split covers: the capacity over the splits, in whole KV
    tiles (the planner may then use fewer splits, none left empty)."""
    per_split = -(-capacity // num_splits)
    return -(-per_split // block_n) * block_n


def decode_abi(config: DecodeConfig) -> KernelABI:
    abi = APPEND_ABI if config.appends else ABI
    extra = (FP8_PARAMS if config.fp8 else ()) + (BALANCE_PARAMS if config.balanced else ())
    return KernelABI(*abi, *extra) if extra else abi


def _scheduler_view(args: KernelArgs, config: DecodeConfig) -> None:
    """What the scheduler's work loop reads, in decode's work space: per (sequence, K/V
    head) up to `work_tiles` prompt tiles (query-row tile x split); balanced, as many as
    the split index gives the sequence (its prefix words are the work's row offsets), else
    a dense batch."""
    args.max_seqlen_q = args.seqlen_q = args.work_tiles
    if config.balanced:
        args.cu_seqlens_q = args.tile_index = args.split_index
        return
    null = ir.Constant(nvptx.ptr(GLOBAL), None)
    args.cu_seqlens_q, args.tile_index = null, null


# ============================================================================ IR helpers
def _i64(b, v):
    return b.sext(v, i64)


def _min(b, x, y):
    return b.select(b.icmp_signed("<", x, y), x, y)


def _max1(b, x):
    return b.select(b.icmp_signed("<", x, i32(1)), i32(1), x)


def _fence(b: ir.IRBuilder) -> None:
    b.asm(ir.FunctionType(nvptx.void, []), "fence.acq_rel.gpu;", "", [], True)


def _load_l2(b: ir.IRBuilder, ptr: ir.Value, lanes: int) -> list[ir.Value]:
    """`lanes` f32 read at the L2 (other CTAs wrote them in this launch; L1 may be stale)."""
    if lanes == 1:
        return [b.asm(ir.FunctionType(f32, [ptr.type]), "ld.global.cg.f32 $0, [$1];", "=f,l",
                      [ptr], True)]
    ret = ir.LiteralStructType([f32] * lanes)
    regs = ",".join(f"${i}" for i in range(lanes))
    res = b.asm(ir.FunctionType(ret, [ptr.type]),
                f"ld.global.cg.v{lanes}.f32 {{{regs}}}, [${lanes}];",
                ",".join(["=f"] * lanes) + ",l", [ptr], True)
    return [b.extract_value(res, i) for i in range(lanes)]


# ============================================================================ the tile
class _DecodeTile:
    """One work tile: (sequence, K/V head, query-row tile, split)."""

    def __init__(self, c: DecodeConfig, hooks: ExprHooks, b: ir.IRBuilder, a: KernelArgs,
                 seq: TileSeq):
        self.c, self.hooks, self.a, self.seq = c, hooks, a, seq
        self.rules = TileRules(hooks, self)
        self.bidx, self.hk = seq.prompt_idx, seq.head_idx
        self.k_start = i32(0)  # (keys are cache positions: every sequence's from 0)
        if c.balanced:
            self._balanced_split(b)
        else:
            self._even_split(b)
        self.n_begin = b.udiv(self.kv_begin, i32(c.block_n))
        self.n_end = b.udiv(b.add(self.kv_end, i32(c.block_n - 1)), i32(c.block_n))
        self.q_lo = b.udiv(self.r0, i32(c.gqa_group))
        self.q_hi = b.udiv(last_index(b, self.r0, c.rows, self.packed_rows), i32(c.gqa_group))

    def _even_split(self, b: ir.IRBuilder) -> None:
        """Splits of `kv_chunk` positions: split s covers [s kv_chunk, (s + 1) kv_chunk) of
        the sequence's keys, and a sequence uses the chunks its keys reach."""
        a = self.a
        self.q_tile = b.udiv(self.seq.prompt_offset, a.num_splits)
        self.split = b.urem(self.seq.prompt_offset, a.num_splits)
        self._rows(b)
        self.seqlen_k = self._keys(b)
        self.kv_begin = b.mul(self.split, a.kv_chunk)
        self.kv_end = _min(b, b.add(self.kv_begin, a.kv_chunk), self.seqlen_k)
        chunks = b.udiv(b.add(self.seqlen_k, b.sub(a.kv_chunk, i32(1))), a.kv_chunk)
        self.splits_used = b.select(b.icmp_signed("<", chunks, i32(1)), i32(1),
                                    _min(b, chunks, a.num_splits))

    def _balanced_split(self, b: ir.IRBuilder) -> None:
        """Splits that follow the lengths: the split index gives the sequence's work tiles
        (query-row tiles x its splits) and where its first one is; its n KV tiles go to its
        splits, ceil(n / splits) each (every split has some: `balanced_splits`)."""
        c, a = self.c, self.a
        index = a.split_index
        self._query_rows(b)
        self.first_work = b.load(b.gep(index, [self.bidx], source_etype=i32), typ=i32)
        end = b.load(b.gep(index, [b.add(self.bidx, i32(1))], source_etype=i32), typ=i32)
        self.work = b.sub(end, self.first_work)
        packed = b.mul(self.seqlen_q, i32(c.gqa_group))
        q_tiles = _max1(b, _min(b, b.udiv(b.add(packed, i32(c.rows - 1)), i32(c.rows)),
                                a.q_tiles))
        self.splits_used = _max1(b, b.udiv(self.work, q_tiles))
        self.q_tile = b.udiv(self.seq.prompt_offset, self.splits_used)
        self.split = b.urem(self.seq.prompt_offset, self.splits_used)
        self._rows(b)
        self.seqlen_k = self._keys(b)
        n = b.udiv(b.add(self.seqlen_k, i32(c.block_n - 1)), i32(c.block_n))
        per = b.udiv(b.add(n, b.sub(self.splits_used, i32(1))), self.splits_used)
        chunk = b.mul(per, i32(c.block_n))
        self.kv_begin = b.mul(self.split, chunk)
        self.kv_end = _min(b, b.add(self.kv_begin, chunk), self.seqlen_k)

    def _query_rows(self, b: ir.IRBuilder) -> None:
        a = self.a
        if self.c.query_rows:
            self.q_start, self.seqlen_q = i32(0), a.query_rows
        else:
            cu = a.query_offsets
            self.q_start = b.load(b.gep(cu, [self.bidx], source_etype=i32), typ=i32)
            end = b.load(b.gep(cu, [b.add(self.bidx, i32(1))], source_etype=i32), typ=i32)
            self.seqlen_q = b.sub(end, self.q_start)

    def _rows(self, b: ir.IRBuilder) -> None:
        """The sequence's query rows (balanced: read already) and the tile's packed rows."""
        if not self.c.balanced:
            self._query_rows(b)
        self.r0 = b.mul(self.q_tile, i32(self.c.rows))
        self.packed_rows = b.mul(self.seqlen_q, i32(self.c.gqa_group))
        self.rows_valid = b.sub(self.packed_rows, self.r0)

    def _keys(self, b: ir.IRBuilder) -> ir.Value:
        """The sequence's keys: its cache length (and the rows it appends), within the
        cache (unchecked device values stay in bounds)."""
        a = self.a
        stored = b.load(b.gep(a.cache_seqlens, [self.bidx], source_etype=i32), typ=i32)
        if self.c.appends:  # the step's rows, now in the cache, follow cache_seqlens[b] of it
            stored = b.add(stored, self.seqlen_q)
        clamped = _min(b, stored, a.cache_capacity)
        return b.select(b.icmp_signed("<", clamped, i32(0)), i32(0), clamped)

    def partial_first(self, b: ir.IRBuilder, group: ir.Value) -> ir.Value:
        """The partial-state slot (i64) of split 0 of the tile's group (`group`: its index,
        `_Emitter._group`): num_splits slots a group; balanced, the work tiles' own order,
        K/V head by K/V head within each sequence (at most kv_heads x q_tiles x B +
        kv_slots slots: `Decode.scratch`)."""
        if not self.c.balanced:
            return b.mul(group, _i64(b, self.a.num_splits))
        heads_before = b.add(b.mul(_i64(b, self.first_work), _i64(b, self.a.num_heads)),
                             b.mul(_i64(b, self.hk), _i64(b, self.work)))
        return b.add(heads_before, b.mul(_i64(b, self.q_tile), _i64(b, self.splits_used)))

    def runs(self, b: ir.IRBuilder) -> ir.Value:
        """Whether the tile has rows and is one of its sequence's used splits (balanced:
        one of the work tiles the index gives it, whatever offsets its scheduler hands out,
        so no tile of an unchecked longer sequence reaches past the planned groups)."""
        runs = b.and_(b.icmp_signed(">", self.rows_valid, i32(0)),
                      b.icmp_signed("<", self.split, self.splits_used))
        if self.c.balanced:
            runs = b.and_(runs, b.icmp_unsigned("<", self.seq.prompt_offset, self.work))
        return runs

    def head_of(self, b, packed_row):
        return b.add(b.mul(self.hk, i32(self.c.gqa_group)),
                     b.urem(packed_row, i32(self.c.gqa_group)))

    def classify(self, b: ir.IRBuilder, n: ir.Value) -> tuple[ir.Value, ir.Value]:
        """(may hold a kept pair, every pair kept) for KV tile n over the tile's rows; a mask
        that reads the head is classified for each head of the group."""
        G = self.c.gqa_group
        kv_lo = b.mul(n, i32(self.c.block_n))
        heads = (b.add(b.mul(self.hk, i32(G)), i32(g))
                 for g in (range(G) if self.hooks.mask_uses_head else (0,)))
        return self.rules.classify(b, heads, self.q_lo, self.q_hi, kv_lo, self.c.block_n,
                                   self.kv_end)

    def next_nonempty(self, b: ir.IRBuilder, start: ir.Value) -> ir.Value:
        """The first KV tile >= start of the split that may hold a kept pair, else n_end.
        One candidate per round, as prefill: a decode split spans few tiles, and this kernel's
        bandwidth is sensitive to register shifts."""
        if self.hooks.classify is None:
            return start
        return warp.first_true(b, start, self.n_end, lambda bb, n: self.classify(bb, n)[0],
                               together=False)


class _Emitter:
    """The kernel body: thread-level values once, then `emit_tile` per work tile."""

    def __init__(self, c: DecodeConfig, hooks: ExprHooks, b: ir.IRBuilder, a: KernelArgs,
                 smem: ir.Value, traced: bool = False):
        self.c, self.hooks, self.a, self.smem = c, hooks, a, smem
        self.traced = traced  # `mhadsl trace`: record each combine, after its splits' ends
        self.RB, self.KRB = c.row_bytes, c.kv_row_bytes
        # q.k's scale; an FP8 cache's folds in k_scale (and the integer steps' f16 tiles
        # hold each key / 256)
        self.fp8_unit = 1.0 if c.fp8_cvt else warp.E4M3_PER_F16
        self.qk_scale = b.fmul(a.softmax_scale, b.fmul(a.k_scale, warp.fconst(
            self.fp8_unit))) if c.fp8 else a.softmax_scale
        if c.wgmma:  # offsets count from the first 1024-byte boundary (the swizzle atom)
            pad = b.and_(b.sub(i32(0), hopper.shared_address(b, smem)),
                         i32(hopper.SWIZZLE_ATOM_BYTES - 1))
            self.smem = warp.smem_ptr(b, smem, pad)
        self.kv_off = c.rows * self.RB
        self.flag_off = 0 if c.wgmma else \
            self.kv_off + max(c.stages * c.stage_bytes, c.merge_bytes)
        tid = nvptx.opaque_special_register(b, "tid.x")
        self.tid = tid
        lane = b.and_(tid, i32(31))
        warp_id = b.lshr(tid, i32(5))
        self.wm = b.urem(warp_id, i32(c.warps_m))
        self.wn = b.udiv(warp_id, i32(c.warps_m))
        self.g = b.lshr(lane, i32(2))
        self.t = b.and_(lane, i32(3))
        r8 = b.and_(lane, i32(7))
        m_lo = b.and_(b.lshr(lane, i32(3)), i32(1))
        m_hi = b.lshr(lane, i32(4))
        self.warp_row = b.mul(self.wm, i32(16))
        self.warp_col = b.mul(self.wn, i32(c.warp_cols))
        # ldmatrix lane offsets {lo: row*RB + (x16 ^ lo)} (as the sm80 design's _lane_bases)
        self.q_lanes = self._lane_offsets(b, b.add(self.warp_row, b.add(b.shl(m_lo, i32(3)), r8)),
                                          b.shl(b.xor(m_hi, r8), i32(4)))
        if c.fp8:  # one pattern for K and V: matrices (rows 0-7, 8-15) x (chunks x, x + 1)
            self.k_lanes = self.v_lanes = self._lane_offsets(
                b, b.add(self.warp_col, b.add(b.shl(m_lo, i32(3)), r8)),
                b.shl(b.xor(m_hi, self._kv_swizzle(b, r8)), i32(4)), self.KRB)
        else:
            self.k_lanes = self._lane_offsets(
                b, b.add(self.warp_col, b.add(b.shl(m_hi, i32(3)), r8)),
                b.shl(b.xor(m_lo, r8), i32(4)))
            self.v_lanes = self._lane_offsets(
                b, b.add(self.warp_col, b.add(b.shl(m_lo, i32(3)), r8)),
                b.shl(b.xor(m_hi, r8), i32(4)))
        # cp.async pattern: thread -> (row in pass, 16-byte chunk)
        cpr = c.head_dim // 8
        self.ld_row = b.udiv(tid, i32(cpr))
        self.ld_chunk = b.urem(tid, i32(cpr))
        # the swizzle follows the row's low 3 bits: where a pass is not a multiple of 8 rows
        # its phase (pass rows mod 8) picks the base
        self.ld_swz = {}
        # the wgmma build's tiles are wgmma's (and TMA's) 128-byte-swizzled layout: 64-column
        # boxes of 128-byte rows, element (r, c) of an R-row tile at byte
        # (c / 64) R 128 + 128 r + 16 ((c / 8 mod 8) xor (r mod 8)); else rows of RB bytes,
        # element (r, c) at RB r + 16 ((c / 8) xor (r mod 8))
        self.row_stride = hopper.SWIZZLE_BYTES if c.wgmma else self.RB
        for phase in sorted({p * c.rows_per_pass % 8 for p in range(c.block_n)}):
            row = b.add(self.ld_row, i32(phase))
            chunk = b.and_(self.ld_chunk, i32(7)) if c.wgmma else self.ld_chunk
            self.ld_swz[phase] = b.add(b.mul(self.ld_row, i32(self.row_stride)),
                                       b.shl(warp.swizzle_chunk(b, chunk, row), i32(4)))
        self.ld_box = b.lshr(self.ld_chunk, i32(3))  # the wgmma layout's 64-column box
        self.ld_elem = b.zext(b.shl(self.ld_chunk, i32(3)), i64)
        # the K/V copies: an FP8 cache's rows are head_dim bytes, 16 elements a chunk
        self.kv_ld_row, self.kv_ld_swz, self.kv_ld_elem = self.ld_row, self.ld_swz, self.ld_elem
        if c.fp8:
            chunks = c.kv_row_bytes // 16
            self.kv_ld_row, chunk = b.udiv(tid, i32(chunks)), b.urem(tid, i32(chunks))
            self.kv_ld_swz = {
                phase: b.add(b.mul(self.kv_ld_row, i32(self.KRB)), b.shl(b.xor(
                    chunk, self._kv_swizzle(b, b.add(self.kv_ld_row, i32(phase)))), i32(4)))
                for phase in sorted({p * c.kv_rows_per_pass % 8 for p in range(c.block_n)})}
            self.kv_ld_elem = b.zext(b.shl(chunk, i32(4)), i64)

    def _kv_swizzle(self, b, row):
        """What an FP8 K/V tile's 16-byte chunk index is XORed with in `row`: row % 8, as
        `warp.swizzle_chunk`; rows of 64 bytes (head dim 64) pair up into 128-byte lines,
        (row / 2) % 4, so 8 rows at one chunk still meet 8 bank groups."""
        if self.KRB >= 128:
            return b.and_(row, i32(7))
        return b.and_(b.lshr(row, i32(1)), i32(3))

    def _copy_dst(self, b, p: int, base: int | ir.Value, tile_rows: int,
                  kv: bool = False) -> ir.Value:
        """Shared byte offset of this thread's 16 bytes in copy pass p of a tile of
        `tile_rows` rows at `base` (`kv`: a K or V tile, whose rows may be FP8's)."""
        if kv and self.c.fp8:
            rows = p * self.c.kv_rows_per_pass
            return b.add(self.kv_ld_swz[rows % 8], b.add(base, i32(rows * self.KRB)))
        rows = p * self.c.rows_per_pass
        RS = self.row_stride
        if self.c.wgmma:
            swz = b.add(self.ld_swz[rows % 8],
                        b.mul(self.ld_box, i32(tile_rows * hopper.SWIZZLE_BYTES)))
        else:
            swz = self.ld_swz[rows % 8]
        return b.add(swz, b.add(base, i32(rows * RS)) if
                     isinstance(base, ir.Value) else i32(base + rows * RS))

    def _lane_offsets(self, b, row, x16, row_bytes: int | None = None):
        row_bytes = row_bytes or self.RB
        row_off = b.mul(row, i32(row_bytes))
        return {lo: b.add(row_off, b.xor(x16, i32(lo))) for lo in (0, 32, 64, 96)
                if lo < row_bytes}

    def _ld(self, b, lanes, region: ir.Value, row_const: int, chunk_const: int, trans=False,
            row_bytes: int | None = None):
        c16 = chunk_const * 16
        lo, hi = c16 & 127, c16 & ~127
        off = b.add(b.add(region, lanes[lo]), i32(row_const * (row_bytes or self.RB) + hi))
        return warp.ldmatrix_x4(b, warp.smem_ptr(b, self.smem, off), trans=trans)

    # ------------------------------------------------------------------ global -> shared
    def _page_keys(self) -> list:
        """Per copy pass of a KV tile, the page entry it reads: k (an int) for the tile's
        k-th page, the same for every thread; ("pass", p) where pages are shorter than a
        pass, so each thread reads its own row's."""
        c = self.c
        rpp, passes = c.kv_rows_per_pass, c.block_n // c.kv_rows_per_pass
        if c.page_size >= c.block_n:
            return [0] * passes
        if c.page_size >= rpp:
            return [p * rpp // c.page_size for p in range(passes)]
        return [("pass", p) for p in range(passes)]

    def _fetch_pages(self, b, t: _DecodeTile, n: ir.Value) -> list[ir.Value]:
        """The pages of KV tile n (one per distinct `_page_keys` entry), from the page table;
        a contiguous cache's "page" is the sequence. An entry whose row lies past the split
        (its copies load nothing) reads the sequence's cache length instead, so no read
        goes past the table."""
        c, a = self.c, self.a
        if c.page_size == 0:
            return [t.bidx]
        base = b.mul(n, i32(c.block_n))
        seq_pages = b.gep(a.page_table, [b.mul(_i64(b, t.bidx), a.page_table_stride)],
                          source_etype=i32)
        fallback = b.gep(a.cache_seqlens, [t.bidx], source_etype=i32)
        pages = []
        for key in dict.fromkeys(self._page_keys()):
            row = b.add(self.kv_ld_row, i32(key[1] * c.kv_rows_per_pass)) \
                if isinstance(key, tuple) \
                else i32(key * c.page_size)
            pos = b.add(base, row)
            entry = b.gep(seq_pages, [b.lshr(pos, i32(c.page_shift))], source_etype=i32)
            live = b.icmp_signed("<", pos, t.kv_end)
            pages.append(b.load(b.select(live, entry, fallback), typ=i32))
        return pages

    def _load_kv(self, b, t: _DecodeTile, n: ir.Value, slot_off: ir.Value,
                 pages: list[ir.Value]) -> None:
        """cp.async KV tile n (K, then V) into the stage at slot_off; positions at or past
        the split's end are zero-filled (nothing read)."""
        c, a = self.c, self.a
        rpp = c.kv_rows_per_pass
        keys = self._page_keys()
        distinct = list(dict.fromkeys(keys))
        base = b.mul(n, i32(c.block_n))
        for gptr, s_page, s_row, s_head, region in (
                (a.k_cache, a.k_stride_page, a.k_stride_row, a.k_stride_head, 0),
                (a.v_cache, a.v_stride_page, a.v_stride_row, a.v_stride_head,
                 c.block_n * self.KRB)):
            head = b.add(b.mul(_i64(b, t.hk), s_head), self.kv_ld_elem)
            tile_base = b.add(slot_off, i32(self.kv_off + region))
            for p, key in enumerate(keys):
                row = b.add(self.kv_ld_row, i32(p * rpp))
                pos = b.add(base, row)
                page = pages[distinct.index(key)] if c.page_size else pages[0]
                in_page = pos if c.page_size == 0 else b.and_(pos, i32(c.page_size - 1))
                off = b.add(b.add(b.mul(_i64(b, page), s_page), b.mul(_i64(b, in_page), s_row)),
                            head)
                valid = b.icmp_signed("<", pos, t.kv_end)
                src = b.gep(gptr, [off], source_etype=nvptx.i8 if c.fp8 else nvptx.i16)
                dst = warp.smem_ptr(b, self.smem, self._copy_dst(b, p, tile_base, c.block_n,
                                                                 kv=True))
                warp.cp_async_16(b, dst, b.select(valid, src, gptr),
                                 b.select(valid, i32(16), i32(0)))

    def _load_q(self, b, t: _DecodeTile) -> None:
        """cp.async the tile's packed query rows; rows past the sequence's are zero-filled."""
        c, a = self.c, self.a
        G = c.gqa_group
        seq = b.add(b.mul(_i64(b, t.bidx), a.q_stride_batch),
                    b.mul(_i64(b, t.q_start), a.q_stride_row))
        for p in range(c.rows // c.rows_per_pass):
            row = b.add(self.ld_row, i32(p * c.rows_per_pass))
            packed = b.add(t.r0, row)
            valid = b.icmp_signed("<", row, t.rows_valid)
            off = b.add(seq, b.add(b.mul(_i64(b, b.udiv(packed, i32(G))), a.q_stride_row),
                                   b.mul(_i64(b, t.head_of(b, packed)), a.q_stride_head)))
            src = b.gep(a.q, [b.add(off, self.ld_elem)], source_etype=nvptx.i16)
            dst = warp.smem_ptr(b, self.smem, self._copy_dst(b, p, 0, c.rows))
            warp.cp_async_16(b, dst, b.select(valid, src, a.q), b.select(valid, i32(16), i32(0)))

    # ------------------------------------------------------------------ the tile
    def emit_tile(self, b: ir.IRBuilder, seq: TileSeq) -> None:
        c = self.c
        t = _DecodeTile(c, self.hooks, b, self.a, seq)
        with b.if_then(t.runs(b)):
            self._emit(b, t)

    def _emit(self, b: ir.IRBuilder, t: _DecodeTile) -> None:
        c = self.c
        S = c.stages
        DT = c.head_dim // 8
        zero, ninf = warp.fconst(0.0), warp.fconst(warp.NEG_INF)
        sl2 = t.rules.scale_log2(b, self.qk_scale)

        nvptx.barrier_all(b)  # the previous tile is done with shared memory
        self._load_q(b, t)
        # prologue: the first S-1 tiles in flight, one commit group each (empty ones too,
        # so the wait counts stay uniform)
        ld = n_first = t.next_nonempty(b, t.n_begin)
        for s in range(S - 1):
            with b.if_then(b.icmp_signed("<", ld, t.n_end)):
                self._load_kv(b, t, ld, i32(s * c.stage_bytes), self._fetch_pages(b, t, ld))
            warp.cp_async_commit(b)
            ld = t.next_nonempty(b, b.add(ld, i32(1)))
        # the next page_lookahead tiles to load and their pages: a page entry is read that
        # many iterations before its tile's copies need it
        ahead = [ld]
        for _ in range(c.page_lookahead - 1):
            ahead.append(t.next_nonempty(b, b.add(ahead[-1], i32(1))))
        ahead_pages = [self._fetch_pages(b, t, x) for x in ahead]
        if c.fp8:  # Q landed with the first tile: into the FP8 tiles' fp16 and order
            warp.cp_async_wait(b, S - 2)
            nvptx.barrier_all(b)
            self._q_to_f16(b)
        if t.seq.advance is not None:  # its atomics under the first tiles' loads
            t.seq.advance(b)

        fn = b.function
        pre = b.block
        hdr, body, done = (fn.append_basic_block(f"kv.{s}") for s in ("hdr", "body", "done"))
        b.branch(hdr)
        b.position_at_end(hdr)
        n, it = b.phi(i32, "n"), b.phi(i32, "it")
        ld_phis = [b.phi(i32, "ld") for _ in ahead]
        page_phis = [[b.phi(i32) for _ in pages] for pages in ahead_pages]
        acc = [[b.phi(f32) for _ in range(4)] for _ in range(DT)]
        m = [b.phi(f32) for _ in range(2)]
        l = [b.phi(f32) for _ in range(2)]
        n.add_incoming(n_first, pre)
        it.add_incoming(i32(0), pre)
        for phi, v in zip(ld_phis, ahead):
            phi.add_incoming(v, pre)
        for phis, pages in zip(page_phis, ahead_pages):
            for phi, v in zip(phis, pages):
                phi.add_incoming(v, pre)
        for row in acc:
            for x in row:
                x.add_incoming(zero, pre)
        for r in range(2):
            m[r].add_incoming(ninf, pre)
            l[r].add_incoming(zero, pre)
        b.cbranch(b.icmp_signed("<", n, t.n_end), body, done)

        b.position_at_end(body)
        warp.cp_async_wait(b, S - 2)
        if c.wgmma:  # the copies' writes, before wgmma (the async proxy) reads them
            hopper.fence_proxy_async(b)
        nvptx.barrier_all(b)  # tile `it` landed; every warp is done with tile it - 1's stage
        issue_slot = b.urem(b.add(it, i32(S - 1)), i32(S))
        with b.if_then(b.icmp_signed("<", ld_phis[0], t.n_end)):
            self._load_kv(b, t, ld_phis[0], b.mul(issue_slot, i32(c.stage_bytes)),
                          page_phis[0])
        warp.cp_async_commit(b)
        ld_new = t.next_nonempty(b, b.add(ld_phis[-1], i32(1)))
        pages_new = self._fetch_pages(b, t, ld_new)  # in flight while tiles compute
        stage = b.add(b.mul(b.urem(it, i32(S)), i32(c.stage_bytes)), i32(self.kv_off))
        acc_new, m_new, l_new = self._kv_tile(b, t, n, stage, acc, m, l, sl2)
        n_next = t.next_nonempty(b, b.add(n, i32(1)))
        latch = b.block
        n.add_incoming(n_next, latch)
        it.add_incoming(b.add(it, i32(1)), latch)
        for phi, v in zip(ld_phis, [*ld_phis[1:], ld_new]):
            phi.add_incoming(v, latch)
        for phis, pages in zip(page_phis, [*page_phis[1:], pages_new]):
            for phi, v in zip(phis, pages):
                phi.add_incoming(v, latch)
        for j in range(DT):
            for e in range(4):
                acc[j][e].add_incoming(acc_new[j][e], latch)
        for r in range(2):
            m[r].add_incoming(m_new[r], latch)
            l[r].add_incoming(l_new[r], latch)
        b.branch(hdr)

        b.position_at_end(done)
        warp.cp_async_wait(b, 0)
        nvptx.barrier_all(b)  # every stage is free: the merge may reuse it
        self._epilogue(b, t, acc, m, l, sl2)

    def _q_to_f16(self, b) -> None:
        """Q's tile in shared memory, in fp16 and each 16 columns reordered to meet an FP8
        K tile's fragments: a K register holds a row's columns 4t..4t+3 as pairs (4t, 4t+2)
        and (4t+1, 4t+3) (`warp.e4m3_pair_to_f16`), which the mma pairs with Q's columns
        (2t, 2t+1) and (2t+8, 2t+9); so those now hold Q's 4t, 4t+2 and 4t+1, 4t+3."""
        c = self.c
        groups = c.head_dim // 16  # 16 columns: two 16-byte chunks
        items = c.rows * groups
        vec = ir.VectorType(i32, 4)
        for k in range(-(-items // c.threads)):
            item = b.add(self.tid, i32(k * c.threads))
            with b.if_then(b.icmp_unsigned("<", item, i32(items))):
                row, group = b.udiv(item, i32(groups)), b.urem(item, i32(groups))
                ptrs = [warp.smem_ptr(b, self.smem, b.add(b.mul(row, i32(self.RB)), b.shl(
                    warp.swizzle_chunk(b, b.add(b.shl(group, i32(1)), i32(h)), row), i32(4))))
                    for h in range(2)]
                words = [b.extract_element(b.load(ptr, typ=vec, align=16), i32(e))
                         for ptr in ptrs for e in range(4)]
                q = [x for w in words for x in warp.unpack2(b, c.dtype, w)]
                for h, ptr in enumerate(ptrs):
                    pairs = [warp.pack2(b, "fp16", q[4 * j + h], q[4 * j + h + 2])
                             for j in range(4)]
                    warp.store(b, warp.vector(b, pairs), ptr, align=16)

    def _kv_tile(self, b, t: _DecodeTile, n, stage, acc_in, m_in, l_in, sl2):
        """One KV tile for this warp's 16 rows and its columns: S = Q K^T, score, mask,
        online softmax, O += P V."""
        c, hooks = self.c, self.hooks
        NT, DT = c.warp_cols // 8, c.head_dim // 8
        dt = c.mma_dtype
        zero = warp.fconst(0.0)
        k_region, v_region = stage, b.add(stage, i32(c.block_n * self.KRB))
        if c.wgmma:
            s = self._wgmma_scores(b, k_region)
        elif c.fp8:  # a K load: 16 rows x 32 columns, two k-steps of two n-tiles
            s = [[zero] * 4 for _ in range(NT)]
            for kp in range(c.head_dim // 32):
                qa = [self._ld(b, self.q_lanes, i32(0), 0, 2 * kk) for kk in (2 * kp, 2 * kp + 1)]
                for jp in range(NT // 2):
                    kb = self._ld(b, self.k_lanes, k_region, jp * 16, 2 * kp,
                                  row_bytes=self.KRB)
                    for m, (j, kk) in enumerate(((0, 0), (1, 0), (0, 1), (1, 1))):
                        s[2 * jp + j] = warp.mma_m16n8k16(b, dt, qa[kk], self._f16(b, kb[m]),
                                                          s[2 * jp + j])
        else:
            s = [[zero] * 4 for _ in range(NT)]
            for kk in range(c.head_dim // 16):
                qa = self._ld(b, self.q_lanes, i32(0), 0, 2 * kk)
                for jp in range(NT // 2):
                    kb = self._ld(b, self.k_lanes, k_region, jp * 16, 2 * kk)
                    s[2 * jp] = warp.mma_m16n8k16(b, dt, qa, kb[0:2], s[2 * jp])
                    s[2 * jp + 1] = warp.mma_m16n8k16(b, dt, qa, kb[2:4], s[2 * jp + 1])

        kv_base = b.add(b.mul(n, i32(c.block_n)), self.warp_col)
        packed = [b.add(t.r0, b.add(self.warp_row, b.add(self.g, i32(8 * r)))) for r in range(2)]
        q_idx = [b.udiv(p, i32(c.gqa_group)) for p in packed]
        heads = [t.head_of(b, p) for p in packed]

        def kv_idx(j, e):
            return b.add(kv_base, b.add(b.shl(self.t, i32(1)), i32(j * 8 + (e & 1))))

        if hooks.score is not None:
            s = [[t.rules.score(b, b.fmul(s[j][e], self.qk_scale), heads[e >> 1],
                                q_idx[e >> 1], kv_idx(j, e)) for e in range(4)]
                 for j in range(NT)]

        _, always = t.classify(b, n)

        def mask(bb):
            return [t.rules.masked(bb, s[j][e], heads[e >> 1], q_idx[e >> 1], kv_idx(j, e),
                                   kv_end=t.kv_end) for j in range(NT) for e in range(4)]
        flat = masked_unless(b, always, [v for row in s for v in row], mask)
        s = [flat[4 * j:4 * j + 4] for j in range(NT)]

        acc = [list(x) for x in acc_in]
        m_new, l_new, p_vals = [None, None], [None, None], [[None] * 4 for _ in range(NT)]
        for r in range(2):
            idx = [(j, 2 * r + e2) for j in range(NT) for e2 in range(2)]
            p, m_new[r], l_new[r], alpha = warp.online_softmax_row(
                b, [s[j][e] for j, e in idx], m_in[r], l_in[r], sl2)
            for (j, e), v in zip(idx, p):
                p_vals[j][e] = v
            for j in range(DT):
                for e2 in range(2):
                    acc[j][2 * r + e2] = b.fmul(acc[j][2 * r + e2], alpha)
        if c.wgmma:
            return self._wgmma_pv(b, v_region, acc, p_vals), m_new, l_new
        for ks in range(c.warp_cols // 16):
            pa = [warp.pack2(b, dt, p_vals[2 * ks][0], p_vals[2 * ks][1]),
                  warp.pack2(b, dt, p_vals[2 * ks][2], p_vals[2 * ks][3]),
                  warp.pack2(b, dt, p_vals[2 * ks + 1][0], p_vals[2 * ks + 1][1]),
                  warp.pack2(b, dt, p_vals[2 * ks + 1][2], p_vals[2 * ks + 1][3])]
            if c.fp8:
                self._fp8_pv(b, v_region, ks, pa, acc)
                continue
            for jp in range(DT // 2):
                vb = self._ld(b, self.v_lanes, v_region, ks * 16, 2 * jp, trans=True)
                acc[2 * jp] = warp.mma_m16n8k16(b, dt, pa, vb[0:2], acc[2 * jp])
                acc[2 * jp + 1] = warp.mma_m16n8k16(b, dt, pa, vb[2:4], acc[2 * jp + 1])
        return acc, m_new, l_new

    def _f16(self, b, word):
        """A B fragment (two i32 of f16 pairs) from an FP8 K or V register: bytes 0 and 2,
        then 1 and 3."""
        if self.c.fp8_cvt:
            return list(warp.e4m3_quad_to_f16(b, word))
        return [warp.e4m3_pair_to_f16(b, word, odd) for odd in (False, True)]

    def _fp8_pv(self, b, v_region, ks: int, pa, acc) -> None:
        """O += P V over KV rows 16 ks.. of an FP8 V tile. A transposed load of 8 rows x 16
        bytes gives thread (g, t) rows 2t, 2t+1 of columns 2g, 2g+1, so each 16 columns x
        make two n-tiles: acc[2x] holds columns 16x + 2n, acc[2x + 1] columns 16x + 2n + 1
        (`_row_values` puts them back in order)."""
        c = self.c
        for jq in range(c.head_dim // 32):
            vb = self._ld(b, self.v_lanes, v_region, ks * 16, 2 * jq, trans=True,
                          row_bytes=self.KRB)
            for h in range(2):  # columns 16 (2 jq + h)..: rows 0-7 in vb[2h], 8-15 in vb[2h+1]
                top, bottom = self._f16(b, vb[2 * h]), self._f16(b, vb[2 * h + 1])
                for odd in (0, 1):
                    j = 2 * (2 * jq + h) + odd
                    acc[j] = warp.mma_m16n8k16(b, c.mma_dtype, pa, [top[odd], bottom[odd]],
                                               acc[j])

    def _wgmma_scores(self, b, k_region):
        """S = Q K^T of this warpgroup's 64 rows by wgmma (Q and K K-major in shared
        memory), waited for: per 8 columns j, this thread's 4 values in mma.sync's C layout
        (`hopper.accumulator_position`)."""
        c = self.c
        SB = hopper.SWIZZLE_BYTES
        steps = [divmod(32 * k, SB) for k in range(c.head_dim // 16)]
        group_rows = b.mul(b.lshr(self.tid, i32(7)), i32(WGMMA_ROWS * SB))
        q_descs = hopper.smem_descriptors(b, warp.smem_ptr(b, self.smem, group_rows),
                                          [box * c.rows * SB + off for box, off in steps])
        k_descs = hopper.smem_descriptors(b, warp.smem_ptr(b, self.smem, k_region),
                                          [box * c.block_n * SB + off for box, off in steps])
        hopper.wgmma_fence(b)
        s = None
        for q_desc, k_desc in zip(q_descs, k_descs):
            s = hopper.wgmma(b, c.dtype, c.block_n, q_desc, k_desc, s)
        hopper.wgmma_commit_group(b)
        hopper.wgmma_wait_group(b, 0)
        s = hopper.fence_operands(b, s)
        return [s[4 * j:4 * j + 4] for j in range(c.block_n // 8)]

    def _wgmma_pv(self, b, v_region, acc, p_vals):
        """O += P V by wgmma: P from registers (the A fragments of S's layout), V MN-major
        in shared memory; waited for. acc and the result as `_kv_tile`'s."""
        c = self.c
        SB = hopper.SWIZZLE_BYTES
        o = [x for row in acc for x in row]
        p = [x for row in p_vals for x in row]
        flat = hopper.fence_operands(b, o + p)
        o, p = flat[:len(o)], flat[len(o):]
        frags = [hopper.a_fragment(b, c.dtype, p, k) for k in range(c.block_n // 16)]
        v_descs = hopper.smem_descriptors(b, warp.smem_ptr(b, self.smem, v_region),
                                          [16 * k * SB for k in range(c.block_n // 16)],
                                          leading_bytes=c.block_n * SB)
        frags = hopper.fence_operands(b, [x for f in frags for x in f])
        hopper.wgmma_fence(b)
        for k, v_desc in enumerate(v_descs):
            o = hopper.wgmma(b, c.dtype, c.head_dim, frags[4 * k:4 * k + 4], v_desc, o,
                             trans_b=True)
        hopper.wgmma_commit_group(b)
        hopper.wgmma_wait_group(b, 0)
        o = hopper.fence_operands(b, o)
        return [o[4 * j:4 * j + 4] for j in range(c.head_dim // 8)]

    # ------------------------------------------------------------------ the end of a tile
    def _epilogue(self, b, t: _DecodeTile, acc, m, l, sl2) -> None:
        """With one warp per row (`warps_n` 1), O from registers (`_store_rows`); else the
        warps that share rows merge their softmax states through shared memory
        (`_merge_warps`). With more than one split in use, the group's last split to finish
        then merges the splits' partial states (`_finish_split`)."""
        total = [warp.quad_allreduce(b, l[r], warp.fadd) for r in range(2)]
        if self.c.fp8:  # the values' scale, and the integer steps' 1 / 256
            v = b.fmul(self.a.v_scale, warp.fconst(self.fp8_unit))
            acc = [[b.fmul(x, v) for x in row] for row in acc]
        if self.c.warps_n == 1:
            self._store_rows(b, t, acc, m, total, sl2)
        else:
            self._merge_warps(b, t, acc, m, total, sl2)
        with b.if_then(b.icmp_signed("!=", t.splits_used, i32(1))):
            self._finish_split(b, t, self._group(b, t))

    def _finish_rows(self, b, t: _DecodeTile, rows, sl2, store) -> None:
        """Normalise each of `rows` (local row, row max, row sum, O columns) and hand it
        to `store(dst, local, columns, lse)`: dst "o" (O and the LSE, rows inside the
        sequence) with one split in use, else the split's index (its partial state)."""
        def finish(local, top, total, o, sink=False):
            """The row normalised, and its LSE; with `sink`, the sink's logit in both."""
            empty = b.fcmp_unordered("==", total, warp.fconst(0.0))
            if sink:
                inv, lse = warp.sink_finish(b, top, sl2, total, empty,
                                            self._sink_log2(b, t, local))
                return local, [b.fmul(x, inv) for x in o], lse()
            inv = b.select(empty, warp.fconst(0.0), warp.rcp(b, total))
            return local, [b.fmul(x, inv) for x in o], warp.row_lse(b, top, sl2, total, empty)
        finished = [finish(*row) for row in rows]
        with b.if_else(b.icmp_signed("==", t.splits_used, i32(1))) as (single, split):
            with single:  # (a split's partial state leaves the sink out: the merge adds it)
                whole = finished if self.hooks.sink is None else \
                    [finish(*row, sink=True) for row in rows]
                for local, o, lse in whole:
                    with b.if_then(b.icmp_signed("<", local, t.rows_valid)):
                        store("o", local, o, lse)
            with split:
                part = b.add(t.partial_first(b, self._group(b, t)), _i64(b, t.split))
                for local, o, lse in finished:
                    store(part, local, o, lse)

    @staticmethod
    def _sink_log2(b, t: _DecodeTile, local: ir.Value) -> ir.Value:
        """The sink logit (log2 domain) of the tile's packed row `local`'s query head."""
        return t.rules.sink_log2(b, t.head_of(b, b.add(t.r0, local)))

    def _store_rows(self, b, t: _DecodeTile, acc, m, total, sl2) -> None:
        """One warp per row: each thread stores its accumulators of rows g and g + 8."""
        col0, width, run = self._thread_columns(b)
        rows = [(b.add(self.warp_row, b.add(self.g, i32(8 * r))), m[r], total[r],
                 self._row_values(acc, r)) for r in range(2)]
        # this thread's columns: col0 + width j + e, runs of `run` of the row's values
        pieces = [(i32(width * j), run * j) for j in range(self.c.head_dim // width)]
        self._finish_rows(b, t, rows, sl2, lambda dst, local, o, lse: self._store_columns(
            b, t, dst, local, col0, [(off, o[k:k + run]) for off, k in pieces],
            lse, self.t))

    def _thread_columns(self, b) -> tuple[ir.Value, int, int]:
        """(first column, columns apart, values a run) of the O columns this thread's
        accumulators hold: pairs 2t, 2t + 1 every 8 columns, or with an FP8 cache
        (`_fp8_pv`) runs 4t..4t + 3 every 16."""
        if self.c.fp8:
            return b.shl(self.t, i32(2)), 16, 4
        return b.shl(self.t, i32(1)), 8, 2

    def _row_values(self, acc, r: int) -> list[ir.Value]:
        """This thread's accumulators of its row g + 8r, in column order."""
        if not self.c.fp8:
            return [acc[j][2 * r + e] for j in range(self.c.head_dim // 8) for e in range(2)]
        return [acc[2 * x + odd][2 * r + e] for x in range(self.c.head_dim // 16)
                for e in range(2) for odd in range(2)]

    def _merge_warps(self, b, t: _DecodeTile, acc, m, total, sl2) -> None:
        """The warps that share rows merge their states through shared memory (over the
        K/V stages): each writes its unnormalised O and its rows' max and sum; then every
        thread finishes whole 4-column pieces of the tile's rows, reading each warp's part
        once (each warp reading every part of its rows makes the merge longer than a 64-key
        decode call of cuDNN)."""
        c = self.c
        D, R, W = c.head_dim, c.rows, c.warps_n
        stride = D + MERGE_PAD  # floats per partial row
        o_base, stats = self.kv_off, self.kv_off + W * R * stride * 4

        def part_row(wn, row):  # the row of warp column wn's partial O and stats
            return b.add(b.mul(wn, i32(R)), row)

        def fptr(offset):
            return warp.smem_ptr(b, self.smem, offset)

        def stat(k, row):  # the row's max (k = 0) or sum (k = 1)
            return fptr(b.add(i32(stats + k * W * R * 4), b.shl(row, i32(2))))

        col0, width, run = self._thread_columns(b)
        for r in range(2):
            row = part_row(self.wn, b.add(self.warp_row, b.add(self.g, i32(8 * r))))
            values = self._row_values(acc, r)
            for j in range(D // width):
                off = b.shl(b.add(b.mul(row, i32(stride)), b.add(col0, i32(width * j))),
                            i32(2))
                warp.store(b, warp.vector(b, values[run * j:run * j + run]),
                           fptr(b.add(off, i32(o_base))), align=4 * run)
            with b.if_then(b.icmp_unsigned("==", self.t, i32(0))):
                warp.store(b, m[r], stat(0, row), align=4)
                warp.store(b, total[r], stat(1, row), align=4)
        nvptx.barrier_all(b)
        quads = D // 4
        for k in range(-(-R * quads // c.threads)):
            item = b.add(self.tid, i32(k * c.threads))
            local, quad = b.udiv(item, i32(quads)), b.urem(item, i32(quads))
            with b.if_then(b.icmp_unsigned("<", item, i32(R * quads))):
                ms, ls, parts = [], [], []
                for w in range(W):
                    row = part_row(i32(w), local)
                    ms.append(b.load(stat(0, row), typ=f32))
                    ls.append(b.load(stat(1, row), typ=f32))
                    off = b.shl(b.add(b.mul(row, i32(stride)), b.shl(quad, i32(2))), i32(2))
                    parts.append(b.load(fptr(b.add(off, i32(o_base))),
                                        typ=ir.VectorType(f32, 4), align=16))
                top = ms[0]
                for x in ms[1:]:
                    top = warp.fmax(b, top, x)
                top_scaled = b.select(b.fcmp_ordered("==", top, warp.fconst(warp.NEG_INF)),
                                      warp.fconst(0.0), b.fmul(top, sl2))
                weights = [warp.ex2(b, b.fsub(b.fmul(x, sl2), top_scaled)) for x in ms]
                lsum, o = warp.fconst(0.0), [warp.fconst(0.0)] * 4
                for wt, lw, part in zip(weights, ls, parts):
                    lsum = warp.fma(b, lw, wt, lsum)
                    o = [warp.fma(b, b.extract_element(part, i32(e)), wt, o[e])
                         for e in range(4)]
                col = b.shl(quad, i32(2))
                self._finish_rows(b, t, [(local, top, lsum, o)], sl2,
                                  lambda dst, row, vals, lse: self._store_columns(
                                      b, t, dst, row, col, [(i32(0), vals)], lse, quad))

    def _store_columns(self, b, t: _DecodeTile, dst, local, col, pieces, lse,
                       lse_lane) -> None:
        """Columns col + off of local row `local` for each (off, values) of `pieces`, to O
        (dst "o", in the dtype) or to split `dst`'s partial O (fp32); the LSE from the
        thread whose `lse_lane` is 0."""
        c, a = self.c, self.a
        if dst == "o":
            packed = b.add(t.r0, local)
            q_row = b.add(t.q_start, b.udiv(packed, i32(c.gqa_group)))
            h = t.head_of(b, packed)
            base = b.add(b.add(b.mul(_i64(b, t.bidx), a.o_stride_batch),
                               b.mul(_i64(b, q_row), a.o_stride_row)),
                         b.mul(_i64(b, h), a.o_stride_head))
            for off, vals in pieces:
                words = [warp.pack2(b, c.dtype, *vals[e:e + 2]) for e in range(0, len(vals), 2)]
                ptr = b.gep(a.o, [b.add(base, _i64(b, b.add(col, off)))], source_etype=nvptx.i16)
                warp.store(b, words[0] if len(words) == 1 else warp.vector(b, words), ptr,
                           align=2 * len(vals))
            if c.return_lse:
                with b.if_then(b.icmp_unsigned("==", lse_lane, i32(0))):
                    self._store_lse(b, t, q_row, h, lse)
            return
        row = b.add(b.mul(dst, i64(c.rows)), _i64(b, local))
        base = b.mul(row, i64(c.head_dim))
        for off, vals in pieces:
            ptr = b.gep(a.partial_o, [b.add(base, _i64(b, b.add(col, off)))], source_etype=f32)
            b.store(warp.vector(b, vals), ptr, align=4 * len(vals))
        with b.if_then(b.icmp_unsigned("==", lse_lane, i32(0))):
            b.store(lse, b.gep(a.partial_lse, [row], source_etype=f32), align=4)

    def _group(self, b, t: _DecodeTile) -> ir.Value:
        """(sequence, K/V head, query-row tile) as one i64 index."""
        a = self.a
        g = b.add(b.mul(_i64(b, t.bidx), _i64(b, a.num_heads)), _i64(b, t.hk))
        return b.add(b.mul(g, _i64(b, a.q_tiles)), _i64(b, t.q_tile))

    def _store_lse(self, b, t, q_row, h, value) -> None:
        a = self.a
        off = b.add(b.mul(_i64(b, t.bidx), a.lse_stride_batch),
                    b.add(b.mul(_i64(b, h), a.lse_stride_head), _i64(b, q_row)))
        b.store(value, b.gep(a.lse, [off], source_etype=f32), align=4)

    def _finish_split(self, b, t: _DecodeTile, group: ir.Value) -> None:
        """Count this split in; the last of its group merges every split's partial state
        (with the LSEs as weights) into O and the LSE, and resets the counter."""
        a = self.a
        _fence(b)  # this thread's partial stores before the count
        nvptx.barrier_all(b)
        if self.traced:  # the split's work ends here: its record ends before its count
            end_record(b, a.trace_thread)
        flag = warp.smem_ptr(b, self.smem, i32(self.flag_off))
        counter = b.gep(a.split_counters, [group], source_etype=i32)
        with b.if_then(b.icmp_unsigned("==", self.tid, i32(0))):
            before = b.atomic_rmw("add", counter, i32(1), "monotonic")
            last = b.icmp_unsigned("==", before, b.sub(t.splits_used, i32(1)))
            warp.store(b, b.zext(last, i32), flag, align=4)
            with b.if_then(last):
                b.atomic_rmw("xchg", counter, i32(0), "monotonic")
        nvptx.barrier_all(b)
        last = b.icmp_unsigned("!=", b.load(flag, typ=i32), i32(0))
        with b.if_then(last):
            def combine():
                _fence(b)  # the other splits' partial stores, before reading them
                self._combine(b, t, group)
            if self.traced:
                record_work_item(b, a.queue, vars(t.seq), a.trace_thread, combine,
                                 kind=TRACE_COMBINE)
            else:
                combine()

    def _combine(self, b, t: _DecodeTile, group: ir.Value) -> None:
        c, a = self.c, self.a
        D = c.head_dim
        per_row = D // 4
        items = c.rows * per_row
        splits = t.splits_used
        first = t.partial_first(b, group)
        for k in range(-(-items // c.threads)):
            item = b.add(self.tid, i32(k * c.threads))
            local = b.udiv(item, i32(per_row))
            col = b.shl(b.urem(item, i32(per_row)), i32(2))
            live = b.and_(b.icmp_signed("<", item, i32(items)),
                          b.icmp_signed("<", local, t.rows_valid))
            with b.if_then(live):
                def lse_of(s):
                    row = b.add(b.mul(b.add(first, _i64(b, s)), i64(c.rows)), _i64(b, local))
                    return _load_l2(b, b.gep(a.partial_lse, [row], source_etype=f32), 1)[0], row

                top, = ir_loop(b, i32(0), splits, [warp.fconst(warp.NEG_INF)],
                               lambda bb, s, cur: (bb.add(s, i32(1)),
                                                   [warp.fmax(bb, cur[0], lse_of(s)[0])]))
                safe_top = b.select(b.fcmp_ordered("==", top, warp.fconst(warp.NEG_INF)),
                                    warp.fconst(0.0), top)

                def accumulate(bb, s, cur):
                    lse_s, row = lse_of(s)
                    w = warp.ex2(bb, bb.fmul(bb.fsub(lse_s, safe_top), warp.fconst(warp.LOG2E)))
                    ptr = bb.gep(a.partial_o, [bb.add(bb.mul(row, i64(D)), _i64(bb, col))],
                                 source_etype=f32)
                    vals = _load_l2(bb, ptr, 4)
                    return bb.add(s, i32(1)), [bb.fadd(cur[0], w)] + [
                        warp.fma(bb, v, w, x) for v, x in zip(vals, cur[1:])]

                total, *o = ir_loop(b, i32(0), splits, [warp.fconst(0.0)] * 5, accumulate)
                empty = b.fcmp_unordered("==", total, warp.fconst(0.0))
                inv = b.select(empty, warp.fconst(0.0), warp.rcp(b, total))
                packed = b.add(t.r0, local)
                q_row = b.add(t.q_start, b.udiv(packed, i32(c.gqa_group)))
                h = t.head_of(b, packed)

                def lse():  # (natural log: safe_top is)
                    value = b.fadd(safe_top, b.fmul(warp.lg2(b, total), warp.fconst(warp.LN2)))
                    return b.select(empty, warp.fconst(warp.NEG_INF), value)
                if self.hooks.sink is not None:
                    inv, lse = warp.sink_finish(b, safe_top, warp.fconst(warp.LOG2E), total,
                                                empty, t.rules.sink_log2(b, h))
                off = b.add(b.add(b.mul(_i64(b, t.bidx), a.o_stride_batch),
                                  b.mul(_i64(b, q_row), a.o_stride_row)),
                            b.add(b.mul(_i64(b, h), a.o_stride_head), _i64(b, col)))
                packed2 = [warp.pack2(b, c.dtype, b.fmul(o[0], inv), b.fmul(o[1], inv)),
                           warp.pack2(b, c.dtype, b.fmul(o[2], inv), b.fmul(o[3], inv))]
                b.store(warp.vector(b, packed2), b.gep(a.o, [off], source_etype=nvptx.i16),
                        align=8)
                if c.return_lse:
                    with b.if_then(b.icmp_signed("==", col, i32(0))):
                        self._store_lse(b, t, q_row, h, lse())


# ============================================================================ the append
def _emit_append(module: ir.Module, config: DecodeConfig, hooks: ExprHooks) -> None:
    """`mha_decode_append`: CTA (b, y) copies query rows y, y + grid_dim.y, ... of sequence
    b's new K and V rows to cache positions cache_seqlens[b] + row, 16 bytes a thread; a
    position outside the cache's capacity, or whose page-table entry names no page of the
    cache, is not written (the host checks the values it has: `check_decode_call`).
    Balanced, warp 0 of CTA (b, 0) then writes sequence b's part of the split index (which
    reads the lengths only, not the cache)."""
    fn, _ = signature.kernel(module, hooks.kernel_abi(decode_abi(config)), APPEND_NAME,
                             APPEND_THREADS)
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    a = KernelArgs(fn, decode_abi(config), config)
    tid = nvptx.special_register(b, "thread_idx", "x")
    bidx = nvptx.special_register(b, "block_idx", "x")
    if config.query_rows:
        first, rows = i32(0), a.query_rows
    else:
        first = b.load(b.gep(a.query_offsets, [bidx], source_etype=i32), typ=i32)
        end = b.load(b.gep(a.query_offsets, [b.add(bidx, i32(1))], source_etype=i32), typ=i32)
        rows = b.sub(end, first)
    stored = b.load(b.gep(a.cache_seqlens, [bidx], source_etype=i32), typ=i32)
    chunks = config.head_dim // 8
    vector = ir.VectorType(i32, 4)

    def row_step(b, row, _):
        pos = b.add(stored, row)
        if config.page_size:
            entry = b.gep(a.page_table, [b.add(b.mul(_i64(b, bidx), a.page_table_stride),
                                               _i64(b, b.lshr(pos, i32(config.page_shift))))],
                          source_etype=i32)
            inside = b.icmp_unsigned("<", pos, a.cache_capacity)
            page = b.load(b.select(inside, entry, a.page_table), typ=i32)
            in_page = b.and_(pos, i32(config.page_size - 1))
        else:
            inside, page, in_page = b.icmp_unsigned("<", pos, a.cache_capacity), bidx, pos
        writes = b.and_(inside, b.icmp_unsigned("<", page, a.cache_pages))

        def copy(b, j, _):
            # K's and V's pieces are read before the page entry is waited for, so the three
            # reads overlap and only the stores follow it
            h, chunk = b.udiv(j, i32(chunks)), _i64(b, b.shl(b.urem(j, i32(chunks)), i32(3)))
            values = {}
            for t in "kv":
                src = b.add(b.add(b.mul(_i64(b, bidx), a[f"{t}_new_stride_batch"]),
                                  b.mul(_i64(b, b.add(first, row)), a[f"{t}_new_stride_row"])),
                            b.add(b.mul(_i64(b, h), a[f"{t}_new_stride_head"]), chunk))
                values[t] = b.load(b.gep(a[f"{t}_new"], [src], source_etype=nvptx.i16),
                                   typ=vector, align=16)
            with b.if_then(writes):
                for t in "kv":
                    value = values[t]
                    if config.fp8:
                        value = _quantized(b, config, value, a[f"{t}_scale"])
                    dst = b.add(b.add(b.mul(_i64(b, page), a[f"{t}_stride_page"]),
                                      b.mul(_i64(b, in_page), a[f"{t}_stride_row"])),
                                b.add(b.mul(_i64(b, h), a[f"{t}_stride_head"]), chunk))
                    b.store(value, b.gep(a[f"{t}_cache"], [dst],
                                         source_etype=nvptx.i8 if config.fp8 else nvptx.i16),
                            align=8 if config.fp8 else 16)
            return b.add(j, i32(APPEND_THREADS)), []
        ir_loop(b, tid, b.mul(a.num_heads, i32(chunks)), [], copy)
        return b.add(row, nvptx.special_register(b, "grid_dim", "y")), []
    row_block = nvptx.special_register(b, "block_idx", "y")
    ir_loop(b, row_block, rows, [], row_step)
    if config.balanced:  # the split index, in warp 0 of CTA (b, 0): one launch fewer
        first_warp = b.and_(b.icmp_unsigned("<", tid, i32(32)),
                            b.icmp_unsigned("==", row_block, i32(0)))
        _write_split_index(b, a, config, b.select(first_warp, bidx, a.batch), tid)
    b.ret_void()


# ============================================================================ the split index
class SplitRule:
    """`valid_work.balanced_splits` in IR, over the kernel's values (`a`: the parameters
    it reads, by name): a sequence's extent, the batch's chunk, a sequence's splits."""

    def __init__(self, c: DecodeConfig, a):
        self.c, self.a = c, a

    def extent(self, b: ir.IRBuilder, j: ir.Value) -> tuple[ir.Value, ir.Value]:
        """(query-row tiles, KV tiles) of sequence j, as the decode kernel's tile sees it."""
        c, a = self.c, self.a
        if c.query_rows:
            rows = a.query_rows
        else:
            lo = b.load(b.gep(a.query_offsets, [j], source_etype=i32), typ=i32)
            hi = b.load(b.gep(a.query_offsets, [b.add(j, i32(1))], source_etype=i32), typ=i32)
            rows = b.sub(hi, lo)
            rows = b.select(b.icmp_signed("<", rows, i32(0)), i32(0), rows)
        q_tiles = b.udiv(b.add(b.mul(rows, i32(c.gqa_group)), i32(c.rows - 1)), i32(c.rows))
        q_tiles = _min(b, q_tiles, a.q_tiles)  # (unchecked device values stay in bounds)
        stored = b.load(b.gep(a.cache_seqlens, [j], source_etype=i32), typ=i32)
        if c.appends:
            stored = b.add(stored, rows)
        keys = _min(b, stored, a.cache_capacity)
        keys = b.select(b.icmp_signed("<", keys, i32(0)), i32(0), keys)
        return q_tiles, b.udiv(b.add(keys, i32(c.block_n - 1)), i32(c.block_n))

    def chunk(self, b: ir.IRBuilder, work: ir.Value) -> ir.Value:
        """KV tiles a chunk aims at, from the batch's `work` (i64: query-row tiles x KV
        tiles, summed over the sequences) over every K/V head and `split_slots` chunks."""
        a = self.a
        work = b.mul(work, b.zext(a.num_heads, i64))
        slots = b.zext(_max1(b, a.split_slots), i64)
        chunk = b.udiv(b.add(work, b.sub(slots, i64(1))), slots)
        chunk = b.select(b.icmp_unsigned("<", chunk, i64(MIN_SPLIT_TILES)),
                         i64(MIN_SPLIT_TILES), chunk)
        return b.trunc(b.select(b.icmp_unsigned(">", chunk, i64(MAX_CHUNK_TILES)),
                                i64(MAX_CHUNK_TILES), chunk), i32)

    def splits(self, b: ir.IRBuilder, n: ir.Value, chunk: ir.Value) -> ir.Value:
        """A sequence of n KV tiles: n / chunk splits to the nearest, 1 to num_splits, as
        few as share its tiles out evenly with none left empty."""
        most = _max1(b, self.a.num_splits)
        spread = b.udiv(b.add(n, b.sub(most, i32(1))), most)
        per = b.select(b.icmp_unsigned(">", spread, chunk), spread, chunk)
        nearest = b.udiv(b.add(b.add(n, n), per), b.add(per, per))
        splits = _max1(b, _min(b, nearest, most))
        per = _max1(b, b.udiv(b.add(n, b.sub(splits, i32(1))), splits))
        return _max1(b, b.udiv(b.add(n, b.sub(per, i32(1))), per))


def _emit_split_index(module: ir.Module, config: DecodeConfig, hooks: ExprHooks) -> None:
    """`mha_decode_splits` (balanced builds that append no rows): `_write_split_index`,
    a warp per sequence."""
    abi = decode_abi(config)
    fn, _ = signature.kernel(module, hooks.kernel_abi(abi), SPLITS_NAME, SPLITS_THREADS)
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    a = KernelArgs(fn, abi, config)
    _write_split_index(b, a, config, *tile_index.warp_per_sequence(b))
    b.ret_void()


def _write_split_index(b: ir.IRBuilder, a, config: DecodeConfig, me: ir.Value,
                       lane: ir.Value) -> None:
    """Warp `me`'s part (none where `me` >= the batch) of the split index: from the lengths
    on the device, each sequence's work tiles (query-row tiles x its KV splits,
    `SplitRule`) as a tile index (`codegen.tile_index`), which the decode kernel's
    scheduler numbers and its tiles read. Each warp first sums the batch's work itself."""
    rule = SplitRule(config, a)

    def counter(me: ir.Value, lane: ir.Value):
        def add_work(bb, j, work):
            q_tiles, n = rule.extent(bb, j)
            return bb.add(j, i32(32)), [bb.add(work[0], bb.mul(bb.zext(q_tiles, i64),
                                                                bb.zext(n, i64)))]
        work, = ir_loop(b, lane, a.batch, [i64(0)], add_work)
        chunk = rule.chunk(b, warp.warp_sum(b, work))

        def tiles(j: ir.Value) -> ir.Value:
            q_tiles, n = rule.extent(b, j)
            return b.mul(q_tiles, rule.splits(b, n, chunk))
        return tiles
    tile_index.write_tile_index(b, me, lane, a.batch, a.split_index, counter)


def _quantized(b: ir.IRBuilder, config: DecodeConfig, value: ir.Value, scale: ir.Value):
    """Eight 16-bit elements (four i32) / `scale` as eight float8_e4m3fn bytes (two i32),
    `warp.e4m3_from_f32`'s rounding: the FP8 cache's row, as the host reference makes it."""
    codes = [warp.e4m3_from_f32(b, b.fdiv(x, scale))
             for e in range(4) for x in warp.unpack2(b, config.dtype,
                                                     b.extract_element(value, i32(e)))]
    words = []
    for w in range(2):
        word = codes[4 * w]
        for k in range(1, 4):
            word = b.or_(word, b.shl(codes[4 * w + k], i32(8 * k)))
        words.append(word)
    return warp.vector(b, words)


# ============================================================================ module
def build_decode_module(config: DecodeConfig, hooks: ExprHooks, target: Target,
                        work_loop, traced: bool = False) -> ir.Module:
    module = new_module(f"mha_decode_{config.dtype}_d{config.head_dim}", target)
    if config.appends:
        _emit_append(module, config, hooks)
    elif config.balanced:
        _emit_split_index(module, config, hooks)
    fn, _ = signature.kernel(module, hooks.kernel_abi(decode_abi(config)), KERNEL_NAME,
                             config.threads)
    smem = ir.GlobalVariable(module, ir.ArrayType(nvptx.i8, 0), SMEM_SYMBOL, addrspace=SHARED)
    smem.linkage = "external"
    smem.align = SMEM_ALIGN
    builder = ir.IRBuilder(fn.append_basic_block("entry"))
    args = KernelArgs(fn, decode_abi(config), config, zero_after_none=False,
                      advance_in_tile=True)
    _scheduler_view(args, config)

    def tile(b: ir.IRBuilder, seq: TileSeq) -> None:
        _Emitter(config, hooks, b, args, smem, traced).emit_tile(b, seq)

    work_loop(builder, args, tile)  # which counts the exit where its scheduler reads the queue
    builder.ret_void()
    return module


class Decode(Backend):
    """Decode against a KV cache: GQA packing, split-KV, paged caches (cp.async, mma.sync)."""

    name = "decode"
    workload = "decode"
    targets = ("sm_90a", "sm_80")
    abi = ABI
    config_type = DecodeConfig

    def problems(self, options, arch: str) -> list[Problem]:
        layout = Layout(cache=CacheLayout())
        return decode_config(options, layout).problems()

    def configs(self, options, layout: Layout) -> tuple[DecodeConfig, ...]:
        """The config, then (should ptxas spill) one that reads page entries one tile
        ahead instead of two, which holds fewer registers across the KV loop, then that
        with an FP8 cache's extra stages given up."""
        config = decode_config(options, layout)
        nearer = replace(config, page_lookahead=1)
        return tuple(dict.fromkeys(
            (config, nearer, replace(nearer, stages=min(nearer.stages, MAX_STAGES)))))

    def kernels(self, config: DecodeConfig) -> tuple[KernelLaunch, ...]:
        """The decode kernel; first, where the call appends the step's rows, the append
        (which also writes the split index where the splits follow the lengths), else
        there the split index."""
        abi = decode_abi(config)
        first = []
        if config.appends:
            def rows(call: CallSizes) -> tuple[int, int, int]:
                q_rows = call.max_seqlen_q if call.ragged else call.query_rows
                return max(1, call.batch), max(1, min(q_rows, APPEND_ROW_BLOCKS)), 1
            first.append(KernelLaunch(APPEND_NAME, abi, APPEND_THREADS, 0, rows))
        elif config.balanced:
            first.append(KernelLaunch(SPLITS_NAME, abi, SPLITS_THREADS, 0, lambda call: (
                max(1, -(-call.batch * 32 // SPLITS_THREADS)), 1, 1)))
        return (*first, KernelLaunch(KERNEL_NAME, abi, config.threads, config.shared_bytes))

    def scheduler_of(self, options, config: DecodeConfig) -> tuple[str, tuple]:
        """The named scheduler, else the decode default for the build's splits."""
        return options.scheduler_for(self.workload, config.balanced)

    def call_values(self, config: DecodeConfig, call: CallSizes) -> dict[str, int]:
        """The split of the cache the call's planner asks for (`call.num_splits`): chunks
        of whole KV tiles and none left empty; balanced, at most that many splits a
        sequence (its chunks come from the lengths, on the device: no `kv_chunk`). The work
        tiles a sequence has at most."""
        capacity = max(call.cache_capacity, 1)
        q_rows = call.max_seqlen_q if call.ragged else call.query_rows
        q_tiles = max(1, -(-q_rows * config.gqa_group // config.rows))
        if config.balanced:
            chunk, splits = 0, min(call.num_splits, -(-capacity // config.block_n))
        else:
            chunk = even_chunk(capacity, call.num_splits, config.block_n)
            splits = -(-capacity // chunk)
        return {"query_rows": call.query_rows, "cache_capacity": call.cache_capacity,
                "page_table_stride": call.page_table_stride, "q_tiles": q_tiles,
                "num_splits": splits, "kv_chunk": chunk, "work_tiles": q_tiles * splits,
                "k_scale": call.kv_scales[0], "v_scale": call.kv_scales[1],
                "kv_slots": call.kv_slots}

    def resident_ctas(self, config: DecodeConfig, call: CallSizes, num_sms: int,
                      fit: int) -> int:
        """Balanced, a CTA for each chunk the split aims at (`kv_slots`), where they fit: a
        uniform batch's work tiles then number about its CTAs. Resident CTAs beyond the
        work tiles cost the launch its balance: the block dispatcher fills some
        multiprocessors with several of the first CTAs, which take the work tiles, while
        others hold one (benchmarks/log/BENCHMARKS_LOG.md, decode split placement)."""
        if not config.balanced:
            return fit
        return max(1, min(fit, -(-call.kv_slots // max(num_sms, 1))))

    def work_space(self, config: DecodeConfig, call: CallSizes) -> tuple[int, int, int, int]:
        """Up to `work_tiles` (query-row tile x KV split) prompt tiles per (sequence, K/V
        head): `_scheduler_view`."""
        tiles = self.call_values(config, call)["work_tiles"]
        return call.batch, tiles, tiles, call.kv_heads

    def scratch(self, config: DecodeConfig, call: CallSizes) -> dict[str, int]:
        """A split call's partial O and LSE (fp32) and its groups' split counters (u32);
        balanced, the split index too, and partial states for every work tile there can
        be: a sequence's splits exceed its KV tiles / chunk by less than one, and the
        chunks of the whole batch number at most `kv_slots` (`balanced_splits`)."""
        values = self.call_values(config, call)
        index = {"split_index": 4 * tile_index_words(call.batch)} if config.balanced else {}
        if values["num_splits"] == 1:
            return index
        groups = call.batch * call.kv_heads * values["q_tiles"]
        slots = groups * values["num_splits"]
        if config.balanced:
            slots = min(slots, groups + max(call.kv_slots, 1))
        rows = slots * config.rows
        return {"partial_o": 4 * rows * config.head_dim, "partial_lse": 4 * rows,
                "split_counters": 4 * groups, **index}

    def build(self, source: KernelSource, configs: tuple[DecodeConfig, ...],
              target: Target) -> KernelBuild:
        if target.arch == "sm_90a":  # whole warpgroups of rows compute by wgmma there
            configs = tuple(replace(c, wgmma=c.wgmma_fits, fp8_cvt=c.fp8) for c in configs)
        return spill_free_build(self.name, target, [
            (c, lambda c=c: build_decode_module(c, source.hooks, target,
                                                source.work_loop(*self.scheduler_shape(c),
                                                                 search_ways=WIDE_SEARCH),
                                                source.trace))
            for c in configs],
            # launched early, a step's append and decode kernels were slower (11 % on 32
            # sequences of about 1,000 keys, eight steps in a CUDA graph, H100)
            grid_dependent=False)


BACKEND = Decode()
