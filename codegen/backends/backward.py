"""The backward pass: a FlashAttention-2-class design in LLVM IR for sm_80 and sm_90a.

Kernels in one module, sharing one parameter list (`ABI`), launched in order
(`Backward.kernels`):

- `mha_bwd_preprocess`: delta = rowsum(dO * O) in fp32 per (batch, head, row), in the LSE's
  layout, and (atomic mode) the fp32 dQ accumulator's rows zeroed;
- `mha_bwd`: the declaration's scheduler hands out the work tiles (its work loop; the work
  space as it sees it: `scheduler_view`): one K/V tile (block_n rows) of one (batch, K/V
  head) each. The CTA keeps K and V in shared memory and dK, dV in registers, and loops over
  the query tiles of every query head of its GQA group that the mask's classification does
  not prove empty. Per query tile it recomputes P from Q, K and the forward's LSE, then
      dV += P^T dO,  dP = dO V^T,  dS = P * (dP - delta) * dscore/ds,
      dK += dS^T Q,  and in atomic mode dQ += dS K (fp32 atomics into the accumulator);
  the softmax scale is applied once at the end (dK here, dQ in the last kernel);
- atomic mode: `mha_bwd_postprocess`: dQ = scale * accumulator, in q's dtype;
- deterministic mode (`BackwardConfig.deterministic`): `mha_bwd_dq`, the main kernel with
  the sides swapped: a CTA owns one query tile (block_n rows) of one (batch, query head),
  steps over its K/V tiles (`dq_step` rows), recomputes P and dS and sums dQ = dS K in
  registers, K/V tile after K/V tile, then writes dQ. No atomics and no CTA waits for
  another, so every run adds in the same order whatever order the CTAs run in. dK and dV
  are deterministic in both modes: one CTA sums them in registers, over the group's query
  heads in a fixed order.

Work split of `mha_bwd` and `mha_bwd_dq` (4 warps; `_TileKernel`): each warp owns
block_n / num_warps of the CTA's rows and computes its rows of S = A B^T and dP, where A is
the CTA's own side (K and V in `mha_bwd`, so it computes the transposed tiles S^T = K Q^T
and dP^T = V dO^T; Q and dO in `mha_bwd_dq`), so P (P^T) and dS (dS^T) are already the A
operands of the products that follow (no transposes through shared memory). In atomic mode
dS^T goes to shared memory once (16-bit) for dQ = dS K, which the warps split by head-dim
columns and add into the accumulator (`red.global.add.v4.f32` on sm_90a, four columns per
lane after a swap with the neighbouring lane; scalar atomics on sm_80). Each step's inputs
(Q, dO, LSE and delta; K and V in `mha_bwd_dq`) are fetched by cp.async into one of two
stages while the other computes. Every shared tile with 128-byte multiples for rows has its
16-byte chunks XOR-swizzled by row % 8, as in sm80 (dS^T of a 32-row query step has 64-byte
rows: plain). The preprocess, postprocess and dQ kernels run one CTA per (row tile, head,
batch).

It stays one module: the kernels share one parameter list, one shared-memory layout and
the tile kernel (`_TileKernel`) that the main and dQ kernels, and the sm90 design's main
kernel, specialise.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from llvmlite import ir

from mhadsl.abi import CallSizes, CallValue, KernelABI, Param, Pointer, Stride, Workspace
from mhadsl.codegen import nvptx, signature, warp
from mhadsl.codegen.backends import (
    SHARED_MEMORY_LIMIT, Backend, ExprHooks, KernelArgs, KernelBuild, KernelSource, KernelLaunch,
    Layout, Problem, RowCopies, TileSeq, WorkLoop, common_problems, ir_loop, spill_free_build,
)
from mhadsl.codegen.backends.blocks import TileRules, TileSequence, sequence_rows
from mhadsl.codegen.nvptx import SHARED, f32, i32, i64
from mhadsl.codegen.work_loop import count_exit
from mhadsl.codegen.target import Target, new_module

PREPROCESS, MAIN, POSTPROCESS, DQ = ("mha_bwd_preprocess", "mha_bwd", "mha_bwd_postprocess",
                                     "mha_bwd_dq")
OPERAND_GRADS = "mha_bwd_operand_grads"
SMEM_SYMBOL = "mha_bwd_smem"
HEAD_DIMS = (64, 128, 256)
MAX_REGISTERS = 255
ROW_THREADS = 128  # threads of the preprocess and postprocess kernels
ROW_TILE = 64  # rows one preprocess/postprocess CTA covers
# what a work tile of the main kernel derives from its SeqInfo, parked in shared memory
WORK_TILE_FIELDS = ("bidx", "hk", "k_start", "seqlen_k", "kv0", "q_start", "seqlen_q")


# ============================================================================ configuration
@dataclass(frozen=True)
class BackwardConfig(RowCopies):
    """Everything that selects a backward build (hashable; part of the cache key)."""

    dtype: str = "bf16"
    head_dim: int = 128
    block_m: int = 64  # query rows per step of mha_bwd's loop
    block_n: int = 64  # rows a CTA owns (K/V rows; query rows in mha_bwd_dq)
    num_warps: int = 4
    gqa_group: int = 1
    ragged: bool = False
    dq_passes: int = 1  # dQ = dS K in this many column passes (fewer live accumulators)
    step_passes: int = 1  # S^T, dP^T, dS^T of a query step in this many passes (likewise)
    # dK, dV (and dQ's) columns in this many passes over the work tile's query tiles, each
    # computing S^T and dP^T again: head dim 256's dK and dV would hold 256 f32 per thread
    column_passes: int = 1
    deterministic: bool = False  # dQ from mha_bwd_dq, not atomics (bitwise repeatable)
    sink: bool = False  # the declaration has a sink rule: the preprocess writes `sink_terms`
    # mha_bwd_operand_grads adds the gradients of the f32 tensors the score reads, last
    operand_grads: bool = False
    # IR shapes of one computation, for ptxas's allocation at the register cap (`configs`):
    park_work_tile: bool = True  # the work tile's values read from shared memory per use
    opaque_env: bool = True  # the scheduler's inputs rederived per step (`KernelArgs`)

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def accumulates_dq(self) -> bool:
        """Whether the main kernel adds dQ into the fp32 accumulator, which the preprocess
        zeroes (deterministic mode: `mha_bwd_dq` writes dQ instead)."""
        return not self.deterministic

    @property
    def tiles_per_warp(self) -> int:
        """16-row m-tiles of the CTA's own rows each warp computes."""
        return self.block_n // self.num_warps // 16

    @property
    def pass_columns(self) -> int:
        """Head-dim columns of dK, dV and dQ one column pass computes."""
        return self.head_dim // self.column_passes

    @property
    def dq_columns(self) -> int:
        """Columns of dQ each warp computes per column pass (atomic mode)."""
        return self.pass_columns // self.num_warps

    @property
    def dq_step(self) -> int:
        """K/V rows per step of mha_bwd_dq, whose registers (dQ, S, dP) and two stages of K
        and V leave room for 64 up to head dim 128."""
        return 64 if self.head_dim <= 128 else 32

    @property
    def accumulators(self) -> int:
        """f32 registers per thread of dK, dV, S^T and dP^T together (one pass's)."""
        step_columns = self.block_m // self.step_passes
        return self.tiles_per_warp * (2 * self.pass_columns + 2 * step_columns) // 2

    def problems(self) -> list[Problem]:
        found = common_problems(self)
        if self.head_dim not in HEAD_DIMS:
            found.append(Problem(("head_dim",), (
                f"the backward pass runs head_dim {', '.join(map(str, HEAD_DIMS))}, not "
                f"{self.head_dim}")))
            return found
        if self.head_dim % (8 * self.column_passes):
            found.append(Problem(("head_dim",), (
                f"head_dim {self.head_dim} does not split into {self.column_passes} column "
                "passes")))
        if self.block_m not in (32, 64):
            found.append(Problem(("tile",), "the backward pass steps 32 or 64 query rows at "
                                            "a time"))
        elif self.block_m % (16 * self.step_passes):
            found.append(Problem(("tile",), (
                f"a query step of {self.block_m} rows does not split into {self.step_passes} "
                f"passes of a multiple of 16 rows")))
        if self.block_n % (16 * self.num_warps) or self.block_n % self.rows_per_pass:
            found.append(Problem(("tile", "warps"), (
                f"the K/V tile ({self.block_n}) must split into 16-row pieces over "
                f"{self.num_warps} warps")))
        columns = self.dq_columns // self.dq_passes
        if columns < 16 or columns & (columns - 1):
            found.append(Problem(("warps", "head_dim"), (
                f"dQ's {self.head_dim} columns must split into power-of-two pieces of at "
                f"least 16 over {self.num_warps} warps and {self.dq_passes} passes")))
        if self.accumulators > MAX_REGISTERS:
            found.append(Problem(("tile", "warps"), (
                f"each thread would hold {self.accumulators} f32 accumulators")))
        return found

    def validate(self) -> "BackwardConfig":
        if found := self.problems():
            raise ValueError("invalid BackwardConfig: " + "; ".join(p.message for p in found))
        return self


def stage_bytes(config: BackwardConfig) -> int:
    """One stage of a query step's inputs: Q, dO (block_m rows), the LSE and delta (block_m
    floats each); a multiple of 128 bytes."""
    return 2 * config.block_m * config.row_bytes + 8 * config.block_m


def shared_bytes(config: BackwardConfig) -> int:
    """`mha_bwd`'s: K, V (block_n rows), two stages (the step's and the next one's,
    `stage_bytes`), and in atomic mode dS^T (block_n x block_m, 16-bit)."""
    c = config
    ds = 0 if c.deterministic else c.block_n * c.block_m * 2
    return 2 * c.block_n * c.row_bytes + 2 * stage_bytes(c) + ds


def dq_shared_bytes(config: BackwardConfig) -> int:
    """`mha_bwd_dq`'s: Q, dO (block_n rows) and two stages of K and V (dq_step rows)."""
    return 2 * config.block_n * config.row_bytes + 4 * config.dq_step * config.row_bytes


