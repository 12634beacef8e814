"""What stops a scheduler that would hang a kernel, and the fault record it leaves.

Each scheduler step refills the fuel its `while` loops burn (`refuel`); after the step a
thread that took too many tiles or ran out of fuel records the fault in the workspace
(`record_fault`, laid out in `mhadsl.abi`) and the CTA votes to stop (`stop_step`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from llvmlite import ir

from mhadsl.codegen import nvptx
from mhadsl.codegen.lower import ENV_FIELDS, TS_FIELDS
from mhadsl.codegen.nvptx import i32, i64
from mhadsl import abi

if TYPE_CHECKING:  # annotations only: both import this module (the rules via the handoff)
    from mhadsl.codegen.scheduler import LoweredScheduler
    from mhadsl.codegen.work_loop import KernelEnv


def stop_step(builder: ir.IRBuilder, sched: LoweredScheduler, kenv: KernelEnv,
               too_many: ir.Value) -> ir.Value:
    """Whether any thread of the CTA stops after this scheduler step (a CTA-wide vote that
    every thread reaches at this one site: `.aligned`); a thread that stops records why
    first."""
    faulted = record_step_fault(builder, sched, kenv, too_many)
    return nvptx.barrier_any(builder, faulted)


def record_step_fault(builder: ir.IRBuilder, sched: LoweredScheduler, kenv: KernelEnv,
                       too_many: ir.Value, then: Callable[[], None] | None = None) -> ir.Value:
    """Whether this thread faulted in this scheduler step (too many tiles, or a `while` out
    of fuel); if so it records the fault and runs `then`. `loop_fuel` (`codegen.scheduler`)
    left a tank it emptied holding the negated fault code; a refilled one is positive."""
    fuel = builder.load(_fuel_ptr(builder, sched, kenv), typ=i64)
    emptied = builder.trunc(builder.select(builder.icmp_signed("<", fuel, i64(0)),
                                           builder.neg(fuel), i64(0)), i32)
    code = builder.select(too_many, i32(abi.fault_code(abi.TOO_MANY_TILES, "advance")),
                          emptied)
    faulted = builder.icmp_unsigned("!=", code, i32(0))
    with builder.if_then(faulted, likely=False):
        record_fault(builder, workspace_of(builder, sched, kenv), code, sched.scheduler_id)
        if then is not None:
            then()
    return faulted


def num_work(builder: ir.IRBuilder, sched: LoweredScheduler, kenv: KernelEnv) -> ir.Value:
    """ts.num_work() of the launch, in i64 (it cannot wrap)."""
    def field(name: str) -> ir.Value:
        ptr = builder.gep(kenv.ts, [i32(0), i32(TS_FIELDS.index(name))],
                          source_etype=sched.ts_struct)
        return builder.zext(builder.load(ptr, typ=i32), i64)
    return builder.mul(builder.mul(field("max_num_prompt_tiles"), field("num_heads")),
                       field("batch_size"))


def _fuel_ptr(builder: ir.IRBuilder, sched: LoweredScheduler, kenv: KernelEnv) -> ir.Value:
    return builder.gep(kenv.env, [i32(0), i32(ENV_FIELDS.index("fuel"))],
                       source_etype=sched.env_struct)


def refuel(builder: ir.IRBuilder, sched: LoweredScheduler, kenv: KernelEnv) -> None:
    """Fill the tank the `while` loops of the next scheduler step burn (abi.WHILE_SLACK).
    The grid size is read through volatile asm: LLVM would hoist plain reads out of the
    work loop and hold their product live across the tile body (measured: spills)."""
    def grid_dim(axis: str) -> ir.Value:
        return builder.asm(ir.FunctionType(i32, []), f"mov.u32 $0, %nctaid.{axis};", "=r", [],
                           True)
    ctas = builder.zext(builder.mul(builder.mul(grid_dim("x"), grid_dim("y")), grid_dim("z")),
                        i64)
    work = builder.add(num_work(builder, sched, kenv), ctas)
    budget = builder.add(builder.mul(work, i64(abi.WHILE_SLACK)), i64(abi.WHILE_MIN))
    builder.store(budget, _fuel_ptr(builder, sched, kenv))


def workspace_of(builder: ir.IRBuilder, sched: LoweredScheduler, kenv: KernelEnv) -> ir.Value:
    """The workspace (`mhadsl.abi`) the kernel filled its env with."""
    ptr = builder.gep(kenv.env, [i32(0), i32(ENV_FIELDS.index("counter"))],
                      source_etype=sched.env_struct)
    return builder.load(ptr, typ=sched.env_struct.elements[0])


def linear_cta(builder: ir.IRBuilder) -> ir.Value:
    """block_idx.x + grid_dim.x * (block_idx.y + grid_dim.y * block_idx.z)."""
    def reg(group: str, axis: str) -> ir.Value:
        return nvptx.special_register(builder, group, axis)
    return builder.add(reg("block_idx", "x"), builder.mul(reg("grid_dim", "x"), builder.add(
        reg("block_idx", "y"), builder.mul(reg("grid_dim", "y"), reg("block_idx", "z")))))


def record_fault(builder: ir.IRBuilder, workspace: ir.Value, code: ir.Value,
                 scheduler_id: int) -> None:
    """Write the fault record (`abi.RECORD_WORD` on, and the host's copy) unless one is
    there already: the first fault wins until the runtime reports and clears it.

    The tile body sits at ptxas's 255-register cap, where its allocation moves with code
    far from it. Measured on the examples' kernels: the record inlined, or a copy of it
    on the work loop's exit path, or a second copy before the loop, each cost spills in
    the tile body (a copy at the exit: causal d128 spilled 104 B, and at every IR shape);
    one call, not inlined, where every step ends (`work_loop.emit_work_loop`) costs none."""
    builder.call(_fault_recorder(builder.module, workspace.type),
                 [workspace, code, i32(scheduler_id)])


def _fault_recorder(module: ir.Module, workspace_type: ir.Type) -> ir.Function:
    name = "mhadsl.record_fault"
    if name in module.globals:
        return module.globals[name]
    fn = ir.Function(module, ir.FunctionType(nvptx.void, [workspace_type, i32, i32]), name)
    fn.linkage = "internal"
    fn.attributes.add("noinline")
    workspace, code, scheduler_id = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    old = b.cmpxchg(word(b, workspace, abi.RECORD_WORD), i32(0), code, "monotonic",
                    "monotonic")
    with b.if_then(b.extract_value(old, 1)):
        record = (code, scheduler_id, linear_cta(b))
        for k, value in enumerate(record[1:], 1):
            b.store(value, word(b, workspace, abi.RECORD_WORD + k))
        # The host's copy (in mapped host memory), code last, so that a host that sees the
        # code sees the rest: a launch reads it without a copy or a wait (`runtime.driver`).
        host = b.load(word(b, workspace, abi.HOST_RECORD_WORD), typ=i64)
        with b.if_then(b.icmp_unsigned("!=", host, i64(0))):
            for k, order in ((1, "relaxed"), (2, "relaxed"), (0, "release")):
                b.asm(ir.FunctionType(nvptx.void, [i64, i32]),
                      f"st.{order}.sys.global.u32 [$0+{4 * k}], $1;", "l,r",
                      [host, record[k]], True)
    b.ret_void()
    return fn


def word(builder: ir.IRBuilder, words: ir.Value, k: int | ir.Value) -> ir.Value:
    """The address of u32 word `k` of `words` (the workspace, or a record in it)."""
    return builder.gep(words, [i32(k) if isinstance(k, int) else k], source_etype=i32)
