"""The builtin functions, each in one place with every meaning it has.

`FUNCTIONS` maps a name (`exp`, `min`, `where`, `i32`, ...) to a `Builtin` that carries:

- `type_rule(check, call, arg_types, ctx)`: its type (and errors, and folding of literal
  arguments), for the checker (`mhadsl.front.check`);
- `lower(lowering, args, ty)`: its LLVM IR, for the lowering (`mhadsl.codegen.lower`);
- `interval(analysis, args, arg_types, ty)`: its abstract value over a tile, for the mask
  classifier (`mhadsl.analysis.classify`);
- `numpy(args, arg_types, ty)`: its value in the float64 reference (`mhadsl.reference`);
- `derivative(d, *args)`: its derivative with respect to the score, for
  `mhadsl.analysis.derivative` (None: not differentiable).

Each meaning is written against the walker that uses it (the checker, the `FunctionLowering`,
the interval analysis, the derivative builder), passed as the first argument, so this module
imports none of them. `ty` is the call's checked type and `arg_types` its arguments'.

`DEVICE_FUNCTIONS` holds the two builtins of scheduler rules on the device alone,
`atomic_add(queue, n)` and `barrier(sync)`, each with its check and its LLVM IR; `f32_math`
folds an f32 math function of constants, as a constant setting (`scale`) does.

A derivative is written in forward mode, by the chain rule: from the arguments and their
own derivatives `d.of(arg)` it makes the call's derivative, in expressions the builder `d`
makes and simplifies. At a kink it takes one side: `abs` has derivative 0 at 0 (PyTorch's
convention), `max(a, b)` follows `a` when a >= b and `min(a, b)` follows `a` when a <= b
(so `max(s, 0)` has derivative 1 at 0; where `b` is a NaN, which loses, they follow `a`),
and `where(c, a, b)` follows the branch it takes
(the condition is not differentiated). The casts to integers and `cdiv` have integer
values: no derivative.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mhadsl.front.semantics import (
    INT_RANGES, SYNCS, attention_type, convert, int_binary, tdiv, wrap,
)
from mhadsl.front.types import (
    BOOL, COUNTER, ERROR, F32, GRID, I32, INT_LITERAL, INTEGERS, NUMBERS, SYNC, U32, VOID,
    TensorTy, unify,
)

LOG2E, LN2 = math.log2(math.e), math.log(2.0)


@dataclass(frozen=True)
class Builtin:
    arity: int
    type_rule: Callable
    lower: Callable
    interval: Callable
    numpy: Callable
    derivative: Callable | None


# ------------------------------------------------------------------ type rules
def _meet(check, e, operands, types, ctx, fold: Callable | None, numbers: bool = True,
          integers: bool = False):
    """The operands meet in one type; operands that are all literals fold with `fold`."""
    common = unify(*types)
    if ERROR in types:
        return ERROR
    if common is None or (numbers and common not in NUMBERS):
        return check.error(e.span, f"'{e.func.id}' does not apply to {types[0]} and {types[1]}")
    if integers and common not in INTEGERS:
        return check.error(e.span, f"'{e.func.id}' needs integers")
    if fold is not None and all(a in check.out.literals for a in operands):
        return check.fold(e, fold(*(check.out.literals[a] for a in operands)))
    for operand in operands:  # a literal meets the other operand's (or the context's) type
        check.fit(operand, ctx.default_int if common == INT_LITERAL else common)
    return common


def _type_pick(fold: Callable) -> Callable:
    return lambda check, e, types, ctx: _meet(check, e, e.args, types, ctx, fold)


def _type_cdiv(check, e, types, ctx):
    return _meet(check, e, e.args, types, ctx, lambda a, b: tdiv(a + b - 1, b), integers=True)


def _type_where(check, e, types, ctx):
    check.expect(types[0], BOOL, e.args[0].span, "condition of where")
    for arg, ty in zip(e.args[1:], types[1:]):
        if isinstance(ty, TensorTy):  # a tensor is read where it is indexed, never chosen
            return check.error(arg.span, f"'where' cannot choose a tensor ({ty}): index each "
                                         f"side to choose between elements "
                                         f"(where(c, t[i], u[j]))")
        if ty == GRID:  # (grid_dim returns a grid where it builds it)
            return check.error(arg.span, "'where' cannot choose a grid: choose each "
                                         "dimension ((where(c, x1, x2), 1, 1)) or return "
                                         "each grid from an if")
    return _meet(check, e, e.args[1:], types[1:], ctx, None, numbers=False)


def _type_cast(target) -> Callable:
    def rule(check, e, types, ctx):
        if types[0] not in NUMBERS + (BOOL, ERROR):
            return check.error(e.span, f"cannot convert {types[0]} to {e.func.id}")
        return target
    return rule


def _type_f32(check, e, types, ctx):
    if types[0] not in NUMBERS + (ERROR,):
        return check.error(e.span, f"'{e.func.id}' needs a number, not {types[0]}")
    return F32


def _type_abs(check, e, types, ctx):
    """abs keeps an integer type (and folds a literal); a float is f32."""
    if e.args[0] in check.out.literals:
        return check.fold(e, abs(check.out.literals[e.args[0]]))
    return types[0] if types[0] in INTEGERS else _type_f32(check, e, types, ctx)


# ------------------------------------------------------------------ LLVM lowerings
def _lower_pick(cmp: str, intrinsic: str) -> Callable:
    """min / max: LLVM's minnum/maxnum for f32 (a NaN loses to a number), else a select."""
    def lower(L, args, ty):
        a, b = (L.operand(x, ty) for x in args)
        if ty == F32:
            return L.intrinsic(intrinsic, a, b)
        return L.b.select(L.arith(cmp, a, b, ty == I32, ty), a, b)
    return lower