def row_grid(call: CallSizes, rows: int) -> tuple[int, int, int]:
    """The preprocess's and postprocess's grid over `rows` query rows of each sequence:
    (row tiles, heads, batch)."""
    return max(1, -(-rows // ROW_TILE)), call.heads, call.batch


# ============================================================================ kernel parameters
_TENSORS = {"q": "queries", "k": "keys", "v": "values", "o": "the forward's output",
            "dout": "the output's gradient dO", "dq_accum": "fp32 dQ accumulator (q's shape)",
            "dq": "dQ (q's shape and dtype)", "dk": "dK (k's shape)", "dv": "dV (v's shape)"}
ABI = KernelABI(
    *(Param(t, "ptr", Pointer(t), f"{meaning}; dense (B,S,H,D) / ragged (total,H,D), rows "
                                  "16-byte aligned", align=16) for t, meaning in _TENSORS.items()),
    Param("lse", "ptr", Pointer("lse"), "the forward's float32 LSE (natural log): element "
          "(b,h,row) at b*lse_stride_batch + h*lse_stride_head + start_of_seq + row", align=4),
    Param("delta", "ptr", Pointer("delta"), "float32 rowsum(dO*O), the LSE's layout", align=4),
    Param("cu_seqlens_q", "ptr", Pointer("cu_seqlens_q"), "int32 (B+1) query row offsets "
          "(ragged), else null", align=4),
    Param("cu_seqlens_k", "ptr", Pointer("cu_seqlens_k"), "int32 (B+1) key row offsets "
          "(ragged), else null", align=4),
    *(Param(f"{t}_stride_{axis}", "i64", Stride(t, axis), f"elements from one {axis} of {t} "
            "to the next" + (" (unused when ragged)" if axis == "batch" else ""))
      for t in _TENSORS for axis in ("batch", "row", "head")),
    Param("lse_stride_batch", "i64", CallValue("lse_stride_batch"), "floats between batches "
          "of lse and delta: Hq*Sq dense, 0 ragged"),
    Param("lse_stride_head", "i64", CallValue("lse_stride_head"), "floats between heads of "
          "lse and delta: Sq dense, total_q ragged"),
    Param("batch", "i32", CallValue("batch"), "number of sequences B"),
    Param("total_q", "i32", CallValue("total_q"), "rows of q, dQ (ragged; 0 dense): the "
          "preprocess zeroes dQ's rows outside every sequence"),
    Param("total_k", "i32", CallValue("total_k"), "rows of k, dK, dV (ragged; 0 dense): the "
          "preprocess zeroes dK's and dV's rows outside every sequence"),
    Param("num_heads", "i32", CallValue("num_heads"), "query heads Hq (= gqa_group * Hkv)"),
    Param("seqlen_q", "i32", CallValue("seqlen_q"), "dense query length (ignored when ragged)"),
    Param("seqlen_k", "i32", CallValue("seqlen_k"), "dense key length (ignored when ragged)"),
    Param("softmax_scale", "f32", CallValue("softmax_scale"), "scale applied to q.k before "
          "the score hook / softmax"),
    # what the main kernel's scheduler reads (`scheduler_view`)
    Param("kv_heads", "i32", CallValue("kv_heads"), "K/V heads Hkv: the scheduler's heads"),
    Param("max_seqlen_k", "i32", CallValue("max_seqlen_k"), "longest key sequence (dense: "
          "seqlen_k): the scheduler's prompt tiles are its K/V tiles"),
    Param("queue", "ptr", Workspace("queue"), "per-stream u32 workspace: the work-queue "
          "counter and the scheduler fault record (mhadsl/abi.py); never null", align=4),
    Param("num_sms", "i32", CallValue("num_sms"), "multiprocessors on the device"),
    Param("ctas_per_sm", "i32", CallValue("ctas_per_sm"), "CTAs of the main kernel that fit "
          "on one multiprocessor"),
    Param("tile_index", "ptr", Workspace("tile_index"), "u32 tile index of a ragged launch's "
          "K/V tiles (codegen/tile_index.py), built on the device from cu_seqlens_k just "
          "before the main kernel; null when dense", align=4),
)
# The preprocess's parameters where the declaration has a sink rule (`BackwardConfig.sink`).
SINK_ABI = KernelABI(*ABI, Param(
    "sink_terms", "ptr", Pointer("sink_terms"), "float32 exp(sink - LSE) * delta per row, the "
    "LSE's layout: summed over a sequence's rows, minus the gradient of its sink", align=4))


def preprocess_abi(config: BackwardConfig) -> KernelABI:
    return SINK_ABI if config.sink else ABI


# ============================================================================ helpers
def pass_swizzle(p: int, rows_per_pass: int) -> int:
    """What a copy pass p XORs into a lane's swizzled byte offset (`_Lanes.ld_swz`, made for
    its pass-0 row r < rows_per_pass): the swizzle takes row % 8, and pass p's row
    r + p * rows_per_pass differs from r in those bits when rows_per_pass is below 8 (head
    dim 256: 4 rows of 512 bytes a pass), by p * rows_per_pass % 8, with no carry."""
    return (p * rows_per_pass % 8) << 4


def _sext64(b, v):
    return b.sext(v, i64)


def _row_offset(b, args, ragged: bool, tensor: str, bidx, row, head):
    """Element offset (i64) of row `row` (counted from the start of the tensor's rows of
    sequence `bidx` for dense, of all rows for ragged) of head `head` of `tensor`."""
    off = b.add(b.mul(_sext64(b, row), args[f"{tensor}_stride_row"]),
                b.mul(_sext64(b, head), args[f"{tensor}_stride_head"]))
    if not ragged:
        off = b.add(off, b.mul(_sext64(b, bidx), args[f"{tensor}_stride_batch"]))
    return off


def _lse_offset(b, args, bidx, head, row):
    """Element offset (i64) of (bidx, head, row) in the LSE's layout (`row` from the start
    of all rows when ragged)."""
    return b.add(b.add(b.mul(_sext64(b, bidx), args.lse_stride_batch),
                       b.mul(_sext64(b, head), args.lse_stride_head)), _sext64(b, row))


def _i32(x) -> ir.Value:
    """An i32 value of `x`, a Python int or already a value."""
    return x if isinstance(x, ir.Value) else i32(x)


def _gep(b, base, offset, etype):
    return b.gep(base, [offset], inbounds=True, source_etype=etype)


def _unpack8(b, dtype: str, vec: ir.Value) -> list[ir.Value]:
    """A 16-byte <4 x i32> of 8 16-bit elements -> 8 f32."""
    wide = b.fpext(b.bitcast(vec, ir.VectorType(warp.element_type(dtype), 8)),
                   ir.VectorType(f32, 8))
    return [b.extract_element(wide, i32(i)) for i in range(8)]


def _ldmatrix(b, address: ir.Value, trans: bool = False) -> list[ir.Value]:
    """`ldmatrix.x4[.trans]` from a 32-bit shared address (`warp.ldmatrix_x4` takes a
    64-bit pointer); volatile, so it never moves across the barriers that order it after
    the tile's copies."""
    shape = "x4.trans" if trans else "x4"
    res = b.asm(ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32]),
                f"ldmatrix.sync.aligned.m8n8.{shape}.shared.b16 {{$0,$1,$2,$3}}, [$4];",
                "=r,=r,=r,=r,r", [address], True)
    return [b.extract_value(res, i) for i in range(4)]


def _unpack_pairs(b, dtype: str, pairs: list[ir.Value]) -> list[ir.Value]:
    """i32s of two 16-bit values each (low half first) -> their f32 values, in order."""
    out = []
    for x in pairs:
        if dtype == "bf16":  # bf16 is f32's upper half
            out += [b.bitcast(b.shl(x, i32(16)), f32), b.bitcast(b.and_(x, i32(-65536)), f32)]
        else:
            wide = b.fpext(b.bitcast(x, ir.VectorType(warp.HALF, 2)), ir.VectorType(f32, 2))
            out += [b.extract_element(wide, i32(e)) for e in range(2)]
    return out


