"""Static tile classification: is a mask empty, full or partial over a (query tile, KV tile) box?

The mask expression is interpreted abstractly: every integer sub-expression becomes an interval
`[lo, hi]`, every boolean a pair `(may, must)` = (may be true somewhere in the box, true
everywhere in the box). EMPTY is `not may`, FULL is `must`, anything else PARTIAL. The reasoning
is sound, never exact by accident: whatever it cannot bound becomes the full range of its type
(an unknown bool is `(True, False)`), so an unknown mask is always PARTIAL.

The analysis is written once against a small "ops" backend and *staged*: it never branches on
a bound's value, only on the expression's shape and static types, and builds `select`s for
every data-dependent choice. Two backends run it:

- `_PyOps` generates straight-line Python over plain ints (constants fold as it goes) and
  compiles it once per rule; the host simulator's cost model calls the result per tile.
- `IrOps` emits the same reasoning as llvmlite IR, so the GPU kernel can classify tiles at run
  time, when the shapes are known.

Bounds are computed in 64 bits (Python ints, or i64 in IR) from 32-bit inputs, so no single
step overflows; a result that leaves its type's range (i32 or u32) may have wrapped in the
kernel and becomes the full range.
"""
from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llvmlite import ir

from mhadsl.front import ast
from mhadsl.front.attention_spec import operand_key
from mhadsl.front.builtin_functions import FUNCTIONS
from mhadsl.front.semantics import I32_MAX, I32_MIN, INT_RANGES, U32_MAX, attention_type, wrap
from mhadsl.front.check import CheckedProgram
from mhadsl.front.types import BOOL, F32, I32, POSITION_AXES, U32, TensorTy, Ty, unify

_BOUNDS = INT_RANGES
_I64, _I1 = ir.IntType(64), ir.IntType(1)

# Parameters of the staged classifier, in order; b and h come as intervals so "unknown" is
# just the full range.
_INPUTS = ("b_lo", "b_hi", "h_lo", "h_hi", "q_lo", "q_hi", "kv_lo", "kv_hi",
           "seqlen_q", "seqlen_k")


# ------------------------------------------------------------------ abstract values
@dataclass(frozen=True)
class _Int:
    """An integer of type `ty` (I32 or U32) known to lie in [lo, hi] (backend values)."""

    lo: Any
    hi: Any
    ty: Ty


@dataclass(frozen=True)
class _Bool:
    may: Any  # backend bool: true somewhere in the box
    must: Any  # backend bool: true everywhere in the box


class _Float:
    """An f32 value: the domain keeps no float bounds."""


_FLOAT = _Float()
# Integer-literal sub-expressions stay Python ints and fold exactly, as constants do.
_Value = _Int | _Bool | _Float | int


def _reads_tensors(e: ast.Expr) -> bool:
    """Whether evaluating `e` may read a tensor element (an index, or a call: a function
    may read one)."""
    todo = [e]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Index, ast.Call)):
            return True
        todo.extend(ast.children(node))
    return False


class Unsupported(Exception):
    """The rule has a shape the analysis does not model; its mask is unknown."""


# ------------------------------------------------------------------ backends
def _tdiv(a: int, b: int) -> int:
    """C division: the quotient truncates toward zero."""
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


def _trem(a: int, b: int) -> int:
    return a - b * _tdiv(a, b)


def _tread(tensor, *indices: int) -> int:
    """Element `indices` of a host tensor operand (a NumPy array), 0 outside it, as the
    kernel reads one; 0 for an unknown tensor (None), whose reads are then not exact."""
    if tensor is None or any(not 0 <= i < n for i, n in zip(indices, tensor.shape)):
        return 0
    return int(tensor[indices])


