"""The attention kernel generator: a FlashAttention-2-class forward kernel in LLVM IR.

Path: sm_80 and up (also built for sm_90a) with `cp.async` (global -> shared, 16 B, zero-fill
for tails), `ldmatrix.x4` (`.trans` for V), `mma.sync.m16n8k16` (bf16/fp16 in, f32
accumulate), an online softmax with `ex2.approx` (softmax scale folded with log2 e), P kept in
registers as the A operand of P.V, and an epilogue that stages O through shared memory so the
global stores are 16-byte and coalesced.

Work split (FlashAttention-2): a CTA owns BM query rows of one (batch, head); each of its
`num_warps` warps owns BM / num_warps consecutive rows (one or more 16-row m-tiles) and all
BN columns of every KV tile, so softmax row statistics never leave the warp (a quad of lanes
shares a row: `shfl.sync.bfly` 1 and 2). Shared memory holds Q (BM x D), one K and one V tile
(BN x D), all with 16-byte chunks XOR-swizzled by row % 8. The KV pipeline is FA2's two-stage
one: K(n) and V(n) sit in their own buffers; V(n) is fetched while S = Q K(n)^T is computed
and K(next) while softmax and O += P V(n) run.

Mask classification: the front end's `classify` hook decides per (query tile, KV tile) whether
the tile is EMPTY (never visited: no loads, no math), FULL (no mask code) or PARTIAL (mask
evaluated per element). Sequence tails are PARTIAL too (the bounds test is added here).

`build_attention_module(config, hooks, target, work_loop)` builds the kernel around a work
loop: the scheduler lowering (or `transient_work_loop`, one tile per CTA) calls
`body(builder, seq)` per work tile and the body (`emit_tile`) computes that whole tile.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from llvmlite import ir

from mhadsl.abi import KernelABI
from mhadsl.codegen import nvptx, signature, warp
from mhadsl.codegen.backends import (
    FORWARD_PARAMS, SHARED_MEMORY_LIMIT, Backend, ExprHooks, KernelArgs, KernelBuild, KernelSource,
    KernelLaunch, Layout, Problem, RowCopies, TileSeq, common_problems, masked_unless,
    spill_free_build,
)
from mhadsl.codegen.backends.blocks import WorkTile, sequence_rows
from mhadsl.codegen.nvptx import SHARED, f32, i1, i32, i64
from mhadsl.codegen.work_loop import count_exit
from mhadsl.codegen.target import Target, new_module

KERNEL_NAME = "mha_fwd"
SMEM_SYMBOL = "mha_fwd_smem"
HEAD_DIMS = (64, 128, 256)
MAX_REGISTERS = 255  # per thread
@dataclass(frozen=True)
class Tuning:
    """IR shape choices (same math) that move ptxas's register allocation and the schedule.

    The defaults are the measured best (see benchmarks/log/ATTENTION_NOTES.md); spills are
    chaotic under small IR changes, so `codegen.kernel` falls back to the next of `TUNINGS`
    when ptxas reports spills for a build. Part of the build's identity.
    """

    mask_branch: bool = True       # PARTIAL tiles branch around the per-element mask
    two_body: bool = False         # instead, FULL and PARTIAL tiles get separate iterations
    k_after_softmax: bool = True   # issue K(next) after the softmax (S dead), not before it
    pack_early: bool = False       # pack P to 16-bit right after ex2, not at the P.V operand
    longest_first: bool = True     # transient loop: longest query tiles first when tiles can be empty
    opaque_tid: bool = True        # persistent loops: recompute thread-level values per tile
    opaque_env: bool = True        # persistent loops: rederive the scheduler's inputs per step


# The search order: the measured best first, then shapes that differ in what stays live.
TUNINGS = tuple(Tuning(**dict(zip(("opaque_env", "opaque_tid", "k_after_softmax"), flags)))
                for flags in ((True, True, True), (False, True, True), (True, False, True),
                              (False, False, True), (True, True, False), (False, True, False),
                              (True, False, False), (False, False, False))) + (
    Tuning(mask_branch=False), Tuning(two_body=True))


# ============================================================================ configuration
@dataclass(frozen=True)
class AttentionConfig(RowCopies):
    """Everything that selects a build (hashable; part of the cache key)."""

    dtype: str = "bf16"        # "bf16" | "fp16"
    head_dim: int = 128        # 64 | 128 | 256
    block_m: int = 128         # query rows per CTA tile
    block_n: int = 64          # KV rows per KV tile
    num_warps: int = 4         # each warp owns block_m // num_warps query rows
    stages: int = 2            # 2: FA2 pipeline (K and V buffers, each refilled under the other's GEMM)
    gqa_group: int = 1         # Hq // Hkv, compile time
    return_lse: bool = False
    ragged: bool = False       # sequence lengths from cu_seqlens_q/k (else the dense seqlen_q/k)

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def rows_per_warp(self) -> int:
        return self.block_m // self.num_warps

    @property
    def m_tiles(self) -> int:
        return self.rows_per_warp // 16


    @property
    def accumulators(self) -> int:
        """f32 registers per thread that S = Q.K^T and O alone hold (4 per 16x8 tile)."""
        return self.m_tiles * (self.block_n + self.head_dim) // 2

    def problems(self) -> list[Problem]:
        """What keeps this design from building the config, in the declaration's terms."""
        found = common_problems(self)
        if self.head_dim not in HEAD_DIMS:
            found.append(Problem(("head_dim",), f"head_dim {self.head_dim} is not one of "
                                                f"{', '.join(map(str, HEAD_DIMS))}"))
        if self.num_warps not in (1, 2, 4, 8):
            found.append(Problem(("warps",), f"warps = {self.num_warps}: the sm80 kernel runs "
                                             "1, 2, 4 or 8 warps"))
        elif self.block_m % (16 * self.num_warps):
            found.append(Problem(("tile", "warps"), (
                f"a tile of {self.block_m} query rows does not split into 16-row pieces over "
                f"{self.num_warps} warps (it must be a multiple of {16 * self.num_warps})")))
        if self.block_n % 16 or self.block_n < 16:
            found.append(Problem(("tile",), f"the KV tile ({self.block_n}) must be a positive "
                                            "multiple of 16"))
        if self.stages != 2:
            found.append(Problem(("stages",), f"stages = {self.stages}: the sm80 kernel has "
                                              "the 2-stage (FlashAttention-2) K/V pipeline"))
        if not found:
            rpp = self.rows_per_pass
            if rpp < 8 or rpp % 8:
                found.append(Problem(("warps", "head_dim"), (
                    f"{self.threads} threads copy {rpp} rows of head_dim {self.head_dim} per "
                    "pass; the sm80 kernel needs a multiple of 8")))
            elif self.block_m % rpp or self.block_n % rpp:
                found.append(Problem(("tile", "warps"), (
                    f"both tile sizes must be multiples of {rpp}, the rows {self.threads} "
                    f"threads copy per pass")))
            elif self.accumulators > MAX_REGISTERS:
                found.append(Problem(("tile", "warps", "head_dim"), (
                    f"each thread would hold {self.accumulators} f32 accumulators, past the "
                    f"{MAX_REGISTERS}-register limit (use fewer query rows per warp: a smaller "
                    "tile or more warps)")))
        return found

    def validate(self) -> "AttentionConfig":
        if found := self.problems():
            raise ValueError("invalid AttentionConfig: " + "; ".join(p.message for p in found))
        return self