def _lower_cdiv(L, args, ty):  # (a + b - 1) / b
    a, b = (L.expr(x) for x in args)
    return L.arith("/", L.b.add(a, L.b.sub(b, b.type(1))), b, ty == I32, ty)


def _lower_where(L, args, ty):
    c = L.expr(args[0])
    return L.b.select(c, L.operand(args[1], ty), L.operand(args[2], ty))


def _lower_cast(L, args, ty):
    return L.cast(args[0], ty)


def _lower_abs(L, args, ty):
    x = L.operand(args[0], ty)
    if ty == F32:
        return L.intrinsic("llvm.fabs.f32", x)
    if ty == U32:
        return x
    return L.b.select(L.b.icmp_signed("<", x, x.type(0)), L.b.neg(x), x)


def _lower_f32(lower_x: Callable) -> Callable:
    """An f32 -> f32 function: its argument converts to f32 first."""
    return lambda L, args, ty: lower_x(L, L.operand(args[0], F32))


# The GPU has no libm: exp, log and tanh use the SFU's approximations there; the host calls
# LLVM's intrinsics (libm).
def _lower_exp(L, x):
    if L.gpu:
        return L.intrinsic("llvm.nvvm.ex2.approx.ftz.f", L.b.fmul(x, x.type(LOG2E)))
    return L.intrinsic("llvm.exp.f32", x)


def _lower_exp2(L, x):
    return L.intrinsic("llvm.nvvm.ex2.approx.ftz.f" if L.gpu else "llvm.exp2.f32", x)


def _lower_log(L, x):
    if L.gpu:
        return L.b.fmul(L.intrinsic("llvm.nvvm.lg2.approx.ftz.f", x), x.type(LN2))
    return L.intrinsic("llvm.log.f32", x)


def _lower_log2(L, x):
    return L.intrinsic("llvm.nvvm.lg2.approx.ftz.f" if L.gpu else "llvm.log2.f32", x)


def _lower_tanh(L, x):
    if L.gpu:
        return L.intrinsic("llvm.nvvm.tanh.approx.f32", x)
    e = _lower_exp(L, L.b.fmul(x, x.type(2.0)))  # tanh(x) = 1 - 2 / (exp(2x) + 1)
    return L.b.fsub(x.type(1.0), L.b.fdiv(x.type(2.0), L.b.fadd(e, x.type(1.0))))


def _lower_sqrt(L, x):
    return L.intrinsic("llvm.sqrt.f32", x)


# ------------------------------------------------------------------ interval rules
def _interval_pick(pick: str) -> Callable:
    """min / max of integers: the bounds' min / max; floats are not modelled."""
    def rule(A, args, types, ty):
        ty = attention_type(ty)
        if ty not in INT_RANGES:
            return A.top(ty)
        a, b = (A.lift(v, ty) for v in args)
        choose = getattr(A, pick)
        return A.interval(choose(a.lo, b.lo), choose(a.hi, b.hi), ty)
    return rule