class _PyOps:
    """Stages the analysis as Python source over ints; an operand is a constant or a name."""

    def __init__(self):
        self.lines: list[str] = []

    def _op(self, fold: Callable, fmt: str, *args):
        if not any(isinstance(a, str) for a in args):
            return fold(*args)
        name = f"v{len(self.lines)}"
        self.lines.append(f"    {name} = " + fmt.format(*map(str, args)))
        return name

    def const(self, v: int):
        return v

    def bconst(self, v: bool):
        return v

    def tensor_read(self, tensor: str, indices: list):
        """Element `indices` of the classifier's tensor argument `tensor` (`_tread`)."""
        name = f"v{len(self.lines)}"
        self.lines.append(f"    {name} = _tread({tensor}, {', '.join(map(str, indices))})")
        return name

    def tensor_known(self, tensor: str):
        """Whether the call gave the tensor (else its reads are any value)."""
        name = f"v{len(self.lines)}"
        self.lines.append(f"    {name} = {tensor} is not None")
        return name

    def add(self, a, b):
        return self._op(operator.add, "{} + {}", a, b)

    def sub(self, a, b):
        return self._op(operator.sub, "{} - {}", a, b)

    def mul(self, a, b):
        return self._op(operator.mul, "{} * {}", a, b)

    def div(self, a, b):
        return self._op(_tdiv, "_tdiv({}, {})", a, b)

    def rem(self, a, b):
        return self._op(_trem, "_trem({}, {})", a, b)

    def shl(self, a, b):
        return self._op(operator.lshift, "{} << {}", a, b)

    def ashr(self, a, b):
        return self._op(operator.rshift, "{} >> {}", a, b)

    def lt(self, a, b):
        return self._op(operator.lt, "{} < {}", a, b)

    def le(self, a, b):
        return self._op(operator.le, "{} <= {}", a, b)

    def eq(self, a, b):
        return self._op(operator.eq, "{} == {}", a, b)

    def select(self, c, a, b):
        if not isinstance(c, str):
            return a if c else b
        if a == b:
            return a
        return self._op(None, "{1} if {0} else {2}", c, a, b)

    def band(self, x, y):
        if not isinstance(x, str) or not isinstance(y, str):
            const, other = (x, y) if not isinstance(x, str) else (y, x)
            return other if const else False
        return self._op(None, "{} and {}", x, y)

    def bor(self, x, y):
        if not isinstance(x, str) or not isinstance(y, str):
            const, other = (x, y) if not isinstance(x, str) else (y, x)
            return True if const else other
        return self._op(None, "{} or {}", x, y)

    def bnot(self, x):
        return self._op(operator.not_, "not {}", x)


class IrOps:
    """Emits the analysis as LLVM IR: bounds are i64, booleans i1."""

    def __init__(self, builder: ir.IRBuilder):
        self.b = builder

    def const(self, v: int):
        return ir.Constant(_I64, v)

    def bconst(self, v: bool):
        return ir.Constant(_I1, int(v))

    def add(self, a, b):
        return self.b.add(a, b)

    def sub(self, a, b):
        return self.b.sub(a, b)

    def mul(self, a, b):
        return self.b.mul(a, b)

    def div(self, a, b):
        return self.b.sdiv(a, b)

    def rem(self, a, b):
        return self.b.srem(a, b)

    def shl(self, a, b):
        return self.b.shl(a, b)

    def ashr(self, a, b):
        return self.b.ashr(a, b)

    def lt(self, a, b):
        return self.b.icmp_signed("<", a, b)

    def le(self, a, b):
        return self.b.icmp_signed("<=", a, b)

    def eq(self, a, b):
        return self.b.icmp_signed("==", a, b)

    def select(self, c, a, b):
        return self.b.select(c, a, b)

    def band(self, x, y):
        return self.b.and_(x, y)

    def bor(self, x, y):
        return self.b.or_(x, y)

    def bnot(self, x):
        return self.b.not_(x)

    def tensor_read(self, tensor, indices: list):
        """The i32 element of tensor operand `tensor` (`codegen.kernel.TensorArgs`) at i64
        `indices`, as i64; 0 outside it, as the kernel's own read (its address stays at
        the first element)."""
        b, zero = self.b, ir.Constant(_I64, 0)
        inside, offset = None, zero
        for index, size, stride in zip(indices, tensor.sizes, tensor.strides):
            ok = b.icmp_unsigned("<", index, b.zext(size, _I64))  # (a negative one is huge)
            inside = ok if inside is None else b.and_(inside, ok)
            offset = b.add(offset, b.mul(index, b.sext(stride, _I64)))
        i32 = ir.IntType(32)
        at = b.gep(tensor.pointer, [b.select(inside, offset, zero)], source_etype=i32)
        return b.select(inside, b.sext(b.load(at, typ=i32), _I64), zero)


# ------------------------------------------------------------------ the analysis
_CMP = {"<": "<", "<=": "<=", ">": "<", ">=": "<="}  # > and >= swap their operands


