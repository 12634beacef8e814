"""The persistent work loop a kernel runs its tiles in, driving the scheduler's rules
(`codegen.scheduler`): the env and tile summary it fills for them, the work-index slots in
shared memory, and the count of threads out at the kernel's end that resets the queue.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from llvmlite import ir

from mhadsl.codegen import nvptx, warp
from mhadsl.codegen.faults import (
    num_work, record_step_fault, refuel, stop_step, word, workspace_of,
)
from mhadsl.codegen.handoff import Handoff, handoff_step
from mhadsl.codegen.lower import ENV_FIELDS, alloca, record_type
from mhadsl.codegen.nvptx import i1, i32, i64
from mhadsl.codegen.scheduler import LoweredScheduler, load_record
from mhadsl.codegen.trace_records import record_work_item
from mhadsl import abi
from mhadsl.front.semantics import SLOT_COUNT
from mhadsl.front.types import SEQ_INFO, WORK_INFO


@dataclass
class KernelEnv:
    """Pointers to the env and tile-summary structs a kernel built from its params."""

    env: ir.Value
    ts: ir.Value
    slots: ir.Value


@dataclass
class EnvParams:
    """The kernel values the scheduler's env and tile summary are filled from."""

    counter: ir.Value
    num_sms: ir.Value
    ctas_per_sm: ir.Value
    batch_size: ir.Value
    max_num_prompt_tiles: ir.Value
    max_seq_len: ir.Value
    num_heads: ir.Value
    valid_length: ir.Value
    tile_index: ir.Value  # the ragged launch's tile index (`codegen.tile_index`), else null


def _entry_alloca(builder: ir.IRBuilder, ty: ir.Type, name: str) -> ir.AllocaInstr:
    """Allocas go to the entry block, where SROA turns them into registers."""
    entry = builder.function.entry_basic_block
    with builder.goto_block(entry):
        if entry.instructions:
            builder.position_before(entry.instructions[0])
        return alloca(builder, ty, name)


def env_filler(builder: ir.IRBuilder, sched: LoweredScheduler, slots: ir.Value,
               params: Callable[[ir.IRBuilder], EnvParams]) -> Callable[[ir.IRBuilder], KernelEnv]:
    """A function that (re)fills the env and tile summary at the current point.

    The work loop refills them before each scheduler step from `params(builder)`, so a
    kernel can hand over values LLVM may not keep live across its tile body.
    """
    env = _entry_alloca(builder, sched.env_struct, "env")
    ts = _entry_alloca(builder, sched.ts_struct, "ts")

    def fill(b: ir.IRBuilder) -> KernelEnv:
        p = params(b)
        b.store(p.counter, b.gep(env, [i32(0), i32(0)], source_etype=sched.env_struct))
        b.store(p.num_sms, b.gep(env, [i32(0), i32(1)], source_etype=sched.env_struct))
        b.store(p.ctas_per_sm, b.gep(env, [i32(0), i32(ENV_FIELDS.index("ctas_per_sm"))],
                                     source_etype=sched.env_struct))
        for k, v in enumerate((p.batch_size, p.max_num_prompt_tiles, p.max_seq_len,
                               p.num_heads, p.valid_length, p.tile_index)):
            b.store(v, b.gep(ts, [i32(0), i32(k)], source_etype=sched.ts_struct))
        return KernelEnv(env, ts, slots)
    return fill


def shared_slots(module: ir.Module) -> ir.GlobalVariable:
    """The CTA's shared-memory work-index slots (one per pipeline stage)."""
    return nvptx.shared_array(module, "mhadsl.sched_slots", ir.ArrayType(i32, SLOT_COUNT))


# The CTA-wide vote of loops that warp-specialised roles run in their own branches (not
# `aligned`): one flag per step parity, in shared memory. A `barrier.red` that the roles reach
# from their two sites is legal PTX, but compute-sanitizer's synccheck reports it ("divergent
# thread(s) in block", measured on the H200 with a two-branch test kernel); a `barrier.sync`
# with the thread count reached from two sites it accepts.
_VOTE_FLAGS = ir.ArrayType(i32, 2)


def _vote_flags(module: ir.Module) -> ir.GlobalVariable:
    return nvptx.shared_array(module, "mhadsl.role_vote", _VOTE_FLAGS)


