"""The producer/consumer handoff of work indices: warp-specialised roles whose work loops
run apart (`Handoff`) pass each step through mbarriers and a stop word in shared memory,
with a memo of the producer's decoding of the step; which schedulers may run so
(`runs_apart`); and one role's scheduler step (`handoff_step`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from llvmlite import ir

from mhadsl.codegen import nvptx
from mhadsl.codegen.faults import num_work, record_step_fault, refuel
from mhadsl.codegen.nvptx import i32, i64
from mhadsl.front import ast
from mhadsl.front.check import CheckedProgram

if TYPE_CHECKING:  # annotations only: the rules import the memo from here
    from mhadsl.codegen.scheduler import LoweredScheduler


@dataclass(frozen=True)
class Handoff:
    """Warp-specialised roles whose work loops run apart (one side of the handoff each).

    The producer's loop takes each next work index (`advance` with producer = true, its
    barrier among the producer's threads), then publishes the step on mbarrier `full[p]`
    (p = the step's pipeline_idx); the consumers' loop waits there and then runs its own
    `advance` (producer = false, no barrier), which reads the index from slot p, and frees the
    slot on `empty[p]`. With two slots the producer runs up to one work tile ahead: it loads
    the next tile while the consumers finish this one. A producer that faults records it,
    writes the step it stopped at (plus one) into the stop word and publishes; the consumers
    stop at that step, and not earlier: the producer's threads other than the loader may
    fault a step ahead of the step the consumers are taking. Only schedulers
    whose `advance` has no `while` (a consumer loop can then not fault alone and strand the
    producer at a full pipeline) and touches no slot but `slots[pipeline_idx]` run apart
    (`runs_apart`). Others run in lock-step."""

    role: str  # "producer" or "consumer"
    producer_threads: int
    consumer_threads: int


_HANDOFF_WORDS = ir.ArrayType(i64, 5)  # mbarriers full[0..1], empty[0..1]; the stop word


def _handoff_state(module: ir.Module) -> ir.GlobalVariable:
    return nvptx.shared_array(module, "mhadsl.sched_handoff", _HANDOFF_WORDS)


def _handoff_word(builder: ir.IRBuilder, k: int | ir.Value) -> ir.Value:
    k = i32(k) if isinstance(k, int) else k
    return builder.gep(_handoff_state(builder.module), [i32(0), k], source_etype=_HANDOFF_WORDS)


def _handoff_barrier(builder: ir.IRBuilder, which: str, step: ir.Value) -> ir.Value:
    first = {"full": 0, "empty": 2}[which]
    return _handoff_word(builder, builder.add(i32(first), builder.and_(step, i32(1))))


# The handoff's memo: per pipeline slot and pure builtin, the producer's decoding of its
# step (`memoized` of `codegen.scheduler`): a flag, the key words, the value words. The
# builtins are functions of the launch alone, so a consumer that asks for the same key may
# take the producer's values: on a ragged batch of short sequences, decoding a work index (a
# search over the tile index, then the sequence's offsets) took a quarter of a
# consumer's time per tile. Published before the producer's arrival on `full[p]`, read
# before the consumers' on `empty[p]`, so no entry changes while it is read (as the slot
# itself).
_MEMO_ENTRIES = {"valid_work_info": (3, 4), "seq_extent": (1, 2)}  # key, value words


def _memo_array(module: ir.Module, name: str) -> tuple[ir.GlobalVariable, ir.ArrayType]:
    keys, values = _MEMO_ENTRIES[name]
    ty = ir.ArrayType(i32, 2 * (1 + keys + values))
    return nvptx.shared_array(module, f"mhadsl.memo.{name}", ty), ty


def memo_words(builder: ir.IRBuilder, name: str, slot: ir.Value) -> Callable[[int], ir.Value]:
    """word(k): the k-th word of `name`'s memo entry in pipeline slot `slot`."""
    array, ty = _memo_array(builder.module, name)
    keys, values = _MEMO_ENTRIES[name]
    first = builder.mul(builder.and_(slot, i32(1)), i32(1 + keys + values))
    return lambda k: builder.gep(array, [i32(0), builder.add(first, i32(k))], source_etype=ty)


def init_handoff(builder: ir.IRBuilder, producer_threads: int, consumer_threads: int) -> None:
    """Thread 0 initialises the handoff's mbarriers, stop word and memo flags; the kernel
    then fences the mbarrier init and runs a CTA barrier before the roles split (as for its
    own)."""
    from mhadsl.codegen import hopper
    for k in range(2):
        hopper.mbarrier_init(builder, _handoff_word(builder, k), producer_threads)
        hopper.mbarrier_init(builder, _handoff_word(builder, 2 + k), consumer_threads)
    builder.store(i64(0), _handoff_word(builder, 4))
    for name in _MEMO_ENTRIES:
        for slot in range(2):
            builder.store(i32(0), memo_words(builder, name, i32(slot))(0))


def runs_apart(program: CheckedProgram, decl: ast.SchedulerDecl) -> bool:
    """Whether the scheduler's roles may run apart (`Handoff`): no `while` in its advance
    nor in the functions it calls, and no slot but this step's, `slots[pipeline_idx]`, in
    its advance: running apart, the producer writes the next step's slot while the
    consumers read this step's, so a step that touches any other slot could race."""
    advance = next(r for r in decl.rules if r.name == "advance")
    this_step = advance.params[2].name
    stack, seen = [(advance, False)], set()
    while stack:
        node, in_fn = stack.pop()
        if isinstance(node, ast.While):
            return False
        if isinstance(node, ast.Index) and (in_fn or not (
                isinstance(node.index, ast.Name) and node.index.id == this_step)):
            return False
        if isinstance(node, ast.Let) and node.name == this_step:  # shadowed
            return False
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in program.fns and node.func.id not in seen:
            seen.add(node.func.id)
            stack.append((program.fns[node.func.id], True))
        stack.extend((child, in_fn) for child in ast.children(node))
    return True


def handoff_step(builder: ir.IRBuilder, sched: LoweredScheduler, fill_env, state, seq,
                  taken, handoff: Handoff, loop_bb, exit_bb) -> None:
    """One role's scheduler step of loops that run apart (`Handoff`); continues at
    `loop_bb` with the next tile, else at `exit_bb`."""
    from mhadsl.codegen import hopper
    b = builder
    kenv = fill_env(b)
    refuel(b, sched, kenv)
    step = b.load(taken, typ=i32)
    use_parity = b.and_(b.lshr(step, i32(1)), i32(1))  # the slot's use count, mod 2
    n = b.add(step, i32(1))
    stop_word = _handoff_word(b, 4)  # 0, or the step a producer thread stopped at, plus one
    if handoff.role == "producer":
        hopper.mbarrier_wait(b, _handoff_barrier(b, "empty", step), b.xor(use_parity, i32(1)))
        more = b.call(sched.functions[sched.advance_name(True, "PRODUCER")],
                      [kenv.env, kenv.ts, state, b.and_(step, i32(1)), seq])
        b.store(n, taken)
        too_many = b.and_(more, b.icmp_unsigned(">", b.zext(n, i64),
                                                num_work(b, sched, kenv)))
        faulted = record_step_fault(b, sched, kenv, too_many,
                                     then=lambda: b.store(b.zext(n, i64), stop_word))
        hopper.mbarrier_arrive(b, _handoff_barrier(b, "full", step))
        b.cbranch(b.and_(more, b.not_(faulted)), loop_bb, exit_bb)
        return
    hopper.mbarrier_wait(b, _handoff_barrier(b, "full", step), use_parity)
    go_on = b.function.append_basic_block("handoff_go_on")
    # the stop word may already hold a later step than this one (see `Handoff`)
    stopped = b.icmp_unsigned("==", b.load(stop_word, typ=i64), b.zext(n, i64))
    b.cbranch(stopped, exit_bb, go_on)
    b.position_at_end(go_on)
    more = b.call(sched.functions[sched.advance_name(False, "NONE")],
                  [kenv.env, kenv.ts, state, b.and_(step, i32(1)), seq])
    b.store(n, taken)
    hopper.mbarrier_arrive(b, _handoff_barrier(b, "empty", step))
    b.cbranch(more, loop_bb, exit_bb)