class _Analysis:
    """Abstract interpretation of one rule, generic over the backend `ops`."""

    def __init__(self, ops, program: CheckedProgram):
        self.o, self.types, self.refs = ops, program.types, program.refs
        self.literals = program.literals

    # ---- helpers over backend values
    def min(self, a, b):
        return self.o.select(self.o.lt(a, b), a, b)

    def max(self, a, b):
        return self.o.select(self.o.lt(a, b), b, a)

    def hull(self, values: list, ty: Ty) -> _Int:
        lo = hi = values[0]
        for v in values[1:]:
            lo, hi = self.min(lo, v), self.max(hi, v)
        return self.norm(lo, hi, ty)

    def full(self, ty: Ty) -> _Int:
        lo, hi = _BOUNDS[ty]
        return _Int(self.o.const(lo), self.o.const(hi), ty)

    def norm(self, lo, hi, ty: Ty) -> _Int:
        """Bounds that leave the type's range mean the kernel's value may have wrapped."""
        tmin, tmax = _BOUNDS[ty]
        o = self.o
        ok = o.band(o.le(o.const(tmin), lo), o.le(hi, o.const(tmax)))
        return _Int(o.select(ok, lo, o.const(tmin)), o.select(ok, hi, o.const(tmax)), ty)

    def guard(self, ok, value: _Int) -> _Int:
        """`value` where `ok`, else the full range."""
        full = self.full(value.ty)
        return _Int(self.o.select(ok, value.lo, full.lo), self.o.select(ok, value.hi, full.hi),
                    value.ty)

    def top(self, ty: Ty) -> _Value:
        if ty == BOOL:
            return _Bool(self.o.bconst(True), self.o.bconst(False))
        if ty in _BOUNDS:
            return self.full(ty)
        if ty == F32:
            return _FLOAT
        raise Unsupported(f"no unknown value of type {ty}")

    def lift(self, v: _Value, ty: Ty) -> _Value:
        """Convert an operand to the type its use needs (literals wrap, as the kernel's do)."""
        if ty == F32:
            return _FLOAT
        if ty not in _BOUNDS or isinstance(v, (_Bool, _Float)):
            return v
        if isinstance(v, int):
            c = self.o.const(wrap(v, ty))
            return _Int(c, c, ty)
        if v.ty == ty:
            return v
        # i32 <-> u32 reinterprets the bits: only a range inside both types survives.
        o = self.o
        ok = o.band(o.le(o.const(0), v.lo), o.le(v.hi, o.const(I32_MAX)))
        return self.guard(ok, _Int(v.lo, v.hi, ty))

    # ---- rules and statements
    def rule(self, rule: ast.Rule, env: dict) -> _Value:
        return self.block(rule.body, env)

    def block(self, stmts: tuple[ast.Stmt, ...], env: dict) -> _Value:
        """Lets, returns and `if`s whose branches return: an `if` joins its two outcomes."""
        for i, s in enumerate(stmts):
            if isinstance(s, ast.Let):
                env[s] = self.expr(s.value, env)
            elif isinstance(s, ast.Return):
                return self.expr(s.value, env)
            elif isinstance(s, ast.If):
                cond = self.expr(s.cond, env)
                then = self.block(s.then, env)
                rest = self.block(s.orelse + stmts[i + 1:], env)
                return self.where(cond, then, rest)
            else:
                raise Unsupported(f"{type(s).__name__} statements")
        raise Unsupported("a path that does not return")

    # ---- expressions
    def expr(self, e: ast.Expr, env: dict) -> _Value:
        ty = self.types[e]
        literal = self.literals.get(e)  # folded exactly by the checker
        if isinstance(literal, bool):
            c = self.o.bconst(literal)
            return _Bool(c, c)
        return self.lift(self._expr(e, env, ty) if literal is None else literal, ty)

    def _expr(self, e: ast.Expr, env: dict, ty: Ty) -> _Value:
        o = self.o
        if isinstance(e, ast.BoolLit):
            c = o.bconst(e.value)
            return _Bool(c, c)
        if isinstance(e, ast.FloatLit):
            return _FLOAT
        if isinstance(e, ast.Name):
            sym = self.refs.get(e)
            if sym is not None and sym.kind in ("rule_param", "operand", "local") \
                    and sym.node in env:
                return env[sym.node]
            return self.top(ty)
        if isinstance(e, ast.Unary):
            v = self.expr(e.operand, env)
            if e.op == "!":
                return _Bool(o.bnot(v.must), o.bnot(v.may))
            if isinstance(v, _Float):
                return _FLOAT
            if e.op == "-":
                return self.norm(o.sub(o.const(0), v.hi), o.sub(o.const(0), v.lo), v.ty)
            ones = o.const(-1 if v.ty == I32 else U32_MAX)  # ~x = ones - x in either type
            return _Int(o.sub(ones, v.hi), o.sub(ones, v.lo), v.ty)
        if isinstance(e, ast.Binary):
            return self.binary(e, env, ty)
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name):
            return self.call(e, e.func.id, env, ty)
        if isinstance(e, ast.Index) and isinstance(self.types.get(e.obj), TensorTy):
            return self.tensor_read(e, env, ty)
        return self.top(ty)

    def tensor_read(self, e: ast.Index, env: dict, ty: Ty) -> _Value:
        """An i32 tensor operand's element: where every index is one value over the box
        (`b` or `h`, say), the element itself, read at run time (the backend reads tensors:
        the kernel's, given the tensor); else any i32, as for a tensor along the call's
        query rows or keys (read at the sequence's rows, which the box does not carry) —
        unless the backend bounds the elements over the indices' intervals
        (`tensor_range`: `codegen.block_classes`, whose box carries its sequence)."""
        indices, node = [], e
        while isinstance(node, ast.Index):
            indices.append(node.index)
            node = node.obj
        tensor = env.get(self.refs[node].node)
        ranged = hasattr(self.o, "tensor_range")
        if tensor is None or ty != I32 or not hasattr(self.o, "tensor_read") or \
                (set(self.types[node].axes) & set(POSITION_AXES) and not ranged):
            return self.top(ty)
        o, bounds = self.o, []
        for index in reversed(indices):
            v = self.lift(self.expr(index, env), self.types[index]
                          if self.types[index] in _BOUNDS else I32)
            bounds.append(v)
        if ranged:
            return _Int(*o.tensor_range(tensor, [(v.lo, v.hi) for v in bounds]), I32)
        exact = o.tensor_known(tensor) if hasattr(o, "tensor_known") else None
        for v in bounds:
            same = o.eq(v.lo, v.hi)
            exact = same if exact is None else o.band(exact, same)
        value = o.tensor_read(tensor, [v.lo for v in bounds])
        lo, hi = _BOUNDS[I32]
        return _Int(o.select(exact, value, o.const(lo)), o.select(exact, value, o.const(hi)), I32)

    def binary(self, e: ast.Binary, env: dict, ty: Ty) -> _Value:
        """A chain of operators (`ast.left_chain`), in a loop."""
        if e.op in ("&&", "||") and hasattr(self.o, "when"):
            operands, node = [e.right], e.left
            while isinstance(node, ast.Binary) and node.op == e.op and \
                    node not in self.literals:
                operands.append(node.right)
                node = node.left
            return self.logic_chain(e, [node, *reversed(operands)], env)
        first, ops = ast.left_chain(e, self.literals)
        value = self.expr(first, env)
        for op in ops:
            value = self.lift(self.binary_step(op, value, self.expr(op.right, env),
                                               self.types[op]), self.types[op])
        return value

    def logic_chain(self, op: ast.Binary, operands: list, env: dict) -> _Value:
        """`a && b && ...` (or `||`) where the backend evaluates a part only where it is
        needed (`when`: the classes kernel, whose tensor reads are loads): the operands
        that read no tensor first, then each of the others only where the result is still
        open (`&&`: may hold; `||`: may not), so a cell the indices decide (above a
        causal diagonal) reads nothing. Both connectives commute, so the order changes no
        bound."""
        o = self.o
        operands = sorted(operands, key=_reads_tensors)  # (stable: the source's order)
        value = self.expr(operands[0], env)
        for operand in operands[1:]:
            if _reads_tensors(operand):
                open_ = value.may if op.op == "&&" else o.bnot(value.must)
                right = _Bool(*o.when(open_, lambda x=operand: self.expr(x, env),
                                      (o.bconst(False),) * 2))
            else:
                right = self.expr(operand, env)
            value = self.lift(self.binary_step(op, value, right, self.types[op]),
                              self.types[op])
        return value

    def binary_step(self, e: ast.Binary, a: _Value, b: _Value, ty: Ty) -> _Value:
        o = self.o
        if e.op == "&&":
            return _Bool(o.band(a.may, b.may), o.band(a.must, b.must))
        if e.op == "||":
            return _Bool(o.bor(a.may, b.may), o.bor(a.must, b.must))
        if ty == BOOL:
            return self.compare(e.op, a, b, self.types[e.left], self.types[e.right])
        if ty == F32:
            return _FLOAT
        ty = attention_type(ty)
        return self.arith(e.op, self.lift(a, ty), self.lift(b, ty), ty)

    def compare(self, op: str, a: _Value, b: _Value, ta: Ty, tb: Ty) -> _Bool:
        o = self.o
        if ta == BOOL and tb == BOOL:  # == or != between booleans
            both = o.band(a.must, b.must)
            neither = o.band(o.bnot(a.may), o.bnot(b.may))
            may_eq = o.bor(o.band(a.may, b.may), o.band(o.bnot(a.must), o.bnot(b.must)))
            eq = _Bool(may_eq, o.bor(both, neither))
            return eq if op == "==" else _Bool(o.bnot(eq.must), o.bnot(eq.may))
        common = attention_type(unify(ta, tb))
        if common not in _BOUNDS:
            return self.top(BOOL)
        a, b = self.lift(a, common), self.lift(b, common)
        if op in ("==", "!="):
            may = o.band(o.le(a.lo, b.hi), o.le(b.lo, a.hi))
            must = o.band(o.band(o.eq(a.lo, a.hi), o.eq(b.lo, b.hi)), o.eq(a.lo, b.lo))
            return _Bool(may, must) if op == "==" else _Bool(o.bnot(must), o.bnot(may))
        if op in (">", ">="):
            a, b = b, a
        cmp = o.lt if _CMP[op] == "<" else o.le
        return _Bool(cmp(a.lo, b.hi), cmp(a.hi, b.lo))

    def arith(self, op: str, a: _Int, b: _Int, ty: Ty) -> _Int:
        o = self.o
        zero = o.const(0)
        if op == "+":
            return self.norm(o.add(a.lo, b.lo), o.add(a.hi, b.hi), ty)
        if op == "-":
            return self.norm(o.sub(a.lo, b.hi), o.sub(a.hi, b.lo), ty)
        if op == "*":
            if ty == U32:  # a u32 product may not fit the 64-bit bounds
                return self.full(ty)
            return self.hull([o.mul(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)], ty)
        if op in ("/", "%"):
            nonzero = o.bor(o.lt(zero, b.lo), o.lt(b.hi, zero))
            # Divide by 1 where the divisor may be 0: LLVM's division by zero is undefined even
            # in a result that is thrown away. The kernel's own result there is undefined too.
            dlo = o.select(o.eq(b.lo, zero), o.const(1), b.lo)
            dhi = o.select(o.eq(b.hi, zero), o.const(1), b.hi)
            if op == "/":  # truncating division is monotone in each operand: corners bound it
                corners = [o.div(x, y) for x in (a.lo, a.hi) for y in (dlo, dhi)]
                return self.guard(nonzero, self.hull(corners, ty))
            return self.guard(nonzero, self.remainder(a, b, dlo, ty))
        if op in ("<<", ">>"):
            in_range = o.band(o.le(zero, b.lo), o.le(b.hi, o.const(31)))
            slo = o.select(in_range, b.lo, zero)
            shi = o.select(in_range, b.hi, zero)
            shift = o.shl if op == "<<" else o.ashr
            corners = [shift(x, y) for x in (a.lo, a.hi) for y in (slo, shi)]
            return self.guard(in_range, self.hull(corners, ty))
        tmin, tmax = (o.const(v) for v in _BOUNDS[ty])
        a_nonneg, b_nonneg = o.le(zero, a.lo), o.le(zero, b.lo)
        both = o.band(a_nonneg, b_nonneg)
        if op == "&":  # a nonnegative operand bounds the result from above and below
            lo = o.select(o.bor(a_nonneg, b_nonneg), zero, tmin)
            hi = self.min(o.select(a_nonneg, a.hi, tmax), o.select(b_nonneg, b.hi, tmax))
            return _Int(lo, hi, ty)
        # For nonnegative operands: max(a, b) <= a | b <= a + b and 0 <= a ^ b <= a + b.
        lo = self.max(a.lo, b.lo) if op == "|" else zero
        return self.guard(both, self.norm(lo, o.add(a.hi, b.hi), ty))

    def remainder(self, a: _Int, b: _Int, dlo, ty: Ty) -> _Int:
        """C remainder: the dividend's sign, magnitude below the divisor's."""
        o = self.o
        zero = o.const(0)
        m = o.sub(o.select(o.lt(zero, b.lo), b.hi, o.sub(zero, b.lo)), o.const(1))
        lo = o.select(o.le(zero, a.lo), zero, self.max(a.lo, o.sub(zero, m)))
        hi = o.select(o.le(a.hi, zero), zero, self.min(a.hi, m))
        # One divisor and one quotient across the range: the remainder is a - q*d, exactly.
        q = o.div(a.lo, dlo)
        exact = o.band(o.eq(b.lo, b.hi), o.eq(q, o.div(a.hi, dlo)))
        qd = o.mul(q, dlo)
        return _Int(o.select(exact, o.sub(a.lo, qd), lo), o.select(exact, o.sub(a.hi, qd), hi), ty)

    def where(self, c: _Bool, a: _Value, b: _Value) -> _Value:
        o = self.o
        if isinstance(a, _Bool):
            may = o.bor(o.band(c.may, a.may), o.band(o.bnot(c.must), b.may))
            must = o.bor(o.bor(o.band(c.must, a.must), o.band(o.bnot(c.may), b.must)),
                         o.band(a.must, b.must))
            return _Bool(may, must)
        if isinstance(a, _Float):
            return _FLOAT
        # Definitely a, definitely b, or either: the hull.
        lo = o.select(c.must, a.lo, o.select(c.may, self.min(a.lo, b.lo), b.lo))
        hi = o.select(c.must, a.hi, o.select(c.may, self.max(a.hi, b.hi), b.hi))
        return _Int(lo, hi, a.ty)

    def call(self, e: ast.Call, name: str, env: dict, ty: Ty) -> _Value:
        args = [self.expr(x, env) for x in e.args]
        builtin = FUNCTIONS.get(name)
        if builtin is None:
            return self.top(ty)  # a user fn: not inlined
        return builtin.interval(self, args, [self.types[x] for x in e.args], ty)

    @staticmethod
    def interval(lo, hi, ty: Ty) -> _Int:
        """[lo, hi] of type `ty`, for the builtins' interval rules."""
        return _Int(lo, hi, ty)


