"""Scheduler rules -> LLVM functions.

Each rule of a scheduler specialisation becomes one function with a fixed ABI, the same
on every target (pointers to structs laid out in `codegen.lower`):

    grid_dim(env*, ts*, i32 batch_size, i32 max_num_prompt_tiles, [3 x i32]* out)  host only
    initial_state(env*, ts*, slots*, State* out)
    get_current_work_info(env*, ts*, State*, WorkInfo* out)
    advance.<producer>.<sync>(env*, ts*, State*, i32 pipeline_idx, SeqInfo* out) -> i1
    unsafe_seq_info(env*, ts*, State*, SeqInfo* out)

On the GPU they are internal and always inlined into a kernel (`codegen.work_loop` drives
them); on the host they are exported for the simulator, which calls them through ctypes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from llvmlite import ir

from mhadsl.codegen import nvptx, warp
from mhadsl.codegen.handoff import memo_words
from mhadsl.codegen.lower import (
    ENV_FIELDS, load, Builtins, FunctionLowering, env_type, record_type, state_type, ts_type,
)
from mhadsl.codegen.nvptx import i1, i8, i32, i64
from mhadsl.codegen.target import Target
from mhadsl import abi
from mhadsl.front import ast
from mhadsl.front.check import CheckedProgram
from mhadsl.front.diagnostics import MhaError
from mhadsl.front.types import BOOL, RECORD_FIELDS, SCHEDULES, SEQ_INFO, SYNCS, U32, WORK_INFO

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
    search_ways: int = 2  # a ragged launch's tile index search (`RaggedIndex.search`)

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
        """The handoff's memo of this step's decoding (`handoff._MEMO_ENTRIES`): in the producer's
        advance its first thread publishes the key and values; a consumer's advance takes
        them where its key is the same, else computes its own."""
        slot = lower.bindings.get("pipeline_idx")
        if self.memo is None or slot is None:
            return compute()
        b = lower.b
        word = memo_words(b, name, slot)
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
        # negated fault code in it, which the work loop (`work_loop.emit_work_loop`, which fills the
        # tank before each step) records where the step ends, the record's one place in a
        # kernel (a second one costs the tile body spills: see `faults.record_fault`).
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
    # a kernel count its threads out (`work_loop.count_exit`) so that the last resets the counter;
    # the count's fence and atomics lengthen every CTA's tail (about 1.3 us a decode call)
    uses_queue: bool

    def advance_name(self, producer: bool, sync: str) -> str:
        return f"advance.{int(producer)}.{sync}"


def may_advance(program: CheckedProgram, spec: SchedulerSpec) -> bool:
    """The scheduler's `may_advance` for its arguments: whether a CTA runs more than one
    work tile (a persistent scheduler), else one."""
    decl = program.schedulers[spec.name]
    constants = {c.name: c for c in decl.constants}
    return bool(const_eval(constants["may_advance"].value, program, spec.arg_dict(), decl))


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
    advances = may_advance(program, spec)
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
                                 gqa_group=spec.gqa_group, search_ways=spec.search_ways)
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
    return LoweredScheduler(spec, decl, advances, functions, b0.env_struct, b0.ts_struct,
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
