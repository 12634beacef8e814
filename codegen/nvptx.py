"""NVPTX facts in one place: address spaces, special registers, barriers, intrinsics.

Everything that names an `llvm.nvvm.*` intrinsic or a PTX address space lives here, so
the scheduler lowering and the attention kernel share one vocabulary.
"""
from __future__ import annotations

import math

from llvmlite import ir

GENERIC, GLOBAL, SHARED, CONSTANT, LOCAL = 0, 1, 3, 4, 5

i1, i8, i16, i32, i64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
f32 = ir.FloatType()
FLT_MIN, FLT_MAX = 2.0 ** -126, (2 - 2.0 ** -23) * 2.0 ** 127  # f32's normal range
void = ir.VoidType()


def ptr(addrspace: int = GENERIC) -> ir.PointerType:
    return ir.PointerType(addrspace=addrspace)


def shared_array(module: ir.Module, name: str, ty: ir.ArrayType) -> ir.GlobalVariable:
    """The module's statically allocated shared-memory array `name` (created on first use;
    8-byte aligned). Its IR initializer is zero, but shared memory starts undefined on the
    GPU: a kernel writes every word before it reads it (as `init_handoff` does)."""
    if name in module.globals:
        return module.globals[name]
    array = ir.GlobalVariable(module, ty, name, addrspace=SHARED)
    array.linkage = "internal"
    array.initializer = ir.Constant(ty, None)
    array.align = 8
    array.type = ptr(SHARED)  # opaque, as LLVM 22 prints pointers
    return array