# ============================================================================ pre/postprocess
class _RowKernel:
    """The row-wise kernels: CTA (row tile, head, batch); a thread owns one 16-byte chunk
    (8 elements) of a row, head_dim / 8 consecutive lanes one row. The accumulator's layout
    is the design's: here q's, each thread's 8 columns one run (`accum_vectors`)."""

    def __init__(self, b, config: BackwardConfig, args: KernelArgs):
        self.c, self.a = config, args
        self.tid = nvptx.special_register(b, "thread_idx", "x")
        self.lanes_per_row = config.head_dim // 8
        self.chunk = b.urem(self.tid, i32(self.lanes_per_row))
        self.row_in_pass = b.udiv(self.tid, i32(self.lanes_per_row))
        self.tile = nvptx.special_register(b, "block_idx", "x")
        self.h = nvptx.special_register(b, "block_idx", "y")
        self.bidx = nvptx.special_register(b, "block_idx", "z")
        self.start, self.seqlen = sequence_rows(b, config.ragged, args.cu_seqlens_q,
                                                args.seqlen_q, self.bidx)

    def rows(self, b, each, tile=None):
        """each(b, row (in the sequence), valid) for every row of the CTA's tile (or of tile
        `tile`, an i32), per thread."""
        rows_per_pass = ROW_THREADS // self.lanes_per_row
        first = b.mul(self.tile if tile is None else tile, i32(ROW_TILE))
        for p in range(ROW_TILE // rows_per_pass):
            row = b.add(first, b.add(self.row_in_pass, i32(p * rows_per_pass)))
            each(b, row, b.icmp_signed("<", row, self.seqlen))

    def store_delta(self, b, row, valid, delta) -> None:
        """Row `row`'s delta (the row's lanes all hold it; the first stores), in the LSE's
        layout."""
        with b.if_then(b.and_(valid, b.icmp_unsigned("==", self.chunk, i32(0)))):
            off = _lse_offset(b, self.a, self.bidx, self.h, b.add(self.start, row))
            b.store(delta, _gep(b, self.a.delta, off, f32), align=4)

    def store_sink_term(self, b, hooks: ExprHooks, row, valid, delta) -> None:
        """Row `row`'s term of its sink's gradient, exp(sink - LSE) * delta (0 where the
        LSE is -inf), in the LSE's layout (`SINK_ABI`)."""
        with b.if_then(b.and_(valid, b.icmp_unsigned("==", self.chunk, i32(0)))):
            off = _lse_offset(b, self.a, self.bidx, self.h, b.add(self.start, row))
            lse = b.load(_gep(b, self.a.lse, off, f32), typ=f32)
            k_start, seqlen_k = sequence_rows(b, self.c.ragged, self.a.cu_seqlens_k,
                                              self.a.seqlen_k, self.bidx)
            sink = TileRules(hooks, TileSequence(self.bidx, self.seqlen, seqlen_k, self.start,
                                                 k_start)).sink_log2(b, self.h)
            weight = warp.ex2(b, b.fsub(sink, b.fmul(lse, warp.fconst(warp.LOG2E))))
            none = b.fcmp_ordered("==", lse, warp.fconst(warp.NEG_INF))
            term = b.select(none, warp.fconst(0.0), b.fmul(weight, delta))
            b.store(term, _gep(b, self.a.sink_terms, off, f32), align=4)

    def accum_vectors(self, b, row) -> list[ir.Value]:
        """Pointers to the two 4-float vectors of the thread's 8 columns of `row`."""
        first = self.chunk_ptr(b, "dq_accum", row, f32)
        return [first, _gep(b, first, i64(4), f32)]

    def zero_accumulator(self, b) -> None:
        """The CTA's rows of dQ's accumulator zeroed (the main kernel adds into it)."""
        zero = ir.Constant(ir.VectorType(f32, 4), [0.0] * 4)

        def row(b, r, valid):
            with b.if_then(valid):
                for ptr in self.accum_vectors(b, r):
                    b.store(zero, ptr, align=16)
        self.rows(b, row)

    def write_dq(self, b) -> None:
        """dQ of the CTA's rows = the accumulator times the softmax scale, in q's dtype."""
        def row(b, r, valid):
            with b.if_then(valid):
                x = []
                for ptr in self.accum_vectors(b, r):
                    part = b.load(ptr, typ=ir.VectorType(f32, 4), align=16)
                    x += [b.fmul(b.extract_element(part, i32(e)), self.a.softmax_scale)
                          for e in range(4)]
                out = warp.vector(b, [warp.pack2(b, self.c.dtype, x[2 * e], x[2 * e + 1])
                                      for e in range(4)])
                b.store(out, self.chunk_ptr(b, "dq", r, nvptx.i16), align=16)
        self.rows(b, row)

    def zero_spare_rows(self, b) -> None:
        """Ragged: the rows of dQ, dK and dV outside every sequence (before cu_seqlens[0],
        from cu_seqlens[B] on), which no other kernel writes, set to zero, so the host need
        not fill the gradients first. Sequence 0's CTAs take the rows before, the last
        sequence's the rows after; a CTA's tile and head its share of them (dK's and dV's
        at K/V head h, for h below Hkv)."""
        a = self.a
        stride = b.mul(nvptx.special_register(b, "grid_dim", "x"), i32(ROW_TILE))
        rows_per_pass = ROW_THREADS // self.lanes_per_row
        zero = ir.Constant(ir.VectorType(i32, 4), [0] * 4)
        last = b.sub(a.batch, i32(1))
        for tensors, cu, total, heads in ((("dq",), a.cu_seqlens_q, a.total_q, a.num_heads),
                                          (("dk", "dv"), a.cu_seqlens_k, a.total_k,
                                           a.kv_heads)):
            first = b.load(cu, typ=i32)
            end = b.load(b.gep(cu, [a.batch], inbounds=True, source_etype=i32), typ=i32)
            for owner, lo, hi in ((i32(0), i32(0), first), (last, end, total)):
                with b.if_then(b.and_(b.icmp_unsigned("==", self.bidx, owner),
                                      b.icmp_unsigned("<", self.h, heads))):
                    def body(b, base, _):
                        for p in range(ROW_TILE // rows_per_pass):
                            row = b.add(base, b.add(self.row_in_pass, i32(p * rows_per_pass)))
                            with b.if_then(b.icmp_signed("<", row, hi)):
                                for tensor in tensors:
                                    off = b.add(_row_offset(b, a, True, tensor, self.bidx, row,
                                                            self.h),
                                                b.zext(b.shl(self.chunk, i32(3)), i64))
                                    b.store(zero, _gep(b, a[tensor], off, nvptx.i16),
                                            align=16)
                        return b.add(base, stride), []
                    ir_loop(b, b.add(lo, b.mul(self.tile, i32(ROW_TILE))), hi, [], body)

    def chunk_ptr(self, b, tensor: str, row, etype):
        off = _row_offset(b, self.a, self.c.ragged, tensor, self.bidx, b.add(self.start, row),
                          self.h)
        off = b.add(off, b.zext(b.shl(self.chunk, i32(3)), i64))
        return _gep(b, self.a[tensor], off, etype)


def _emit_preprocess(b, config: BackwardConfig, args: KernelArgs, hooks: ExprHooks, rows=None):
    """delta = rowsum(dO * O), with a sink each row's term of its gradient
    (`_RowKernel.store_sink_term`), and the rows' dQ accumulator zeroed; `rows` (a
    `_RowKernel` type) says where a design keeps the accumulator."""
    k = (rows or _RowKernel)(b, config, args)
    v4i = ir.VectorType(i32, 4)

    def row(b, r, valid):
        def dot(b):
            o = _unpack8(b, config.dtype, b.load(k.chunk_ptr(b, "o", r, nvptx.i16), typ=v4i,
                                                 align=16))
            do = _unpack8(b, config.dtype, b.load(k.chunk_ptr(b, "dout", r, nvptx.i16),
                                                  typ=v4i, align=16))
            total = b.fmul(o[0], do[0])
            for x, y in zip(o[1:], do[1:]):
                total = warp.fma(b, x, y, total)
            return [total]
        (partial,) = warp.guarded(b, valid, dot, [warp.fconst(0.0)])
        for m in range(k.lanes_per_row.bit_length() - 1):  # the row's lanes: 1, 2, 4, (8)
            partial = b.fadd(partial, warp.shfl_bfly(b, partial, 1 << m))
        k.store_delta(b, r, valid, partial)
        if config.sink:
            k.store_sink_term(b, hooks, r, valid, partial)
    k.rows(b, row)
    if config.accumulates_dq:
        k.zero_accumulator(b)
    if config.ragged:
        k.zero_spare_rows(b)


def _emit_postprocess(b, config: BackwardConfig, args: KernelArgs, rows=None):
    """dQ = the accumulator times the softmax scale, in q's dtype (`rows`: as in
    `_emit_preprocess`)."""
    (rows or _RowKernel)(b, config, args).write_dq(b)


# ============================================================================ the tile kernels
class _Lanes:
    """A thread's place in its warp and CTA (warp.py's operand conventions), and its
    16-byte chunk of the CTA's cp.async copies."""

    def __init__(self, b, config: BackwardConfig, tid: ir.Value):
        self.tid = tid
        lane = b.and_(tid, i32(31))
        self.warp_id = b.lshr(tid, i32(5))
        self.g = b.lshr(lane, i32(2))  # accumulator row within an 8-row group
        self.t = b.and_(lane, i32(3))  # accumulator column pair
        r8 = b.and_(lane, i32(7))
        self.m_lo = b.and_(b.lshr(lane, i32(3)), i32(1))  # ldmatrix: (lane // 8) % 2
        self.m_hi = b.lshr(lane, i32(4))  # lane // 16
        # ldmatrix lane rows: `a_row` (chunk m_hi) for A operands and transposed B operands,
        # `b_row` (chunk m_lo) for B operands and transposed A operands
        self.a_row = b.add(b.shl(self.m_lo, i32(3)), r8)
        self.b_row = b.add(b.shl(self.m_hi, i32(3)), r8)
        # the first of the CTA's own rows this warp computes
        self.warp_row = b.mul(self.warp_id, i32(config.block_n // config.num_warps))
        chunks = config.head_dim // 8
        self.ld_row = b.udiv(tid, i32(chunks))
        self.ld_chunk = b.urem(tid, i32(chunks))
        self.ld_swz = b.add(b.mul(self.ld_row, i32(config.row_bytes)),
                            b.shl(warp.swizzle_chunk(b, self.ld_chunk, self.ld_row), i32(4)))

    def own_row(self, b, i: int, r: int) -> ir.Value:
        """The CTA's own row of this thread's accumulator rows g + 8r of m-tile i."""
        return b.add(self.warp_row, b.add(self.g, i32(16 * i + 8 * r)))

    def step_column(self, b, j: int, e: int) -> ir.Value:
        """The step's row (a column of the warp's tiles) of element e of n-tile j."""
        return b.add(b.shl(self.t, i32(1)), i32(8 * j + (e & 1)))


def _flat(tiles) -> list[ir.Value]:
    """[m-tile][n-tile][4] -> one list (a loop's carried values)."""
    return [x for tile in tiles for frag in tile for x in frag]


def _tiles(flat, m_tiles: int) -> list:
    """The inverse of `_flat` for m_tiles m-tiles."""
    n = len(flat) // m_tiles // 4
    return [[list(flat[(i * n + j) * 4:(i * n + j + 1) * 4]) for j in range(n)]
            for i in range(m_tiles)]


class _TileKernel:
    """What `mha_bwd` and `mha_bwd_dq` share. A CTA owns block_n rows of one side of the
    attention (K/V rows in `mha_bwd`, query rows in `mha_bwd_dq`), each warp
    16 * tiles_per_warp of them, and steps over rows of the other side (block_m in
    `mha_bwd`, `dq_step` in `mha_bwd_dq`), each step's inputs cp.async'ed into one of two
    stages while the other computes: the shared tiles, the products, P and dS of a step,
    the step loop and the store of the own rows' results.
    A subclass sets `tile_rows`, the (query rows, K/V rows) of a step's pair of tiles, and
    the seqlen_q, seqlen_k and bidx of its work tile."""

    tile_rows: tuple[int, int]

    def __init__(self, config: BackwardConfig, hooks: ExprHooks, args: KernelArgs,
                 smem: ir.Value):
        self.c, self.hooks, self.a, self.smem = config, hooks, args, smem
        self.RB = config.row_bytes  # bytes of a D-wide row

    def _lanes(self, b) -> _Lanes:
        """This thread's lane values, derived afresh where a phase needs them: through an
        opaque %tid.x, so LLVM cannot hoist them (and the dozens of ldmatrix addresses made
        from them) out of the loop and keep them live across it."""
        return _Lanes(b, self.c, nvptx.opaque_special_register(b, "tid.x"))

    # ------------------------------------------------------------------ shared memory
    def _bases(self, b, row, chunk, region_off, row_bytes: int):
        """(row_bytes, the lane's 32-bit shared address of (row, chunk) in the region,
        swizzled where rows are 128-byte multiples): one register per operand, where 64-bit
        pointers per XOR variant would take eight. `row` is a multiple of 8 plus r8."""
        if row_bytes % 128 == 0:
            chunk = warp.swizzle_chunk(b, chunk, row)
        region = b.add(b.ptrtoint(self.smem, i32), _i32(region_off))
        return row_bytes, b.add(b.add(region, b.mul(row, i32(row_bytes))), b.shl(chunk, i32(4)))

    def _at(self, b, bases, row: int, chunk: int):
        """The lane's ldmatrix address `row` rows (a multiple of 8) and `chunk` 16-byte
        chunks (even) further: the chunk's low 3 bits XOR into the swizzled chunk (rows
        and regions are 128-byte multiples, so the XOR touches the chunk alone), the rest
        adds (a compile-time chunk never carries into the lane's chunk bits)."""
        row_bytes, base = bases
        c16 = chunk * 16
        if row_bytes % 128:  # a plain region
            return b.add(base, i32(row * row_bytes + c16))
        return b.add(b.xor(base, i32(c16 & 127)), i32(row * row_bytes + (c16 & ~127)))

    def _load_tile(self, b, tensor: str, first_row_off, rows_valid, rows: int, smem_off):
        """cp.async `rows` rows of `tensor` from element offset first_row_off (i64) into the
        swizzled region at smem_off; rows >= rows_valid are zero-filled."""
        a = self.a
        stride = a[f"{tensor}_stride_row"]
        rpp = self.c.rows_per_pass
        lanes = self._lanes(b)
        thread_off = b.add(first_row_off, b.add(b.mul(_sext64(b, lanes.ld_row), stride),
                                                b.zext(b.shl(lanes.ld_chunk, i32(3)), i64)))
        dst = warp.smem_ptr(b, self.smem, b.add(lanes.ld_swz, _i32(smem_off)))
        for p in range(rows // rpp):
            valid = b.icmp_signed("<", b.add(lanes.ld_row, i32(p * rpp)), rows_valid)
            src = _gep(b, a[tensor], b.add(thread_off, b.mul(stride, i64(p * rpp))), nvptx.i16)
            moved = pass_swizzle(p, rpp)
            base = dst if not moved else warp.smem_ptr(
                b, self.smem, b.add(b.xor(lanes.ld_swz, i32(moved)), _i32(smem_off)))
            warp.cp_async_16(b, _gep(b, base, i64(p * rpp * self.RB), nvptx.i8),
                             b.select(valid, src, a[tensor]),
                             b.select(valid, i32(16), i32(0)))

    def _stage(self, b, stage, name: str) -> ir.Value:
        """The shared offset of input `name` in `stage` (i32 0 or 1)."""
        return b.add(b.add(i32(self.stage0), b.mul(stage, i32(self.stage_bytes))),
                     i32(self.in_stage[name]))

    # ------------------------------------------------------------------ tile products
    def _mma_rows(self, b, a_tile, b_tile, n_cols: int, k_depth: int, start=None):
        """A B^T over k_depth for this warp's m-tiles: A rows from the shared tile at offset
        `a_tile` (the warp's own rows), B rows from the one at `b_tile` (n_cols rows of the
        step), both k-contiguous; added to `start(i, j, e)` (else 0). Returns
        [m-tile][n-tile][4]."""
        c, dt = self.c, self.c.dtype
        lanes = self._lanes(b)
        a_bases = self._bases(b, b.add(lanes.warp_row, lanes.a_row), lanes.m_hi,
                              a_tile, self.RB)
        b_bases = self._bases(b, lanes.b_row, lanes.m_lo, b_tile, self.RB)
        MT, NT = c.tiles_per_warp, n_cols // 8
        start = start or (lambda i, j, e: warp.fconst(0.0))
        acc = [[[start(i, j, e) for e in range(4)] for j in range(NT)] for i in range(MT)]
        for kk in range(k_depth // 16):
            fa = [_ldmatrix(b, self._at(b, a_bases, i * 16, 2 * kk)) for i in range(MT)]
            for jp in range(NT // 2):
                fb = _ldmatrix(b, self._at(b, b_bases, jp * 16, 2 * kk))
                for i in range(MT):
                    acc[i][2 * jp] = warp.mma_m16n8k16(b, dt, fa[i], fb[0:2], acc[i][2 * jp])
                    acc[i][2 * jp + 1] = warp.mma_m16n8k16(b, dt, fa[i], fb[2:4],
                                                           acc[i][2 * jp + 1])
        return acc

    def _pack(self, b, tiles):
        """[m-tile][n-tile][4] f32 -> the A operands [m-tile][k-slice][4 x i32] of a product
        whose k dimension is the step's rows (16-bit, as P in sm80's P V)."""
        dt = self.c.dtype
        return [[[warp.pack2(b, dt, t[2 * s][0], t[2 * s][1]),
                  warp.pack2(b, dt, t[2 * s][2], t[2 * s][3]),
                  warp.pack2(b, dt, t[2 * s + 1][0], t[2 * s + 1][1]),
                  warp.pack2(b, dt, t[2 * s + 1][2], t[2 * s + 1][3])]
                 for s in range(len(t) // 2)] for t in tiles]

    def _mma_registers(self, b, packed, bt_tile, acc, first_column: int = 0):
        """acc += T B for this warp: T packed by `_pack`, B = the shared tile at offset
        `bt_tile` (the step's rows x head_dim), transposed by ldmatrix: its columns
        first_column.. (as many as acc has)."""
        dt = self.c.dtype
        lanes = self._lanes(b)
        bt_bases = self._bases(b, lanes.a_row, lanes.m_hi, bt_tile, self.RB)
        for s in range(len(packed[0])):
            fa = [t[s] for t in packed]
            for jp in range(len(acc[0]) // 2):
                fb = _ldmatrix(b, self._at(b, bt_bases, s * 16, first_column // 8 + 2 * jp),
                               trans=True)
                for i, a_frag in enumerate(fa):
                    acc[i][2 * jp] = warp.mma_m16n8k16(b, dt, a_frag, fb[0:2], acc[i][2 * jp])
                    acc[i][2 * jp + 1] = warp.mma_m16n8k16(b, dt, a_frag, fb[2:4],
                                                           acc[i][2 * jp + 1])
        return acc

    # ------------------------------------------------------------------ P and dS
    def _starts(self) -> tuple:
        """The sequence's first query row and key, where a rule reads an operand along
        them (`ExprHooks.positions`; read from where the kernel keeps them only then)."""
        return (self.q_start, self.k_start) if self.hooks.positions else ()

    def _classify(self, b, h, q0, kv0):
        """(may hold a kept pair, every pair kept) for the pair of tiles at q0 and kv0 of
        head h (`tile_rows`); a K/V tile past seqlen_k is never all kept (query rows past
        the sequence get P = 0 from their LSE, see `_neg_lse`)."""
        q_rows, kv_rows = self.tile_rows
        return TileRules(self.hooks, self).classify(b, (h,), q0, q_rows, kv0, kv_rows)

    @staticmethod
    def _neg_lse(b, lse, q_idx, seqlen_q):
        """-LSE * log2(e) of query row q_idx; -inf (P = 0) for a row without a kept key
        (LSE -inf) or past the sequence."""
        ninf = warp.fconst(warp.NEG_INF)
        return b.select(b.or_(b.icmp_signed(">=", q_idx, seqlen_q),
                              b.fcmp_ordered("==", lse, ninf)),
                        ninf, b.fmul(lse, warp.fconst(-warp.LOG2E)))

    def _probabilities(self, b, h, q0, kv0, S, q_idx, kv_idx, neg_lse, always=None):
        """P = exp(score - LSE) of the step's scores S ([m-tile][n-tile][4]), 0 for pairs
        outside the K/V sequence or the mask, as `_pack`'s A operands (16-bit: P is dV's
        operand in `mha_bwd`), and G = P * dscore/ds in bf16 pairs (None without a score
        rule). q_idx, kv_idx, neg_lse: element (i, j, e)'s query row, key row and `_neg_lse`;
        always: whether the pair of tiles keeps every pair (`_classify`), if the caller
        classified it already."""
        a, hooks = self.a, self.hooks
        elements = [(i, j, e) for i in range(len(S)) for j in range(len(S[0]))
                    for e in range(4)]
        P = [[[None] * 4 for _ in mt] for mt in S]
        G = [[[None] * 4 for _ in mt] for mt in S]
        log2_scale = b.fmul(a.softmax_scale, warp.fconst(warp.LOG2E))
        lengths = (self.seqlen_q, self.seqlen_k) if hooks.score_reads_lengths else ()
        if hooks.positions:  # (a score reads an operand along the rows: their extents)
            rules = TileRules(hooks, TileSequence(self.bidx, self.seqlen_q, self.seqlen_k,
                                                  self.q_start, self.k_start))
        else:
            rules = TileRules(hooks, TileSequence(
                self.bidx if hooks.score is not None else None, *lengths))
        for i, j, e in elements:
            s = S[i][j][e]
            if hooks.score is not None:
                scaled = b.fmul(s, a.softmax_scale)
                qi, ki = q_idx(i, j, e), kv_idx(i, j, e)
                score = rules.score(b, scaled, h, qi, ki)
                p = warp.ex2(b, warp.fma(b, score, warp.fconst(warp.LOG2E), neg_lse(i, j, e)))
                G[i][j][e] = b.fmul(p, rules.derivative(b, scaled, h, qi, ki))
            else:
                p = warp.ex2(b, warp.fma(b, s, log2_scale, neg_lse(i, j, e)))
            P[i][j][e] = p
        # P and G = P * dscore/ds stay 16-bit until dS (P as dV's operand, G in bf16 for
        # its range): the f32 tiles die here, so registers suffice beside the accumulators
        if always is None:
            always = self._classify(b, h, q0, kv0)[1]
        if hooks.score is None:
            return self._pack(b, self._masked(b, h, always, [P], elements, q_idx,
                                              kv_idx)[0]), None
        P, G = self._masked(b, h, always, [P, G], elements, q_idx, kv_idx)
        return self._pack(b, P), [[[warp.pack2(b, "bf16", t[2 * e2], t[2 * e2 + 1])
                                    for e2 in range(2)] for t in mt] for mt in G]

    def _masked(self, b, h, always, tiles, elements, q_idx, kv_idx):
        """Each of `tiles` ([m-tile][n-tile][4] f32) with the pairs outside the K/V sequence
        or the mask set to 0; pairs of tiles the classification proves full (`always`)
        skip the per-element code (a branch and phis)."""
        pre = b.block
        with b.if_then(b.not_(always)):
            kept = [[[list(t) for t in mt] for mt in tile] for tile in tiles]
            rules = TileRules(self.hooks, TileSequence(self.bidx, self.seqlen_q, self.seqlen_k,
                                                       *self._starts()))
            for i, j, e in elements:
                ki = kv_idx(i, j, e)
                keep = rules.keeps(b, h, lambda bb: q_idx(i, j, e), ki)
                for out, tile in zip(kept, tiles):
                    out[i][j][e] = b.select(keep, tile[i][j][e], warp.fconst(0.0))
            then = b.block
        merged = [[[[None] * 4 for _ in mt] for mt in tile] for tile in tiles]
        for out, masked, tile in zip(merged, kept, tiles):
            phis = warp.merge(b, [masked[i][j][e] for i, j, e in elements], then,
                              [tile[i][j][e] for i, j, e in elements], pre)
            for (i, j, e), phi in zip(elements, phis):
                out[i][j][e] = phi
        return merged

    def _unpacked(self, b, packed_p, n_tiles: int):
        """P ([m-tile][n-tile][4] f32) from its 16-bit A operands (`_pack`)."""
        return [[_unpack_pairs(b, self.c.dtype, [frags[j // 2][2 * (j % 2)],
                                                 frags[j // 2][2 * (j % 2) + 1]])
                 for j in range(n_tiles)] for frags in packed_p]

    def _ds(self, b, packed_p, G, dP_delta):
        """dS = G * (dP - delta) ([m-tile][n-tile][4] f32) from dP - delta (the product
        started from -delta, so delta takes no registers of its own beside dP), G = P
        without a score rule (its 16-bit values, from the A operands they are in)."""
        if G is None:
            G = self._unpacked(b, packed_p, len(dP_delta[0]))
        else:
            G = [[_unpack_pairs(b, "bf16", t) for t in mt] for mt in G]
        return [[[b.fmul(g, x) for g, x in zip(gt, xt)] for gt, xt in zip(gm, xm)]
                for gm, xm in zip(G, dP_delta)]

    # ------------------------------------------------------------------ the step loop
    def _next_step(self, b, start, steps, pair_of):
        """The first step >= start whose pair of tiles (`pair_of(b, s)` -> (head, q0, kv0))
        may hold a kept pair, or `steps`: empty pairs are never loaded or computed."""
        if self.hooks.classify is None:
            return start
        return warp.first_true(b, start, steps,
                               lambda bb, s: self._classify(bb, *pair_of(bb, s))[0])

    def _step_loop(self, b, steps, pair_of, issue, compute, init: list[ir.Value]):
        """The CTA's loop over its steps in [0, steps) that `_next_step` keeps: the next
        step's inputs go to the other stage (`issue(b, s, stage)`) while this one computes
        (`compute(b, s, stage, carried) -> carried`); the own tiles are the first cp.async
        group. Returns the final carried values."""
        def body(b, s, carried):
            stage = carried[-1]
            nxt = self._next_step(b, b.add(s, i32(1)), steps, pair_of)
            nvptx.barrier_all(b)  # every warp is done with the other stage (and dS)
            with b.if_then(b.icmp_signed("<", nxt, steps)):
                issue(b, nxt, b.sub(i32(1), stage))
            warp.cp_async_commit(b)
            warp.cp_async_wait(b, 1)  # this step's group (and the own tiles) landed
            nvptx.barrier_all(b)
            return nxt, compute(b, s, stage, carried[:-1]) + [b.sub(i32(1), stage)]

        first = self._next_step(b, i32(0), steps, pair_of)
        with b.if_then(b.icmp_signed("<", first, steps)):
            issue(b, first, i32(0))
        warp.cp_async_commit(b)
        final = ir_loop(b, first, steps, init + [i32(0)], body)[:-1]
        warp.cp_async_wait(b, 0)  # none of these copies lands on the next work tile's
        return final

    def _store_own(self, b, tensor: str, head, first_row, rows_valid, flat, scale,
                   first_column: int = 0):
        """The warp's accumulator `flat` of the CTA's own rows (times `scale` unless None),
        in the input dtype, to rows first_row.. of `tensor`'s head `head`, those below
        rows_valid, columns first_column.. (an int or an i32; as many as `flat` holds)."""
        c, a = self.c, self.a
        MT = c.tiles_per_warp
        DT = len(flat) // (4 * MT)
        # whole quads of 8-column tiles (head dims 64, 128, 256), inside the head
        assert DT % 4 == 0 and len(flat) == 4 * MT * DT
        assert not isinstance(first_column, int) or first_column + 8 * DT <= c.head_dim
        lanes = self._lanes(b)
        for i in range(MT):
            for r in range(2):
                row = lanes.own_row(b, i, r)
                pairs = []
                for j in range(DT):
                    x = [flat[(i * DT + j) * 4 + 2 * r + e2] for e2 in range(2)]
                    if scale is not None:
                        x = [b.fmul(v, scale) for v in x]
                    pairs.append(warp.pack2(b, c.dtype, *x))
                # the row's quad trades pairs so that each lane holds 8 whole columns (a
                # 16-byte store, where pairs wrote half sectors), before the row's branch
                groups = [warp.quad_transpose(b, pairs[4 * k: 4 * k + 4])
                          for k in range(DT // 4)]
                with b.if_then(b.icmp_signed("<", row, rows_valid)):
                    off = _row_offset(b, a, c.ragged, tensor, self.bidx, b.add(first_row, row),
                                      head)
                    column = b.add(b.shl(lanes.t, i32(3)), _i32(first_column))
                    base = _gep(b, a[tensor], b.add(off, b.zext(column, i64)), nvptx.i16)
                    for k, group in enumerate(groups):
                        warp.store(b, warp.vector(b, group), _gep(b, base, i64(32 * k), nvptx.i16),
                                   align=16)


def scheduler_view(args: KernelArgs) -> KernelArgs:
    """The main kernel's work space as its scheduler sees it (what the work loop reads): per
    (sequence, K/V head) the sequence's K/V tiles are its prompt tiles (block_n rows:
    `Backward.scheduler_shape`), from the key rows' offsets and a tile index of the K/V
    tiles. Prompt tile t is K/V tile n - 1 - t of the sequence's n: under a causal mask the
    first K/V tiles see the most query tiles, so a longest-first order (LPT) starts with
    them, as the forward's starts with the last query tiles."""
    view = copy.copy(args)
    view.max_seqlen_q, view.seqlen_q = args.max_seqlen_k, args.seqlen_k
    view.num_heads, view.cu_seqlens_q = args.kv_heads, args.cu_seqlens_k
    return view


def _parked(field: str) -> property:
    """A work tile's value (`_MainKernel.work_tile_fields`), read back from shared memory
    where the code being emitted uses it (at the builder's point: `_MainKernel.builder`)."""
    def reload(kernel: _MainKernel) -> ir.Value:
        if not kernel.c.park_work_tile:
            return kernel.held[field]
        return nvptx.reload_shared(kernel.builder, kernel._record(kernel.builder, field))
    return property(reload)


class _MainKernel(_TileKernel):
    """`mha_bwd`: a work tile is one K/V tile of one (batch, K/V head), which loops over the
    query tiles of the group's query heads, heads outermost. The tile's values are
    `_parked`: every use reads them from shared memory."""

    bidx, hk, k_start, seqlen_k, kv0, q_start, seqlen_q = map(_parked, WORK_TILE_FIELDS)
    # False where warp-specialised roles meet at the work tile's barriers from their own
    # branches (`nvptx.barrier_all`)
    aligned_barriers = True
    work_tile_fields = WORK_TILE_FIELDS  # the values parked (a design may park more)

    def __init__(self, config: BackwardConfig, hooks: ExprHooks, args: KernelArgs,
                 smem: ir.Value, target_arch: str):
        super().__init__(config, hooks, args, smem)
        c = config
        self.tile_rows = (c.block_m, c.block_n)
        self.DSB = c.block_m * 2  # row bytes of the dS^T tile
        self.k_off, self.v_off = 0, c.block_n * self.RB
        # a stage: Q, dO, LSE, delta at these offsets from its start
        self.stage0, self.stage_bytes = 2 * c.block_n * self.RB, stage_bytes(c)
        self.in_stage = {"q": 0, "dout": c.block_m * self.RB, "lse": 2 * c.block_m * self.RB,
                         "delta": 2 * c.block_m * self.RB + 4 * c.block_m}
        self.ds_off = self.stage0 + 2 * self.stage_bytes
        self.vector_red = target_arch == "sm_90a"  # red.global.add.v4.f32 is sm_90's
        self.first_column = 0  # of the column pass being emitted (`column_passes`)

    def emit(self, b, work_loop: WorkLoop) -> None:
        self.builder = b  # (the kernel's one builder: `_parked` values are read at its point)
        work_loop(b, scheduler_view(self.a), self._work_tile)
        count_exit(b, self.a.queue)

    def _start_work_tile(self, b, seq: TileSeq) -> None:
        """Once the last work tile's warps are done with shared memory, park this one's
        values (`WORK_TILE_FIELDS`) from the scheduler's SeqInfo."""
        c, a = self.c, self.a
        nvptx.barrier_all(b, self.aligned_barriers)
        q_start, seqlen_q = sequence_rows(b, c.ragged, a.cu_seqlens_q, a.seqlen_q,
                                          seq.prompt_idx)
        # prompt tile t is K/V tile n - 1 - t (`scheduler_view`); seq_len > prompt_offset
        last = b.mul(b.udiv(b.sub(seq.seq_len, i32(1)), i32(c.block_n)), i32(c.block_n))
        self._park(b, dict(bidx=seq.prompt_idx, **self._work_tile_heads(b, seq.head_idx),
                           k_start=seq.start_of_seq, seqlen_k=seq.seq_len,
                           kv0=b.sub(last, seq.prompt_offset), q_start=q_start,
                           seqlen_q=seqlen_q))

    def _work_tile_heads(self, b, head) -> dict[str, ir.Value]:
        """The parked values of the scheduler's head `head`: here a K/V head (`hk`)."""
        return dict(hk=head)

    def _work_tile(self, b, seq: TileSeq) -> None:
        c, a = self.c, self.a
        MT = c.tiles_per_warp
        self._start_work_tile(b, seq)
        kv_row = b.add(self.k_start, self.kv0)
        for tensor, off in (("k", self.k_off), ("v", self.v_off)):
            self._load_tile(b, tensor, _row_offset(b, a, c.ragged, tensor, self.bidx, kv_row,
                                                   self.hk), b.sub(self.seqlen_k, self.kv0),
                            c.block_n, off)
        warp.cp_async_commit(b)
        steps, pair_of = self._query_steps()

        def issue(b, s, stage):
            h, q0, _ = pair_of(b, s)
            self._issue(b, h, q0, stage)

        def compute(b, s, stage, carried):
            h, q0, _ = pair_of(b, s)
            half = len(carried) // 2
            dk, dv = self._step(b, h, q0, stage, _tiles(carried[:half], MT),
                                _tiles(carried[half:], MT))
            return _flat(dk) + _flat(dv)

        for p in range(c.column_passes):
            if p:  # every warp is done with the last pass's stages
                nvptx.barrier_all(b)
            self.first_column = p * c.pass_columns
            init = [warp.fconst(0.0)] * (2 * MT * c.pass_columns // 2)
            final = self._step_loop(b, steps(b), pair_of, issue, compute, init)
            half = len(final) // 2
            kv_row, rows_valid = b.add(self.k_start, self.kv0), b.sub(self.seqlen_k, self.kv0)
            self._store_own(b, "dk", self.hk, kv_row, rows_valid, final[:half], a.softmax_scale,
                            self.first_column)
            self._store_own(b, "dv", self.hk, kv_row, rows_valid, final[half:], None,
                            self.first_column)

    def _query_steps(self):
        """The work tile's steps: steps(b), as many as its group's query heads times their
        query tiles, and pair_of(b, s) -> (query head, first query row, first K/V row) of
        step s, heads outermost."""
        c = self.c

        def q_tiles(b):
            return b.udiv(b.add(self.seqlen_q, i32(c.block_m - 1)), i32(c.block_m))

        def steps(b):
            return b.mul(q_tiles(b), i32(c.gqa_group))

        def pair_of(b, s):
            head0 = b.mul(self.hk, i32(c.gqa_group))
            if c.gqa_group == 1:  # one head: no division (a step's, and each searched one's)
                return head0, b.mul(s, i32(c.block_m)), self.kv0
            return (b.add(head0, b.udiv(s, q_tiles(b))),
                    b.mul(b.urem(s, q_tiles(b)), i32(c.block_m)), self.kv0)
        return steps, pair_of

    def _record(self, b, field: str) -> ir.Value:
        """The 32-bit shared address of the work tile's value `field`."""
        record = nvptx.shared_array(b.module, "mha_bwd.work_tile",
                                    ir.ArrayType(i32, len(self.work_tile_fields)))
        return b.add(b.ptrtoint(record, i32), i32(4 * self.work_tile_fields.index(field)))

    def _park(self, b, values: dict[str, ir.Value]) -> None:
        """Thread 0 parks the work tile's values in shared memory; each use reads them back
        (`_parked`): held in registers across the step loop, beside dK and dV, the values a
        scheduler hands out cost spills (block indices would rematerialise). Without
        `park_work_tile` they stay in registers."""
        if not self.c.park_work_tile:
            self.held = values
            return
        with b.if_then(b.icmp_unsigned("==", self._lanes(b).tid, i32(0))):
            for name, value in values.items():
                b.store(value, b.inttoptr(self._record(b, name), nvptx.ptr(SHARED)))
        nvptx.barrier_all(b, self.aligned_barriers)

    def _issue(self, b, h, q0, stage):
        """cp.async the query tile at q0 of head h (Q, dO, and the LSE and delta of its
        rows; rows past the sequence zero-filled) into `stage` (i32 0 or 1)."""
        c, a = self.c, self.a
        q_row = b.add(self.q_start, q0)
        rows_valid = b.sub(self.seqlen_q, q0)
        for tensor in ("q", "dout"):
            self._load_tile(b, tensor, _row_offset(b, a, c.ragged, tensor, self.bidx, q_row, h),
                            rows_valid, c.block_m, self._stage(b, stage, tensor))
        tid = self._lanes(b).tid
        with b.if_then(b.icmp_unsigned("<", tid, i32(c.block_m))):
            valid = b.icmp_signed("<", tid, rows_valid)
            off = _lse_offset(b, a, self.bidx, h, b.add(q_row, b.select(valid, tid, i32(0))))
            for name in ("lse", "delta"):
                dst = b.add(self._stage(b, stage, name), b.shl(tid, i32(2)))
                nvptx.call(b, "llvm.nvvm.cp.async.ca.shared.global.4.s", nvptx.void,
                           [warp.smem_ptr(b, self.smem, dst), _gep(b, a[name], off, f32),
                            b.select(valid, i32(4), i32(0))])

    def _step(self, b, h, q0, stage, dk, dv):
        """One query tile of head h, its inputs in `stage`: dV, dK updated, and in atomic
        mode dQ added into the accumulator. S^T, dP^T and dS^T are computed in `step_passes`
        passes over the tile's query rows (`_step_pass`): each of dV's and dK's elements
        gets the same adds in the same order as in one pass, with fewer values live."""
        c = self.c
        width = c.block_m // c.step_passes
        for p in range(c.step_passes):
            dk, dv = self._step_pass(b, h, q0, stage, p * width, width, dk, dv)
        if c.deterministic:  # dQ comes from mha_bwd_dq
            return dk, dv
        nvptx.barrier_all(b)  # dS^T is in shared memory
        self._dq(b, h, b.add(self.q_start, q0), b.sub(self.seqlen_q, q0))
        return dk, dv

    def _step_pass(self, b, h, q0, stage, first: int, width: int, dk, dv):
        """The step's query rows first..first+width-1 (columns of the warp's tiles): their
        S^T, P^T, dP^T and dS^T, their part of dV += P^T dO and dK += dS^T Q (k-slices in
        order), and in atomic mode their dS^T columns to shared memory."""
        c = self.c
        MT, NQ, J0 = c.tiles_per_warp, width // 8, first // 8  # J0: the first n-tile's index
        # the pass's Q and dO rows (first is a multiple of 8: the swizzle is unchanged)
        q_tile = b.add(self._stage(b, stage, "q"), i32(first * self.RB))
        do_tile = b.add(self._stage(b, stage, "dout"), i32(first * self.RB))
        lanes = self._lanes(b)

        def column_values(name):  # this thread's query columns' values: [n-tile][e & 1]
            v2 = ir.VectorType(f32, 2)
            out = []
            start = b.add(self._stage(b, stage, name), b.shl(lanes.t, i32(3)))
            for j in range(J0, J0 + NQ):
                byte = b.add(start, i32(32 * j))
                pair = b.load(warp.smem_ptr(b, self.smem, byte), typ=v2, align=8)
                out.append([b.extract_element(pair, i32(e)) for e in range(2)])
            return out

        kv0 = self.kv0

        def q_idx(i, j, e):
            return b.add(q0, lanes.step_column(b, J0 + j, e))

        def kv_idx(i, j, e):
            return b.add(kv0, lanes.own_row(b, i, e >> 1))

        # S^T = K Q^T, then P^T (and G = P^T * dscore/ds with a score rule); the mask's
        # classification is the whole step's (q0)
        S = self._mma_rows(b, self.k_off, q_tile, width, c.head_dim)
        seqlen_q = self.seqlen_q
        neg_lse = [[self._neg_lse(b, lse, q_idx(0, j, e), seqlen_q)
                    for e, lse in enumerate(pair)]
                   for j, pair in enumerate(column_values("lse"))]
        packed_p, G = self._probabilities(b, h, q0, kv0, S, q_idx, kv_idx,
                                          lambda i, j, e: neg_lse[j][e & 1])
        dv = self._mma_registers(b, packed_p, do_tile, dv, self.first_column)
        neg_delta = [[b.fneg(x) for x in pair] for pair in column_values("delta")]
        dS = self._ds(b, packed_p, G, self._mma_rows(b, self.v_off, do_tile, width,
                                                     c.head_dim,
                                                     lambda i, j, e: neg_delta[j][e & 1]))
        dk = self._mma_registers(b, self._pack(b, dS), q_tile, dk, self.first_column)
        if c.deterministic:  # (no dQ here: mha_bwd_dq's)
            return dk, dv

        # dS^T (16-bit) to shared memory, for dQ = dS K
        lanes = self._lanes(b)
        for i in range(MT):
            for r in range(2):
                row_base = b.add(b.mul(lanes.own_row(b, i, r), i32(self.DSB)),
                                 b.add(b.shl(lanes.t, i32(2)), i32(self.ds_off)))
                for j in range(NQ):
                    chunk = (b.xor(lanes.g, i32(J0 + j)) if self.DSB % 128 == 0
                             else i32(J0 + j))
                    off = b.add(row_base, b.shl(chunk, i32(4)))
                    val = warp.pack2(b, c.dtype, dS[i][j][2 * r], dS[i][j][2 * r + 1])
                    warp.store(b, val, warp.smem_ptr(b, self.smem, off), align=4)
        return dk, dv

    def _dq(self, b, h, q_row, rows_valid):
        """dQ (block_m x this warp's dq_columns of the column pass's) = dS K, added into the
        fp32 accumulator with one atomic per element (rows past the sequence skipped); in
        `dq_passes` passes over the columns, each holding only its part of the product."""
        c = self.c
        width = c.dq_columns // c.dq_passes
        for p in range(c.dq_passes):
            self._dq_pass(b, h, q_row, rows_valid, p * width, width)

    def _dq_pass(self, b, h, q_row, rows_valid, first: int, width: int):
        c, a, dt = self.c, self.a, self.c.dtype
        MQ, ND = c.block_m // 16, width // 8
        zero = warp.fconst(0.0)
        acc = [[[zero] * 4 for _ in range(ND)] for _ in range(MQ)]
        lanes = self._lanes(b)
        ds_bases = self._bases(b, lanes.b_row, lanes.m_lo, self.ds_off, self.DSB)
        warp_chunk = b.add(b.mul(lanes.warp_id, i32(c.dq_columns // 8)),
                           i32(self.first_column // 8))
        k_bases = self._bases(b, lanes.a_row, b.add(warp_chunk, lanes.m_hi), self.k_off,
                              self.RB)
        for s in range(c.block_n // 16):
            fa = [_ldmatrix(b, self._at(b, ds_bases, s * 16, 2 * m), trans=True)
                  for m in range(MQ)]
            for jp in range(ND // 2):
                fb = _ldmatrix(b, self._at(b, k_bases, s * 16, first // 8 + 2 * jp),
                                      trans=True)
                for m in range(MQ):
                    acc[m][2 * jp] = warp.mma_m16n8k16(b, dt, fa[m], fb[0:2], acc[m][2 * jp])
                    acc[m][2 * jp + 1] = warp.mma_m16n8k16(b, dt, fa[m], fb[2:4],
                                                           acc[m][2 * jp + 1])
        lanes = self._lanes(b)
        warp_col = b.add(b.mul(lanes.warp_id, i32(c.dq_columns)),
                         i32(self.first_column + first))
        if self.vector_red:
            self._red_v4(b, h, q_row, rows_valid, lanes, warp_col, acc)
            return
        col0 = b.add(warp_col, b.shl(lanes.t, i32(1)))
        for m in range(MQ):
            for r in range(2):
                row = b.add(lanes.g, i32(16 * m + 8 * r))
                with b.if_then(b.icmp_signed("<", row, rows_valid)):
                    off = _row_offset(b, a, c.ragged, "dq_accum", self.bidx,
                                      b.add(q_row, row), h)
                    base = _gep(b, a.dq_accum, b.add(off, b.zext(col0, i64)), f32)
                    for j in range(ND):
                        for e2 in range(2):
                            b.atomic_rmw("fadd", _gep(b, base, i64(8 * j + e2), f32),
                                         acc[m][j][2 * r + e2], "monotonic")

    def _red_v4(self, b, h, q_row, rows_valid, lanes, warp_col, acc):
        """The dQ tile added four columns at a time (`red.global.add.v4.f32`, sm_90): lanes
        t and t^1 swap half their accumulators, so the even one holds row g's columns
        4(t/2)..+3 and the odd one row g+8's."""
        c, a = self.c, self.a
        odd = b.and_(lanes.t, i32(1))
        is_odd = b.icmp_unsigned("!=", odd, i32(0))
        col = b.add(warp_col, b.shl(b.lshr(lanes.t, i32(1)), i32(2)))
        for m, tiles in enumerate(acc):
            row = b.add(lanes.g, b.add(b.shl(odd, i32(3)), i32(16 * m)))
            exchanged = []
            for c0, c1, c2, c3 in tiles:  # (shuffles outside the branch: every lane takes part)
                sent = [b.select(is_odd, x, y) for x, y in ((c0, c2), (c1, c3))]
                got = [warp.shfl_bfly(b, x, 1) for x in sent]
                exchanged.append([b.select(is_odd, got[0], c0), b.select(is_odd, got[1], c1),
                                  b.select(is_odd, c2, got[0]), b.select(is_odd, c3, got[1])])
            with b.if_then(b.icmp_signed("<", row, rows_valid)):
                off = _row_offset(b, a, c.ragged, "dq_accum", self.bidx, b.add(q_row, row), h)
                base = _gep(b, a.dq_accum, b.add(off, b.zext(col, i64)), f32)
                for j, values in enumerate(exchanged):
                    address = b.ptrtoint(_gep(b, base, i64(8 * j), f32), i64)
                    b.asm(ir.FunctionType(nvptx.void, [i64] + [f32] * 4),
                          "red.global.add.v4.f32 [$0], {$1, $2, $3, $4};", "l,f,f,f,f",
                          [address, *values], True)



class _DqKernel(_TileKernel):
    """`mha_bwd_dq` (deterministic mode): the main kernel with the sides swapped. A CTA
    owns one query tile (block_n rows) of one (batch, query head) and steps over the K/V
    tiles (`dq_step` rows) the mask does not prove empty: S = Q K^T, P, dP = dO V^T and dS as
    in `mha_bwd`, dQ += dS K in registers; then dQ * scale in q's dtype. One CTA per (query
    tile, head, batch), the query tiles from the last (under a causal mask the longest
    first)."""

    writes_dq = True

    def __init__(self, config: BackwardConfig, hooks: ExprHooks, args: KernelArgs,
                 smem: ir.Value):
        super().__init__(config, hooks, args, smem)
        c = config
        self.tile_rows = (c.block_n, c.dq_step)
        self.q_off, self.do_off = 0, c.block_n * self.RB
        self.stage0, self.stage_bytes = 2 * c.block_n * self.RB, 2 * c.dq_step * self.RB
        self.in_stage = {"k": 0, "v": c.dq_step * self.RB}

    def emit(self, b) -> None:
        c, a = self.c, self.a
        MT = c.tiles_per_warp
        self.bidx = nvptx.special_register(b, "block_idx", "z")
        h = nvptx.special_register(b, "block_idx", "y")
        tile = b.sub(b.sub(nvptx.special_register(b, "grid_dim", "x"), i32(1)),
                     nvptx.special_register(b, "block_idx", "x"))
        q_start, self.seqlen_q = sequence_rows(b, c.ragged, a.cu_seqlens_q, a.seqlen_q,
                                               self.bidx)
        k_start, self.seqlen_k = sequence_rows(b, c.ragged, a.cu_seqlens_k, a.seqlen_k,
                                               self.bidx)
        self.q_start, self.k_start = q_start, k_start
        q0 = b.mul(tile, i32(c.block_n))
        with b.if_then(b.icmp_signed("<", q0, self.seqlen_q)):
            q_row = b.add(q_start, q0)
            rows_valid = b.sub(self.seqlen_q, q0)
            for tensor, off in (("q", self.q_off), ("dout", self.do_off)):
                self._load_tile(b, tensor, _row_offset(b, a, c.ragged, tensor, self.bidx,
                                                       q_row, h), rows_valid, c.block_n, off)
            warp.cp_async_commit(b)
            # the LSE and delta of this thread's rows ([2 * m-tile + r]: rows g + 8r)
            lanes = self._lanes(b)
            neg_lse, neg_delta = [], []
            for i in range(MT):
                for r in range(2):
                    row = lanes.own_row(b, i, r)
                    valid = b.icmp_signed("<", row, rows_valid)
                    off = _lse_offset(b, a, self.bidx, h,
                                      b.add(q_row, b.select(valid, row, i32(0))))
                    lse = b.load(_gep(b, a.lse, off, f32), typ=f32)
                    neg_lse.append(self._neg_lse(b, lse, b.add(q0, row), self.seqlen_q))
                    delta = b.load(_gep(b, a.delta, off, f32), typ=f32)
                    neg_delta.append(b.select(valid, b.fneg(delta), warp.fconst(0.0)))
            hk = b.udiv(h, i32(c.gqa_group)) if c.gqa_group > 1 else h

            def pair_of(b, s):  # (query head, first query row, first K/V row) of step s
                return h, q0, b.mul(s, i32(c.dq_step))

            def issue(b, s, stage):
                kv0 = b.mul(s, i32(c.dq_step))
                kv_row = b.add(k_start, kv0)
                for tensor in ("k", "v"):
                    self._load_tile(b, tensor, _row_offset(b, a, c.ragged, tensor, self.bidx,
                                                           kv_row, hk),
                                    b.sub(self.seqlen_k, kv0), c.dq_step,
                                    self._stage(b, stage, tensor))

            def compute(b, s, stage, carried):
                return _flat(self._step(b, h, q0, b.mul(s, i32(c.dq_step)), stage,
                                        _tiles(carried, MT), neg_lse, neg_delta))

            steps = b.udiv(b.add(self.seqlen_k, i32(c.dq_step - 1)), i32(c.dq_step))
            dq = self._step_loop(b, steps, pair_of, issue, compute,
                                 [warp.fconst(0.0)] * (MT * c.head_dim // 2 * self.writes_dq))
            if self.writes_dq:
                self._store_own(b, "dq", h, q_row, rows_valid, dq, a.softmax_scale)

    def _step(self, b, h, q0, kv0, stage, dq, neg_lse, neg_delta):
        """One K/V tile at kv0, its K and V in `stage`: dQ += dS K."""
        c = self.c
        k_tile, v_tile = self._stage(b, stage, "k"), self._stage(b, stage, "v")
        lanes = self._lanes(b)

        def q_idx(i, j, e):
            return b.add(q0, lanes.own_row(b, i, e >> 1))

        def kv_idx(i, j, e):
            return b.add(kv0, lanes.step_column(b, j, e))

        S = self._mma_rows(b, self.q_off, k_tile, c.dq_step, c.head_dim)
        packed_p, G = self._probabilities(b, h, q0, kv0, S, q_idx, kv_idx,
                                          lambda i, j, e: neg_lse[2 * i + (e >> 1)])
        dS = self._ds(b, packed_p, G, self._mma_rows(b, self.do_off, v_tile, c.dq_step,
                                                     c.head_dim,
                                                     lambda i, j, e: neg_delta[2 * i + (e >> 1)]))
        return self._mma_registers(b, self._pack(b, dS), k_tile, dq)


class _OperandGradKernel(_DqKernel):
    """`mha_bwd_operand_grads` (`BackwardConfig.operand_grads`): the dQ kernel's walk over a
    query tile's K/V tiles, without dQ: per pair, dZ = P * (dP - delta) (P 16-bit, as dS
    takes it; 0 outside the mask and the sequence, where nothing is added) goes to the
    gradients of the f32 tensors the score reads (`TileRules.scatter_reads`). A kernel of
    its own: beside dQ's accumulators, S, P and dP would not fit the registers."""

    writes_dq = False

    def _step(self, b, h, q0, kv0, stage, dq, neg_lse, neg_delta):
        c = self.c
        lanes = self._lanes(b)

        def q_idx(i, j, e):
            return b.add(q0, lanes.own_row(b, i, e >> 1))

        def kv_idx(i, j, e):
            return b.add(kv0, lanes.step_column(b, j, e))

        S = self._mma_rows(b, self.q_off, self._stage(b, stage, "k"), c.dq_step, c.head_dim)
        packed_p, _ = self._probabilities(b, h, q0, kv0, S, q_idx, kv_idx,
                                          lambda i, j, e: neg_lse[2 * i + (e >> 1)])
        dP_delta = self._mma_rows(b, self.do_off, self._stage(b, stage, "v"), c.dq_step,
                                  c.head_dim, lambda i, j, e: neg_delta[2 * i + (e >> 1)])
        rules = TileRules(self.hooks, TileSequence(self.bidx, self.seqlen_q, self.seqlen_k,
                                                   *self._starts()))
        P = self._unpacked(b, packed_p, len(dP_delta[0]))
        # (the pairs' rows and keys from opaque values: what the reads' offsets derive from
        # them is computed here, not hoisted out of the loop into a register per pair)
        q0, kv0, h = (nvptx.opaque(b, x) for x in (q0, kv0, h))
        scale = self.a.softmax_scale
        rules.scatter_reads(b, [(b.fmul(P[i][j][e], x), b.fmul(S[i][j][e], scale),
                                 q_idx(i, j, e), kv_idx(i, j, e))
                                for i, mt in enumerate(dP_delta) for j, tile in enumerate(mt)
                                for e, x in enumerate(tile)], h)
        return dq


# ============================================================================ module
def kernel_function(module: ir.Module, name: str, threads: int, hooks: ExprHooks,
                    abi: KernelABI = ABI) -> tuple[ir.Function, ir.IRBuilder]:
    """Kernel `name` of a backward module, taking `abi`'s parameters and the operands'
    (`ExprHooks.kernel_abi`)."""
    # (one CTA a multiprocessor at least lets ptxas use 255 registers)
    fn, _ = signature.kernel(module, hooks.kernel_abi(abi), name, threads, 1)
    return fn, ir.IRBuilder(fn.append_basic_block("entry"))


def backward_module(name: str, hooks: ExprHooks | None, target: Target,
                    smem_symbol: str = SMEM_SYMBOL
                    ) -> tuple[ir.Module, ir.GlobalVariable, ExprHooks]:
    """A backward design's module, its dynamic shared memory (`smem_symbol`) and its hooks
    (the score's derivative required with a score)."""
    hooks = hooks or ExprHooks()
    if hooks.score is not None and hooks.derivative is None:
        raise ValueError("a score hook needs its derivative hook for the backward pass")
    module = new_module(name, target)
    smem = ir.GlobalVariable(module, ir.ArrayType(nvptx.i8, 0), smem_symbol, addrspace=SHARED)
    smem.linkage = "external"
    smem.align = 128
    return module, smem, hooks


def build_backward_module(config: BackwardConfig, hooks: ExprHooks | None, target: Target,
                          work_loop: WorkLoop) -> ir.Module:
    """One module with the build's kernels (`Backward.kernels`), all taking `ABI`'s parameters;
    `work_loop` is the scheduler's, for the main kernel's view (`scheduler_view`)."""
    config.validate()
    module, smem, hooks = backward_module(f"mha_bwd_{config.dtype}_d{config.head_dim}", hooks,
                                          target)
    fn, b = kernel_function(module, PREPROCESS, ROW_THREADS, hooks, preprocess_abi(config))
    _emit_preprocess(b, config, KernelArgs(fn, preprocess_abi(config), config), hooks)
    b.ret_void()
    fn, b = kernel_function(module, MAIN, config.threads, hooks)
    # (opaque_env: the scheduler's inputs rederived per step, not held across the tile)
    _MainKernel(config, hooks, KernelArgs(fn, ABI, config, opaque_env=config.opaque_env), smem,
                target.arch).emit(b, work_loop)
    b.ret_void()
    if config.deterministic:
        fn, b = kernel_function(module, DQ, config.threads, hooks)
        _DqKernel(config, hooks, KernelArgs(fn, ABI, config), smem).emit(b)
    else:
        fn, b = kernel_function(module, POSTPROCESS, ROW_THREADS, hooks)
        _emit_postprocess(b, config, KernelArgs(fn, ABI, config))
    b.ret_void()
    if config.operand_grads:
        if hooks.scatter_reads is None:
            raise ValueError("an operand_grads build needs the scatter_reads hook")
        fn, b = kernel_function(module, OPERAND_GRADS, config.threads, hooks)
        _OperandGradKernel(config, hooks, KernelArgs(fn, ABI, config), smem).emit(b)
        b.ret_void()
    return module


# ============================================================================ the design
class BackwardDesign(Backend):
    """What the backward designs share: the main kernel's scheduler hands out K/V tiles of
    K/V heads (`scheduler_view`), numbered over cu_seqlens_k in a ragged call."""

    workload = "backward"
    tile_offsets = "cu_seqlens_k"

    def scheduler_of(self, options, config: BackwardConfig) -> tuple[str, tuple]:
        return options.scheduler_for(self.workload, deterministic=config.deterministic)

    def scheduler_shape(self, config: BackwardConfig) -> tuple[int, int]:
        return config.block_n, 1

    def work_space(self, config: BackwardConfig, call: CallSizes) -> tuple[int, int, int, int]:
        return (call.batch, -(-call.max_seqlen_k // config.block_n), call.max_seqlen_k,
                call.kv_heads)


class Backward(BackwardDesign):
    """The backward pass: three kernels in one build (`kernels`), the main one driven by the
    scheduler."""

    name = "backward"
    targets = ("sm_90a", "sm_80")
    abi = ABI
    config_type = BackwardConfig

    def problems(self, options, arch: str) -> list[Problem]:
        config = declared_config(options, Layout())
        found = config.problems()
        if not found and shared_bytes(config) > SHARED_MEMORY_LIMIT[arch]:
            found.append(Problem(("head_dim",), f"the backward pass needs "
                                                f"{shared_bytes(config) // 1024} KiB of shared "
                                                f"memory; {arch} allows "
                                                f"{SHARED_MEMORY_LIMIT[arch] // 1024} KiB"))
        return found

    def configs(self, options, layout: Layout) -> tuple[BackwardConfig, ...]:
        """The declaration's config in its IR shapes (the work tile's values parked in
        shared memory or held, the scheduler's inputs rederived per step or not), then
        variants with fewer live values (dQ in two column passes, the step's S^T and dP^T
        in two passes, 32-row query steps), then the same work over 8 warps of 128 K/V
        rows: ptxas's allocation at the 255-register cap is chaotic, so the first that
        assembles without spills wins."""
        return self.configs_for(declared_config(options, layout))

    def configs_for(self, config: BackwardConfig) -> tuple[BackwardConfig, ...]:
        """`configs` from the declaration's config (its dtype, head dim and layout fields;
        another design's config of the same fields too: `backward_sm90`'s fallback)."""
        config = fields_config(config.dtype, config.head_dim, config.gqa_group, config.ragged,
                               config.deterministic, config.sink, config.operand_grads)
        passes = (1,) if config.deterministic else (1, 2)  # (no dQ product in mha_bwd)
        candidates = [replace(config, block_m=m, step_passes=s, dq_passes=p,
                              park_work_tile=park, opaque_env=opaque)
                      for m, s in ((config.block_m, 1), (config.block_m, 2), (32, 1))
                      for p in passes for park in (True, False) for opaque in (True, False)]
        candidates.append(replace(config, block_n=128, num_warps=8))
        fits = min(SHARED_MEMORY_LIMIT.values())  # (a config is chosen before the arch)
        return tuple(c for c in candidates if not c.problems() and max(
            shared_bytes(c), dq_shared_bytes(c) if c.deterministic or c.operand_grads else 0
        ) <= fits)

    def kernels(self, config: BackwardConfig) -> tuple[KernelLaunch, ...]:
        """The preprocess, the main kernel, then the postprocess (atomic mode) or the dQ
        kernel (deterministic mode: one CTA per query tile of block_n rows)."""
        def rows(call: CallSizes) -> tuple[int, int, int]:
            return row_grid(call, call.max_seqlen_q)

        def query_tiles(call: CallSizes) -> tuple[int, int, int]:
            return max(1, -(-call.max_seqlen_q // config.block_n)), call.heads, call.batch

        last = KernelLaunch(DQ, ABI, config.threads, dq_shared_bytes(config), query_tiles) \
            if config.deterministic else KernelLaunch(POSTPROCESS, ABI, ROW_THREADS, 0, rows)
        grads = (KernelLaunch(OPERAND_GRADS, ABI, config.threads, dq_shared_bytes(config),
                              query_tiles),) if config.operand_grads else ()
        return (KernelLaunch(PREPROCESS, preprocess_abi(config), ROW_THREADS, 0, rows),
                KernelLaunch(MAIN, ABI, config.threads, shared_bytes(config)), last, *grads)

    def scratch(self, config: BackwardConfig, call: CallSizes) -> dict[str, int]:
        """delta (fp32, the LSE's layout) and the atomic mode's fp32 dQ accumulator (q's
        shape; deterministic mode has none: `mha_bwd_dq` writes dQ)."""
        q_rows = query_rows(call)
        accum = {} if config.deterministic else {
            "dq_accum": 4 * q_rows * call.heads * config.head_dim}
        return {**accum, "delta": 4 * q_rows * call.heads, **sink_scratch(config, call)}

    def build(self, source: KernelSource, configs: tuple[BackwardConfig, ...],
              target: Target) -> KernelBuild:
        """LLVM IR, PTX and (with ptxas) the cubin of the first of `configs` that assembles
        without spills (its hooks carry the score's derivative: `codegen.kernel`)."""
        return spill_free_build(self.name, target, [
            (c, lambda c=c: build_backward_module(c, source.hooks, target,
                                                  source.work_loop(*self.scheduler_shape(c))))
            for c in configs])


def query_rows(call: CallSizes) -> int:
    """The query rows of q (and of the LSE's layout, per head)."""
    return call.total_q if call.ragged else call.batch * call.seqlen_q


def sink_scratch(config: BackwardConfig, call: CallSizes) -> dict[str, int]:
    """The rows' sink terms (`SINK_ABI`: float32, the LSE's layout), where there is a sink."""
    return {"sink_terms": 4 * query_rows(call) * call.heads} if config.sink else {}


def declared_config(options, layout: Layout) -> BackwardConfig:
    return fields_config(options.dtype, options.head_dim, layout.gqa_group, layout.ragged,
                         layout.deterministic, options.sink is not None, layout.operand_grads)


def fields_config(dtype: str, head_dim: int, gqa_group: int, ragged: bool,
                  deterministic: bool, sink: bool = False,
                  operand_grads: bool = False) -> BackwardConfig:
    """The config of a declaration's dtype and head dim in a layout. Head dim 256: dK and dV
    in two column passes, 32-row query steps (K, V and two stages of 64 rows would pass
    sm_80's shared memory)."""
    wide = head_dim > 128
    return BackwardConfig(dtype, head_dim, block_m=32 if wide else 64,
                          column_passes=2 if wide else 1, gqa_group=gqa_group, ragged=ragged,
                          deterministic=deterministic, sink=sink, operand_grads=operand_grads)


BACKEND = Backward()