def _inputs(b_lo, b_hi, h_lo, h_hi, q_lo, q_hi, kv_lo, kv_hi,
            seqlen_q, seqlen_k) -> dict[str, _Int]:
    """The environment of a mask rule, keyed by parameter role."""
    return {"b": _Int(b_lo, b_hi, I32), "h": _Int(h_lo, h_hi, I32),
            "q_idx": _Int(q_lo, q_hi, I32), "kv_idx": _Int(kv_lo, kv_hi, I32),
            "seqlen_q": _Int(seqlen_q, seqlen_q, I32), "seqlen_k": _Int(seqlen_k, seqlen_k, I32)}


def integer_operands(rule: ast.Rule, program: CheckedProgram) -> tuple[str, ...]:
    """The i32 operands of the declaration that `rule` reads, in order of first use: the
    classification's inputs beyond the box (an f32 operand bounds nothing)."""
    return _operands_read(rule, program, lambda ty: ty == I32)


def tensor_operands(rule: ast.Rule, program: CheckedProgram) -> tuple[str, ...]:
    """The tensor operands of the declaration that `rule` reads, in order of first use."""
    return _operands_read(rule, program, lambda ty: isinstance(ty, TensorTy))


def _operands_read(rule: ast.Rule, program: CheckedProgram, wanted) -> tuple[str, ...]:
    names: dict[str, None] = {}
    todo = list(reversed(rule.body))
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Name):
            sym = program.refs.get(node)
            if sym is not None and sym.kind == "operand" and wanted(sym.ty):
                names[sym.name] = None
        todo.extend(reversed(list(ast.children(node))))
    return tuple(names)


