"""A mask as a run of keys per query row, where it is one: the first and last key a row keeps
as linear forms of the row's indices and the declaration's i32 operands (`kv_limits`), and
those bounds emitted as IR (`emit_kv_limits`). A design that knows a row's run masks a
partial tile by bits, not by comparing every element (the `sm90` design)."""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from mhadsl.analysis.classify import Unsupported
from mhadsl.front import ast
from mhadsl.front.check import CheckedProgram
from mhadsl.front.semantics import I32_MAX, I32_MIN
from mhadsl.front.types import I32

_I64 = ir.IntType(64)

# The range of each index a mask reads: lengths below 2**31, indices below them.
_ROLE_RANGES = {"b": (0, I32_MAX), "h": (0, I32_MAX), "q_idx": (0, I32_MAX - 1),
                "kv_idx": (0, I32_MAX - 1), "seqlen_q": (0, I32_MAX), "seqlen_k": (0, I32_MAX)}
_Linear = tuple[tuple[str, int], ...]  # ((role, coefficient), ...); role "" is the constant


@dataclass(frozen=True)
class KVLimits:
    """A mask that keeps, in each query row, exactly the keys from the largest of `lows`
    to the smallest of `highs` (no low: from key 0; no high: to the sequence's end), each
    bound a linear form of the row's other indices. Exact: no sub-expression of the mask
    can leave the 32-bit range the kernel computes it in."""

    lows: tuple[_Linear, ...]
    highs: tuple[_Linear, ...]


_FLIPPED = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "=="}


def kv_limits(mask_rule: ast.Rule | None, program: CheckedProgram) -> KVLimits | None:
    """The mask as a run of keys per query row where it is one: a conjunction (`&&`) of
    comparisons (<, <=, >, >=, ==) whose sides are sums of i32 indices, i32 operands and
    integer literals (times literals), kv_idx on one side with coefficient 1
    (`kv_idx <= q_idx`, `q_idx - kv_idx < 256`, `q_idx - kv_idx < window`); None for any
    other mask, or one that might wrap. An operand's term is keyed `operand_term(name)`."""
    if mask_rule is None or len(mask_rule.body) != 1 \
            or not isinstance(mask_rule.body[0], ast.Return):
        return None
    bounds: dict[str, list[_Linear]] = {"lo": [], "hi": []}
    try:
        _conjunct(mask_rule.body[0].value, program, bounds)
    except Unsupported:
        return None
    return KVLimits(tuple(bounds["lo"]), tuple(bounds["hi"]))


def _conjunct(e: ast.Expr, program: CheckedProgram, bounds: dict) -> None:
    """Add the bounds on kv_idx that `e` (one conjunct of the mask) puts."""
    if e in program.literals or not isinstance(e, ast.Binary):
        raise Unsupported("not a comparison")
    if e.op == "&&":
        _conjunct(e.left, program, bounds)
        _conjunct(e.right, program, bounds)
        return
    if e.op not in _FLIPPED:
        raise Unsupported(f"operator {e.op}")
    left, right = _linear(e.left, program)[0], _linear(e.right, program)[0]
    diff = dict(left)
    for role, c in right.items():
        diff[role] = diff.get(role, 0) - c
    op, a = e.op, diff.pop("kv_idx", 0)  # a * kv_idx + rest OP 0
    if a not in (1, -1):
        raise Unsupported("kv_idx's coefficient")
    # kv_idx OP' bound, with bound = -rest / a
    bound = {role: -c * a for role, c in diff.items() if c}
    op = op if a == 1 else _FLIPPED[op]

    def shifted(k: int) -> _Linear:
        form = dict(bound)
        form[""] = form.get("", 0) + k
        return tuple(sorted((r, c) for r, c in form.items() if c or r == ""))
    if op in ("<", "<=", "=="):  # a strict bound moves by one key
        bounds["hi"].append(shifted(-1 if op == "<" else 0))
    if op in (">", ">=", "=="):
        bounds["lo"].append(shifted(1 if op == ">" else 0))