def intrinsic(module: ir.Module, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
    """Declare (once) and return an intrinsic or external function."""
    existing = module.globals.get(name)
    if existing is not None:
        return existing
    return ir.Function(module, ir.FunctionType(ret, args), name=name)


def call(builder: ir.IRBuilder, name: str, ret: ir.Type, args: list[ir.Value]) -> ir.Value:
    fn = intrinsic(builder.module, name, ret, [a.type for a in args])
    return builder.call(fn, args)


def divide(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    """f32 `a / b` as fast-math GPU code divides, not by the IEEE division's subroutine: by a
    constant whose reciprocal is a normal float, a multiplication by that reciprocal (LLVM's
    `arcp`); by a kernel parameter (a scalar operand: one value for every element), a
    multiplication by its reciprocal by `div.full.f32`, which LLVM computes once; otherwise
    `div.full.f32` (at most 2 ulp, the full range)."""
    if isinstance(b, ir.Constant):
        reciprocal = 1.0 / b.constant if b.constant else math.inf
        if math.isfinite(reciprocal) and FLT_MIN <= abs(reciprocal) <= FLT_MAX:
            return builder.fdiv(a, b, flags=("arcp",))
    if isinstance(b, ir.Argument) and b.parent.calling_convention == "ptx_kernel":
        return builder.fmul(a, call(builder, "llvm.nvvm.div.full", f32, [f32(1.0), b]))
    return call(builder, "llvm.nvvm.div.full", f32, [a, b])


# ----------------------------------------------------------------- special registers
SPECIAL_REGISTERS = {
    ("block_idx", axis): f"llvm.nvvm.read.ptx.sreg.ctaid.{axis}" for axis in "xyz"
} | {
    ("thread_idx", axis): f"llvm.nvvm.read.ptx.sreg.tid.{axis}" for axis in "xyz"
} | {
    ("grid_dim", axis): f"llvm.nvvm.read.ptx.sreg.nctaid.{axis}" for axis in "xyz"
} | {
    ("block_dim", axis): f"llvm.nvvm.read.ptx.sreg.ntid.{axis}" for axis in "xyz"
}


def special_register(builder: ir.IRBuilder, group: str, axis: str) -> ir.Value:
    return call(builder, SPECIAL_REGISTERS[(group, axis)], i32, [])


def lane_id(builder: ir.IRBuilder) -> ir.Value:
    return call(builder, "llvm.nvvm.read.ptx.sreg.laneid", i32, [])


def opaque_special_register(builder: ir.IRBuilder, name: str, ty: ir.IntType = i32) -> ir.Value:
    """`%name` read by a volatile asm, which LLVM neither hoists nor rematerialises: in a
    persistent loop nothing derived from %tid.x stays live across tiles (that spills), and
    %smid and %globaltimer are read exactly where the trace records them."""
    constraint = "=l" if ty.width == 64 else "=r"
    return builder.asm(ir.FunctionType(ty, []), f"mov.u{ty.width} $0, %{name};", constraint,
                       [], True)


def opaque(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    """`value`, through an empty volatile asm LLVM cannot see through or hoist: what is
    derived from it is computed where it is used, not held in registers from earlier."""
    ty = value.type
    if isinstance(ty, ir.PointerType):
        as_int = builder.ptrtoint(value, i64)
        return builder.inttoptr(opaque(builder, as_int), ty)
    constraint = "=l,0" if ty == i64 else "=r,0"
    return builder.asm(ir.FunctionType(ty, [ty]), "", constraint, [value], True)


def red_add_f32_if(builder: ir.IRBuilder, pointer: ir.Value, value: ir.Value,
                   predicate: ir.Value) -> None:
    """`red.global.add.f32` of `value` at global `pointer`, where `predicate` (i1) holds:
    predicated in PTX, so the IR around it keeps one block (a caller lowering an
    expression may hold its current block for a phi)."""
    builder.asm(ir.FunctionType(void, [i64, f32, i32]),
                "{ .reg .pred %p; setp.ne.u32 %p, $2, 0; @%p red.global.add.f32 [$0], $1; }",
                "l,f,r", [builder.ptrtoint(pointer, i64), value, builder.zext(predicate, i32)],
                True)


def load_global_if(builder: ir.IRBuilder, pointer: ir.Value, predicate: ir.Value,
                   offsets: tuple[tuple[ir.Value, int], ...] = ()) -> ir.Value:
    """The 32 bits at global `pointer` plus `offsets` (pairs of an i32 stride and a constant
    count of it, in 4-byte elements) where `predicate` (i1) holds, else 0. The load is
    predicated, so where the predicate fails the address is never read; the offsets are
    added inside the asm, so LLVM neither hoists their products out of a loop (a register
    each) nor keeps two loads of one address apart (the asm is pure)."""
    text = ["{ .reg .b64 %a, %t; mov.b64 %a, $1;"]
    for i, (_, count) in enumerate(offsets):
        if abs(count) < 2**29:  # (4 x count is an s32: one multiply-add)
            text.append(f"mad.wide.s32 %a, ${i + 3}, {4 * count}, %a;")
        else:
            text.append(f"mul.wide.s32 %t, ${i + 3}, {count}; shl.b64 %t, %t, 2; "
                        "add.s64 %a, %a, %t;")
    text.append("mov.b32 $0, 0; @$2 ld.global.nc.b32 $0, [%a]; }")
    strides = [stride for stride, _ in offsets]
    return builder.asm(ir.FunctionType(i32, [i64, i1] + [i32] * len(strides)), " ".join(text),
                       "=r,l,b" + ",r" * len(strides),
                       [builder.ptrtoint(pointer, i64), predicate, *strides], False)


def reload_shared(builder: ir.IRBuilder, address: ir.Value, bits: int = 32) -> ir.Value:
    """The u32 (or u64: `bits`) at 32-bit shared address `address`, read by a volatile asm
    exactly where it stands: neither LLVM nor ptxas keeps the value live from an earlier
    read, so a value a kernel parks in shared memory costs no register between its uses."""
    return builder.asm(ir.FunctionType(ir.IntType(bits), [i32]),
                       f"ld.volatile.shared.u{bits} $0, [$1];",
                       ("=r" if bits == 32 else "=l") + ",r", [address], True)


# ----------------------------------------------------------------- barriers
CTA_BARRIER = 0  # bar.sync 0: every thread of the CTA
PRODUCER_BARRIER = 1  # a named barrier among the producer's threads
CONSUMER_EPILOGUE_BARRIER = 2  # sm90: around O's staging tile (2 + group: per warpgroup)
DS_BARRIER = 3  # sm90 backward (a kernel of its own): the consumers' dS^T tile is complete
DQ_FULL_BARRIER = 4  # sm90 backward: 4 + group, the warpgroup's dQ staging tile is written
DQ_EMPTY_BARRIER = 6  # sm90 backward: 6 + group, its last bulk reduce-add has read the tile
DQ_ODD_STEPS = 4  # sm90 deterministic backward: the two above + 4 (8-11) at odd query steps


def _cta_threads(builder: ir.IRBuilder) -> ir.Value:
    ntid = [special_register(builder, "block_dim", axis) for axis in "xyz"]
    return builder.mul(builder.mul(ntid[0], ntid[1]), ntid[2])


def barrier_all(builder: ir.IRBuilder, aligned: bool = True) -> None:
    """A CTA-wide barrier. `aligned` (PTX `bar.sync 0`) promises every thread reaches this
    very instruction. Warp-specialised roles that meet from different branches use the
    non-aligned form with the CTA's thread count spelled out (`barrier.sync 0, n`): without
    the count it is `__syncthreads`, which compute-sanitizer's synccheck requires every
    thread to reach at one site (it reports divergent threads)."""
    if aligned:
        call(builder, "llvm.nvvm.barrier.cta.sync.aligned.all", void, [i32(CTA_BARRIER)])
    else:
        call(builder, "llvm.nvvm.barrier.cta.sync.count", void,
             [i32(CTA_BARRIER), _cta_threads(builder)])


def _value(x: int | ir.Value) -> ir.Value:
    return i32(x) if isinstance(x, int) else x


def barrier_named(builder: ir.IRBuilder, barrier_id: int | ir.Value,
                  num_threads: int | ir.Value, aligned: bool = True) -> None:
    """Wait at named barrier `barrier_id` until `num_threads` threads arrived (this one too);
    `aligned=False` where its participants meet at different sites (as `barrier_all`)."""
    call(builder, f"llvm.nvvm.barrier.cta.sync{'.aligned' if aligned else ''}.count", void,
         [_value(barrier_id), _value(num_threads)])


def barrier_arrive(builder: ir.IRBuilder, barrier_id: int | ir.Value,
                   num_threads: int | ir.Value) -> None:
    """Arrive at named barrier `barrier_id` (of `num_threads` threads) without waiting: the
    producer's side of a barrier whose consumers `barrier_named` at another site."""
    call(builder, "llvm.nvvm.barrier.cta.arrive.count", void,
         [_value(barrier_id), _value(num_threads)])


def barrier_any(builder: ir.IRBuilder, pred: ir.Value) -> ir.Value:
    """A CTA-wide barrier, reached by every thread at this one site (`.aligned`), that
    returns to every thread whether `pred` held in any thread. (Roles that meet from their
    own branches vote through `work_loop.divergent_vote`: compute-sanitizer's synccheck
    refuses a `barrier.red` reached from two sites.)"""
    return call(builder, "llvm.nvvm.barrier.cta.red.or.aligned.all", i1,
                [i32(CTA_BARRIER), pred])


# ----------------------------------------------------------------- kernels
def mark_kernel(fn: ir.Function) -> None:
    """Kernels use the ptx_kernel calling convention (LLVM >= 20)."""
    fn.calling_convention = "ptx_kernel"