def default_config(dtype: str = "bf16", head_dim: int = 128, *, gqa_group: int = 1,
                   return_lse: bool = False, ragged: bool = False,
                   causal: bool = False) -> AttentionConfig:
    """FlashAttention-2's own tile choices for sm_80+ (forward, no dropout)."""
    if head_dim == 64:
        bm, bn, nw = 128, 64, 4
    elif head_dim == 128:
        bm, bn, nw = 128, 64, 4
    elif head_dim == 256:
        bm, bn, nw = 128, 64, 8
    else:
        raise ValueError(f"head_dim {head_dim} not in {HEAD_DIMS}")
    return AttentionConfig(dtype, head_dim, bm, bn, nw, 2, gqa_group, return_lse,
                           ragged).validate()


def shared_bytes(config: AttentionConfig) -> int:
    """Dynamic shared memory per CTA: Q (BM x D) + K (BN x D) + V (BN x D), 16-bit elements.
    The O tile of the epilogue reuses Q's space."""
    return (config.block_m + 2 * config.block_n) * config.row_bytes


def threads(config: AttentionConfig) -> int:
    return config.threads


def min_ctas_per_sm(config: AttentionConfig) -> int:
    return max(1, min(2, 256 // config.threads))


def kernel_name(config: AttentionConfig) -> str:
    return KERNEL_NAME


def transient_grid(config: AttentionConfig, batch: int, num_heads: int,
                   max_seqlen_q: int) -> tuple[int, int, int]:
    """The launch grid `transient_work_loop` expects: (q tiles, heads, batch)."""
    return (max(1, -(-max_seqlen_q // config.block_m)), num_heads, batch)


# ============================================================================ kernel parameters
ABI = KernelABI(*FORWARD_PARAMS)


# ============================================================================ small IR helpers
def _sext64(builder, v):
    return builder.sext(v, i64)


# ============================================================================ the kernel
class _TileEmitter:
    """Per-kernel state: thread-level values computed once in the entry block, and the
    tile body."""

    def __init__(self, config: AttentionConfig, hooks: ExprHooks, builder: ir.IRBuilder,
                 args: KernelArgs, smem: ir.Value, tuning: Tuning):
        self.c = config
        self.tuning = tuning
        self.hooks = hooks
        self.a = args
        self.smem = smem
        c = config
        b = builder
        self.et = warp.element_type(c.dtype)
        self.RB = c.row_bytes
        self.q_smem_off = 0
        self.k_smem_off = c.block_m * self.RB
        self.v_smem_off = (c.block_m + c.block_n) * self.RB

        if args.persistent and tuning.opaque_tid:
            # Read through an opaque asm: in a persistent loop nothing derived from the
            # thread index may be hoisted out and kept live across tiles (that spills).
            tid = nvptx.opaque_special_register(b, "tid.x")
        else:
            tid = nvptx.special_register(b, "thread_idx", "x")
        self.tid = tid
        self.lane = b.and_(tid, i32(31))
        self.warp_id = b.lshr(tid, i32(5))
        lane = self.lane
        self.g = b.lshr(lane, i32(2))          # accumulator row within an 8-row group
        self.t = b.and_(lane, i32(3))          # accumulator column pair
        r8 = b.and_(lane, i32(7))              # ldmatrix: row within the 8x8 matrix
        m_lo = b.and_(b.lshr(lane, i32(3)), i32(1))  # (lane // 8) % 2
        m_hi = b.lshr(lane, i32(4))                  # lane // 16

        self._copy_lanes(b, tid)

        # ldmatrix lane bases: offset(row, chunk) = row*RB + ((chunk ^ (row%8)) * 16);
        # compile-time chunk c splits into (c*16 & 127) XORed in and (c*16 & ~127) added,
        # so each operand needs four lane-dependent bases (keyed by the XOR value).
        warp_row = b.mul(self.warp_id, i32(c.rows_per_warp))
        q_row = b.add(warp_row, b.add(b.shl(m_lo, i32(3)), r8))
        q_x = b.shl(b.xor(m_hi, r8), i32(4))
        k_row = b.add(b.shl(m_hi, i32(3)), r8)
        k_x = b.shl(b.xor(m_lo, r8), i32(4))
        v_row = b.add(b.shl(m_lo, i32(3)), r8)
        v_x = b.shl(b.xor(m_hi, r8), i32(4))
        # ldmatrix bases per operand: {lo: row*RB + (x16 ^ lo)} (see _ld_addr)
        self.q_base = self._lane_bases(b, q_row, q_x, self.q_smem_off)
        self.k_base = self._lane_bases(b, k_row, k_x, self.k_smem_off)
        self.v_base = self._lane_bases(b, v_row, v_x, self.v_smem_off)

        # epilogue: accumulator (row g / g+8 of m-tile i, chunk j, word t) -> swizzled smem
        self.o_row0 = b.add(warp_row, self.g)
        self.o_word = b.shl(self.t, i32(2))
        self.o_x = b.shl(self.g, i32(4))       # (row % 8) * 16 for rows g and g+8

    def _copy_lanes(self, b, tid):
        """cp.async fill pattern: thread -> (row in pass, 16-byte chunk); the chunk is fixed
        per thread. Sets ld_row, ld_chunk, ld_swz_off (swizzled smem byte offset)."""
        c = self.c
        self.ld_row = b.udiv(tid, i32(c.chunks_per_row))
        self.ld_chunk = b.urem(tid, i32(c.chunks_per_row))
        self.ld_swz_off = b.add(b.mul(self.ld_row, i32(self.RB)),
                                b.shl(warp.swizzle_chunk(b, self.ld_chunk, self.ld_row), i32(4)))
        self.ld_chunk_elems64 = b.zext(b.shl(self.ld_chunk, i32(3)), i64)

    def _lane_bases(self, b, row, x16, region_off):
        """ldmatrix base pointers {lo: row*RB + (x16 ^ lo) + region} for lo in 0/32/64/96."""
        row_off = b.add(b.mul(row, i32(self.RB)), i32(region_off))
        return {lo: warp.smem_ptr(b, self.smem, b.add(row_off, b.xor(x16, i32(lo))))
                for lo in (0, 32, 64, 96) if lo < self.RB}

    def _ld_addr(self, b, bases, row_const: int, chunk_const: int):
        """Shared address for an ldmatrix whose lane-relative (row, chunk) is offset by
        compile-time (row_const (multiple of 8), chunk_const (even)): the XOR part of the
        chunk picks the base, the rest is an immediate."""
        c16 = chunk_const * 16
        lo, hi = c16 & 127, c16 & ~127
        return b.gep(bases[lo], [i64(row_const * self.RB + hi)], inbounds=True,
                     source_etype=nvptx.i8)

    # ------------------------------------------------------------------ global -> shared
    def _thread_off(self, b, stride_row64):
        """This thread's element offset (i32) within a tile for the copy pattern: row ld_row,
        chunk ld_chunk. ld_row < rows_per_pass <= 16, so it fits unless a row stride exceeds
        2**27 elements; the rest of every address is formed in 64 bits."""
        return b.add(b.mul(self.ld_row, b.trunc(stride_row64, i32)),
                     b.shl(self.ld_chunk, i32(3)))

    def _load_tile(self, b, gptr, tile_off64, thread_off, stride_row64, rows_valid, rows: int,
                   smem_off: int):
        """cp.async `rows` x D elements whose first row starts at element offset tile_off64
        (i64, CTA-uniform) into the swizzled smem region at smem_off; thread_off is
        `_thread_off`; rows >= rows_valid are zero-filled (nothing is read for them)."""
        c = self.c
        rpp = c.rows_per_pass
        dst_base = warp.smem_ptr(b, self.smem, b.add(self.ld_swz_off, i32(smem_off)))
        tile_ptr = b.gep(gptr, [tile_off64], inbounds=True, source_etype=nvptx.i16)
        for p in range(rows // rpp):
            row = b.add(self.ld_row, i32(p * rpp))
            valid = b.icmp_signed("<", row, rows_valid)
            pass_ptr = tile_ptr if p == 0 else b.gep(
                tile_ptr, [b.mul(stride_row64, i64(p * rpp))], inbounds=True,
                source_etype=nvptx.i16)
            src = b.gep(pass_ptr, [b.sext(thread_off, i64)], inbounds=True,
                        source_etype=nvptx.i16)
            nbytes = b.select(valid, i32(16), i32(0))
            dst = b.gep(dst_base, [i64(p * rpp * self.RB)], inbounds=True, source_etype=nvptx.i8)
            warp.cp_async_16(b, dst, b.select(valid, src, gptr), nbytes)

    # ------------------------------------------------------------------ the tile
    def emit_tile(self, b: ir.IRBuilder, seq) -> None:
        c, a = self.c, self.a
        BM, BN, D = c.block_m, c.block_n, c.head_dim
        MT, DT = c.m_tiles, D // 8

        t = WorkTile(b, c, a, self.hooks, seq)
        bidx, h, hk, q0, q_start, k_start = t.bidx, t.h, t.hk, t.q0, t.q_start, t.k_start
        seqlen_k = t.seqlen_k
        rows_q = b.sub(t.seqlen_q, q0)

        b64 = _sext64(b, bidx)
        q_tile_off = b.add(b.add(b.mul(b64, a.q_stride_batch),
                                 b.mul(_sext64(b, b.add(q_start, q0)), a.q_stride_row)),
                           b.mul(_sext64(b, h), a.q_stride_head))
        k_head_off = b.add(b.add(b.mul(b64, a.k_stride_batch),
                                 b.mul(_sext64(b, k_start), a.k_stride_row)),
                           b.mul(_sext64(b, hk), a.k_stride_head))
        v_head_off = b.add(b.add(b.mul(b64, a.v_stride_batch),
                                 b.mul(_sext64(b, k_start), a.v_stride_row)),
                           b.mul(_sext64(b, hk), a.v_stride_head))

        k_thr = self._thread_off(b, a.k_stride_row)
        v_thr = self._thread_off(b, a.v_stride_row)

        def load_kv(bb, n, which, fresh=False):
            if fresh is True:   # in the KV loop: re-derive the lane offsets rather than keep them live
                saved = (self.ld_row, self.ld_chunk, self.ld_swz_off, self.ld_chunk_elems64)
                self._copy_lanes(bb, warp.fresh_thread_idx(bb))
                thr = self._thread_off(bb, a.k_stride_row if which == "k" else a.v_stride_row)
                load_kv(bb, n, which, thr)
                self.ld_row, self.ld_chunk, self.ld_swz_off, self.ld_chunk_elems64 = saved
                return
            kv0 = bb.mul(n, i32(BN))
            gptr, stride, head, off = (
                (a.k, a.k_stride_row, k_head_off, self.k_smem_off) if which == "k"
                else (a.v, a.v_stride_row, v_head_off, self.v_smem_off))
            thr = fresh if isinstance(fresh, ir.Value) else (k_thr if which == "k" else v_thr)
            tile_off = bb.add(head, bb.mul(_sext64(bb, kv0), stride))
            self._load_tile(bb, gptr, tile_off, thr, stride, bb.sub(seqlen_k, kv0), BN, off)

        # ---- prologue: the previous tile's epilogue must be done with shared memory
        nvptx.barrier_all(b)
        self._load_tile(b, a.q, q_tile_off, self._thread_off(b, a.q_stride_row),
                        a.q_stride_row, rows_q, BM, self.q_smem_off)
        n_first, kv_end = t.kv_range(b)
        with b.if_then(b.icmp_signed("<", n_first, kv_end)):
            load_kv(b, n_first, "k")
        warp.cp_async_commit(b)

        sl2 = t.rules.scale_log2(b, a.softmax_scale)

        # ---- KV loop (a real IR loop); loop-carried: n, O accumulators, row max m, row sum l
        fn = b.function
        pre = b.block
        hdr = fn.append_basic_block("kv.hdr")
        body = fn.append_basic_block("kv.body")
        exit_ = fn.append_basic_block("kv.exit")
        b.branch(hdr)
        b.position_at_end(hdr)
        n = b.phi(i32, "n")
        n.add_incoming(n_first, pre)
        acc_phi = [[[b.phi(f32) for _ in range(4)] for _ in range(DT)] for _ in range(MT)]
        m_phi = [[b.phi(f32) for _ in range(2)] for _ in range(MT)]
        l_phi = [[b.phi(f32) for _ in range(2)] for _ in range(MT)]
        zero, ninf = warp.fconst(0.0), warp.fconst(warp.NEG_INF)
        for i in range(MT):
            for j in range(DT):
                for e in range(4):
                    acc_phi[i][j][e].add_incoming(zero, pre)
            for r in range(2):
                m_phi[i][r].add_incoming(ninf, pre)
                l_phi[i][r].add_incoming(zero, pre)
        b.cbranch(b.icmp_signed("<", n, kv_end), body, exit_)

        b.position_at_end(body)
        warp.cp_async_wait(b, 0)
        nvptx.barrier_all(b)          # K(n) (and Q) landed; every warp is done with V(n-1)
        load_kv(b, n, "v")
        warp.cp_async_commit(b)

        # FULL tiles and PARTIAL tiles (mask hook and/or the KV tail) get their own copy of
        # the iteration: the full one has no mask code, and neither needs a merge of S
        _, always = t.classify(b, n)
        if not self.tuning.two_body:
            always = ir.Constant(i1, 0)   # one (masked) body only
        full_blk = fn.append_basic_block("kv.full")
        part_blk = fn.append_basic_block("kv.partial")
        b.cbranch(always, full_blk, part_blk)
        state = (acc_phi, m_phi, l_phi)
        for blk, masked in ((full_blk, False), (part_blk, True)):
            b.position_at_end(blk)
            nn, acc, m_new, l_new = self._kv_iteration(b, t, state, n, kv_end, masked,
                                                       load_kv, sl2)
            latch = b.block
            n.add_incoming(nn, latch)
            for i in range(MT):
                for j in range(DT):
                    for e in range(4):
                        acc_phi[i][j][e].add_incoming(acc[i][j][e], latch)
                for r in range(2):
                    m_phi[i][r].add_incoming(m_new[i][r], latch)
                    l_phi[i][r].add_incoming(l_new[i][r], latch)
            b.branch(hdr)

        # ---- epilogue
        b.position_at_end(exit_)
        self._epilogue(b, t, acc_phi, m_phi, l_phi, sl2, rows_q)

    def _kv_iteration(self, b, t: WorkTile, state, n, kv_end, masked, load_kv, sl2):
        """One KV tile: S = Q K(n)^T, [mask], prefetch K(next) (below `kv_end`), online
        softmax, O += P V(n). Returns (next tile, O accumulators, row max, row sum)."""
        c, a, hooks = self.c, self.a, self.hooks
        BN, D = c.block_n, c.head_dim
        MT, NT, DT = c.m_tiles, BN // 8, D // 8
        dt = c.dtype
        acc_in, m_in, l_in = state
        zero = warp.fconst(0.0)
        q0 = t.q0

        # S = Q K^T
        S = [[[zero] * 4 for _ in range(NT)] for _ in range(MT)]
        for kk in range(D // 16):
            qa = [warp.ldmatrix_x4(b, self._ld_addr(b, self.q_base, i * 16, 2 * kk))
                  for i in range(MT)]
            for jp in range(NT // 2):
                kb = warp.ldmatrix_x4(b, self._ld_addr(b, self.k_base, jp * 16, 2 * kk))
                for i in range(MT):
                    S[i][2 * jp] = warp.mma_m16n8k16(b, dt, qa[i], kb[0:2], S[i][2 * jp])
                    S[i][2 * jp + 1] = warp.mma_m16n8k16(b, dt, qa[i], kb[2:4], S[i][2 * jp + 1])

        kv_base = b.mul(n, i32(BN))

        def q_idx_of(i, r):
            return b.add(q0, b.add(self.o_row0, i32(i * 16 + r * 8)))

        def kv_idx_of(j, e):
            return b.add(kv_base, b.add(b.shl(self.t, i32(1)), i32(j * 8 + (e & 1))))

        if hooks.score is not None:
            S = [[[t.scored(b, b.fmul(S[i][j][e], a.softmax_scale), q_idx_of(i, e >> 1),
                            kv_idx_of(j, e)) for e in range(4)]
                  for j in range(NT)] for i in range(MT)]

        if masked:
            def mask(bb):
                S_masked = [[list(row) for row in mt] for mt in S]
                for i in range(MT):
                    for r in range(2):
                        qi = q_idx_of(i, r)
                        for j in range(NT):
                            for e2 in range(2):
                                e = 2 * r + e2
                                S_masked[i][j][e] = t.masked(bb, S_masked[i][j][e], qi,
                                                             kv_idx_of(j, e))
                return [v for mt in S_masked for row in mt for v in row]
            if self.tuning.mask_branch:  # one body: only PARTIAL tiles run the mask
                _, always = t.classify(b, n)
                flat = masked_unless(b, always, [v for mt in S for row in mt for v in row],
                                     mask)
            else:
                flat = mask(b)
            S = [[flat[(i * NT + j) * 4:(i * NT + j) * 4 + 4] for j in range(NT)]
                 for i in range(MT)]

        def prefetch_k():
            warp.cp_async_wait(b, 0)
            nvptx.barrier_all(b)          # V(n) landed; every warp is done with K(n)
            nn = t.next_nonempty(b, b.add(n, i32(1)), kv_end)
            with b.if_then(b.icmp_signed("<", nn, kv_end)):
                load_kv(b, nn, "k")
            warp.cp_async_commit(b)
            return nn

        if not self.tuning.k_after_softmax:
            nn = prefetch_k()

        # online softmax (log2 domain), rescale O, P in registers
        acc = [[[acc_in[i][j][e] for e in range(4)] for j in range(DT)] for i in range(MT)]
        m_new_all = [[None] * 2 for _ in range(MT)]
        l_new_all = [[None] * 2 for _ in range(MT)]
        P = [[[None] * 4 for _ in range(NT)] for _ in range(MT)]
        for i in range(MT):
            for r in range(2):
                row = [(j, 2 * r + e2) for j in range(NT) for e2 in range(2)]
                p, m_new_all[i][r], l_new_all[i][r], alpha = warp.online_softmax_row(
                    b, [S[i][j][e] for j, e in row], m_in[i][r], l_in[i][r], sl2)
                for (j, e), value in zip(row, p):
                    P[i][j][e] = value
                for j in range(DT):
                    for e2 in range(2):
                        acc[i][j][2 * r + e2] = b.fmul(acc[i][j][2 * r + e2], alpha)

        if self.tuning.pack_early:
            P = [[[warp.pack2(b, dt, P[i][j][0], P[i][j][1]),
                   warp.pack2(b, dt, P[i][j][2], P[i][j][3])] for j in range(NT)]
                 for i in range(MT)]
        if self.tuning.k_after_softmax:
            nn = prefetch_k()

        # O += P V
        for s in range(BN // 16):
            pa = [[P[i][2 * s][0], P[i][2 * s][1], P[i][2 * s + 1][0], P[i][2 * s + 1][1]]
                  for i in range(MT)] if self.tuning.pack_early else [
                  [warp.pack2(b, dt, P[i][2 * s][0], P[i][2 * s][1]),
                   warp.pack2(b, dt, P[i][2 * s][2], P[i][2 * s][3]),
                   warp.pack2(b, dt, P[i][2 * s + 1][0], P[i][2 * s + 1][1]),
                   warp.pack2(b, dt, P[i][2 * s + 1][2], P[i][2 * s + 1][3])]
                  for i in range(MT)]
            for jp in range(DT // 2):
                vb = warp.ldmatrix_x4(b, self._ld_addr(b, self.v_base, s * 16, 2 * jp),
                                      trans=True)
                for i in range(MT):
                    acc[i][2 * jp] = warp.mma_m16n8k16(b, dt, pa[i], vb[0:2], acc[i][2 * jp])
                    acc[i][2 * jp + 1] = warp.mma_m16n8k16(b, dt, pa[i], vb[2:4],
                                                           acc[i][2 * jp + 1])
        return nn, acc, m_new_all, l_new_all

    def _epilogue(self, b, t: WorkTile, acc, m, l, sl2, rows_q):
        q_start, q0, bidx, h = t.q_start, t.q0, t.bidx, t.h
        c, a = self.c, self.a
        MT, DT, BM = c.m_tiles, c.head_dim // 8, c.block_m
        inv = [[None] * 2 for _ in range(MT)]
        lse = [[None] * 2 for _ in range(MT)]
        sink = t.rules.sink_log2(b, h)
        for i in range(MT):
            for r in range(2):
                inv[i][r], row_lse = t.rules.finish_row(b, m[i][r], sl2, l[i][r], sink)
                if c.return_lse:
                    lse[i][r] = row_lse()

        # Q's shared memory is free once every cp.async landed and every warp left the loop
        warp.cp_async_wait(b, 0)
        nvptx.barrier_all(b)
        for i in range(MT):
            for r in range(2):
                row = b.add(self.o_row0, i32(i * 16 + r * 8))
                row_base = b.add(b.mul(row, i32(self.RB)), b.add(self.o_word, i32(self.q_smem_off)))
                for j in range(DT):
                    c16 = j * 16
                    off = b.add(row_base, b.add(b.xor(self.o_x, i32(c16 & 127)), i32(c16 & ~127)))
                    val = warp.pack2(b, c.dtype, b.fmul(acc[i][j][2 * r], inv[i][r]),
                                     b.fmul(acc[i][j][2 * r + 1], inv[i][r]))
                    warp.store(b, val, warp.smem_ptr(b, self.smem, off), align=4)
        nvptx.barrier_all(b)

        # coalesced 16-byte stores of the valid rows
        rpp = c.rows_per_pass
        o_off = b.add(b.add(b.mul(_sext64(b, bidx), a.o_stride_batch),
                            b.mul(_sext64(b, b.add(q_start, q0)), a.o_stride_row)),
                      b.mul(_sext64(b, h), a.o_stride_head))
        o_off = b.add(b.add(o_off, b.mul(_sext64(b, self.ld_row), a.o_stride_row)),
                      self.ld_chunk_elems64)
        dst_base = b.gep(a.o, [o_off], inbounds=True, source_etype=nvptx.i16)
        step = b.mul(a.o_stride_row, i64(rpp))
        src_base = warp.smem_ptr(b, self.smem, b.add(self.ld_swz_off, i32(self.q_smem_off)))
        v4 = ir.VectorType(i32, 4)
        for p in range(BM // rpp):
            row = b.add(self.ld_row, i32(p * rpp))
            src = b.gep(src_base, [i64(p * rpp * self.RB)], inbounds=True, source_etype=nvptx.i8)
            val = b.load(src, typ=v4, align=16)
            with b.if_then(b.icmp_signed("<", row, rows_q)):
                dst = b.gep(dst_base, [b.mul(step, i64(p))], inbounds=True,
                            source_etype=nvptx.i16)
                b.store(val, dst, align=16)

        if c.return_lse:
            lse_base = b.add(b.mul(_sext64(b, bidx), a.lse_stride_batch),
                             b.add(b.mul(_sext64(b, h), a.lse_stride_head),
                                   _sext64(b, b.add(q_start, q0))))
            is_t0 = b.icmp_unsigned("==", self.t, i32(0))
            for i in range(MT):
                for r in range(2):
                    row = b.add(self.o_row0, i32(i * 16 + r * 8))
                    with b.if_then(b.and_(is_t0, b.icmp_signed("<", row, rows_q))):
                        ptr = b.gep(a.lse, [b.add(lse_base, _sext64(b, row))], inbounds=True,
                                    source_etype=f32)
                        b.store(lse[i][r], ptr, align=4)


# ============================================================================ work loops
def transient_work_loop(builder: ir.IRBuilder, args: KernelArgs, body: Callable) -> None:
    """Non-persistent: one tile per CTA, grid (q tiles, heads, batch) (see `transient_grid`).
    Query tiles run last-first (the longest ones under a causal mask start first)."""
    b = builder
    c = args.config
    x = nvptx.special_register(b, "block_idx", "x")
    nx = nvptx.special_register(b, "grid_dim", "x")
    head = nvptx.special_register(b, "block_idx", "y")
    batch = nvptx.special_register(b, "block_idx", "z")
    if getattr(args, "longest_first", False):
        # masks that empty tiles make query tiles unequal: hand out the linear block index
        # with the query tile slowest (longest first), so the short tiles fill the tail
        ny = nvptx.special_register(b, "grid_dim", "y")
        nz = nvptx.special_register(b, "grid_dim", "z")
        lin = b.add(x, b.mul(nx, b.add(head, b.mul(ny, batch))))
        per_tile = b.mul(ny, nz)
        x = b.udiv(lin, per_tile)
        rest = b.urem(lin, per_tile)
        head = b.urem(rest, ny)
        batch = b.udiv(rest, ny)
    tile = b.sub(b.sub(nx, i32(1)), x)
    start, seq_len = sequence_rows(b, c.ragged, args.cu_seqlens_q, args.seqlen_q, batch)
    offset = b.mul(tile, i32(c.block_m))
    with b.if_then(b.icmp_signed("<", offset, seq_len)):
        body(b, TileSeq(seq_len=seq_len, start_of_seq=start, prompt_offset=offset,
                        head_idx=head, prompt_idx=batch))


# ============================================================================ module
def build_attention_module(config: AttentionConfig, hooks: ExprHooks | None, target: Target,
                           work_loop: Callable = transient_work_loop,
                           tuning: Tuning = Tuning()) -> ir.Module:
    """One module holding the kernel `kernel_name(config)` with ABI as its
    parameters, `threads(config)` threads and `shared_bytes(config)` of dynamic shared memory
    (the extern array SMEM_SYMBOL, 128-byte aligned)."""
    config.validate()
    hooks = hooks or ExprHooks()
    module = new_module(f"mha_{config.dtype}_d{config.head_dim}", target)
    fn, _ = signature.kernel(module, hooks.kernel_abi(ABI), kernel_name(config),
                             config.threads, min_ctas_per_sm(config))
    smem = ir.GlobalVariable(module, ir.ArrayType(nvptx.i8, 0), SMEM_SYMBOL, addrspace=SHARED)
    smem.linkage = "external"
    smem.align = 128

    builder = ir.IRBuilder(fn.append_basic_block("entry"))
    args = KernelArgs(fn, ABI, config, opaque_env=tuning.opaque_env)
    args.longest_first = hooks.classify is not None and tuning.longest_first
    def tile(b: ir.IRBuilder, seq) -> None:
        # Thread-level values are recomputed per tile (cheap ALU) rather than held across a
        # persistent loop.
        _TileEmitter(config, hooks, b, args, smem, tuning).emit_tile(b, seq)
    work_loop(builder, args, tile)
    if args.counts_exits:
        count_exit(builder, args.queue)
    builder.ret_void()
    return module


# ============================================================================ stock hooks
def causal_hooks(bottom_right: bool = False) -> ExprHooks:
    """kv_idx <= q_idx (top-left, torch's is_causal) or kv_idx <= q_idx + seqlen_k - seqlen_q."""

    def shift(b, sq, sk):
        return b.sub(sk, sq) if bottom_right else i32(0)

    def mask(b, bi, h, q, kv, sq, sk):
        return b.icmp_signed("<=", kv, b.add(q, shift(b, sq, sk)))

    def classify(b, bi, h, q_lo, q_hi, kv_lo, kv_hi, sq, sk, q_rows=None, kv_rows=None):
        d = shift(b, sq, sk)
        return (b.icmp_signed("<=", kv_lo, b.add(q_hi, d)),
                b.icmp_signed("<=", kv_hi, b.add(q_lo, d)))

    return ExprHooks(mask=mask, score=None, classify=classify)


NO_MASK = ExprHooks()


# ============================================================================ the backend
def declared_config(options, layout: Layout = Layout()) -> AttentionConfig:
    """FlashAttention-2's default tile for the declaration's dtype and head dim, overridden
    by what the declaration (`AttentionOptions`) fixes; not validated."""
    base = default_config("bf16", options.head_dim if options.head_dim in HEAD_DIMS else 128)
    overrides = {k: v for k, v in (("block_m", options.block_m), ("block_n", options.block_n),
                                   ("num_warps", options.warps), ("stages", options.stages))
                 if v is not None}
    return replace(base, dtype=options.dtype, head_dim=options.head_dim,
                   gqa_group=layout.gqa_group, return_lse=layout.return_lse,
                   ragged=layout.ragged, **overrides)


def build_configs(options, layout: Layout = Layout()) -> tuple[AttentionConfig, ...]:
    """The builds to try, best first: the declared config; then, unless the declaration fixes
    the tile, a 32-row KV tile, which leaves ptxas more registers, and last half the query
    rows too (a score that reads a tensor at every element: its loads' registers)."""
    primary = declared_config(options, layout).validate()
    narrow = replace(primary, block_n=32)
    if options.block_n is not None or primary.block_n <= 32 or narrow.problems():
        return (primary,)
    short = replace(narrow, block_m=primary.block_m // 2)
    return (primary, narrow) if options.block_m is not None or short.problems() else \
        (primary, narrow, short)


def compile_kernel(source: KernelSource, configs: tuple[AttentionConfig, ...],
                   target: Target) -> KernelBuild:
    """LLVM IR, PTX and (with ptxas) the cubin, spill-free if any candidate is. The IR shapes
    in `TUNINGS` compute the same thing, but ptxas's allocation under the 255-register cap
    is chaotic, so the first shape that assembles without spills wins; after them come the
    fallback `configs` (a narrower KV tile), and with no spill-free candidate the one with
    the fewest spills."""
    return spill_free_build(BACKEND.name, target, [
        (c, lambda c=c, t=t: build_attention_module(c, source.hooks, target,
                                                    source.work_loop(c.block_m, c.gqa_group), t))
        for c in configs for t in TUNINGS])


class SM80(Backend):
    """FlashAttention-2 on cp.async, ldmatrix and mma.sync: every GPU from Ampere on."""

    name = "sm80"
    targets = ("sm_90a", "sm_80")  # the roomiest first: its problems are reported on ties
    abi = ABI
    config_type = AttentionConfig

    def problems(self, options, arch: str) -> list[Problem]:
        config = declared_config(options)
        found = config.problems()
        limit = SHARED_MEMORY_LIMIT[arch]
        if shared_bytes(config) > limit:
            found.append(Problem(("tile", "head_dim"), (
                f"the tile needs {shared_bytes(config) // 1024} KiB of shared memory (Q, K "
                f"and V tiles of head_dim {config.head_dim}); {arch} allows "
                f"{limit // 1024} KiB")))
        return found

    def configs(self, options, layout: Layout) -> tuple[AttentionConfig, ...]:
        return build_configs(options, layout)

    def kernels(self, config: AttentionConfig) -> tuple[KernelLaunch, ...]:
        return (KernelLaunch(kernel_name(config), ABI, threads(config), shared_bytes(config)),)

    def build(self, source: KernelSource, configs: tuple[AttentionConfig, ...],
              target: Target) -> KernelBuild:
        return compile_kernel(source, configs, target)


BACKEND = SM80()
