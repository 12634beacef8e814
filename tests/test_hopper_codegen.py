"""The Hopper building blocks (codegen/hopper.py, runtime/tensormap.py) on the CPU.

The small kernels built here are the ones tests/test_gpu_hopper.py runs on an H200: each
lowers to sm_90a PTX (ISA <= 9.0, what the CUDA 13.0 driver takes) and ptxas assembles it
with no spills. The tensor-map checks run without a driver.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from llvmlite import ir

from mhadsl.codegen import hopper, nvptx, warp
from mhadsl.codegen.assemble import assemble
from mhadsl.codegen.nvptx import SHARED, f32, i8, i32, void
from mhadsl.codegen.target import emit_ptx, gpu_target, new_module, optimize
from mhadsl.runtime.tensormap import tiled_layout

TARGET = gpu_target("sm_90a")
TILE = 64  # rows x 64 columns of 16-bit elements: one 128-byte-swizzled TMA box
TILE_BYTES = TILE * hopper.SWIZZLE_BYTES  # 8192


# ============================================================================ kernel scaffolding
@dataclass
class Kernel:
    module: ir.Module
    fn: ir.Function
    builder: ir.IRBuilder
    smem: ir.Value  # 1024-byte aligned start of dynamic shared memory
    tid: ir.Value  # thread_idx.x

    def at(self, offset: int | ir.Value) -> ir.Value:
        """addrspace(3) pointer `offset` bytes into the aligned shared memory."""
        off = i32(offset) if isinstance(offset, int) else offset
        return warp.smem_ptr(self.builder, self.smem, off)


def new_kernel(name: str, params: list[ir.Type], threads: int,
               tensor_maps: tuple[int, ...] = ()) -> Kernel:
    """A kernel with `threads` threads (a register cap at entry, as setmaxnreg needs), the
    tensor-map parameters at `tensor_maps`, and dynamic shared memory whose start is rounded
    up to 1024 bytes at run time (so launches add `SMEM_SLACK` bytes)."""
    module = new_module(name, TARGET)
    fn = ir.Function(module, ir.FunctionType(void, params), name=name)
    nvptx.mark_kernel(fn)
    set.add(fn.attributes, f'"nvvm.maxntid"="{threads}"')
    set.add(fn.attributes, '"nvvm.minctasm"="1"')
    for index in tensor_maps:
        hopper.mark_tensor_map_param(fn.args[index])
    smem = ir.GlobalVariable(module, ir.ArrayType(i8, 0), "smem", addrspace=SHARED)
    smem.linkage = "external"
    # Declared 128-aligned (as the sm80 backend does), so the round-up below is real code
    # and tma_roundtrip reports where the driver put dynamic shared memory.
    smem.align = 128
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    raw = hopper.shared_address(b, smem)
    pad = b.and_(b.sub(i32(0), raw), i32(hopper.SWIZZLE_ATOM_BYTES - 1))
    return Kernel(module, fn, b, warp.smem_ptr(b, smem, pad),
                  nvptx.special_register(b, "thread_idx", "x"))


SMEM_SLACK = hopper.SWIZZLE_ATOM_BYTES


def global_ptr(b: ir.IRBuilder, base: ir.Value, index: ir.Value, ty: ir.Type) -> ir.Value:
    return b.gep(base, [b.zext(index, nvptx.i64)], inbounds=True, source_etype=ty)


def counted_loop(b: ir.IRBuilder, count: ir.Value, body: Callable[[ir.Value], None]) -> None:
    """for i in range(count): body(i), as an IR loop (body may add blocks)."""
    fn = b.function
    head, loop, done = (fn.append_basic_block(n) for n in ("loop_head", "loop", "loop_done"))
    entry = b.block
    b.branch(head)
    b.position_at_end(head)
    i = b.phi(i32, "i")
    i.add_incoming(i32(0), entry)
    b.cbranch(b.icmp_unsigned("<", i, count), loop, done)
    b.position_at_end(loop)
    body(i)
    i.add_incoming(b.add(i, i32(1)), b.block)
    b.branch(head)
    b.position_at_end(done)


def if_thread(b: ir.IRBuilder, tid: ir.Value, which: int = 0):
    return b.if_then(b.icmp_unsigned("==", tid, i32(which)))


def store_accumulators(b: ir.IRBuilder, out: ir.Value, acc: list[ir.Value], thread: ir.Value,
                       row0: ir.Value, col0: ir.Value, row_stride: ir.Value) -> None:
    """out[(row0 + row) * row_stride + col0 + col] = acc[j] for this thread's (row, col)."""
    for j, value in enumerate(acc):
        row, col = hopper.accumulator_row_col(b, thread, j)
        index = b.add(b.mul(b.add(row0, row), row_stride), b.add(col0, col))
        b.store(value, global_ptr(b, out, index, f32))


