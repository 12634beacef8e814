"""What the expression language means: the builtin names and where each may be used, the
operators, and the integer semantics, read by every walker (the checker, the LLVM lowering
for host and GPU, the interval classifier and the NumPy reference), so they cannot drift
apart. The builtin *functions* (exp, min, where, ...), each with all of its meanings, are in
`mhadsl.front.builtin_functions`.

Integer semantics (the same on the host, the GPU and in the reference; README "Semantics"):

- `u32` and `i32` are 32-bit; `+ - *` and unary `-` wrap modulo 2**32.
- `/` truncates toward zero and `%` takes the dividend's sign (C); a divisor of 0 gives 0,
  and `INT_MIN / -1` gives INT_MIN, `INT_MIN % -1` gives 0.
- A shift count is read as unsigned: a count of 32 or more (a negative `i32` count included)
  gives 0 for `<<` and for `>>` of a `u32`, and the sign fill (0 or -1) for `>>` of an `i32`.
- `i32(x)` / `u32(x)` of an integer reinterpret its 32 bits; of an `f32` they truncate toward
  zero and saturate at the type's limits, NaN giving 0.
- Integer literals (and expressions of literals alone) are exact integers until they meet a
  typed value; there they must fit the type (a diagnostic otherwise). An explicit cast wraps.
- `state.slots[i]` indexes the CTA's SLOT_COUNT slots modulo SLOT_COUNT.
"""
from __future__ import annotations

import math
import operator

import numpy as np

from mhadsl.front.types import (
    BOOL, COUNTER, DIM3, F32, I32, INT_LITERAL, SCHEDULE, SCHEDULES, SYNC, SYNCS, U32, Ty,
)

# Where code runs: host-side rules (grid_dim, parameter defaults), device rules and fns,
# attention mask/score expressions.
HOST, DEVICE, ATTENTION = "host", "device", "attention"

# Builtin values: name -> (type, contexts where allowed, only inside these rules or None).
BUILTIN_VALUES: dict[str, tuple[Ty, tuple[str, ...], tuple[str, ...] | None]] = {
    "num_sms": (U32, (HOST, DEVICE), None),
    "ctas_per_sm": (U32, (HOST, DEVICE), None),
    "num_heads": (U32, (HOST, DEVICE), None),
    "tile_m": (U32, (HOST, DEVICE), None),
    "gqa_group": (U32, (HOST, DEVICE), None),
    "block_idx": (DIM3, (DEVICE,), None),
    "thread_idx": (DIM3, (DEVICE,), None),
    "grid_dim": (DIM3, (DEVICE,), None),
    "queue": (COUNTER, (DEVICE,), None),
    "producer": (BOOL, (DEVICE,), ("advance",)),
    "sync": (SYNC, (DEVICE,), ("advance",)),
    **{s: (SCHEDULE, (HOST, DEVICE), None) for s in SCHEDULES},
    **{s: (SYNC, (HOST, DEVICE), None) for s in SYNCS},
}
# Builtins whose value is the same in every thread of a launch and known when the rule is
# compiled: a condition made of them alone may guard a barrier.
COMPILE_TIME_VALUES = ("producer", "sync", *SCHEDULES, *SYNCS)

COMPARISONS = ("==", "!=", "<", "<=", ">", ">=")
INTEGER_ONLY_OPS = ("<<", ">>", "&", "|", "^", "%")

SLOT_COUNT = 2  # the work index rides a double-buffered pipeline (BRIEF §3)
# CUDA's launch limits per grid dimension (x, y, z).
GRID_LIMITS = (2**31 - 1, 65535, 65535)

I32_MIN, I32_MAX, U32_MAX = -2**31, 2**31 - 1, 2**32 - 1
INT_RANGES = {I32: (I32_MIN, I32_MAX), U32: (0, U32_MAX)}
LITERAL_LIMIT = 2**64  # literal expressions beyond this magnitude are an error
# The smallest magnitude that rounds to infinity in f32 (FLT_MAX plus half an ulp).
F32_OVERFLOW = 2.0**128 * (1 - 2.0**-25)
FLOAT_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


# ------------------------------------------------------------------ integer semantics
def wrap(x, ty: Ty):
    """An int, or an int64 array, as `ty` holds it (modulo 2**32)."""
    x = x & U32_MAX
    return x if ty == U32 else (x ^ 0x80000000) - 0x80000000