def _operand_env(names: tuple[str, ...], bounds: list) -> dict:
    """The environment entries of i32 operands `names`, each an interval (lo, hi)."""
    return {operand_key(n): _Int(lo, hi, I32) for n, (lo, hi) in zip(names, bounds)}


def _analyse(analysis: _Analysis, rule: ast.Rule, env: dict) -> _Bool:
    try:
        result = analysis.rule(rule, env)
    except Unsupported:
        return analysis.top(BOOL)
    return result if isinstance(result, _Bool) else analysis.top(BOOL)


# ------------------------------------------------------------------ public API
_compiled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _python_classifier(mask_rule: ast.Rule, program: CheckedProgram) -> Callable:
    """The analysis staged as a Python function of `_INPUTS` and, after them, the
    interval of each i32 operand the rule reads (`integer_operands`: lo and hi, by default
    the full range), then each tensor operand it reads (`tensor_operands`: a NumPy array of
    its i32 elements, by default None: unknown); built once per rule."""
    fn = _compiled.get(mask_rule)
    if fn is None:
        ops = _PyOps()
        analysis = _Analysis(ops, program)
        names = integer_operands(mask_rule, program)
        tensors = tensor_operands(mask_rule, program)
        bounds = [(f"_o{i}_lo", f"_o{i}_hi") for i in range(len(names))]
        env = {**_inputs(*_INPUTS), **_operand_env(names, bounds),
               **{operand_key(n): f"_t{i}" for i, n in enumerate(tensors)}}
        result = _analyse(analysis, mask_rule, env)
        params = [*_INPUTS, *(f"{lo}={I32_MIN}, {hi}={I32_MAX}" for lo, hi in bounds),
                  *(f"_t{i}=None" for i in range(len(tensors)))]
        source = (f"def classify({', '.join(params)}):\n" + "\n".join(ops.lines)
                  + f"\n    return bool({result.may}), bool({result.must})\n")
        namespace = {"_tdiv": _tdiv, "_trem": _trem, "_tread": _tread}
        exec(compile(source, f"<mask classifier {mask_rule.span!r}>", "exec"), namespace)
        fn = _compiled[mask_rule] = namespace["classify"]
        fn.operands, fn.tensors = names, tensors
    return fn


