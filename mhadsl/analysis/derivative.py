"""Symbolic differentiation of a score rule with respect to the score `s`.

`differentiate_score` turns a checked `score(s, b, h, q_idx, kv_idx)` rule into the rule
that computes d score / d s, made of ordinary checked AST: the reference evaluates it and
the lowering compiles it like any score rule. It works in forward mode: every expression
`e` that depends on `s` gets an expression for de/ds, by the sum, product and quotient
rules and, for a builtin call, the builtin's own derivative (`mhadsl.front.builtin_functions`,
where the one-sided conventions at kinks are written down). Expressions that do not depend
on `s` have derivative 0, so integer index arithmetic is never differentiated; results are
simplified as they are built (0 * x, 1 * x, x + 0, ...), so `score = s` gives 1.

A `var` that depends on s carries a derivative `var` beside it: each assignment to it is
preceded by one to its derivative, from the values before the assignment (`x *= 2.0` after
`dx = dx * 2.0`), so the derivative follows every branch the value takes.

What cannot be differentiated is an error at its place in the source: `s` turned into an
integer or a bool (`i32(s)`, `s > 0` feeding arithmetic; `where` and `if` conditions are
fine), or flowing through a fn call or a loop (not supported yet).
"""
from __future__ import annotations

from dataclasses import replace

from mhadsl.front import ast
from mhadsl.front.builtin_functions import FUNCTIONS
from mhadsl.front.check import CheckedProgram, Symbol
from mhadsl.front.diagnostics import DiagnosticSink
from mhadsl.front.types import BOOL, F32, TYPE_NAMES, Ty


def differentiate_score(rule: ast.Rule, program: CheckedProgram, read: ast.Index | None = None
                        ) -> tuple[ast.Rule, CheckedProgram]:
    """The rule computing d score / d s (with `read`, one of `float_reads(rule, program)`:
    d score / d the tensor element that read gives), and `program` extended with its new
    expressions' types and names. Raises `MhaError` for what cannot be differentiated."""
    d = _Differentiator(rule, program, read)
    body = d.block(rule.body)
    d.sink.raise_if_any()
    derived = replace(program, types={**program.types, **d.types},
                      refs={**program.refs, **d.refs})
    return ast.Rule(rule.span, rule.name, rule.params, body), derived


def read_operand(read: ast.Index) -> str:
    """The name of the tensor a read (`t[i][j]`) picks its element from."""
    while isinstance(read, ast.Index):
        read = read.obj
    return read.id


def float_reads(rule: ast.Rule, program: CheckedProgram) -> tuple[ast.Index, ...]:
    """The reads of f32 tensor operands in a score rule's body, in source order: each the
    outermost index of its chain (`bias[h][i]`). (A fn sees no operand: what it gets of one
    is a value the rule read, which `differentiate_score` follows into the call.)"""
    found = []
    todo = list(reversed(rule.body))
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Index) and program.types.get(node) == F32:
            found.append(node)
            todo.extend(reversed(_indices(node)))
        else:
            todo.extend(reversed(list(ast.children(node))))
    return tuple(found)


def _indices(read: ast.Index) -> list[ast.Expr]:
    out = []
    while isinstance(read, ast.Index):
        out.append(read.index)
        read = read.obj
    return out[::-1]