def tdiv(a, b):
    """C division of exact integers (truncating), 0 where the divisor is 0."""
    if isinstance(a, int) and isinstance(b, int):
        q = abs(a) // abs(b) if b else 0
        return q if (a < 0) == (b < 0) else -q
    a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
    safe = np.where(b == 0, 1, b)
    q = np.abs(a) // np.abs(safe)
    return np.where(b == 0, 0, np.where((a < 0) != (safe < 0), -q, q))


def _trem(a, b):
    """C remainder (the dividend's sign), 0 where the divisor is 0."""
    r = a - b * tdiv(a, b)
    if isinstance(r, int):
        return r if b else 0
    return np.where(np.asarray(b) == 0, 0, r)


def _shift(op: str, a, count, ty: Ty):
    """`a << count` / `a >> count` in `ty`; counts are unsigned, 32 or more saturate."""
    count = count & U32_MAX  # a negative i32 count is a large unsigned one
    big = count >= 32
    fill = (a < 0) * -1 if op == ">>" else 0  # sign fill (u32 values are never negative)
    safe = count * ~big if not isinstance(big, bool) else (0 if big else count)
    shifted = wrap(a << safe, ty) if op == "<<" else a >> safe
    if isinstance(big, bool):
        return fill if big else shifted
    return np.where(big, fill, shifted)


_EXACT = {"+": operator.add, "-": operator.sub, "*": operator.mul, "&": operator.and_,
          "|": operator.or_, "^": operator.xor, "/": tdiv, "%": _trem}


def int_binary(op: str, a, b, ty: Ty):
    """`a op b` for `ty` = u32 or i32: ints or int64 arrays holding the type's values.

    This is the lowering's meaning, written in Python; the reference uses it and the tests
    compare the host JIT with it.
    """
    if op in ("<<", ">>"):
        return _shift(op, a, b, ty)
    return wrap(_EXACT[op](a, b), ty)  # INT_MIN / -1 = 2**31 wraps back to INT_MIN


class LiteralError(ValueError):
    """A constant expression of literals has no value (the checker reports it)."""


def fold_literal(op: str, a: int, b: int) -> int | bool:
    """`a op b` of two exact literal values (comparisons give a bool)."""
    if op in COMPARISONS:
        return {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
                ">": operator.gt, ">=": operator.ge}[op](a, b)
    if op in ("<<", ">>"):
        if b < 0:
            raise LiteralError(f"negative shift count {b} in a constant expression")
        if op == ">>":
            return a >> b
        if a and b >= 64:
            raise LiteralError("constant expression does not fit in 64 bits")
        return check_literal(a << b)
    return check_literal(_EXACT[op](a, b))


def check_literal(value: int) -> int:
    if abs(value) >= LITERAL_LIMIT:
        raise LiteralError("constant expression does not fit in 64 bits")
    return value


def finite_f32(value: float) -> bool:
    """Whether a float constant stays a finite number once it is an f32."""
    return math.isfinite(value) and abs(value) < F32_OVERFLOW


def fits(value: int, ty: Ty) -> bool:
    lo, hi = INT_RANGES[ty]
    return lo <= value <= hi


def float_to_int(x, ty: Ty):
    """`i32(f)` / `u32(f)`: truncate toward zero, saturate at the type's limits, NaN -> 0."""
    lo, hi = INT_RANGES[ty]
    x = np.nan_to_num(np.trunc(np.asarray(x, np.float64)), nan=0.0)
    return np.clip(x, lo, hi).astype(np.int64)


def attention_type(ty: Ty) -> Ty:
    """The type a value typed "integer literal" computes in when it is not a constant (a
    `where` of literals): i32, the attention default, as the lowering does."""
    return I32 if ty == INT_LITERAL else ty


def convert(v, src: Ty, dst: Ty):
    """A reference value of type `src` as type `dst` (float64 for f32, int64 for integers):
    the promotions, and the explicit casts."""
    if src == dst or dst in (INT_LITERAL, BOOL):
        return v
    if dst == F32:
        return np.asarray(v, dtype=np.float64)
    if src == F32:
        return float_to_int(v, dst)
    return wrap(np.asarray(v).astype(np.int64), dst)