def operand_bounds(fn, operands: dict | None) -> list:
    """The classifier `fn`'s operand arguments for a call's `operands` (by name; one not
    given is unknown: an i32's full range, a tensor None)."""
    out = []
    for name in fn.operands:
        value = (operands or {}).get(name)
        out += [I32_MIN, I32_MAX] if value is None else [value, value]
    return out + [(operands or {}).get(name) for name in fn.tensors]


_bands: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # rule -> {key: band}

# A band of at most this many KV tiles of 128 keys a query tile is short: a design may build
# for it (sm90's `BAND_STAGES` and masks by bits, measured faster on the H200 for a window of
# 256 keys), and a call whose i32 operands make the mask one selects that build.
SHORT_BAND_TILES = 4


def kv_band_tiles(mask_rule: ast.Rule | None, program: CheckedProgram | None,
                  block: int = 128, operands: dict | None = None) -> int | None:
    """The KV tiles of `block` keys that a query tile of `block` rows in the middle of a long
    self-attention sequence visits, where that count does not grow with the sequence (a
    sliding window's band); None where it does (no mask, causal) or depends on an i32
    operand missing from `operands` (by name). Planned once per rule and operand values."""
    if mask_rule is None:
        return None
    bands = _bands.setdefault(mask_rule, {})
    key = (block, tuple(sorted((operands or {}).items())))
    if key not in bands:
        counts = {count_visited_kv_tiles(mask_rule, program, q_tile=n // (2 * block),
                                         block_m=block, block_n=block, seqlen_q=n, seqlen_k=n,
                                         operands=operands)
                  for n in (4096, 8192)}
        bands[key] = counts.pop() if len(counts) == 1 else None
    return bands[key]