def k_major_qk(k: Kernel, a_tiles: int, b_tiles: int, dtype: str, n: int, head_dim: int
               ) -> list[ir.Value]:
    """S = A B^T by wgmma m64n{n}k16 over `head_dim`, both operands K-major in shared memory
    as 64-column boxes (A's box c at a_tiles + c * A box bytes, likewise B)."""
    b = k.builder
    hopper.wgmma_fence(b)
    acc = None
    for step in range(head_dim // 16):
        box, offset = divmod(step * 32, hopper.SWIZZLE_BYTES)
        a_desc = hopper.smem_descriptor(b, k.at(a_tiles + box * TILE_BYTES + offset))
        b_desc = hopper.smem_descriptor(b, k.at(b_tiles + box * n * hopper.SWIZZLE_BYTES + offset))
        acc = hopper.wgmma(b, dtype, n, a_desc, b_desc, acc)
    hopper.wgmma_commit_group(b)
    hopper.wgmma_wait_group(b, 0)
    return hopper.fence_operands(b, acc)


# ============================================================================ the test kernels
def build_tma_roundtrip(rank: int) -> ir.Module:
    """tma_roundtrip(map_in, map_out, raw: u32*, info: u32*, c_0 .. c_{rank-1}: i32), 128
    threads: load one box of map_in at c (64 x 64 innermost, 1 elsewhere) onto an mbarrier,
    dump the shared tile's words to raw, store the tile back through map_out at c, and
    write the unaligned dynamic shared address to info[0]."""
    ptr = nvptx.ptr(nvptx.GLOBAL)
    k = new_kernel("tma_roundtrip", [nvptx.ptr(), nvptx.ptr(), ptr, ptr] + [i32] * rank, 128,
                   tensor_maps=(0, 1))
    b, tid = k.builder, k.tid
    map_in, map_out, raw, info = (hopper.tensor_map_address(b, k.fn.args[0]),
                                  hopper.tensor_map_address(b, k.fn.args[1]),
                                  k.fn.args[2], k.fn.args[3])
    coords = list(k.fn.args[4:])
    tile, bar = k.at(0), k.at(TILE_BYTES)
    with if_thread(b, tid):
        hopper.prefetch_tensor_map(b, map_in)
        hopper.mbarrier_init(b, bar, 1)
        hopper.fence_mbarrier_init(b)
    nvptx.barrier_all(b)
    with if_thread(b, tid):
        hopper.mbarrier_arrive_expect_tx(b, bar, TILE_BYTES)
        hopper.tma_load(b, tile, map_in, coords, bar)
    hopper.mbarrier_wait(b, bar, 0)
    for i in range(TILE_BYTES // 4 // 128):
        word = b.add(tid, i32(128 * i))
        value = b.load(warp.smem_ptr(b, tile, b.shl(word, i32(2))), typ=i32)
        b.store(value, global_ptr(b, raw, word, i32))
    hopper.fence_proxy_async(b)
    nvptx.barrier_all(b)
    with if_thread(b, tid):
        hopper.tma_store(b, map_out, coords, tile)
        hopper.bulk_commit_group(b)
        hopper.bulk_wait_group_read(b, 0)
        b.store(b.ptrtoint(k.smem, i32), global_ptr(b, info, i32(0), i32))
        raw_smem = hopper.shared_address(b, b.module.get_global("smem"))
        b.store(raw_smem, global_ptr(b, info, i32(1), i32))
    b.ret_void()
    return k.module


TMA_ROUNDTRIP_SMEM = TILE_BYTES + hopper.MBARRIER_BYTES + SMEM_SLACK


def build_qk(dtype: str, head_dim: int = 128) -> ir.Module:
    """qk(map_q, map_k, s: f32*), 128 threads: Q and K (64 x head_dim each, 64-column
    boxes) by TMA, S = Q K^T by chained wgmma m64n64k16, S written row-major 64 x 64."""
    boxes = head_dim // TILE
    k = new_kernel("qk", [nvptx.ptr(), nvptx.ptr(), nvptx.ptr(nvptx.GLOBAL)], 128, (0, 1))
    b, tid = k.builder, k.tid
    map_q, map_k = (hopper.tensor_map_address(b, a) for a in k.fn.args[:2])
    k_tiles = boxes * TILE_BYTES
    bar = k.at(2 * k_tiles)
    with if_thread(b, tid):
        hopper.mbarrier_init(b, bar, 1)
        hopper.fence_mbarrier_init(b)
    nvptx.barrier_all(b)
    with if_thread(b, tid):
        hopper.mbarrier_arrive_expect_tx(b, bar, 2 * k_tiles)
        for c in range(boxes):
            hopper.tma_load(b, k.at(c * TILE_BYTES), map_q, [i32(0), i32(TILE * c)], bar)
            hopper.tma_load(b, k.at(k_tiles + c * TILE_BYTES), map_k, [i32(0), i32(TILE * c)], bar)
    hopper.mbarrier_wait(b, bar, 0)
    acc = k_major_qk(k, 0, k_tiles, dtype, TILE, head_dim)
    store_accumulators(b, k.fn.args[2], acc, tid, i32(0), i32(0), i32(TILE))
    b.ret_void()
    return k.module


def qk_smem(head_dim: int = 128) -> int:
    return 2 * (head_dim // TILE) * TILE_BYTES + hopper.MBARRIER_BYTES + SMEM_SLACK


def build_pv(dtype: str, head_dim: int, leading_bytes: int = TILE_BYTES,
             stride_bytes: int = hopper.SWIZZLE_ATOM_BYTES) -> ir.Module:
    """pv(p: f32*, map_v, o: f32*), 128 threads: P (64 x 64 f32, read in the accumulator
    layout, rounded to `dtype` by `a_fragment`) times V (64 kv rows x head_dim, MN-major,
    head_dim / 64 boxes of 64 x 64) by wgmma m64n{head_dim}k16 with A from registers and
    trans-b; O written row-major 64 x head_dim. (The descriptor's byte offsets are
    parameters only so a failing GPU run can report which encoding would have worked.)"""
    boxes = head_dim // TILE
    glob = nvptx.ptr(nvptx.GLOBAL)
    k = new_kernel("pv", [glob, nvptx.ptr(), glob], 128, (1,))
    b, tid = k.builder, k.tid
    p_in, map_v, o_out = k.fn.args[0], hopper.tensor_map_address(b, k.fn.args[1]), k.fn.args[2]
    bar = k.at(boxes * TILE_BYTES)
    with if_thread(b, tid):
        hopper.mbarrier_init(b, bar, 1)
        hopper.fence_mbarrier_init(b)
    nvptx.barrier_all(b)
    with if_thread(b, tid):
        hopper.mbarrier_arrive_expect_tx(b, bar, boxes * TILE_BYTES)
        for c in range(boxes):
            hopper.tma_load(b, k.at(c * TILE_BYTES), map_v, [i32(0), i32(TILE * c)], bar)
    p = []
    for j in range(hopper.accumulator_count(TILE)):
        row, col = hopper.accumulator_row_col(b, tid, j)
        index = b.add(b.mul(row, i32(TILE)), col)
        p.append(b.load(global_ptr(b, p_in, index, f32), typ=f32))
    fragments = [hopper.a_fragment(b, dtype, p, step) for step in range(TILE // 16)]
    hopper.mbarrier_wait(b, bar, 0)
    hopper.wgmma_fence(b)
    acc = None
    for step, fragment in enumerate(fragments):
        # 16 kv rows of 128 B per step; the next 64 head-dim columns are the next box
        v_desc = hopper.smem_descriptor(b, k.at(step * 16 * hopper.SWIZZLE_BYTES),
                                        stride_bytes=stride_bytes, leading_bytes=leading_bytes)
        acc = hopper.wgmma(b, dtype, head_dim, fragment, v_desc, acc, trans_b=True)
    hopper.wgmma_commit_group(b)
    hopper.wgmma_wait_group(b, 0)
    acc = hopper.fence_operands(b, acc)
    store_accumulators(b, o_out, acc, tid, i32(0), i32(0), i32(head_dim))
    b.ret_void()
    return k.module


def pv_smem(head_dim: int) -> int:
    return (head_dim // TILE) * TILE_BYTES + hopper.MBARRIER_BYTES + SMEM_SLACK


# warp-specialised S = Q K^T: warpgroup 0 loads, warpgroups 1 and 2 each own 64 query rows
WS_THREADS = 384
WS_PRODUCER_REGS, WS_CONSUMER_REGS = 40, 232
WS_STAGES = 2
WS_HEAD_DIM = 128
_WS_Q_BYTES = 2 * 2 * TILE_BYTES  # 2 consumers x 2 boxes of 64 head-dim columns
_WS_STAGE_BYTES = 2 * TILE_BYTES
_WS_BARRIERS = _WS_Q_BYTES + WS_STAGES * _WS_STAGE_BYTES


def build_warp_specialized() -> ir.Module:
    """ws_qk(map_q, map_k, s: f32*, kv_tiles: i32), 384 threads: the producer warpgroup
    (setmaxnreg.dec) loads Q (128 x 128) once and streams K (kv_tiles x 64 rows of 128)
    through a ring of WS_STAGES stages (full barriers: expect_tx; empty barriers: 256
    consumer arrivals); consumer warpgroup c (setmaxnreg.inc) computes
    S[64c:64c+64, 64i:64i+64] = Q_c K_i^T for each tile i. S is 128 x (64 kv_tiles)."""
    k = new_kernel("ws_qk", [nvptx.ptr(), nvptx.ptr(), nvptx.ptr(nvptx.GLOBAL), i32],
                   WS_THREADS, (0, 1))
    b, tid = k.builder, k.tid
    map_q, map_k = (hopper.tensor_map_address(b, a) for a in k.fn.args[:2])
    s_out, kv_tiles = k.fn.args[2], k.fn.args[3]
    q_full = k.at(_WS_BARRIERS)

    def full(stage: ir.Value) -> ir.Value:
        return k.at(b.add(i32(_WS_BARRIERS + 8), b.shl(stage, i32(3))))

    def empty(stage: ir.Value) -> ir.Value:
        return k.at(b.add(i32(_WS_BARRIERS + 8 + 8 * WS_STAGES), b.shl(stage, i32(3))))

    def stage_tile(stage: ir.Value, box: int) -> ir.Value:
        return b.add(i32(_WS_Q_BYTES + box * TILE_BYTES), b.mul(stage, i32(_WS_STAGE_BYTES)))

    consumers = 2 * hopper.WARPGROUP_THREADS
    with if_thread(b, tid):
        hopper.mbarrier_init(b, q_full, 1)
        for s in range(WS_STAGES):
            hopper.mbarrier_init(b, full(i32(s)), 1)
            hopper.mbarrier_init(b, empty(i32(s)), consumers)
        hopper.fence_mbarrier_init(b)
    nvptx.barrier_all(b)
    group = b.lshr(tid, i32(7))
    thread = b.and_(tid, i32(hopper.WARPGROUP_THREADS - 1))
    with b.if_else(b.icmp_unsigned("==", group, i32(0))) as (producer, consumer):
        with producer:
            hopper.setmaxnreg(b, WS_PRODUCER_REGS, increase=False)
            with if_thread(b, thread):
                hopper.mbarrier_arrive_expect_tx(b, q_full, _WS_Q_BYTES)
                for c in range(2):
                    for box in range(2):
                        hopper.tma_load(b, k.at((2 * c + box) * TILE_BYTES), map_q,
                                        [i32(TILE * c), i32(TILE * box)], q_full)

                def produce(i: ir.Value) -> None:
                    stage, rnd = b.and_(i, i32(WS_STAGES - 1)), b.lshr(i, i32(1))
                    hopper.mbarrier_wait(b, empty(stage), b.xor(b.and_(rnd, i32(1)), i32(1)))
                    hopper.mbarrier_arrive_expect_tx(b, full(stage), _WS_STAGE_BYTES)
                    for box in range(2):
                        hopper.tma_load(b, k.at(stage_tile(stage, box)), map_k,
                                        [b.mul(i, i32(TILE)), i32(TILE * box)], full(stage))
                counted_loop(b, kv_tiles, produce)
        with consumer:
            hopper.setmaxnreg(b, WS_CONSUMER_REGS, increase=True)
            c = b.sub(group, i32(1))
            hopper.mbarrier_wait(b, q_full, 0)

            def consume(i: ir.Value) -> None:
                stage, rnd = b.and_(i, i32(WS_STAGES - 1)), b.lshr(i, i32(1))
                hopper.mbarrier_wait(b, full(stage), b.and_(rnd, i32(1)))
                q_tile = b.mul(c, i32(2 * TILE_BYTES))
                hopper.wgmma_fence(b)
                acc = None
                for step in range(WS_HEAD_DIM // 16):
                    box, offset = divmod(step * 32, hopper.SWIZZLE_BYTES)
                    a_desc = hopper.smem_descriptor(
                        b, k.at(b.add(q_tile, i32(box * TILE_BYTES + offset))))
                    b_desc = hopper.smem_descriptor(
                        b, k.at(b.add(stage_tile(stage, box), i32(offset))))
                    acc = hopper.wgmma(b, "bf16", TILE, a_desc, b_desc, acc)
                hopper.wgmma_commit_group(b)
                hopper.wgmma_wait_group(b, 0)
                acc = hopper.fence_operands(b, acc)
                hopper.mbarrier_arrive(b, empty(stage))
                store_accumulators(b, s_out, acc, thread, b.mul(c, i32(TILE)),
                                   b.mul(i, i32(TILE)), b.mul(kv_tiles, i32(TILE)))
            counted_loop(b, kv_tiles, consume)
    b.ret_void()
    return k.module


WS_SMEM = _WS_BARRIERS + (1 + 2 * WS_STAGES) * hopper.MBARRIER_BYTES + SMEM_SLACK


# ============================================================================ lowering
@dataclass(frozen=True)
class Built:
    ptx: str
    log: str
    cubin: bytes
    registers: int
    spills: int


def build(module: ir.Module) -> Built:
    ptx = emit_ptx(optimize(module, TARGET), TARGET)
    assembled = assemble(ptx, TARGET.arch)
    (resources,) = assembled.kernels.values()
    return Built(ptx, assembled.log, assembled.cubin, resources.registers, resources.spills)


KERNELS = {
    "tma_roundtrip_2d": (lambda: build_tma_roundtrip(2), ["cp.async.bulk.tensor.2d", "mbarrier"]),
    "tma_roundtrip_3d": (lambda: build_tma_roundtrip(3), ["cp.async.bulk.tensor.3d"]),
    "tma_roundtrip_4d": (lambda: build_tma_roundtrip(4), ["cp.async.bulk.tensor.4d"]),
    "qk_bf16": (lambda: build_qk("bf16"), ["wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"]),
    "qk_fp16": (lambda: build_qk("fp16"), ["wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16"]),
    "pv_d64": (lambda: build_pv("bf16", 64), ["m64n64k16.f32.bf16.bf16", "cvt.rn.bf16x2.f32"]),
    "pv_d128": (lambda: build_pv("bf16", 128), ["m64n128k16.f32.bf16.bf16"]),
    "pv_d128_fp16": (lambda: build_pv("fp16", 128), ["m64n128k16.f32.f16.f16"]),
    "warp_specialized": (build_warp_specialized, ["setmaxnreg.dec.sync.aligned.u32 40",
                                                  "setmaxnreg.inc.sync.aligned.u32 232"]),
}


@pytest.fixture(scope="module")
def built() -> dict[str, Built]:
    return {}


def _built(cache: dict[str, Built], name: str) -> Built:
    if name not in cache:
        cache[name] = build(KERNELS[name][0]())
    return cache[name]


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_lowers_and_assembles_without_spills(built, name):
    result = _built(built, name)
    version = re.search(r"^\.version (\d+)\.(\d+)", result.ptx, re.M)
    assert version and (int(version[1]), int(version[2])) <= (9, 0), version
    assert ".target sm_90a" in result.ptx
    assert ".extern .func" not in result.ptx, "an unknown llvm.nvvm intrinsic became a call"
    text = " ".join(result.ptx.split())
    for needle in KERNELS[name][1]:
        assert needle in text, needle
    assert result.spills == 0, result.log
    assert "error" not in result.log.lower(), result.log
    # C7519: ptxas serialised the wgmma pipeline (registers touched while in flight)
    assert "C7519" not in result.log, result.log


def test_tensor_map_parameter_is_grid_constant_param_space(built):
    ptx = _built(built, "tma_roundtrip_2d").ptx
    assert re.search(r"\.param \.align (64|128) \.b8 tma_roundtrip_param_0\[128\]", ptx)
    assert "cvta.param" in ptx  # the map's own address, no local copy
    assert "local" not in ptx


def test_setmaxnreg_is_honoured(built):
    result = _built(built, "warp_specialized")
    assert ".maxntid 384" in result.ptx and ".minnctapersm 1" in result.ptx
    assert "C7508" not in result.log, result.log  # ptxas: setmaxnreg ignored
    assert result.registers <= 168  # the entry cap that makes setmaxnreg effective


def test_wgmma_constraints_have_no_spaces_and_reject_bad_shapes():
    k = new_kernel("probe", [], 128)
    b = k.builder
    desc = hopper.smem_descriptor(b, k.at(0))
    with pytest.raises(ValueError, match="multiple of 8"):
        hopper.wgmma(b, "bf16", 60, desc, desc)
    with pytest.raises(ValueError, match="accumulators"):
        hopper.wgmma(b, "bf16", 64, desc, desc, acc=[f32(0.0)] * 4)
    with pytest.raises(ValueError, match="4 registers"):
        hopper.wgmma(b, "bf16", 64, [i32(0)] * 3, desc)
    with pytest.raises(ValueError, match="dtype"):
        hopper.wgmma(b, "fp8", 64, desc, desc)
    with pytest.raises(ValueError, match="multiple of 8"):
        hopper.setmaxnreg(b, 20, increase=False)
    with pytest.raises(ValueError, match="stride_bytes"):
        hopper.smem_descriptor(b, k.at(0), stride_bytes=1000)


@pytest.mark.parametrize("count", [1, 2])
def test_fence_operands_passes_any_number_of_values_through_one_asm(count):
    """One value or several, f32 or i32: each comes back through one empty asm, in order,
    and the module parses and lowers (LLVM rejects an asm returning a struct of one)."""
    module = new_module("fence", TARGET)
    fn = ir.Function(module, ir.FunctionType(f32, [f32, i32]), name="fence")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    x, n = fn.args
    fenced = hopper.fence_operands(b, [x, n][:count])
    assert [v.type for v in fenced] == [f32, i32][:count]
    b.ret(b.fadd(fenced[0], b.sitofp(fenced[-1], f32)) if count == 2 else fenced[0])
    ptx = emit_ptx(optimize(module, TARGET), TARGET)
    assert len(re.findall(r"// begin inline asm", ptx)) == 1


def test_smem_descriptor_fields():
    """Address 0x1400 (a 1024-aligned tile), K-major: start 0x140, leading 1, stride 64,
    128-byte swizzle; MN-major with the next box 8192 B away: leading 512."""
    module = new_module("desc", TARGET)
    fn = ir.Function(module, ir.FunctionType(nvptx.i64, []), name="desc")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    tile = b.inttoptr(i32(0x1400), nvptx.ptr(SHARED))
    k_major = hopper.smem_descriptor(b, tile)
    mn_major = hopper.smem_descriptor(b, tile, leading_bytes=8192)
    b.ret(b.xor(k_major, mn_major))
    text = str(module)
    assert f"{1 << 16 | 64 << 32 | 1 << 62}" in text
    assert f"{512 << 16 | 64 << 32 | 1 << 62}" in text


def test_accumulator_layout_covers_the_tile_once():
    for n in (64, 128, 256):
        seen = {hopper.accumulator_position(t, j)
                for t in range(128) for j in range(hopper.accumulator_count(n))}
        assert seen == {(r, c) for r in range(64) for c in range(n)}
    # a register A fragment of slice k is accumulators 8k..8k+7: columns 16k..16k+15
    cols = {hopper.accumulator_position(t, j)[1] for t in range(128) for j in range(8, 16)}
    assert cols == set(range(16, 32))


# ============================================================================ tensor maps
GOOD = dict(address=0x10000, dtype="bf16", shape=(4, 16, 4096, 128),
            strides=(16 * 4096 * 128, 4096 * 128, 128, 1), box=(1, 1, 64, 64))


def test_tiled_layout_is_innermost_first_in_bytes():
    layout = tiled_layout(**GOOD)
    assert layout.dims == (128, 4096, 16, 4)
    assert layout.byte_strides == (256, 256 * 4096, 256 * 4096 * 16)
    assert layout.box == (64, 64, 1, 1)
    assert layout.box_bytes == 8192 and layout.swizzle == 128


@pytest.mark.parametrize("change, message", [
    (dict(address=0x10008), "16-byte aligned"),
    (dict(dtype="float32"), "dtype"),
    (dict(shape=(8,), strides=(1,), box=(8,)), "rank 1"),
    (dict(box=(1, 64, 64)), "one entry per dimension"),
    (dict(strides=(16 * 4096 * 128, 4096 * 128, 1, 128)), "contiguous"),
    (dict(strides=(16 * 4096 * 128, 4096 * 128, 100, 1)), "multiple of 16"),
    (dict(box=(1, 1, 512, 64)), "1 to 256"),
    (dict(box=(1, 1, 64, 128)), "at most 128"),
    (dict(box=(1, 1, 64, 4)), "multiple of 16"),
    (dict(swizzle=96), "swizzle"),
    (dict(shape=(4, 16, 0, 128)), "extent 0"),
])
def test_tiled_layout_rejects_what_the_driver_would(change, message):
    with pytest.raises(ValueError, match=message):
        tiled_layout(**(GOOD | change))


def test_unswizzled_box_may_be_wider():
    assert tiled_layout(**(GOOD | dict(box=(1, 1, 64, 128), swizzle=0))).box_bytes == 16384
