"""Typed, frozen AST of a `.mha` file. Every node carries the `Span` it came from.

Nodes compare and hash by identity (``eq=False``) so later stages can key side tables
(types, constant values) on them.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass

from mhadsl.front.diagnostics import Span

node = dataclass(frozen=True, eq=False)


# ---------------------------------------------------------------- expressions
@node
class Expr:
    span: Span


@node
class IntLit(Expr):
    value: int


@node
class FloatLit(Expr):
    value: float


@node
class BoolLit(Expr):
    value: bool


@node
class NoneLit(Expr):
    pass


@node
class Name(Expr):
    id: str


@node
class Attr(Expr):
    obj: Expr
    name: str


@node
class Index(Expr):
    obj: Expr
    index: Expr


@node
class Keyword:
    span: Span
    name: str
    value: Expr


@node
class Call(Expr):
    func: Expr
    args: tuple[Expr, ...]
    kwargs: tuple[Keyword, ...]


@node
class Unary(Expr):
    op: str  # "-", "!", "~"
    operand: Expr


@node
class Binary(Expr):
    op: str  # "+", "-", "*", "/", "%", "<<", ">>", "&", "|", "^", "<", ..., "&&", "||"
    left: Expr
    right: Expr


def left_chain(e: Binary, stop=()) -> tuple[Expr, list[Binary]]:
    """`((a + b) * c) - d` as its first operand `a` and its operators, innermost first.

    Operators of one precedence parse left-nested, so a flat 5,000-term sum is a chain
    5,000 deep on its left: walkers loop over the chain instead of recursing into it, and
    only other nesting counts against the depth limit (`continues_chain`). Nodes in
    `stop` (constants the checker folded) end the chain as operands.
    """
    ops = []
    while isinstance(e, Binary) and e not in stop:
        ops.append(e)
        e = e.left
    ops.reverse()
    return e, ops


def continues_chain(parent, child) -> bool:
    """Whether `child` is the next link of `parent`'s `left_chain` (no deeper nesting)."""
    return isinstance(parent, Binary) and isinstance(child, Binary) and child is parent.left


@node
class Tuple(Expr):
    items: tuple[Expr, ...]


# ---------------------------------------------------------------- statements
@node
class Stmt:
    span: Span


@node
class Let(Stmt):
    name: str
    type: TypeRef | None
    value: Expr
    mutable: bool  # `var` is mutable, `let` is not


@node
class Assign(Stmt):
    target: Expr  # Name, Attr or Index
    op: str  # "=" or a compound operator such as "+="
    value: Expr


@node
class If(Stmt):
    cond: Expr
    then: tuple[Stmt, ...]
    orelse: tuple[Stmt, ...]


@node
class While(Stmt):
    cond: Expr
    body: tuple[Stmt, ...]


@node
class Return(Stmt):
    value: Expr


@node
class ExprStmt(Stmt):
    expr: Expr


# ---------------------------------------------------------------- declarations
@node
class TypeRef:
    span: Span
    name: str
    axes: tuple[str, ...] = ()  # a tensor operand's axes (`i32[batch]`)


@node
class Param:
    span: Span
    name: str
    type: TypeRef
    default: Expr | None


@node
class RuleParam:
    span: Span
    name: str


@node
class Rule:
    """``name(params) = expr`` or ``name(params) { stmts }``; the expr form is a return."""

    span: Span
    name: str
    params: tuple[RuleParam, ...]
    body: tuple[Stmt, ...]


@node
class Constant:
    """``name = expr`` inside a declaration body (``may_advance = true``, ``dtype = bf16``)."""

    span: Span
    name: str
    value: Expr


@node
class Decl:
    span: Span
    name: str


@node
class SchedulerDecl(Decl):
    params: tuple[Param, ...]
    constants: tuple[Constant, ...]
    rules: tuple[Rule, ...]


@node
class FnDecl(Decl):
    params: tuple[Param, ...]
    ret: TypeRef
    body: tuple[Stmt, ...]


@node
class AttentionDecl(Decl):
    operands: tuple[Param, ...]  # run-time values its mask and score read
    constants: tuple[Constant, ...]
    rules: tuple[Rule, ...]


@node
class Import:
    span: Span
    path: str


@node
class Module:
    """One parsed file: its imports and declarations in source order."""

    span: Span
    imports: tuple[Import, ...]
    decls: tuple[Decl, ...]


@functools.cache
def _child_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.name not in ("span", "axes"))


def children(node) -> Iterator:
    """The AST nodes directly inside `node`, in source order (for walks without recursion)."""
    for name in _child_fields(type(node)):
        value = getattr(node, name)
        if isinstance(value, tuple):
            yield from value
        elif isinstance(value, _NODES):
            yield value


_NODES = (Expr, Stmt, Keyword, TypeRef, Param, RuleParam, Rule, Constant, Decl, Import)