def band_operands(mask_rule: ast.Rule | None, program: CheckedProgram) -> tuple[str, ...]:
    """The i32 operands whose values decide whether the mask is a short band
    (`SHORT_BAND_TILES`, a run-time window): those the mask reads, where its constants alone
    bound no band; () otherwise."""
    if mask_rule is None or kv_band_tiles(mask_rule, program) is not None:
        return ()
    return tuple(integer_operands(mask_rule, program))


def short_band(mask_rule: ast.Rule, program: CheckedProgram, operands: dict) -> bool:
    """Whether the mask, its i32 operands given these values, is a short band."""
    band = kv_band_tiles(mask_rule, program, operands=operands)
    return band is not None and band <= SHORT_BAND_TILES


def _range(v: int | None) -> tuple[int, int]:
    return (I32_MIN, I32_MAX) if v is None else (v, v)


def classify_bounds(mask_rule: ast.Rule, program: CheckedProgram, *, b: int | None,
                    h: int | None, q_lo: int, q_hi: int, kv_lo: int, kv_hi: int,
                    seqlen_q: int, seqlen_k: int,
                    operands: dict | None = None) -> tuple[bool, bool]:
    """`(may_be_true, always_true)` of the mask over the box; `b`/`h` None means any value,
    and so does an i32 operand missing from `operands` (by name).

    Ranges are inclusive and must be non-empty; all values are i32.
    """
    fn = _python_classifier(mask_rule, program)
    return fn(*_range(b), *_range(h), q_lo, q_hi, kv_lo, kv_hi, seqlen_q, seqlen_k,
              *operand_bounds(fn, operands))