def _interval_cdiv(A, args, types, ty):
    ty = attention_type(ty)
    if ty not in INT_RANGES:
        return A.top(ty)
    a, b = (A.lift(v, ty) for v in args)
    one = A.interval(A.o.const(1), A.o.const(1), ty)
    return A.arith("/", A.arith("-", A.arith("+", a, b, ty), one, ty), b, ty)


def _interval_where(A, args, types, ty):
    c, a, b = args
    ty = attention_type(ty)
    return A.where(c, A.lift(a, ty), A.lift(b, ty))


def _interval_abs(A, args, types, ty):
    ty = attention_type(ty)  # (abs of a `where` of literals computes in i32)
    if ty != I32:
        return A.top(ty)  # abs of a u32 or f32 is not modelled: unknown
    v = A.lift(args[0], ty)
    o = A.o
    zero = o.const(0)
    lo = o.select(o.le(zero, v.lo), v.lo, o.select(o.le(v.hi, zero), o.sub(zero, v.hi), zero))
    return A.norm(lo, A.max(o.sub(zero, v.lo), v.hi), ty)


def _interval_int_cast(A, args, types, ty):
    (v,) = args
    if types[0] == BOOL:  # false is 0, true is 1
        o = A.o
        return A.interval(o.select(v.must, o.const(1), o.const(0)),
                          o.select(v.may, o.const(1), o.const(0)), ty)
    if types[0] == F32:
        return A.full(ty)
    return A.lift(v, ty)


def _interval_float(A, args, types, ty):
    return A.top(F32)  # the domain keeps no float bounds


# ------------------------------------------------------------------ NumPy meanings
def _numpy_pick(float_fn: Callable, int_fn: Callable, exact_fn: Callable) -> Callable:
    def meaning(args, types, ty):
        a, b = (convert(v, t, ty) for v, t in zip(args, types))
        if ty == F32:  # minnum/maxnum: a NaN loses to a number
            return float_fn(a, b)
        if isinstance(a, int) and isinstance(b, int):
            return exact_fn(a, b)
        return int_fn(a, b)
    return meaning


def _numpy_cdiv(args, types, ty):  # (a + b - 1) / b, as the lowering computes it
    a, b = (convert(v, t, ty) for v, t in zip(args, types))
    ty = attention_type(ty)
    return int_binary("/", int_binary("-", int_binary("+", a, b, ty), 1, ty), b, ty)


def _numpy_where(args, types, ty):
    c, a, b = args
    return np.where(c, convert(a, types[1], ty), convert(b, types[2], ty))


def _numpy_cast(args, types, ty):
    return convert(args[0], types[0], ty)


def _numpy_abs(args, types, ty):
    x = convert(args[0], types[0], ty)
    return np.abs(x) if ty == F32 else wrap(np.abs(x), attention_type(ty))


def _numpy_f32(fn: Callable) -> Callable:
    return lambda args, types, ty: fn(convert(args[0], types[0], F32))


# ------------------------------------------------------------------ derivatives
def _d_exp(d, x):
    return d.mul(d.call("exp", x), d.of(x))


def _d_exp2(d, x):
    return d.mul(d.mul(d.const(LN2), d.call("exp2", x)), d.of(x))


def _d_log(d, x):
    return d.div(d.of(x), x)


def _d_log2(d, x):
    return d.div(d.of(x), d.mul(x, d.const(LN2)))


def _d_tanh(d, x):
    t = d.call("tanh", x)
    return d.mul(d.sub(d.const(1.0), d.mul(t, t)), d.of(x))


def _d_sqrt(d, x):
    return d.div(d.of(x), d.mul(d.const(2.0), d.call("sqrt", x)))


def _d_abs(d, x):  # sign(x) dx, 0 at x = 0
    dx = d.of(x)
    return d.where(d.compare(">", x, d.const(0.0)), dx,
                   d.where(d.compare("<", x, d.const(0.0)), d.neg(dx), d.const(0.0)))


def _d_pick(cmp: str) -> Callable:
    """min / max follow the operand they return: `a` on a tie, and where `b` is a NaN (which
    loses to a number)."""
    def derivative(d, a, b):
        da, db = d.of(a), d.of(b)
        picked = d.where(d.compare(cmp, a, b), da, db)
        return d.where(d.compare("!=", b, b), da, picked) if d.may_be_nan(b) else picked
    return derivative


def _d_where(d, c, a, b):  # the condition is not differentiated
    return d.where(c, d.of(a), d.of(b))