def init_role_votes(builder: ir.IRBuilder) -> None:
    """Zero the role vote's flags (`divergent_vote`): one thread, before the CTA barrier that
    precedes the work loops of a kernel whose roles diverge."""
    for k in range(2):
        builder.store(i32(0), builder.gep(_vote_flags(builder.module), [i32(0), i32(k)],
                                          source_etype=_VOTE_FLAGS))


def role_vote_flags(builder: ir.IRBuilder) -> ir.Value:
    """The 32-bit shared address of the role vote's two flags (for a kernel that zeroes them
    in asm: `init_role_votes`)."""
    return builder.ptrtoint(_vote_flags(builder.module), i32)


def divergent_vote(builder: ir.IRBuilder, sched: LoweredScheduler, kenv: KernelEnv,
                   too_many: ir.Value, step: ir.Value) -> ir.Value:
    """`faults.stop_step` for roles that reach the vote from their own branches: a thread
    that faults sets the flag of the step's parity, every thread meets at a non-`.aligned`
    `barrier.sync` (the CTA's thread count) and reads the flag. A flag set at step n stops
    every thread at step n, so it never needs clearing; and no thread writes the flag of
    step n + 2 before every thread has read step n's, as it passes step n + 1's barrier
    first. The flags start at zero (`init_role_votes`)."""
    flag = builder.gep(_vote_flags(builder.module), [i32(0), builder.and_(step, i32(1))],
                       source_etype=_VOTE_FLAGS)
    record_step_fault(builder, sched, kenv, too_many,
                      then=lambda: builder.store(i32(1), flag))
    nvptx.barrier_all(builder, aligned=False)
    return builder.icmp_unsigned("!=", builder.load(flag, typ=i32), i32(0))