def classify_tile(mask_rule: ast.Rule | None, program: CheckedProgram | None, *,
                  b: int | None, h: int | None, q_lo: int, q_hi: int, kv_lo: int, kv_hi: int,
                  seqlen_q: int, seqlen_k: int, operands: dict | None = None) -> str:
    """"empty", "full" or "partial" for the box; no mask (None) is full."""
    if mask_rule is None:
        return "full"
    may, must = classify_bounds(mask_rule, program, b=b, h=h, q_lo=q_lo, q_hi=q_hi,
                                kv_lo=kv_lo, kv_hi=kv_hi, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                                operands=operands)
    return "full" if must else "partial" if may else "empty"


def emit_classify(builder: ir.IRBuilder, mask_rule: ast.Rule, program: CheckedProgram,
                  b: ir.Value | None, h: ir.Value | None, q_lo: ir.Value, q_hi: ir.Value,
                  kv_lo: ir.Value, kv_hi: ir.Value, seqlen_q: ir.Value,
                  seqlen_k: ir.Value, operands: dict | None = None,
                  ops: IrOps | None = None) -> tuple[ir.Value, ir.Value]:
    """Emit the classification of one box at `builder`; i32 inputs, `(may_be_true,
    always_true)` as i1. `b`/`h` None means any value; `operands`: the i32 operands' values
    by name (the kernel's parameters: the box is classified for the call's values; a tensor
    left out is read as any value); `ops`: the IR backend (an `IrOps` at `builder` by
    default)."""
    ops = ops or IrOps(builder)

    def wide(v: ir.Value) -> ir.Value:
        return builder.sext(v, _I64)

    def interval(v: ir.Value | None) -> tuple[ir.Value, ir.Value]:
        return tuple(map(ops.const, _range(None))) if v is None else (wide(v), wide(v))

    analysis = _Analysis(ops, program)
    env = _inputs(*interval(b), *interval(h), wide(q_lo), wide(q_hi), wide(kv_lo),
                  wide(kv_hi), wide(seqlen_q), wide(seqlen_k))
    names = integer_operands(mask_rule, program)
    env.update(_operand_env(names, [interval(operands[n]) for n in names]))
    env.update((operand_key(n), operands[n]) for n in tensor_operands(mask_rule, program)
               if n in operands)
    result = _analyse(analysis, mask_rule, env)
    return result.may, result.must


def count_visited_kv_tiles(mask_rule: ast.Rule | None, program: CheckedProgram | None, *,
                           q_tile: int, block_m: int, block_n: int, seqlen_q: int,
                           seqlen_k: int, b: int = 0, h: int = 0,
                           operands: dict | None = None) -> int:
    """How many KV tiles a query tile must visit (the non-empty ones): the default cost;
    an i32 operand missing from `operands` is unknown."""
    q_lo = q_tile * block_m
    q_hi = min(q_lo + block_m, seqlen_q) - 1
    if q_lo > q_hi or seqlen_k <= 0:
        return 0
    num_tiles = -(-seqlen_k // block_n)
    if mask_rule is None:
        return num_tiles
    fn = _python_classifier(mask_rule, program)
    extra = operand_bounds(fn, operands)
    count = 0
    for j in range(num_tiles):
        kv_lo = j * block_n
        may, _ = fn(b, b, h, h, q_lo, q_hi, kv_lo, min(kv_lo + block_n, seqlen_k) - 1,
                    seqlen_q, seqlen_k, *extra)
        count += may
    return count