def operand_term(name: str) -> str:
    """The key of i32 operand `name` in a `KVLimits` form (apart from every role's)."""
    return f"operand {name}"


def _linear(e: ast.Expr, program: CheckedProgram) -> tuple[dict[str, int], int, int]:
    """(e as {role: coefficient}, its lowest and highest value) for a sum of i32 rule
    parameters, i32 operands (any i32) and integer literals, where no step leaves the i32
    range."""
    literal = program.literals.get(e)
    if isinstance(literal, int) and not isinstance(literal, bool):
        form, lo, hi = {"": literal}, literal, literal  # (an untyped literal takes i32 here)
    elif program.types.get(e) != I32:
        raise Unsupported("not i32")
    elif isinstance(e, ast.Name):
        sym = program.refs.get(e)
        if sym is not None and sym.kind == "operand":
            (lo, hi), form = (I32_MIN, I32_MAX), {operand_term(sym.name): 1}
        elif sym is None or sym.kind != "rule_param" or sym.node not in _ROLE_RANGES:
            raise Unsupported("a name other than a parameter or an operand")
        else:
            (lo, hi), form = _ROLE_RANGES[sym.node], {sym.node: 1}
    elif isinstance(e, ast.Unary) and e.op == "-":
        inner, ilo, ihi = _linear(e.operand, program)
        form, lo, hi = {r: -c for r, c in inner.items()}, -ihi, -ilo
    elif isinstance(e, ast.Binary) and e.op in ("+", "-", "*"):
        (fa, alo, ahi), (fb, blo, bhi) = _linear(e.left, program), _linear(e.right, program)
        if e.op == "*":
            if set(fa) == {""}:
                fa, alo, ahi, fb, blo, bhi = fb, blo, bhi, fa, alo, ahi
            if set(fb) != {""}:
                raise Unsupported("a product of two indices")
            k = fb[""]
            form = {r: c * k for r, c in fa.items()}
            lo, hi = sorted((alo * k, ahi * k))
        else:
            sign = 1 if e.op == "+" else -1
            form = dict(fa)
            for r, c in fb.items():
                form[r] = form.get(r, 0) + sign * c
            lo, hi = (alo + blo, ahi + bhi) if sign == 1 else (alo - bhi, ahi - blo)
    else:
        raise Unsupported(type(e).__name__)
    if lo < I32_MIN or hi > I32_MAX:
        raise Unsupported("may wrap")
    return form, lo, hi


def emit_kv_limits(builder: ir.IRBuilder, limits: KVLimits,
                   values: dict[str, ir.Value]) -> tuple[ir.Value | None, ir.Value | None]:
    """(first kept key, last kept key) of a query row as i32, None where the mask puts no
    such bound; `values`: the row's i32 indices by role, and the i32 operands' values by
    `operand_term`. Computed in 64 bits, then clamped
    to [0, I32_MAX] and [-1, I32_MAX] (a key index lies in [0, I32_MAX - 1])."""
    b = builder

    def form(terms: _Linear) -> ir.Value:
        total = ir.Constant(_I64, 0)
        for role, c in terms:
            term = ir.Constant(_I64, c) if role == "" else \
                b.mul(b.sext(values[role], _I64), ir.Constant(_I64, c))
            total = b.add(total, term)
        return total

    def fold(forms, pick, floor: int):
        if not forms:
            return None
        v = form(forms[0])
        for f in forms[1:]:
            w = form(f)
            v = b.select(b.icmp_signed(pick, v, w), v, w)
        for pick_, edge in ((">", floor), ("<", I32_MAX)):  # clamp into [floor, I32_MAX]
            c = ir.Constant(_I64, edge)
            v = b.select(b.icmp_signed(pick_, v, c), v, c)
        return b.trunc(v, ir.IntType(32))
    return fold(limits.lows, ">", 0), fold(limits.highs, "<", -1)