def emit_work_loop(builder: ir.IRBuilder, sched: LoweredScheduler,
                   fill_env: Callable[[ir.IRBuilder], KernelEnv],
                   body: Callable[[ir.IRBuilder, dict[str, ir.Value]], None], *,
                   producer: bool = True, sync: str = "ALL", aligned: bool = True,
                   trace_thread: int | None = None, handoff: Handoff | None = None,
                   advance_in_tile: bool = False) -> None:
    """The persistent loop: initial_state, then body per valid tile, advance until none.

    Every thread of the CTA runs it (advance may hold a barrier); `body` gets the tile's
    SeqInfo fields and is skipped for tiles past their sequence's end. The env is filled
    (`fill_env`) before the first rules and again before each advance.

    No scheduler can hang it: a CTA that takes more tiles than all the work of the launch
    plus one, or a step whose `while` loops run out of fuel (`loop_fuel` of
    `codegen.scheduler`), records a fault in the workspace (`codegen.faults`), and a
    CTA-wide vote after each step ends the loop for every thread at once (a fault seen by
    one thread alone must not strand the others at a barrier; where roles run the loop in
    their own branches, not `aligned`, the vote is `divergent_vote`, whose flags the kernel
    zeroes first: `init_role_votes`). No `trap`: the CUDA context stays usable.

    With `trace_thread`, that thread records each tile it runs into the workspace's trace
    buffer (`trace_records.record_work_item`); other threads run exactly what they run
    untraced.

    With `handoff`, this is one role's loop of a warp-specialised kernel whose roles run
    apart (`Handoff`): after the first step (whose vote all roles take together) the steps
    synchronise through the handoff's mbarriers, not CTA-wide.

    With `advance_in_tile`, the body gets the scheduler step as `advance` in its fields and
    takes it once, where it likes (the loop takes it after the body where the body did not),
    and, where the scheduler reads `queue`, the loop counts each thread's exit (`count_exit`)
    at the step that finds no more work, or at the loop's end: a CTA that issues its tile's
    loads first hides the step's atomics under them, where after the tile they added to the
    launch's tail.
    """
    fns = sched.functions
    kenv = fill_env(builder)
    args = (kenv.env, kenv.ts)
    state = alloca(builder, sched.state_struct, "state")
    info = alloca(builder, record_type(WORK_INFO), "work_info")
    seq = alloca(builder, record_type(SEQ_INFO), "seq_info")
    # Advances so far; its low bit is the pipeline_idx of the next one. One counter, so
    # the hang bound adds no register live across the tile body (which sits at the cap).
    taken = alloca(builder, i32, "tiles_taken")
    builder.store(i32(0), taken)
    counts_exits = advance_in_tile and sched.uses_queue
    if counts_exits:
        exit_counted = alloca(builder, i1, "exit_counted")
        builder.store(i1(0), exit_counted)
    else:
        exit_counted = None
    refuel(builder, sched, kenv)
    builder.call(fns["initial_state"], [*args, kenv.slots, state])
    builder.call(fns["get_current_work_info"], [*args, state, info])
    valid = load_record(builder, info, WORK_INFO)["is_valid"]
    entry_bb = builder.block
    first_bb = builder.append_basic_block("first_tile")
    step_bb = builder.append_basic_block("step_done")
    loop_bb = builder.append_basic_block("work")
    exit_bb = builder.append_basic_block("work_done")
    builder.cbranch(valid, first_bb, step_bb)
    builder.position_at_end(first_bb)
    builder.call(fns["unsafe_seq_info"], [*args, state, seq])
    builder.branch(step_bb)
    # Every step (the first rules, each advance) ends here, so the fault record has one
    # place in the kernel: a second copy cost spills in the tile body (see faults.record_fault).
    builder.position_at_end(step_bb)
    has_work = builder.phi(i1)
    has_work.add_incoming(i1(0), entry_bb)
    has_work.add_incoming(i1(1), first_bb)
    too_many = builder.phi(i1)
    too_many.add_incoming(i1(0), entry_bb)
    too_many.add_incoming(i1(0), first_bb)
    stop = stop_step(builder, sched, kenv, too_many) if aligned else \
        divergent_vote(builder, sched, kenv, too_many, builder.load(taken, typ=i32))
    builder.cbranch(builder.and_(has_work, builder.not_(stop)), loop_bb, exit_bb)

    builder.position_at_end(loop_bb)
    fields = load_record(builder, seq, SEQ_INFO)
    is_valid = builder.icmp_unsigned(">", fields["seq_len"], fields["prompt_offset"])
    step = _TileStep(builder, sched, fill_env, state, seq, taken, exit_counted, producer,
                     sync) if advance_in_tile and sched.may_advance else None
    tile_fields = fields if step is None else {**fields, "advance": step}
    with builder.if_then(is_valid):
        if trace_thread is None:
            body(builder, tile_fields)
        else:
            record_work_item(builder, workspace_of(builder, sched, kenv), fields, trace_thread,
                             lambda: body(builder, tile_fields))
    if step is not None:
        more, too_many_now = step.results(builder)
        has_work.add_incoming(more, builder.block)
        too_many.add_incoming(too_many_now, builder.block)
        builder.branch(step_bb)
    elif sched.may_advance and handoff is not None:
        handoff_step(builder, sched, fill_env, state, seq, taken, handoff, loop_bb, exit_bb)
    elif sched.may_advance:
        more, too_many_now, _ = _advance(builder, sched, fill_env, state, seq, taken,
                                         producer, sync)
        has_work.add_incoming(more, builder.block)
        too_many.add_incoming(too_many_now, builder.block)
        builder.branch(step_bb)
    else:
        builder.branch(exit_bb)
    builder.position_at_end(exit_bb)
    if counts_exits:
        with builder.if_then(builder.not_(builder.load(exit_counted, typ=i1))):
            count_exit(builder, workspace_of(builder, sched, fill_env(builder)))


