"""The backward pass: a FlashAttention-2-class design in LLVM IR for sm_80 and sm_90a.

Three kernels in one module, sharing one parameter list (`ABI`):

- `mha_bwd_preprocess`: delta = rowsum(dO * O) in fp32 per (batch, head, row), in the LSE's
  layout, and the fp32 dQ accumulator's rows zeroed;
- `mha_bwd`: a CTA owns one K/V tile (block_n rows) of one (batch, K/V head), keeps K and V
  in shared memory and dK, dV in registers, and loops over the query tiles of every query
  head of its GQA group that the mask's classification does not prove empty. Per query
  tile it recomputes P from Q, K and the forward's LSE, then
      dV += P^T dO,  dP = dO V^T,  dS = P * (dP - delta) * dscore/ds,
      dK += dS^T Q,  dQ += dS K  (fp32 atomics into the accumulator);
  the softmax scale is applied once at the end (dK here, dQ in the postprocess);
- `mha_bwd_postprocess`: dQ = scale * accumulator, in q's dtype.

Work split of `mha_bwd` (4 warps): each warp owns block_n / num_warps K/V rows and computes
its rows of the transposed tiles S^T = K Q^T and dP^T = V dO^T, so P^T and dS^T are already
the A operands of dV += P^T dO and dK += dS^T Q (no transposes through shared memory). dS^T
goes to shared memory once (16-bit) for dQ = dS K, which the warps split by head-dim
columns and add into the accumulator (`red.global.add.v4.f32` on sm_90a, four columns per
lane after a swap with the neighbouring lane; scalar atomics on sm_80). Each step's Q, dO,
LSE and delta are fetched by cp.async into one of two stages while the other computes. Every
shared tile with 128-byte multiples for rows has its 16-byte chunks XOR-swizzled by row % 8,
as in sm80 (dS^T of a 32-row query step has 64-byte rows: plain). One CTA per (K/V tile,
K/V head, batch); grids are `grids()`'s.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from llvmlite import ir

from mhadsl.codegen import nvptx, warp
from mhadsl.codegen.abi import CallValue, KernelABI, Param, Pointer, Stride
from mhadsl.codegen.backends import (
    SHARED_MEMORY_LIMIT, Backend, ExprHooks, KernelArgs, KernelBuild, KernelSource, LaunchShape,
    Layout, Problem, common_problems, ir_loop, last_index, sequence_rows, spill_free_build,
)
from mhadsl.codegen.nvptx import SHARED, f32, i1, i32, i64
from mhadsl.codegen.target import Target, new_module

PREPROCESS, MAIN, POSTPROCESS = "mha_bwd_preprocess", "mha_bwd", "mha_bwd_postprocess"
KERNELS = (PREPROCESS, MAIN, POSTPROCESS)  # in launch order
SMEM_SYMBOL = "mha_bwd_smem"
HEAD_DIMS = (64, 128)  # 256 would hold 2 x 128 f32 dK/dV accumulators per thread: past 255
MAX_REGISTERS = 255
ROW_THREADS = 128  # threads of the preprocess and postprocess kernels
ROW_TILE = 64  # rows one preprocess/postprocess CTA covers


# ============================================================================ configuration
@dataclass(frozen=True)
class BackwardConfig:
    """Everything that selects a backward build (hashable; part of the cache key)."""

    dtype: str = "bf16"
    head_dim: int = 128
    block_m: int = 64  # query rows per step of a CTA's loop
    block_n: int = 64  # K/V rows a CTA owns
    num_warps: int = 4
    gqa_group: int = 1
    ragged: bool = False
    dq_passes: int = 1  # dQ = dS K in this many column passes (fewer live accumulators)

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def kv_tiles_per_warp(self) -> int:
        """16-row m-tiles of K/V rows each warp owns."""
        return self.block_n // self.num_warps // 16

    @property
    def dq_columns(self) -> int:
        """Head-dim columns of dQ each warp computes."""
        return self.head_dim // self.num_warps

    @property
    def row_bytes(self) -> int:
        return self.head_dim * warp.ELEMENT_BYTES

    @property
    def rows_per_pass(self) -> int:
        return self.threads // (self.head_dim // 8)

    @property
    def accumulators(self) -> int:
        """f32 registers per thread of dK, dV, S^T and dP^T together."""
        return self.kv_tiles_per_warp * (2 * self.head_dim + 2 * self.block_m) // 2

    def problems(self) -> list[Problem]:
        found = common_problems(self)
        if self.head_dim not in HEAD_DIMS:
            found.append(Problem(("head_dim",), (
                f"the backward pass runs head_dim {', '.join(map(str, HEAD_DIMS))}, not "
                f"{self.head_dim}")))
            return found
        if self.block_m not in (32, 64):
            found.append(Problem(("tile",), "the backward pass steps 32 or 64 query rows at "
                                            "a time"))
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
    """K, V (block_n rows), two stages (the step's and the next one's, `stage_bytes`), and
    dS^T (block_n x block_m, 16-bit)."""
    c = config
    return 2 * c.block_n * c.row_bytes + 2 * stage_bytes(c) + c.block_n * c.block_m * 2


def launch_shapes(config: BackwardConfig) -> dict[str, LaunchShape]:
    return {PREPROCESS: LaunchShape(PREPROCESS, ROW_THREADS, 0),
            MAIN: LaunchShape(MAIN, config.threads, shared_bytes(config)),
            POSTPROCESS: LaunchShape(POSTPROCESS, ROW_THREADS, 0)}


def grids(config: BackwardConfig, batch: int, heads: int, kv_heads: int, max_seqlen_q: int,
          max_seqlen_k: int) -> dict[str, tuple[int, int, int]]:
    """Each kernel's grid: (row tiles, heads, batch); the K/V tile of `mha_bwd` per CTA."""
    rows = (max(1, -(-max_seqlen_q // ROW_TILE)), heads, batch)
    return {PREPROCESS: rows, MAIN: (max(1, -(-max_seqlen_k // config.block_n)), kv_heads, batch),
            POSTPROCESS: rows}


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
    Param("num_heads", "i32", CallValue("num_heads"), "query heads Hq (= gqa_group * Hkv)"),
    Param("seqlen_q", "i32", CallValue("seqlen_q"), "dense query length (ignored when ragged)"),
    Param("seqlen_k", "i32", CallValue("seqlen_k"), "dense key length (ignored when ragged)"),
    Param("softmax_scale", "f32", CallValue("softmax_scale"), "scale applied to q.k before "
          "the score hook / softmax"),
)


# ============================================================================ helpers
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


def _guarded(b: ir.IRBuilder, cond: ir.Value, make, default: list[ir.Value]) -> list[ir.Value]:
    """`make(b)`'s values where `cond` holds (emitted under a branch), else `default`."""
    pre = b.block
    with b.if_then(cond):
        values = make(b)
        then = b.block
    merged = []
    for v, d in zip(values, default):
        phi = b.phi(v.type)
        phi.add_incoming(v, then)
        phi.add_incoming(d, pre)
        merged.append(phi)
    return merged


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
    (8 elements) of a row, head_dim / 8 consecutive lanes one row."""

    def __init__(self, b, config: BackwardConfig, args: KernelArgs):
        self.c, self.a = config, args
        tid = nvptx.special_register(b, "thread_idx", "x")
        self.lanes_per_row = config.head_dim // 8
        self.chunk = b.urem(tid, i32(self.lanes_per_row))
        self.row_in_pass = b.udiv(tid, i32(self.lanes_per_row))
        self.tile = nvptx.special_register(b, "block_idx", "x")
        self.h = nvptx.special_register(b, "block_idx", "y")
        self.bidx = nvptx.special_register(b, "block_idx", "z")
        self.start, self.seqlen = sequence_rows(b, config.ragged, args.cu_seqlens_q,
                                                args.seqlen_q, self.bidx)

    def rows(self, b, each):
        """each(b, row (in the sequence), valid) for every row of the CTA's tile, per thread."""
        rows_per_pass = ROW_THREADS // self.lanes_per_row
        first = b.mul(self.tile, i32(ROW_TILE))
        for p in range(ROW_TILE // rows_per_pass):
            row = b.add(first, b.add(self.row_in_pass, i32(p * rows_per_pass)))
            each(b, row, b.icmp_signed("<", row, self.seqlen))

    def chunk_ptr(self, b, tensor: str, row, etype):
        off = _row_offset(b, self.a, self.c.ragged, tensor, self.bidx, b.add(self.start, row),
                          self.h)
        off = b.add(off, b.zext(b.shl(self.chunk, i32(3)), i64))
        return _gep(b, self.a[tensor], off, etype)


def _emit_preprocess(b, config: BackwardConfig, args: KernelArgs):
    k = _RowKernel(b, config, args)
    v4i, v4f = ir.VectorType(i32, 4), ir.VectorType(f32, 4)

    def row(b, r, valid):
        def dot(b):
            o = _unpack8(b, config.dtype, b.load(k.chunk_ptr(b, "o", r, nvptx.i16), typ=v4i,
                                                 align=16))
            do = _unpack8(b, config.dtype, b.load(k.chunk_ptr(b, "dout", r, nvptx.i16),
                                                  typ=v4i, align=16))
            total = b.fmul(o[0], do[0])
            for x, y in zip(o[1:], do[1:]):
                total = warp.fma(b, x, y, total)
            acc = k.chunk_ptr(b, "dq_accum", r, f32)
            zero = ir.Constant(v4f, [0.0] * 4)
            b.store(zero, acc, align=16)
            b.store(zero, _gep(b, acc, i64(4), f32), align=16)
            return [total]
        (partial,) = _guarded(b, valid, dot, [warp.fconst(0.0)])
        for m in range(k.lanes_per_row.bit_length() - 1):  # the row's lanes: 1, 2, 4, (8)
            partial = b.fadd(partial, warp.shfl_bfly(b, partial, 1 << m))
        with b.if_then(b.and_(valid, b.icmp_unsigned("==", k.chunk, i32(0)))):
            ptr = _gep(b, args.delta, _lse_offset(b, args, k.bidx, k.h, b.add(k.start, r)), f32)
            b.store(partial, ptr, align=4)
    k.rows(b, row)


def _emit_postprocess(b, config: BackwardConfig, args: KernelArgs):
    k = _RowKernel(b, config, args)
    v4f = ir.VectorType(f32, 4)

    def row(b, r, valid):
        with b.if_then(valid):
            acc = k.chunk_ptr(b, "dq_accum", r, f32)
            halves = [b.load(_gep(b, acc, i64(4 * h), f32), typ=v4f, align=16) for h in (0, 1)]
            x = [b.fmul(b.extract_element(halves[e // 4], i32(e % 4)), args.softmax_scale)
                 for e in range(8)]
            out = ir.Constant(ir.VectorType(i32, 4), ir.Undefined)
            for e in range(4):
                out = b.insert_element(out, warp.pack2(b, config.dtype, x[2 * e], x[2 * e + 1]),
                                       i32(e))
            b.store(out, k.chunk_ptr(b, "dq", r, nvptx.i16), align=16)
    k.rows(b, row)


# ============================================================================ the main kernel
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
        self.warp_kv_row = b.mul(self.warp_id, i32(config.block_n // config.num_warps))
        chunks = config.head_dim // 8
        self.ld_row = b.udiv(tid, i32(chunks))
        self.ld_chunk = b.urem(tid, i32(chunks))
        self.ld_swz = b.add(b.mul(self.ld_row, i32(config.row_bytes)),
                            b.shl(warp.swizzle_chunk(b, self.ld_chunk, self.ld_row), i32(4)))


class _MainKernel:
    """`mha_bwd`: the shared-memory layout, and the K/V tile's loop over query tiles."""

    def __init__(self, b, config: BackwardConfig, hooks: ExprHooks, args: KernelArgs,
                 smem: ir.Value, target_arch: str):
        c = self.c = config
        self.hooks, self.a, self.smem = hooks, args, smem
        self.RB, self.DSB = c.row_bytes, c.block_m * 2  # row bytes of the D-wide and dS^T tiles
        self.k_off = 0
        self.v_off = c.block_n * self.RB
        # a stage: Q, dO, LSE, delta at these offsets from its start
        self.stage0, self.stage_bytes = 2 * c.block_n * self.RB, stage_bytes(c)
        self.in_stage = {"q": 0, "dout": c.block_m * self.RB, "lse": 2 * c.block_m * self.RB,
                         "delta": 2 * c.block_m * self.RB + 4 * c.block_m}
        self.ds_off = self.stage0 + 2 * self.stage_bytes
        self.vector_red = target_arch == "sm_90a"  # red.global.add.v4.f32 is sm_90's

    def _lanes(self, b) -> _Lanes:
        """This thread's lane values, derived afresh where a phase needs them: through an
        opaque %tid.x, so LLVM cannot hoist them (and the dozens of ldmatrix addresses made
        from them) out of the loop and keep them live across it."""
        return _Lanes(b, self.c, nvptx.opaque_special_register(b, "tid.x"))

    # ------------------------------------------------------------------ shared memory
    def _bases(self, b, row, chunk, region_off: int, row_bytes: int):
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

    def _load_tile(self, b, tensor: str, first_row_off, rows_valid, rows: int, smem_off: int):
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
            warp.cp_async_16(b, _gep(b, dst, i64(p * rpp * self.RB), nvptx.i8),
                             b.select(valid, src, a[tensor]),
                             b.select(valid, i32(16), i32(0)))

    # ------------------------------------------------------------------ tile products
    def _mma_rows(self, b, a_tile, b_tile, n_cols: int, k_depth: int):
        """A B^T over k_depth for this warp's K/V m-tiles: A rows from the shared tile at
        offset `a_tile` (the warp's own K/V rows), B rows from the one at `b_tile` (n_cols
        query rows), both k-contiguous. Returns [m-tile][n-tile][4]."""
        c, dt = self.c, self.c.dtype
        lanes = self._lanes(b)
        a_bases = self._bases(b, b.add(lanes.warp_kv_row, lanes.a_row), lanes.m_hi,
                              a_tile, self.RB)
        b_bases = self._bases(b, lanes.b_row, lanes.m_lo, b_tile, self.RB)
        MT, NT = c.kv_tiles_per_warp, n_cols // 8
        zero = warp.fconst(0.0)
        acc = [[[zero] * 4 for _ in range(NT)] for _ in range(MT)]
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
        """[m-tile][q n-tile][4] f32 -> the A operands [m-tile][k-slice][4 x i32] of a
        product whose k dimension is the query columns (16-bit, as P in sm80's P V)."""
        dt = self.c.dtype
        return [[[warp.pack2(b, dt, t[2 * s][0], t[2 * s][1]),
                  warp.pack2(b, dt, t[2 * s][2], t[2 * s][3]),
                  warp.pack2(b, dt, t[2 * s + 1][0], t[2 * s + 1][1]),
                  warp.pack2(b, dt, t[2 * s + 1][2], t[2 * s + 1][3])]
                 for s in range(len(t) // 2)] for t in tiles]

    def _mma_registers(self, b, packed, bt_tile, acc):
        """acc += T B for this warp: T packed by `_pack`, B = the shared tile at offset
        `bt_tile` (block_m x head_dim), transposed by ldmatrix."""
        c, dt = self.c, self.c.dtype
        lanes = self._lanes(b)
        bt_bases = self._bases(b, lanes.a_row, lanes.m_hi, bt_tile, self.RB)
        for s in range(c.block_m // 16):
            fa = [t[s] for t in packed]
            for jp in range(c.head_dim // 16):
                fb = _ldmatrix(b, self._at(b, bt_bases, s * 16, 2 * jp), trans=True)
                for i, a_frag in enumerate(fa):
                    acc[i][2 * jp] = warp.mma_m16n8k16(b, dt, a_frag, fb[0:2], acc[i][2 * jp])
                    acc[i][2 * jp + 1] = warp.mma_m16n8k16(b, dt, a_frag, fb[2:4],
                                                           acc[i][2 * jp + 1])
        return acc

    # ------------------------------------------------------------------ the kernel body
    def emit(self, b):
        c, a = self.c, self.a
        MT, DT = c.kv_tiles_per_warp, c.head_dim // 8
        n = nvptx.special_register(b, "block_idx", "x")
        hk = nvptx.special_register(b, "block_idx", "y")
        bidx = nvptx.special_register(b, "block_idx", "z")
        k_start, seqlen_k = sequence_rows(b, c.ragged, a.cu_seqlens_k, a.seqlen_k, bidx)
        q_start, seqlen_q = sequence_rows(b, c.ragged, a.cu_seqlens_q, a.seqlen_q, bidx)
        kv0 = b.mul(n, i32(c.block_n))
        with b.if_then(b.icmp_signed("<", kv0, seqlen_k)):
            self.bidx, self.seqlen_q, self.seqlen_k = bidx, seqlen_q, seqlen_k
            self.q_start, self.kv0 = q_start, kv0
            self.kv_hi = last_index(b, kv0, c.block_n, seqlen_k)
            kv_row = b.add(k_start, kv0)
            for tensor, off in (("k", self.k_off), ("v", self.v_off)):
                self._load_tile(b, tensor, _row_offset(b, a, c.ragged, tensor, bidx, kv_row, hk),
                                b.sub(seqlen_k, kv0), c.block_n, off)
            warp.cp_async_commit(b)

            q_tiles = b.udiv(b.add(seqlen_q, i32(c.block_m - 1)), i32(c.block_m))
            steps = b.mul(q_tiles, i32(c.gqa_group))
            head0 = b.mul(hk, i32(c.gqa_group))

            def step_of(b, s):  # (query head, first query row) of step s: heads outermost
                return b.add(head0, b.udiv(s, q_tiles)), b.mul(b.urem(s, q_tiles),
                                                               i32(c.block_m))

            zero = warp.fconst(0.0)
            count = MT * DT * 4
            init = [zero] * (2 * count)

            def body(b, s, carried):
                # the next step's inputs go to the other stage while this one computes
                stage = carried[-1]
                nxt = self._next_step(b, b.add(s, i32(1)), steps, step_of)
                nvptx.barrier_all(b)  # every warp is done with the other stage and dS
                with b.if_then(b.icmp_signed("<", nxt, steps)):
                    self._issue(b, *step_of(b, nxt), b.sub(i32(1), stage))
                warp.cp_async_commit(b)
                warp.cp_async_wait(b, 1)  # this step's group (and K, V) landed
                nvptx.barrier_all(b)
                dk = [[list(carried[(i * DT + j) * 4:(i * DT + j + 1) * 4]) for j in range(DT)]
                      for i in range(MT)]
                dv = [[list(carried[count + (i * DT + j) * 4:count + (i * DT + j + 1) * 4])
                       for j in range(DT)] for i in range(MT)]
                dk, dv = self._step(b, *step_of(b, s), stage, dk, dv)
                flat = [x for acc in (dk, dv) for tile in acc for frag in tile for x in frag]
                return nxt, flat + [b.sub(i32(1), stage)]

            first = self._next_step(b, i32(0), steps, step_of)
            with b.if_then(b.icmp_signed("<", first, steps)):
                self._issue(b, *step_of(b, first), i32(0))
            warp.cp_async_commit(b)
            final = ir_loop(b, first, steps, init + [i32(0)], body)
            self._store_dkdv(b, hk, kv_row, final[:count], final[count:2 * count])

    def _classify(self, b, h, q0):
        """(may hold a kept pair, every pair kept) for the query tile at q0 of head h and
        this CTA's K/V tile; a K/V tile past seqlen_k is never all kept (the query tile's
        tail rows get P = 0 from their LSE entry, see `_step`)."""
        c, hooks = self.c, self.hooks
        in_bounds = b.icmp_signed("<=", b.add(self.kv0, i32(c.block_n)), self.seqlen_k)
        if hooks.classify is None:
            return ir.Constant(i1, 1), in_bounds if hooks.mask is None else ir.Constant(i1, 0)
        q_hi = last_index(b, q0, c.block_m, self.seqlen_q)
        may, always = hooks.classify(b, self.bidx, h, q0, q_hi, self.kv0, self.kv_hi,
                                     self.seqlen_q, self.seqlen_k)
        return may, b.and_(always, in_bounds)

    def _next_step(self, b, start, steps, step_of):
        """The first step >= start whose query tile may hold a kept pair, or `steps`: empty
        tiles are never loaded or computed."""
        if self.hooks.classify is None:
            return start

        def scan(b, s, _):
            h, q0 = step_of(b, s)
            may, _always = self._classify(b, h, q0)
            # found: jump past the end with the step in the carried value
            return b.select(may, b.add(steps, i32(1)), b.add(s, i32(1))), [
                b.select(may, s, steps)]
        (found,) = ir_loop(b, start, steps, [steps], scan)
        return found

    def _issue(self, b, h, q0, stage):
        """cp.async the query tile at q0 of head h (Q, dO, and the LSE and delta of its
        rows; rows past the sequence zero-filled) into `stage` (i32 0 or 1)."""
        c, a = self.c, self.a
        base = b.add(i32(self.stage0), b.mul(stage, i32(self.stage_bytes)))
        q_row = b.add(self.q_start, q0)
        rows_valid = b.sub(self.seqlen_q, q0)
        for tensor in ("q", "dout"):
            self._load_tile(b, tensor, _row_offset(b, a, c.ragged, tensor, self.bidx, q_row, h),
                            rows_valid, c.block_m, b.add(base, i32(self.in_stage[tensor])))
        tid = self._lanes(b).tid
        with b.if_then(b.icmp_unsigned("<", tid, i32(c.block_m))):
            valid = b.icmp_signed("<", tid, rows_valid)
            off = _lse_offset(b, a, self.bidx, h, b.add(q_row, b.select(valid, tid, i32(0))))
            for name in ("lse", "delta"):
                dst = b.add(base, b.add(b.shl(tid, i32(2)), i32(self.in_stage[name])))
                nvptx.call(b, "llvm.nvvm.cp.async.ca.shared.global.4.s", nvptx.void,
                           [warp.smem_ptr(b, self.smem, dst), _gep(b, a[name], off, f32),
                            b.select(valid, i32(4), i32(0))])

    def _step(self, b, h, q0, stage, dk, dv):
        """One query tile of head h, its inputs in `stage`: dV, dK updated, dQ added into
        the accumulator."""
        c, a, hooks = self.c, self.a, self.hooks
        MT, NQ = c.kv_tiles_per_warp, c.block_m // 8
        q_row = b.add(self.q_start, q0)
        rows_valid = b.sub(self.seqlen_q, q0)
        base = b.add(i32(self.stage0), b.mul(stage, i32(self.stage_bytes)))
        q_tile, do_tile = (b.add(base, i32(self.in_stage[n])) for n in ("q", "dout"))

        lanes = self._lanes(b)

        def column_values(name):  # this thread's query columns' values: [n-tile][e & 1]
            v2 = ir.VectorType(f32, 2)
            out = []
            first = b.add(b.add(base, i32(self.in_stage[name])), b.shl(lanes.t, i32(3)))
            for j in range(NQ):
                byte = b.add(first, i32(32 * j))
                pair = b.load(warp.smem_ptr(b, self.smem, byte), typ=v2, align=8)
                out.append([b.extract_element(pair, i32(e)) for e in range(2)])
            return out

        def q_idx(j, e):
            return b.add(q0, b.add(b.shl(lanes.t, i32(1)), i32(8 * j + (e & 1))))

        def kv_idx(i, e):
            return b.add(self.kv0, b.add(lanes.warp_kv_row,
                                         b.add(lanes.g, i32(16 * i + 8 * (e >> 1)))))

        # S^T = K Q^T, then P^T (and G = P^T * dscore/ds with a score rule)
        S = self._mma_rows(b, self.k_off, q_tile, c.block_m, c.head_dim)
        # -LSE*log2(e) per column; -inf (P = 0) for rows without a kept key or past the end
        ninf = warp.fconst(warp.NEG_INF)
        neg_lse = [[b.select(b.or_(b.icmp_signed(">=", q_idx(j, e), self.seqlen_q),
                                   b.fcmp_ordered("==", lse, ninf)),
                             ninf, b.fmul(lse, warp.fconst(-warp.LOG2E)))
                    for e, lse in enumerate(pair)]
                   for j, pair in enumerate(column_values("lse"))]
        elements = [(i, j, e) for i in range(MT) for j in range(NQ) for e in range(4)]
        P = [[[None] * 4 for _ in range(NQ)] for _ in range(MT)]
        G = [[[None] * 4 for _ in range(NQ)] for _ in range(MT)]
        log2_scale = b.fmul(a.softmax_scale, warp.fconst(warp.LOG2E))
        for i, j, e in elements:
            s = S[i][j][e]
            if hooks.score is not None:
                scaled = b.fmul(s, a.softmax_scale)
                score = hooks.score(b, scaled, self.bidx, h, q_idx(j, e), kv_idx(i, e))
                p = warp.ex2(b, warp.fma(b, score, warp.fconst(warp.LOG2E), neg_lse[j][e & 1]))
                G[i][j][e] = b.fmul(p, hooks.derivative(b, scaled, self.bidx, h, q_idx(j, e),
                                                        kv_idx(i, e)))
            else:
                p = warp.ex2(b, warp.fma(b, s, log2_scale, neg_lse[j][e & 1]))
            P[i][j][e] = p
        # P and G = P * dscore/ds stay 16-bit until dS (P as dV's operand, G in bf16 for
        # its range): the f32 tiles die here, so registers suffice beside dK and dV
        if hooks.score is None:
            P = self._masked(b, h, q0, [P], elements, q_idx, kv_idx)[0]
            G = None
        else:
            P, G = self._masked(b, h, q0, [P, G], elements, q_idx, kv_idx)
            G = [[[warp.pack2(b, "bf16", t[2 * e2], t[2 * e2 + 1]) for e2 in range(2)]
                  for t in mt] for mt in G]
        packed_p = self._pack(b, P)

        dv = self._mma_registers(b, packed_p, do_tile, dv)
        dP = self._mma_rows(b, self.v_off, do_tile, c.block_m, c.head_dim)
        delta = column_values("delta")
        if G is None:  # P's 16-bit values, from the A operands they are in
            G = [[_unpack_pairs(b, c.dtype, [frags[j // 2][2 * (j % 2)],
                                             frags[j // 2][2 * (j % 2) + 1]])
                  for j in range(NQ)] for frags in packed_p]
        else:
            G = [[_unpack_pairs(b, "bf16", t) for t in mt] for mt in G]
        dS = [[[b.fmul(G[i][j][e], b.fsub(dP[i][j][e], delta[j][e & 1])) for e in range(4)]
               for j in range(NQ)] for i in range(MT)]
        dk = self._mma_registers(b, self._pack(b, dS), q_tile, dk)

        # dS^T (16-bit) to shared memory, then dQ = dS K into the accumulator
        lanes = self._lanes(b)
        for i in range(MT):
            for r in range(2):
                row = b.add(lanes.warp_kv_row, b.add(lanes.g, i32(16 * i + 8 * r)))
                row_base = b.add(b.mul(row, i32(self.DSB)), b.add(b.shl(lanes.t, i32(2)),
                                                                   i32(self.ds_off)))
                for j in range(NQ):
                    chunk = b.xor(lanes.g, i32(j)) if self.DSB % 128 == 0 else i32(j)
                    off = b.add(row_base, b.shl(chunk, i32(4)))
                    val = warp.pack2(b, c.dtype, dS[i][j][2 * r], dS[i][j][2 * r + 1])
                    warp.store(b, val, warp.smem_ptr(b, self.smem, off), align=4)
        nvptx.barrier_all(b)
        self._dq(b, h, q_row, rows_valid)
        return dk, dv

    def _masked(self, b, h, q0, tiles, elements, q_idx, kv_idx):
        """Each of `tiles` ([m-tile][n-tile][4] f32) with the pairs outside the K/V sequence
        or the mask set to 0; tiles the classification proves full skip the per-element
        code (a branch and phis)."""
        hooks = self.hooks
        _, always = self._classify(b, h, q0)
        pre = b.block
        with b.if_then(b.not_(always)):
            kept = [[[list(t) for t in mt] for mt in tile] for tile in tiles]
            for i, j, e in elements:
                keep = b.icmp_signed("<", kv_idx(i, e), self.seqlen_k)
                if hooks.mask is not None:
                    keep = b.and_(keep, hooks.mask(b, self.bidx, h, q_idx(j, e), kv_idx(i, e),
                                                   self.seqlen_q, self.seqlen_k))
                for out, tile in zip(kept, tiles):
                    out[i][j][e] = b.select(keep, tile[i][j][e], warp.fconst(0.0))
            then = b.block
        merged = [[[[None] * 4 for _ in mt] for mt in tile] for tile in tiles]
        for out, masked, tile in zip(merged, kept, tiles):
            for i, j, e in elements:
                phi = b.phi(f32)
                phi.add_incoming(masked[i][j][e], then)
                phi.add_incoming(tile[i][j][e], pre)
                out[i][j][e] = phi
        return merged

    def _dq(self, b, h, q_row, rows_valid):
        """dQ (block_m x this warp's dq_columns) = dS K, added into the fp32 accumulator
        with one atomic per element (rows past the sequence skipped); in `dq_passes` passes
        over the columns, each holding only its part of the product."""
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
        warp_chunk = b.mul(lanes.warp_id, i32(c.dq_columns // 8))
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
        warp_col = b.add(b.mul(lanes.warp_id, i32(c.dq_columns)), i32(first))
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

    def _store_dkdv(self, b, hk, kv_row, dk_flat, dv_flat):
        """dK * scale and dV, in the input dtype, for the K/V rows inside the sequence."""
        c, a = self.c, self.a
        MT, DT = c.kv_tiles_per_warp, c.head_dim // 8
        rows_valid = b.sub(self.seqlen_k, self.kv0)
        lanes = self._lanes(b)
        for tensor, flat, scale in (("dk", dk_flat, a.softmax_scale), ("dv", dv_flat, None)):
            for i in range(MT):
                for r in range(2):
                    row = b.add(lanes.warp_kv_row, b.add(lanes.g, i32(16 * i + 8 * r)))
                    with b.if_then(b.icmp_signed("<", row, rows_valid)):
                        off = _row_offset(b, a, c.ragged, tensor, self.bidx,
                                          b.add(kv_row, row), hk)
                        base = _gep(b, a[tensor], b.add(off, b.zext(b.shl(lanes.t, i32(1)), i64)),
                                    nvptx.i16)
                        for j in range(DT):
                            x = [flat[(i * DT + j) * 4 + 2 * r + e2] for e2 in range(2)]
                            if scale is not None:
                                x = [b.fmul(v, scale) for v in x]
                            warp.store(b, warp.pack2(b, c.dtype, *x),
                                       _gep(b, base, i64(8 * j), nvptx.i16), align=4)


# ============================================================================ module
def _kernel(module: ir.Module, name: str, threads: int) -> tuple[ir.Function, ir.IRBuilder]:
    fn = ir.Function(module, ir.FunctionType(nvptx.void, ABI.llvm_types()), name=name)
    nvptx.mark_kernel(fn)
    # NVVM's attributes are strings; one CTA per SM at least lets ptxas use 255 registers
    set.add(fn.attributes, f'"nvvm.maxntid"="{threads}"')
    set.add(fn.attributes, '"nvvm.minctasm"="1"')
    ABI.declare(fn)
    return fn, ir.IRBuilder(fn.append_basic_block("entry"))


def build_backward_module(config: BackwardConfig, hooks: ExprHooks | None,
                          target: Target) -> ir.Module:
    """One module with the three kernels (`launch_shapes`), all taking `ABI`'s parameters."""
    config.validate()
    hooks = hooks or ExprHooks()
    if hooks.score is not None and hooks.derivative is None:
        raise ValueError("a score hook needs its derivative hook for the backward pass")
    module = new_module(f"mha_bwd_{config.dtype}_d{config.head_dim}", target)
    smem = ir.GlobalVariable(module, ir.ArrayType(nvptx.i8, 0), SMEM_SYMBOL, addrspace=SHARED)
    smem.linkage = "external"
    smem.align = 128
    for name, emit in ((PREPROCESS, _emit_preprocess), (POSTPROCESS, _emit_postprocess)):
        fn, b = _kernel(module, name, ROW_THREADS)
        emit(b, config, KernelArgs(fn, ABI, config))
        b.ret_void()
    fn, b = _kernel(module, MAIN, config.threads)
    _MainKernel(b, config, hooks, KernelArgs(fn, ABI, config), smem, target.arch).emit(b)
    b.ret_void()
    return module


# ============================================================================ the design
class Backward(Backend):
    """The backward pass: three kernels in one build (`launch_shapes`); `launch_shape` is
    the main kernel's."""

    name = "backward"
    workload = "backward"
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
        """The declaration's config, then variants with fewer live values (dQ in two column
        passes, 32-row query steps, both), then the same work over 8 warps of 128 K/V rows:
        ptxas's allocation at the 255-register cap is chaotic, so the first that assembles
        without spills wins."""
        config = declared_config(options, layout)
        candidates = (config, replace(config, dq_passes=2), replace(config, block_m=32),
                      replace(config, block_m=32, dq_passes=2),
                      replace(config, block_n=128, num_warps=8))
        return tuple(c for c in candidates if not c.problems())

    def launch_shape(self, config: BackwardConfig) -> LaunchShape:
        return launch_shapes(config)[MAIN]

    def build(self, source: KernelSource, configs: tuple[BackwardConfig, ...],
              target: Target) -> KernelBuild:
        """LLVM IR, PTX and (with ptxas) the cubin of the first of `configs` that assembles
        without spills (its hooks carry the score's derivative: `codegen.kernel`)."""
        return spill_free_build(self.name, target, [
            (c, lambda c=c: build_backward_module(c, source.hooks, target)) for c in configs])


def declared_config(options, layout: Layout) -> BackwardConfig:
    return BackwardConfig(options.dtype, options.head_dim, gqa_group=layout.gqa_group,
                          ragged=layout.ragged)


BACKEND = Backward()