def _d_identity(d, x):
    return d.of(x)


def _math(lower_x: Callable, fn: Callable, derivative: Callable) -> Builtin:
    """An f32 -> f32 function."""
    return Builtin(1, _type_f32, _lower_f32(lower_x), _interval_float, _numpy_f32(fn),
                   derivative)


FUNCTIONS: dict[str, Builtin] = {
    "exp": _math(_lower_exp, np.exp, _d_exp),
    "exp2": _math(_lower_exp2, np.exp2, _d_exp2),
    "log": _math(_lower_log, np.log, _d_log),
    "log2": _math(_lower_log2, np.log2, _d_log2),
    "tanh": _math(_lower_tanh, np.tanh, _d_tanh),
    "sqrt": _math(_lower_sqrt, np.sqrt, _d_sqrt),
    "abs": Builtin(1, _type_abs, _lower_abs, _interval_abs, _numpy_abs, _d_abs),
    "min": Builtin(2, _type_pick(min), _lower_pick("<", "llvm.minnum.f32"), _interval_pick("min"),
                   _numpy_pick(np.fmin, np.minimum, min), _d_pick("<=")),
    "max": Builtin(2, _type_pick(max), _lower_pick(">", "llvm.maxnum.f32"), _interval_pick("max"),
                   _numpy_pick(np.fmax, np.maximum, max), _d_pick(">=")),
    "cdiv": Builtin(2, _type_cdiv, _lower_cdiv, _interval_cdiv, _numpy_cdiv, None),
    "where": Builtin(3, _type_where, _lower_where, _interval_where, _numpy_where, _d_where),
    "i32": Builtin(1, _type_cast(I32), _lower_cast, _interval_int_cast, _numpy_cast, None),
    "u32": Builtin(1, _type_cast(U32), _lower_cast, _interval_int_cast, _numpy_cast, None),
    "f32": Builtin(1, _type_cast(F32), _lower_cast, _interval_float, _numpy_cast, _d_identity),
}


def f32_math(name: str, arity: int) -> Callable[[list[float]], float] | None:
    """The value in float64 (its NumPy meaning) of f32 math function `name` (`exp`, `sqrt`,
    ...) on `arity` constant numbers, as a constant setting folds it (`scale = 1.0 /
    sqrt(128.0)`); None where `name` is no such function of that arity."""
    builtin = FUNCTIONS.get(name)
    if builtin is None or builtin.type_rule is not _type_f32 or builtin.arity != arity:
        return None

    def value(args: list[float]) -> float:
        with np.errstate(all="ignore"):  # (a NaN or an infinity is the caller's to refuse)
            return float(builtin.numpy([np.float64(a) for a in args], [F32] * arity, F32))
    return value


# ------------------------------------------------------------------ device-only builtins
@dataclass(frozen=True)
class DeviceBuiltin:
    """A builtin of scheduler rules on the device alone (not in `fn`s, not in attention
    code): its check (`type_rule(check, call, scope, ctx)`: the arguments checked, the
    call's type) and its LLVM IR (`lower(lowering, args)`)."""

    type_rule: Callable
    lower: Callable


def _type_atomic_add(check, e, scope, ctx):
    check.call_args(e, (COUNTER, U32), scope, ctx, e.func.id)
    return U32


def _lower_atomic_add(L, args):
    counter, amount = (L.expr(a) for a in args)
    return L.b.atomic_rmw("add", counter, amount, "monotonic")


def _type_barrier(check, e, scope, ctx):
    if e.args or e.kwargs:
        check.call_args(e, (SYNC,), scope, ctx, e.func.id)
    if ctx.divergent:
        # Threads that skip a barrier leave the others waiting forever on the GPU.
        check.error(e.span, f"barrier {ctx.divergent}: every thread of the CTA must reach it "
                            f"(a condition on producer or sync is fine)")
    return VOID


def _lower_barrier(L, args):
    # (the checker admits only compile-time syncs: the argument lowers to a constant)
    sync = L.expr(args[0]).constant if args else SYNCS.index("ALL")
    L.builtins.barrier(L, sync)


DEVICE_FUNCTIONS: dict[str, DeviceBuiltin] = {
    "atomic_add": DeviceBuiltin(_type_atomic_add, _lower_atomic_add),
    "barrier": DeviceBuiltin(_type_barrier, _lower_barrier),
}