class _TileStep:
    """The scheduler step a tile body takes itself (`emit_work_loop`'s `advance_in_tile`):
    called once on the body's path, it advances and, where no work is left, counts the
    thread's exit; `results` takes it where the body did not and gives (more work, too many
    tiles) for the loop's step."""

    def __init__(self, builder: ir.IRBuilder, sched: LoweredScheduler, fill_env, state, seq,
                 taken, exit_counted, producer: bool, sync: str):
        self.sched, self.fill_env, self.state, self.seq = sched, fill_env, state, seq
        self.taken, self.exit_counted = taken, exit_counted
        self.producer, self.sync = producer, sync
        self.taken_now = _entry_alloca(builder, i1, "step_taken")
        self.more = _entry_alloca(builder, i1, "step_more")
        self.too_many = _entry_alloca(builder, i1, "step_too_many")
        builder.store(i1(0), self.taken_now)

    def __call__(self, b: ir.IRBuilder) -> None:
        b.store(i1(1), self.taken_now)
        more, too_many, kenv = _advance(b, self.sched, self.fill_env, self.state, self.seq,
                                        self.taken, self.producer, self.sync)
        b.store(more, self.more)
        b.store(too_many, self.too_many)
        if self.exit_counted is not None:
            with b.if_then(b.not_(more)):
                count_exit(b, workspace_of(b, self.sched, kenv))
                b.store(i1(1), self.exit_counted)

    def results(self, b: ir.IRBuilder) -> tuple[ir.Value, ir.Value]:
        with b.if_then(b.not_(b.load(self.taken_now, typ=i1))):
            self(b)
        return b.load(self.more, typ=i1), b.load(self.too_many, typ=i1)


def _advance(b: ir.IRBuilder, sched: LoweredScheduler, fill_env, state, seq, taken,
             producer: bool, sync: str) -> tuple[ir.Value, ir.Value, KernelEnv]:
    """One scheduler step of loops that step together: (more work, too many tiles taken,
    the env it was taken with)."""
    kenv = fill_env(b)
    refuel(b, sched, kenv)
    before = b.load(taken, typ=i32)
    more = b.call(sched.functions[sched.advance_name(producer, sync)],
                  [kenv.env, kenv.ts, state, b.and_(before, i32(1)), seq])
    n = b.add(before, i32(1))
    b.store(n, taken)
    return more, b.and_(more, b.icmp_unsigned(">", b.zext(n, i64), num_work(b, sched, kenv))), \
        kenv


def count_exit(builder: ir.IRBuilder, workspace: ir.Value) -> None:
    """Where every thread of a kernel ends: the last thread of the launch out resets the
    queue counter (and this count), so the next launch on the workspace, a CUDA-graph replay
    too, starts from 0 with no memset from the host. A call, not inlined, like the fault
    record: inlined, it cost the sm80 tile body spills (ragged bottom-right causal)."""
    builder.call(_exit_counter(builder.module, workspace.type), [workspace])


def _exit_counter(module: ir.Module, workspace_type: ir.Type) -> ir.Function:
    """Each group of a warp's threads that arrive together adds its size with one atomic,
    after a fence (its queue atomics come before it), so a warp that reconverges costs one."""
    name = "mhadsl.count_exit"
    if name in module.globals:
        return module.globals[name]
    fn = ir.Function(module, ir.FunctionType(nvptx.void, [workspace_type]), name)
    fn.linkage = "internal"
    fn.attributes.add("noinline")
    workspace, = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    mask = warp.active_lanes(b)
    warp.sync_lanes(b, mask)
    popc = b.module.declare_intrinsic("llvm.ctpop", [i32])
    below = b.sub(b.shl(i32(1), nvptx.lane_id(b)), i32(1))  # the lanes below this one
    with b.if_then(b.icmp_unsigned("==", b.and_(mask, below), i32(0))):  # the first lane
        arrived = b.zext(b.call(popc, [mask]), i64)
        dims = [nvptx.special_register(b, group, axis)
                for group in ("grid_dim", "block_dim") for axis in "xyz"]
        threads = b.zext(dims[0], i64)
        for d in dims[1:]:
            threads = b.mul(threads, b.zext(d, i64))
        exited = word(b, workspace, abi.EXITED_WORD)
        fence = ir.FunctionType(nvptx.void, [])
        b.asm(fence, "fence.acq_rel.gpu;", "", [], True)  # (LLVM drops an atomic's ordering)
        before = b.atomic_rmw("add", exited, arrived, "monotonic")
        with b.if_then(b.icmp_unsigned("==", b.add(before, arrived), threads)):
            b.asm(fence, "fence.acq_rel.gpu;", "", [], True)
            b.atomic_rmw("xchg", word(b, workspace, abi.COUNTER_WORD), i32(0), "monotonic")
            b.atomic_rmw("xchg", exited, i64(0), "monotonic")
    b.ret_void()
    return fn