class _Differentiator:
    """Builds derivative expressions (the `d` the builtins' derivative rules are written
    against) and simplifies them as it goes."""

    def __init__(self, rule: ast.Rule, program: CheckedProgram, read: ast.Index | None):
        self.program, self.span = program, rule.span
        self.read = read  # the variable: this tensor read, or (None) the score s
        self.wrt = "s" if read is None else f"operand '{read_operand(read)}'"
        self.types: dict[ast.Expr, Ty] = {}  # of the expressions made here
        self.refs: dict[ast.Name, Symbol] = {}
        self.sink = DiagnosticSink()
        self.dependent: dict[ast.Expr, bool] = {}
        self.local_derivatives: dict[ast.Let, ast.Let] = {}  # of the f32 locals that depend on s
        self.dependent_vars: set[ast.Let] = set()  # the vars whose value may depend on s
        self._find_dependent_vars(rule.body)

    # ---- statements
    def block(self, stmts: tuple[ast.Stmt, ...]) -> tuple[ast.Stmt, ...]:
        out: list[ast.Stmt] = []
        for s in stmts:
            if isinstance(s, ast.Let):
                out.append(s)
                # An integer or bool local is differentiated only if arithmetic uses it.
                local_type = TYPE_NAMES[s.type.name] if s.type else self.type(s.value)
                if self.depends_local(s) and local_type == F32:
                    derivative = ast.Let(s.span, f"d{s.name}/ds", None, self.of(s.value),
                                         s.mutable)
                    out.append(derivative)
                    self.local_derivatives[s] = derivative
            elif isinstance(s, ast.If):
                out.append(ast.If(s.span, s.cond, self.block(s.then), self.block(s.orelse)))
            elif isinstance(s, ast.Return):
                out.append(ast.Return(s.span, self.of(s.value)))
            elif isinstance(s, ast.Assign):
                derivative = self.local_derivatives.get(self.program.refs[s.target].node)
                if derivative is not None:  # (before the value it reads changes)
                    out.append(ast.Assign(s.span, self.name(derivative), "=",
                                          self.assigned(s, derivative)))
                out.append(s)
            elif isinstance(s, ast.While):
                self.sink.error(s.span, "cannot differentiate the score through a while "
                                        "loop (not supported yet)")
            else:
                out.append(s)  # a call for nothing: attention code has no effects
        return tuple(out)

    def assigned(self, s: ast.Assign, derivative: ast.Let) -> ast.Expr:
        """The derivative of what assignment `s` gives its variable, from the values before
        it (`derivative`: the variable's)."""
        d_value = self.of(s.value)
        if s.op == "=":
            return d_value
        d_old, old = self.name(derivative), s.target
        if s.op in ("+=", "-="):
            return self.add(d_old, d_value) if s.op == "+=" else self.sub(d_old, d_value)
        if s.op == "*=":
            return self.add(self.mul(d_old, s.value), self.mul(old, d_value))
        assert s.op == "/=", s.op  # (the checker allows no other operator on an f32)
        return self.sub(self.div(d_old, s.value),
                        self.div(self.mul(old, d_value), self.mul(s.value, s.value)))

    def _find_dependent_vars(self, body: tuple[ast.Stmt, ...]) -> None:
        """Fill `dependent_vars`: the `var`s whose value may depend on the variable, from
        their first value or any assignment, through each other, to a fixed point."""
        assigned: dict[ast.Let, list[ast.Expr]] = {}
        todo = list(body)
        while todo:
            node = todo.pop()
            if isinstance(node, ast.Let) and node.mutable:
                assigned.setdefault(node, []).append(node.value)
            elif isinstance(node, ast.Assign):
                assigned.setdefault(self.program.refs[node.target].node, []).append(node.value)
            elif isinstance(node, ast.If):
                todo.extend((*node.then, *node.orelse))
        while True:
            self.dependent.clear()  # (answers given before a var joined may have changed)
            grown = {var for var, values in assigned.items() if var not in self.dependent_vars
                     and any(self.depends(v) for v in values)}
            if not grown:
                return
            self.dependent_vars |= grown

    # ---- what depends on s
    def depends_local(self, let: ast.Let) -> bool:
        return let in self.dependent_vars if let.mutable else self.depends(let.value)

    def depends(self, e) -> bool:
        if e not in self.dependent:
            self.dependent[e] = self._depends(e)
        return self.dependent[e]

    def _depends(self, e) -> bool:
        if e is self.read:
            return True
        if isinstance(e, ast.Name):
            sym = self.program.refs.get(e)
            if sym is None:
                return False
            if sym.kind == "local":
                return self.depends_local(sym.node)
            return self.read is None and sym.kind == "rule_param" and sym.node == "s"
        return any(self.depends(child) for child in ast.children(e))

    def type(self, e: ast.Expr) -> Ty:
        return self.types.get(e) or self.program.types[e]

    # ---- derivatives
    def of(self, e: ast.Expr) -> ast.Expr:
        """de/ds as an f32 expression."""
        if not self.depends(e):
            return self.const(0.0)
        if self.type(e) != F32:
            return self.not_differentiable(e)
        if e is self.read:
            return self.const(1.0)
        if isinstance(e, ast.Index):  # an element picked by an index made from the variable
            return self.not_differentiable(e.index)
        if isinstance(e, ast.Name):
            sym = self.program.refs[e]
            if sym.kind == "rule_param":
                return self.const(1.0)
            return self.name(self.local_derivatives[sym.node])
        if isinstance(e, ast.Unary):  # only "-" applies to f32
            return self.neg(self.of(e.operand))
        if isinstance(e, ast.Binary):
            return self.binary(e)
        assert isinstance(e, ast.Call) and isinstance(e.func, ast.Name)
        builtin = FUNCTIONS.get(e.func.id)
        if builtin is None:
            self.sink.error(e.span, f"cannot differentiate the score through fn "
                                    f"'{e.func.id}' (not supported yet)")
            return self.const(0.0)
        return builtin.derivative(self, *e.args)

    def binary(self, e: ast.Binary) -> ast.Expr:
        a, b = e.left, e.right
        da, db = self.of(a), self.of(b)
        if e.op in ("+", "-"):
            return self.add(da, db) if e.op == "+" else self.sub(da, db)
        if e.op == "*":
            return self.add(self.mul(da, b), self.mul(a, db))
        assert e.op == "/"
        return self.sub(self.div(da, b), self.div(self.mul(a, db), self.mul(b, b)))

    def not_differentiable(self, e: ast.Expr) -> ast.Expr:
        """Report where the variable becomes an integer or a bool inside `e`."""
        at = self.culprit(e)
        what = {ast.Call: lambda: f"'{at.func.id}'", ast.Binary: lambda: f"'{at.op}'",
                ast.Unary: lambda: f"'{at.op}'"}.get(type(at), lambda: "this")()
        kind = "a bool" if self.type(at) == BOOL else "an integer"
        self.sink.error(at.span, f"cannot differentiate the score with respect to "
                                 f"{self.wrt}: {what} makes {kind} of a value computed from "
                                 f"{'s' if self.read is None else 'it'}")
        return self.const(0.0)

    def culprit(self, e: ast.Expr) -> ast.Expr:
        """The innermost non-f32 expression in `e` with an f32 operand that depends on s."""
        if isinstance(e, ast.Name):
            sym = self.program.refs[e]
            return self.culprit(sym.node.value) if sym.kind == "local" else e
        for child in ast.children(e):
            if self.depends(child):
                return e if self.type(child) == F32 else self.culprit(child)
        return e

    # ---- the expressions the derivative is made of (also used by builtins' rules)
    def node(self, e: ast.Expr, ty: Ty = F32) -> ast.Expr:
        self.types[e] = ty
        return e

    def const(self, value: float) -> ast.Expr:
        return self.node(ast.FloatLit(self.span, value))

    def name(self, let: ast.Let) -> ast.Expr:
        """Local `let`, to read or assign."""
        e = self.node(ast.Name(let.span, let.name))
        self.refs[e] = Symbol("local", let.name, F32, let, let.mutable)
        return e

    def may_be_nan(self, e: ast.Expr) -> bool:
        """Whether `e` could be a NaN: an f32 value that is no literal."""
        return self.type(e) == F32 and not isinstance(e, (ast.FloatLit, ast.IntLit))

    def value_of(self, e: ast.Expr) -> float | None:
        return e.value if isinstance(e, ast.FloatLit) else None

    def as_f32(self, e: ast.Expr) -> ast.Expr:
        """`e` as an f32 value: a derivative that is an integer factor (d(s * q_idx)) must
        still compute in f32 where it meets another integer."""
        if self.type(e) == F32:
            return e
        return self.node(ast.Call(e.span, ast.Name(e.span, "f32"), (e,), ()))

    def add(self, a: ast.Expr, b: ast.Expr) -> ast.Expr:
        if self.value_of(a) == 0.0:
            return self.as_f32(b)
        if self.value_of(b) == 0.0:
            return self.as_f32(a)
        return self.node(ast.Binary(self.span, "+", a, b))

    def sub(self, a: ast.Expr, b: ast.Expr) -> ast.Expr:
        return self.add(a, self.neg(b))  # exactly a - b in floating point

    def neg(self, a: ast.Expr) -> ast.Expr:
        if self.value_of(a) is not None:
            return self.const(-a.value)
        return self.node(ast.Unary(self.span, "-", self.as_f32(a)))

    def mul(self, a: ast.Expr, b: ast.Expr) -> ast.Expr:
        if 0.0 in (self.value_of(a), self.value_of(b)):
            return self.const(0.0)
        if self.value_of(a) == 1.0:
            return self.as_f32(b)
        if self.value_of(b) == 1.0:
            return self.as_f32(a)
        return self.node(ast.Binary(self.span, "*", self.as_f32(a), b))

    def div(self, a: ast.Expr, b: ast.Expr) -> ast.Expr:
        if self.value_of(a) == 0.0:
            return self.const(0.0)
        if self.value_of(b) == 1.0:
            return self.as_f32(a)
        return self.node(ast.Binary(self.span, "/", self.as_f32(a), b))

    def compare(self, op: str, a: ast.Expr, b: ast.Expr) -> ast.Expr:
        return self.node(ast.Binary(self.span, op, a, b), BOOL)

    def call(self, name: str, *args: ast.Expr) -> ast.Expr:
        return self.node(ast.Call(self.span, ast.Name(self.span, name), args, ()))

    def where(self, cond: ast.Expr, a: ast.Expr, b: ast.Expr) -> ast.Expr:
        if self.value_of(a) is not None and self.value_of(a) == self.value_of(b):
            return a
        return self.call("where", cond, a, b)
