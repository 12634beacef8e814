"""Scheduler rules -> LLVM functions, the per-CTA work loop, and the trace kernel.

Each rule of a scheduler specialisation becomes one function with a fixed ABI, the same
on every target (pointers to structs laid out in `codegen.lower`):

    grid_dim(env*, ts*, i32 batch_size, i32 max_num_prompt_tiles, [3 x i32]* out)  host only
    initial_state(env*, ts*, slots*, State* out)
    get_current_work_info(env*, ts*, State*, WorkInfo* out)
    advance.<producer>.<sync>(env*, ts*, State*, i32 pipeline_idx, SeqInfo* out) -> i1
    unsafe_seq_info(env*, ts*, State*, SeqInfo* out)

On the GPU they are internal and always inlined into a kernel; on the host they are
exported for the simulator, which calls them through ctypes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from llvmlite import ir

from mhadsl.codegen import nvptx, warp
from mhadsl.codegen.lower import (
    ENV_FIELDS, TS_FIELDS, alloca, load, Builtins, FunctionLowering, env_type, record_type,
    state_type, ts_type,
)
from mhadsl.codegen.nvptx import i1, i8, i32, i64
from mhadsl.codegen.target import Target
from mhadsl import abi, ast
from mhadsl.builtins import SLOT_COUNT
from mhadsl.check import CheckedProgram
from mhadsl.diagnostics import MhaError
from mhadsl.types import BOOL, RECORD_FIELDS, SCHEDULES, SEQ_INFO, SYNCS, U32, WORK_INFO

HOST_LOOP_FUEL = 1 << 20  # iterations a host `while` may run before the simulator gives up


@dataclass(frozen=True)
class SchedulerSpec:
    """One specialisation of a scheduler: its name, bound parameters, the tile height
    (`tile_m`) and the query heads per K/V head (`gqa_group`), both constants of the build.

    `args` maps parameter names to Python values (int, bool, or a Schedule name).
    """

    name: str
    args: tuple[tuple[str, object], ...] = ()
    tile_m: int = 128
    gqa_group: int = 1

    def arg_dict(self) -> dict[str, object]:
        return dict(self.args)


def const_eval(e: ast.Expr, program: CheckedProgram, args: dict[str, object],
               decl: ast.SchedulerDecl) -> object:
    """Evaluate a compile-time constant (may_advance, a parameter's default)."""
    if isinstance(e, (ast.BoolLit, ast.IntLit)):
        return e.value
    if isinstance(e, ast.Name):
        if e.id in SCHEDULES:
            return e.id
        params = {p.name: p for p in decl.params}
        if e.id in args:
            return args[e.id]
        if e.id in params and params[e.id].default is not None:
            return const_eval(params[e.id].default, program, args, decl)
    if isinstance(e, ast.Unary) and e.op == "!":
        return not const_eval(e.operand, program, args, decl)
    raise MhaError("this must be a compile-time constant here", e.span)


class _TargetBuiltins(Builtins):
    def __init__(self, target: Target, producer: bool, sync: int, producer_threads: int,
                 rule: str = "initial_state", scheduler_id: int = 0,
                 aligned_barriers: bool = True, memo: str | None = None):
        self.target = target
        self.memo = memo  # "publish", "reuse" or None: this step's decoding (`memoized`)
        self.aligned_barriers = aligned_barriers  # see nvptx.barrier_all
        self.gpu = target.is_gpu
        self.producer, self.sync, self.producer_threads = producer, sync, producer_threads
        self.rule, self.scheduler_id = rule, scheduler_id  # named by a fault record
        self.reads_queue = False  # whether a rule lowered with these builtins read `queue`
        space = nvptx.SHARED if target.is_gpu else nvptx.GENERIC
        gspace = nvptx.GLOBAL if target.is_gpu else nvptx.GENERIC
        self.state_struct = state_type(space)
        self.ts_struct = ts_type(gspace)
        self.env_struct = env_type(gspace)

    def env_field(self, lower: FunctionLowering, name: str, axis: int | None = None):
        idx = [i32(0), i32(ENV_FIELDS.index(name))] + ([i32(axis)] if axis is not None else [])
        return lower.b.gep(lower.bindings["env"], idx, source_etype=self.env_struct)

    def value(self, lower: FunctionLowering, name: str):
        if name in ("num_sms", "ctas_per_sm"):
            return lower.b.load(self.env_field(lower, name), typ=i32)
        if name == "num_heads":
            return lower.ts_field(lower.bindings["ts"], "num_heads")
        if name == "queue":
            self.reads_queue = True
            return lower.b.load(self.env_field(lower, "counter"), typ=self.env_struct.elements[0])
        if name == "producer":
            return i1(int(self.producer))
        assert name == "sync"
        return i32(self.sync)

    def dim3(self, lower: FunctionLowering, group: str, axis: str):
        if self.target.is_gpu:
            return nvptx.special_register(lower.b, group, axis)
        return lower.b.load(self.env_field(lower, group, "xyz".index(axis)), typ=i32)

    def barrier(self, lower: FunctionLowering, sync: int) -> None:
        if not self.target.is_gpu or SYNCS[sync] == "NONE":
            return  # the host simulates one thread per CTA: nothing to wait for
        if SYNCS[sync] == "ALL" or self.producer_threads == 0:
            nvptx.barrier_all(lower.b, self.aligned_barriers)
        else:
            # not .aligned where the roles diverge: the producer's first thread may come
            # from its loads while the rest of its warp waits here
            nvptx.barrier_named(lower.b, nvptx.PRODUCER_BARRIER, self.producer_threads,
                                aligned=self.aligned_barriers)

    def memoized(self, lower: FunctionLowering, name: str, key: list[ir.Value],
                 compute: Callable[[], dict[str, ir.Value]]) -> dict[str, ir.Value]:
        """The handoff's memo of this step's decoding (`_MEMO_ENTRIES`): in the producer's
        advance its first thread publishes the key and values; a consumer's advance takes
        them where its key is the same, else computes its own."""
        slot = lower.bindings.get("pipeline_idx")
        if self.memo is None or slot is None:
            return compute()
        b = lower.b
        word = _memo_words(b, name, slot)
        keys = len(key)
        if self.memo == "publish":
            values = compute()
            first = b.icmp_unsigned("==", nvptx.special_register(b, "thread_idx", "x"), i32(0))
            with b.if_then(first):
                for k, v in enumerate(key + [b.zext(x, i32) if x.type == i1 else x
                                             for x in values.values()]):
                    b.store(v, word(1 + k))
                b.store(i32(1), word(0))  # the entry holds a key
            return values
        hit = b.icmp_unsigned("!=", b.load(word(0), typ=i32), i32(0))
        for k, v in enumerate(key):
            hit = b.and_(hit, b.icmp_unsigned("==", b.load(word(1 + k), typ=i32), v))
        hit_bb, miss_bb, done_bb = (b.append_basic_block(f"memo.{name}.{x}")
                                    for x in ("hit", "miss", "done"))
        b.cbranch(hit, hit_bb, miss_bb)
        b.position_at_end(miss_bb)
        computed = compute()
        miss_end = b.block
        b.branch(done_bb)
        b.position_at_end(hit_bb)
        published = {}
        for k, (field, v) in enumerate(computed.items()):
            stored = b.load(word(1 + keys + k), typ=i32)
            published[field] = b.trunc(stored, i1) if v.type == i1 else stored
        b.branch(done_bb)
        b.position_at_end(done_bb)
        return dict(zip(computed, warp.merge(b, list(computed.values()), miss_end,
                                             [published[f] for f in computed], hit_bb)))

    def loop_fuel(self, lower: FunctionLowering):
        # Every iteration burns fuel, so a loop that never ends stops: on the host the
        # simulator reports it; on the GPU the iteration that empties the tank leaves the
        # negated fault code in it, which the work loop (`emit_work_loop`, which fills the
        # tank before each step) records where the step ends, the record's one place in a
        # kernel (a second one costs the tile body spills: see `record_fault`).
        b = lower.b
        fuel_ptr = self.env_field(lower, "fuel")
        fuel = b.load(fuel_ptr, typ=i64)
        left = b.sub(fuel, i64(1))
        if self.target.is_gpu:
            code = abi.fault_code(abi.ENDLESS_WHILE, self.rule)
            left = b.select(b.icmp_signed(">", fuel, i64(1)), left,
                            b.select(b.icmp_signed("==", fuel, i64(1)), i64(-code), fuel))
        b.store(left, fuel_ptr)
        return b.icmp_signed(">", left, i64(0))


@dataclass
class LoweredScheduler:
    spec: SchedulerSpec
    decl: ast.SchedulerDecl
    may_advance: bool
    functions: dict[str, ir.Function]
    env_struct: ir.LiteralStructType
    ts_struct: ir.LiteralStructType
    state_struct: ir.LiteralStructType
    scheduler_id: int  # what a fault record names it by (`abi.scheduler_id`)
    # whether a rule reads `queue` (an atomic_add on the workspace counter): only then does
    # a kernel count its threads out (`count_exit`) so that the last resets the counter;
    # the count's fence and atomics lengthen every CTA's tail (about 1.3 us a decode call)
    uses_queue: bool

    def advance_name(self, producer: bool, sync: str) -> str:
        return f"advance.{int(producer)}.{sync}"


def lower_scheduler(module: ir.Module, program: CheckedProgram, spec: SchedulerSpec,
                    target: Target, *, advance_variants=((True, "ALL"),),
                    producer_threads: int = 0, aligned_barriers: bool = True,
                    handoff: bool = False, zero_after_none: bool = True) -> LoweredScheduler:
    """Emit the rule functions of one scheduler specialisation into `module` (`handoff`:
    for one role of loops that run apart, whose advance shares the producer's decoding;
    `zero_after_none`: an advance that returns none stores a zero SeqInfo, else leaves it
    undefined)."""
    decl = program.schedulers.get(spec.name)
    if decl is None:
        raise MhaError(f"no scheduler named '{spec.name}' (declared: "
                       f"{', '.join(program.schedulers) or 'none'})")
    args = spec.arg_dict()
    params = {p.name: p for p in decl.params}
    for name, value in args.items():
        if name not in params:
            raise MhaError(f"scheduler '{spec.name}' has no parameter '{name}' (it has: "
                           f"{', '.join(params) or 'none'})", decl.span)
        _check_argument(spec.name, params[name], value)
    constants = {c.name: c for c in decl.constants}
    may_advance = bool(const_eval(constants["may_advance"].value, program, args, decl))
    rules = {r.name: r for r in decl.rules}
    prefix = f"{spec.name}.{spec.tile_m}.{spec.gqa_group}." + ".".join(
        f"{k}={v}" for k, v in spec.args)
    functions: dict[str, ir.Function] = {}
    lowered_with: list[_TargetBuiltins] = []

    sid = abi.scheduler_id(spec.name)

    def emit(rule_name: str, fn_name: str, producer: bool = True, sync: str = "ALL"):
        memo = ("publish" if producer else "reuse") if handoff and rule_name == "advance" \
            else None
        builtins = _TargetBuiltins(target, producer, SYNCS.index(sync), producer_threads,
                                   rule_name, sid, aligned_barriers, memo)
        lowered_with.append(builtins)
        rule = rules[rule_name]
        roles = program.rule_roles[rule]
        slot_space = nvptx.SHARED if target.is_gpu else nvptx.GENERIC
        role_types = {"ts": nvptx.ptr(), "state": nvptx.ptr(), "slots": nvptx.ptr(slot_space),
                      "batch_size": i32, "max_num_prompt_tiles": i32, "max_seq_len": i32,
                      "pipeline_idx": i32}
        arg_roles = ["env", "ts"] + [r for r in roles if r != "ts"] + ["out"]
        ret = i1 if rule_name == "advance" else nvptx.void
        fnty = ir.FunctionType(ret, [role_types.get(r, nvptx.ptr()) for r in arg_roles])
        fn = ir.Function(module, fnty, name=f"{prefix}{fn_name}")
        if target.is_gpu:
            fn.linkage = "internal"
            fn.attributes.add("alwaysinline")
        builder = ir.IRBuilder(fn.append_basic_block("entry"))
        bindings = dict(zip(arg_roles, fn.args))
        lower = FunctionLowering(builder, program, builtins, bindings, tile_m=spec.tile_m,
                                 gqa_group=spec.gqa_group)
        lower.param_values = _param_thunks(lower, decl, args)
        returned_none = lower.entry_alloca(i1, "is_none") if rule_name == "advance" else None
        if returned_none is not None:
            builder.store(i1(0), returned_none)
            lower.on_return = lambda s: builder.store(
                i1(int(isinstance(s.value, ast.NoneLit))), returned_none)
        result_ty = {"grid_dim": None, "advance": SEQ_INFO, "initial_state": None,
                     "get_current_work_info": WORK_INFO, "unsafe_seq_info": SEQ_INFO,
                     "kv_splits": U32}[rule_name]
        slot = _lower_rule_body(lower, rule, rule_name, result_ty, bindings["out"],
                                builtins)
        if rule_name == "advance":
            # `return none` sets no SeqInfo: zeros then, not undefined values, which would
            # keep the caller's registers of the last tile's SeqInfo live across its body
            none = load(builder, returned_none)
            _store_record(builder, slot, SEQ_INFO, bindings["out"],
                          zero_if=none if zero_after_none else None)
            builder.ret(builder.not_(none))
        elif result_ty == U32:
            builder.store(lower.load_value(slot), bindings["out"])
            builder.ret_void()
        else:
            if result_ty is not None:
                _store_record(builder, slot, result_ty, bindings["out"])
            builder.ret_void()
        functions[fn_name] = fn

    if not target.is_gpu:
        emit("grid_dim", "grid_dim")
        if "kv_splits" in rules:
            emit("kv_splits", "kv_splits")
    emit("initial_state", "initial_state")
    emit("get_current_work_info", "get_current_work_info")
    emit("unsafe_seq_info", "unsafe_seq_info")
    for producer, sync in advance_variants:
        emit("advance", f"advance.{int(producer)}.{sync}", producer, sync)
    b0 = _TargetBuiltins(target, True, 0, producer_threads)
    return LoweredScheduler(spec, decl, may_advance, functions, b0.env_struct, b0.ts_struct,
                            b0.state_struct, sid,
                            any(builtins.reads_queue for builtins in lowered_with))


def _check_argument(scheduler: str, param: ast.Param, value: object) -> None:
    """A bound parameter must be a constant of the parameter's type."""
    kind = param.type.name
    ok = {"bool": isinstance(value, bool),
          "Schedule": value in SCHEDULES,
          "u32": isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32,
          "i32": isinstance(value, int) and not isinstance(value, bool)
          and -2**31 <= value < 2**31}.get(kind, False)
    if not ok:
        expected = {"Schedule": f"one of {', '.join(SCHEDULES)}"}.get(kind, f"a {kind}")
        raise MhaError(f"parameter '{param.name}' of scheduler '{scheduler}' takes {expected}, "
                       f"got {value!r}", param.span)


def _param_thunks(lower: FunctionLowering, decl: ast.SchedulerDecl,
                  args: dict[str, object]) -> dict[str, Callable]:
    """Scheduler parameters and constants, lowered where they are used."""
    thunks: dict[str, Callable] = {}
    for p in decl.params:
        if p.name in args:
            value = args[p.name]
            const = (i32(SCHEDULES.index(value)) if p.type.name == "Schedule"
                     else i1(int(value)) if p.type.name == "bool" else i32(int(value) & 0xFFFFFFFF))
            thunks[p.name] = lambda c=const: c
        else:
            thunks[p.name] = lambda e=p.default: lower.expr(e)
    for c in decl.constants:
        thunks[c.name] = lambda e=c.value: lower.expr(e)
    return thunks


def _lower_rule_body(lower: FunctionLowering, rule: ast.Rule, rule_name: str, result_ty,
                     out: ir.Value, builtins: _TargetBuiltins):
    if rule_name == "grid_dim":
        # The result is a tuple; store its items into out[0..2] at the return.
        values = [lower.entry_alloca(i32) for _ in range(3)]
        for v in values:
            lower.b.store(i32(1), v)
        original = lower.stmt

        def stmt(s):
            if isinstance(s, ast.Return):
                items = lower.expr(s.value)
                for slot, item in zip(values, items):
                    lower.b.store(item, slot)
                lower.b.branch(lower.ret_block)
            else:
                original(s)
        lower.stmt = stmt
        lower.lower_body(rule.body, None)
        for k, slot in enumerate(values):
            lower.b.store(load(lower.b, slot), lower.b.gep(out, [i32(k)], source_etype=i32))
        return None
    if rule_name == "initial_state":
        original = lower.stmt

        def stmt(s):
            if isinstance(s, ast.Return):
                src = lower.expr(s.value)
                lower.b.store(lower.b.load(src, typ=builtins.state_struct), out)
                lower.b.branch(lower.ret_block)
            else:
                original(s)
        lower.stmt = stmt
        lower.lower_body(rule.body, None)
        return None
    return lower.lower_body(rule.body, result_ty)


def _store_record(builder: ir.IRBuilder, slot: dict, ty, out: ir.Value,
                  zero_if: ir.Value | None = None) -> None:
    struct = record_type(ty)
    for k, (field, field_ty) in enumerate(RECORD_FIELDS[ty].items()):
        value = load(builder, slot[field])
        if field_ty == BOOL:
            value = builder.zext(value, i8)
        if zero_if is not None:
            value = builder.select(zero_if, ir.Constant(value.type, 0), value)
        builder.store(value, builder.gep(out, [i32(0), i32(k)], source_etype=struct))


def load_record(builder: ir.IRBuilder, ptr: ir.Value, ty) -> dict[str, ir.Value]:
    struct = record_type(ty)
    values = {}
    for k, (field, field_ty) in enumerate(RECORD_FIELDS[ty].items()):
        v = builder.load(builder.gep(ptr, [i32(0), i32(k)], source_etype=struct),
                         typ=struct.elements[k])
        values[field] = builder.trunc(v, i1) if field_ty == BOOL else v
    return values


# ---------------------------------------------------------------------- GPU side
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
# step (`_TargetBuiltins.memoized`): a flag, the key words, the value words. The builtins are
# functions of the launch alone, so a consumer that asks for the same key may take the
# producer's values: on a ragged batch of short sequences, decoding a work index (a binary
# search over the tile index, then the sequence's offsets) took a quarter of a consumer's time
# per tile. Published before the producer's arrival on `full[p]`, read before the consumers'
# on `empty[p]`, so no entry changes while it is read (as the slot itself).
_MEMO_ENTRIES = {"valid_work_info": (3, 4), "seq_extent": (1, 2)}  # key, value words


def _memo_array(module: ir.Module, name: str) -> tuple[ir.GlobalVariable, ir.ArrayType]:
    keys, values = _MEMO_ENTRIES[name]
    ty = ir.ArrayType(i32, 2 * (1 + keys + values))
    return nvptx.shared_array(module, f"mhadsl.memo.{name}", ty), ty


def _memo_words(builder: ir.IRBuilder, name: str, slot: ir.Value) -> Callable[[int], ir.Value]:
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
            builder.store(i32(0), _memo_words(builder, name, i32(slot))(0))


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
    plus one, or a step whose `while` loops run out of fuel (`loop_fuel`), records a fault
    in the workspace (`mhadsl.abi`), and a CTA-wide vote after each step ends the loop
    for every thread at once (a fault seen by one thread alone must not strand the others
    at a barrier). No `trap`: the CUDA context stays usable.

    With `trace_thread`, that thread records each tile it runs into the workspace's trace
    buffer (`record_work_item`); other threads run exactly what they run untraced.

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
    _refuel(builder, sched, kenv)
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
    # place in the kernel: a second copy cost spills in the tile body (see record_fault).
    builder.position_at_end(step_bb)
    has_work = builder.phi(i1)
    has_work.add_incoming(i1(0), entry_bb)
    has_work.add_incoming(i1(1), first_bb)
    too_many = builder.phi(i1)
    too_many.add_incoming(i1(0), entry_bb)
    too_many.add_incoming(i1(0), first_bb)
    stop = _stop_step(builder, sched, kenv, too_many, aligned)
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
            record_work_item(builder, _workspace(builder, sched, kenv), fields, trace_thread,
                             lambda: body(builder, tile_fields))
    if step is not None:
        more, too_many_now = step.results(builder)
        has_work.add_incoming(more, builder.block)
        too_many.add_incoming(too_many_now, builder.block)
        builder.branch(step_bb)
    elif sched.may_advance and handoff is not None:
        _handoff_step(builder, sched, fill_env, state, seq, taken, handoff, loop_bb, exit_bb)
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
            count_exit(builder, _workspace(builder, sched, fill_env(builder)))


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
                count_exit(b, _workspace(b, self.sched, kenv))
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
    _refuel(b, sched, kenv)
    before = b.load(taken, typ=i32)
    more = b.call(sched.functions[sched.advance_name(producer, sync)],
                  [kenv.env, kenv.ts, state, b.and_(before, i32(1)), seq])
    n = b.add(before, i32(1))
    b.store(n, taken)
    return more, b.and_(more, b.icmp_unsigned(">", b.zext(n, i64), _num_work(b, sched, kenv))), \
        kenv


def _handoff_step(builder: ir.IRBuilder, sched: LoweredScheduler, fill_env, state, seq,
                  taken, handoff: Handoff, loop_bb, exit_bb) -> None:
    """One role's scheduler step of loops that run apart (`Handoff`); continues at
    `loop_bb` with the next tile, else at `exit_bb`."""
    from mhadsl.codegen import hopper
    b = builder
    kenv = fill_env(b)
    _refuel(b, sched, kenv)
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
                                                _num_work(b, sched, kenv)))
        faulted = _record_step_fault(b, sched, kenv, too_many,
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


def _stop_step(builder: ir.IRBuilder, sched: LoweredScheduler, kenv: KernelEnv,
               too_many: ir.Value, aligned: bool) -> ir.Value:
    """Whether any thread of the CTA stops after this scheduler step (a CTA-wide vote); a
    thread that stops records why first."""
    faulted = _record_step_fault(builder, sched, kenv, too_many)
    return nvptx.barrier_any(builder, faulted, aligned)


def _record_step_fault(builder: ir.IRBuilder, sched: LoweredScheduler, kenv: KernelEnv,
                       too_many: ir.Value, then: Callable[[], None] | None = None) -> ir.Value:
    """Whether this thread faulted in this scheduler step (too many tiles, or a `while` out
    of fuel); if so it records the fault and runs `then`. `loop_fuel` left a tank it emptied
    holding the negated fault code; a refilled one is positive."""
    fuel = builder.load(_fuel_ptr(builder, sched, kenv), typ=i64)
    emptied = builder.trunc(builder.select(builder.icmp_signed("<", fuel, i64(0)),
                                           builder.neg(fuel), i64(0)), i32)
    code = builder.select(too_many, i32(abi.fault_code(abi.TOO_MANY_TILES, "advance")),
                          emptied)
    faulted = builder.icmp_unsigned("!=", code, i32(0))
    with builder.if_then(faulted, likely=False):
        record_fault(builder, _workspace(builder, sched, kenv), code, sched.scheduler_id)
        if then is not None:
            then()
    return faulted


def _num_work(builder: ir.IRBuilder, sched: LoweredScheduler, kenv: KernelEnv) -> ir.Value:
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


def _refuel(builder: ir.IRBuilder, sched: LoweredScheduler, kenv: KernelEnv) -> None:
    """Fill the tank the `while` loops of the next scheduler step burn (abi.WHILE_SLACK).
    The grid size is read through volatile asm: LLVM would hoist plain reads out of the
    work loop and hold their product live across the tile body (measured: spills)."""
    def grid_dim(axis: str) -> ir.Value:
        return builder.asm(ir.FunctionType(i32, []), f"mov.u32 $0, %nctaid.{axis};", "=r", [],
                           True)
    ctas = builder.zext(builder.mul(builder.mul(grid_dim("x"), grid_dim("y")), grid_dim("z")),
                        i64)
    work = builder.add(_num_work(builder, sched, kenv), ctas)
    budget = builder.add(builder.mul(work, i64(abi.WHILE_SLACK)), i64(abi.WHILE_MIN))
    builder.store(budget, _fuel_ptr(builder, sched, kenv))


def _workspace(builder: ir.IRBuilder, sched: LoweredScheduler, kenv: KernelEnv) -> ir.Value:
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
    one call, not inlined, where every step ends (`emit_work_loop`) costs none."""
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
    old = b.cmpxchg(_word(b, workspace, abi.RECORD_WORD), i32(0), code, "monotonic",
                    "monotonic")
    with b.if_then(b.extract_value(old, 1)):
        record = (code, scheduler_id, linear_cta(b))
        for k, value in enumerate(record[1:], 1):
            b.store(value, _word(b, workspace, abi.RECORD_WORD + k))
        # The host's copy (in mapped host memory), code last, so that a host that sees the
        # code sees the rest: a launch reads it without a copy or a wait (`runtime.driver`).
        host = b.load(_word(b, workspace, abi.HOST_RECORD_WORD), typ=i64)
        with b.if_then(b.icmp_unsigned("!=", host, i64(0))):
            for k, order in ((1, "relaxed"), (2, "relaxed"), (0, "release")):
                b.asm(ir.FunctionType(nvptx.void, [i64, i32]),
                      f"st.{order}.sys.global.u32 [$0+{4 * k}], $1;", "l,r",
                      [host, record[k]], True)
    b.ret_void()
    return fn


def _word(builder: ir.IRBuilder, words: ir.Value, k: int | ir.Value) -> ir.Value:
    """The address of u32 word `k` of `words` (the workspace, or a record in it)."""
    return builder.gep(words, [i32(k) if isinstance(k, int) else k], source_etype=i32)


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
        exited = _word(b, workspace, abi.EXITED_WORD)
        fence = ir.FunctionType(nvptx.void, [])
        b.asm(fence, "fence.acq_rel.gpu;", "", [], True)  # (LLVM drops an atomic's ordering)
        before = b.atomic_rmw("add", exited, arrived, "monotonic")
        with b.if_then(b.icmp_unsigned("==", b.add(before, arrived), threads)):
            b.asm(fence, "fence.acq_rel.gpu;", "", [], True)
            b.atomic_rmw("xchg", _word(b, workspace, abi.COUNTER_WORD), i32(0), "monotonic")
            b.atomic_rmw("xchg", exited, i64(0), "monotonic")
    b.ret_void()
    return fn


def record_work_item(builder: ir.IRBuilder, workspace: ir.Value, fields: dict[str, ir.Value],
                     thread: int, emit_body: Callable[[], None],
                     kind: int = abi.TRACE_WORK_ITEM) -> None:
    """Emit `emit_body()` between the two halves of a record (`abi.TRACE_FIELDS`, decoded by
    `runtime.trace_records`) of `kind`, which thread `thread` of the CTA writes: before the
    body it claims a record, writes the tile, CTA, SM and %globaltimer there and keeps the
    record's address and start time in shared memory (so no register stays live across the
    tile body, which sits at ptxas's register cap); after it, the duration
    (`end_record`, unless the body ended the record itself)."""
    b = builder
    scratch = _trace_scratch(b.module)
    gptr = workspace.type

    with b.if_then(_is_recorder(b, thread)):
        k = b.atomic_rmw("add", _word(b, workspace, abi.TRACE_COUNT_WORD), i32(1), "monotonic")
        fits = b.icmp_unsigned("<", k, b.load(_word(b, workspace, abi.TRACE_CAPACITY_WORD),
                                               typ=i32))
        at = b.add(i32(abi.TRACE_HEADER_WORDS), b.mul(k, i32(abi.TRACE_RECORD_WORDS)))
        record = b.select(fits, _word(b, workspace, at), ir.Constant(gptr, None))
        smid = nvptx.opaque_special_register(b, "smid")
        start = nvptx.opaque_special_register(b, "globaltimer", i64)
        with b.if_then(fits):
            values = {"prompt_offset": fields["prompt_offset"], "head": fields["head_idx"],
                      "batch": fields["prompt_idx"], "cta": linear_cta(b), "sm": smid,
                      "start_lo": b.trunc(start, i32),
                      "start_hi": b.trunc(b.lshr(start, i64(32)), i32), "kind": i32(kind)}
            for name, v in values.items():
                b.store(v, _word(b, record, abi.TRACE_FIELDS.index(name)))
        b.store(b.ptrtoint(record, i64), _scratch_slot(b, scratch, 0))
        b.store(start, _scratch_slot(b, scratch, 1))
    emit_body()
    end_record(b, thread)


def end_record(builder: ir.IRBuilder, thread: int) -> None:
    """Thread `thread` writes the duration of its open record (`record_work_item`) and
    closes it, so a second end does nothing: a body may end its work item's record early,
    at the point its work is done (the decode design: where a split has published its
    result, before a combine that must start after it)."""
    b = builder
    scratch = _trace_scratch(b.module)
    with b.if_then(_is_recorder(b, thread)):
        end = nvptx.opaque_special_register(b, "globaltimer", i64)
        address = b.load(_scratch_slot(b, scratch, 0), typ=i64)
        with b.if_then(b.icmp_unsigned("!=", address, i64(0))):
            duration = b.trunc(b.sub(end, b.load(_scratch_slot(b, scratch, 1), typ=i64)), i32)
            b.store(duration, _word(b, b.inttoptr(address, nvptx.ptr(nvptx.GLOBAL)),
                                   abi.TRACE_FIELDS.index("duration")))
            b.store(i64(0), _scratch_slot(b, scratch, 0))


def _is_recorder(builder: ir.IRBuilder, thread: int) -> ir.Value:
    return builder.icmp_unsigned("==", nvptx.special_register(builder, "thread_idx", "x"),
                                 i32(thread))


def _scratch_slot(builder: ir.IRBuilder, scratch: ir.Value, k: int) -> ir.Value:
    return builder.gep(scratch, [i32(0), i32(k)], source_etype=_TRACE_SCRATCH)


_TRACE_SCRATCH = ir.ArrayType(i64, 2)


def _trace_scratch(module: ir.Module) -> ir.GlobalVariable:
    """The recording thread's shared-memory scratch: its record's address, its start time."""
    return nvptx.shared_array(module, "mhadsl.trace_scratch", _TRACE_SCRATCH)


TRACE_FIELDS = 4  # per step: prompt_offset, head_idx, prompt_idx, 1 (0 past the last step)


def build_trace_kernel(module: ir.Module, sched: LoweredScheduler) -> ir.Function:
    """A kernel that drives the scheduler over the whole grid and records every tile.

    Params: (u32* workspace, u32 num_sms, u32 batch, u32 max_tiles, u32 max_seq_len,
    u32 num_heads, i32* valid_length or null, u32* out, u32 max_steps, u32* overflow,
    u32* tile_index or null); the workspace is the stream's (`mhadsl.abi`), the tile index
    what `codegen.tile_index` builds from valid_length.
    Thread 0 of CTA c writes step s at out[(c * max_steps + s) * 4 ...].
    """
    g = nvptx.ptr(nvptx.GLOBAL)
    fnty = ir.FunctionType(nvptx.void, [g, i32, i32, i32, i32, i32, g, g, i32, g, g])
    fn = ir.Function(module, fnty, name=f"trace_{sched.spec.name}")
    nvptx.mark_kernel(fn)
    counter, num_sms, batch, tiles, max_len, heads, vl, out, max_steps, overflow, index = \
        fn.args
    for a in (counter, vl, out, overflow, index):
        a.add_attribute("noalias")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    fill_env = env_filler(b, sched, shared_slots(module),
                          lambda _: EnvParams(counter, num_sms, i32(1), batch, tiles, max_len,
                                              heads, vl, index))
    step = alloca(b, i32, "step")
    b.store(i32(0), step)
    tid = nvptx.special_register(b, "thread_idx", "x")
    cta = linear_cta(b)

    def record(bb: ir.IRBuilder, fields: dict[str, ir.Value]) -> None:
        s = bb.load(step, typ=i32)
        fits = bb.icmp_unsigned("<", s, max_steps)
        with bb.if_else(bb.and_(fits, bb.icmp_unsigned("==", tid, i32(0)))) as (then, other):
            with then:
                base = bb.mul(bb.add(bb.mul(cta, max_steps), s), i32(TRACE_FIELDS))
                for k, v in enumerate((fields["prompt_offset"], fields["head_idx"],
                                       fields["prompt_idx"], i32(1))):
                    bb.store(v, bb.gep(out, [bb.add(base, i32(k))], source_etype=i32))
            with other:
                with bb.if_then(bb.not_(fits)):
                    bb.store(i32(1), overflow)
        bb.store(bb.add(s, i32(1)), step)

    emit_work_loop(b, sched, fill_env, record)
    if sched.uses_queue:
        count_exit(b, counter)
    b.ret_void()
    return fn

