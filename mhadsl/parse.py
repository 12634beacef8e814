"""Parse driver: `.mha` text -> `ast.Module`, and import resolution.

Lark runs in LALR mode with positions propagated; the tree is turned into frozen AST
nodes by a Transformer applied after parsing. Syntax errors become `MhaError`s.
"""
from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from mhadsl import ast
from mhadsl.diagnostics import Diagnostic, MhaError, Source, Span

STD_PREFIX = "std/"

# Terminal names as a user reads them in "expected ..." messages.
_TOKEN_WORDS = {
    "NAME": "a name", "INT": "a number", "HEX": "a number", "FLOAT": "a number",
    "STRING": "a string", "LBRACE": "'{'", "RBRACE": "'}'", "LPAR": "'('", "RPAR": "')'",
    "LSQB": "'['", "RSQB": "']'", "COMMA": "','", "COLON": "':'", "EQUAL": "'='",
    "SEMICOLON": "';'", "DOT": "'.'", "__ANON_0": "'->'", "$END": "end of file",
}


@functools.cache
def _parser() -> Lark:
    grammar = resources.files("mhadsl.grammar").joinpath("mha.lark").read_text()
    return Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=True)


_BINARY = {
    "or_": "||", "and_": "&&", "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">",
    "ge": ">=", "bor": "|", "bxor": "^", "band": "&", "shl": "<<", "shr": ">>", "add": "+",
    "sub": "-", "mul": "*", "div": "/", "mod": "%",
}
_UNARY = {"neg": "-", "not_": "!", "bitnot": "~"}


class _ToAst(Transformer):
    """Builds AST nodes bottom-up; every node gets the span of its first token."""

    def __init__(self, source: Source):
        super().__init__()
        self.source = source

    def _span(self, meta_or_token) -> Span:
        line = getattr(meta_or_token, "line", None)
        if line is None:  # empty production: no position
            return Span(self.source, 1, 1)
        return Span(self.source, line, meta_or_token.column,
                    getattr(meta_or_token, "end_line", line) or line,
                    getattr(meta_or_token, "end_column", 0) or 0)

    def __default__(self, data, children, meta):
        if data in _BINARY:
            return ast.Binary(self._span(meta), _BINARY[data], children[0], children[1])
        if data in _UNARY:
            return ast.Unary(self._span(meta), _UNARY[data], children[0])
        raise AssertionError(f"grammar rule without a builder: {data}")

    # --- atoms
    @v_args(inline=True, meta=True)
    def int_lit(self, meta, tok: Token):
        return ast.IntLit(self._span(tok), int(tok, 0))

    @v_args(inline=True, meta=True)
    def float_lit(self, meta, tok: Token):
        return ast.FloatLit(self._span(tok), float(tok))

    @v_args(meta=True)
    def true_lit(self, meta, _):
        return ast.BoolLit(self._span(meta), True)

    @v_args(meta=True)
    def false_lit(self, meta, _):
        return ast.BoolLit(self._span(meta), False)

    @v_args(meta=True)
    def none_lit(self, meta, _):
        return ast.NoneLit(self._span(meta))

    @v_args(inline=True)
    def name(self, tok: Token):
        return ast.Name(self._span(tok), str(tok))

    @v_args(meta=True)
    def tuple(self, meta, items):
        return ast.Tuple(self._span(meta), tuple(i for i in items if i is not None))

    @v_args(inline=True, meta=True)
    def attr(self, meta, obj, tok: Token):
        return ast.Attr(self._span(meta), obj, str(tok))

    @v_args(inline=True, meta=True)
    def index(self, meta, obj, idx):
        return ast.Index(self._span(meta), obj, idx)

    @v_args(meta=True)
    def call(self, meta, children):
        func, *args = children
        args = [a for a in args if a is not None]
        positional = tuple(a for a in args if not isinstance(a, ast.Keyword))
        keywords = tuple(a for a in args if isinstance(a, ast.Keyword))
        return ast.Call(self._span(meta), func, positional, keywords)

    @v_args(inline=True)
    def keyword(self, tok: Token, value):
        return ast.Keyword(self._span(tok), str(tok), value)

    # --- statements
    @v_args(inline=True, meta=True)
    def let_stmt(self, meta, name, typ, value):
        return ast.Let(self._span(meta), str(name), typ, value, mutable=False)

    @v_args(inline=True, meta=True)
    def var_stmt(self, meta, name, typ, value):
        return ast.Let(self._span(meta), str(name), typ, value, mutable=True)

    @v_args(inline=True, meta=True)
    def assign_stmt(self, meta, target, op, value):
        return ast.Assign(self._span(meta), target, op, value)

    @v_args(inline=True)
    def assign_op(self, tok: Token):
        return str(tok)

    @v_args(inline=True, meta=True)
    def return_stmt(self, meta, value):
        return ast.Return(self._span(meta), value)

    @v_args(inline=True, meta=True)
    def expr_stmt(self, meta, expr):
        return ast.ExprStmt(self._span(meta), expr)

    @v_args(inline=True, meta=True)
    def if_stmt(self, meta, cond, then, orelse):
        if isinstance(orelse, ast.If):
            orelse = (orelse,)
        return ast.If(self._span(meta), cond, then, orelse or ())

    @v_args(inline=True, meta=True)
    def while_stmt(self, meta, cond, body):
        return ast.While(self._span(meta), cond, body)

    def block(self, stmts):
        return tuple(stmts)

    # --- declarations
    @v_args(inline=True)
    def type(self, tok: Token):
        return ast.TypeRef(self._span(tok), str(tok))

    @v_args(inline=True)
    def param(self, name: Token, typ, default):
        return ast.Param(self._span(name), str(name), typ, default)

    def params(self, items):
        return tuple(p for p in items if p is not None)

    @v_args(inline=True)
    def rule_param(self, tok: Token):
        return ast.RuleParam(self._span(tok), str(tok))

    @v_args(inline=True)
    def constant(self, name: Token, value):
        return ast.Constant(self._span(name), str(name), value)

    def rule_expr(self, children):
        name, *params, value = children
        return ast.Rule(self._span(name), str(name), tuple(p for p in params if p is not None),
                        (ast.Return(value.span, value),))

    def rule_block(self, children):
        name, *params, body = children
        return ast.Rule(self._span(name), str(name), tuple(p for p in params if p is not None),
                        body)

    @v_args(inline=True)
    def import_decl(self, tok: Token):
        return ast.Import(self._span(tok), str(tok)[1:-1])

    def scheduler_decl(self, children):
        name, params, *members = children
        return ast.SchedulerDecl(
            self._span(name), str(name), params or (),
            tuple(m for m in members if isinstance(m, ast.Constant)),
            tuple(m for m in members if isinstance(m, ast.Rule)))

    def attention_decl(self, children):
        name, *members = children
        return ast.AttentionDecl(
            self._span(name), str(name),
            tuple(m for m in members if isinstance(m, ast.Constant)),
            tuple(m for m in members if isinstance(m, ast.Rule)))

    @v_args(inline=True)
    def fn_decl(self, name: Token, params, ret, body):
        return ast.FnDecl(self._span(name), str(name), params, ret, body)

    def start(self, items):
        return ast.Module(Span(self.source, 1, 1),
                          tuple(i for i in items if isinstance(i, ast.Import)),
                          tuple(i for i in items if isinstance(i, ast.Decl)))


def _syntax_error(source: Source, err: UnexpectedInput) -> MhaError:
    span = Span(source, err.line if err.line > 0 else 1, err.column if err.column > 0 else 1)
    if isinstance(err, UnexpectedCharacters):
        message = f"unexpected character {source.text[err.pos_in_stream]!r}"
    elif isinstance(err, UnexpectedEOF):
        message = "unexpected end of file"
        lines = source.text.splitlines() or [""]
        span = Span(source, len(lines), len(lines[-1]) + 1)
    else:
        assert isinstance(err, UnexpectedToken)
        tok = err.token
        if tok.type == "$END":
            message = "unexpected end of file"
            lines = source.text.splitlines() or [""]
            span = Span(source, len(lines), len(lines[-1]) + 1)
        else:
            message = f"unexpected {tok!s}" if tok.type in ("NAME", "INT", "FLOAT", "HEX") \
                else f"unexpected '{tok!s}'"
        expected = sorted({_TOKEN_WORDS.get(t, repr(_parser().get_terminal(t).pattern.value)
                                            if _is_literal(t) else t.lower())
                           for t in err.expected})
        if expected and len(expected) <= 8:
            message += f"; expected {', '.join(expected)}"
    return MhaError(Diagnostic(span, f"syntax error: {message}"))


def _is_literal(terminal: str) -> bool:
    try:
        return _parser().get_terminal(terminal).pattern.type == "str"
    except KeyError:
        return False


def parse_source(source: Source) -> ast.Module:
    """Parse one file's text; raise `MhaError` on a syntax error."""
    try:
        tree = _parser().parse(source.text)
    except UnexpectedInput as err:
        raise _syntax_error(source, err) from None
    return _ToAst(source).transform(tree)


def load_program(text: str, name: str, base_dir: Path) -> list[ast.Module]:
    """Parse a file and, transitively, everything it imports (each file once)."""
    modules: list[ast.Module] = []
    seen: set[str] = set()

    def visit(source: Source, directory: Path | None) -> None:
        module = parse_source(source)
        for imp in module.imports:
            key, loaded = _resolve_import(imp, directory)
            if key not in seen:
                seen.add(key)
                visit(loaded, None if key.startswith(STD_PREFIX) else Path(key).parent)
        modules.append(module)

    seen.add(name)
    visit(Source(name, text), base_dir)
    return modules


def _resolve_import(imp: ast.Import, directory: Path | None) -> tuple[str, Source]:
    if imp.path.startswith(STD_PREFIX):
        file = resources.files("mhadsl").joinpath("std", imp.path[len(STD_PREFIX):])
        if not file.is_file():
            raise MhaError(f"no standard library file '{imp.path}'", imp.span)
        return imp.path, Source(imp.path, file.read_text())
    path = (directory or Path.cwd()) / imp.path
    try:
        text = path.read_text()
    except OSError as err:
        raise MhaError(f"cannot import '{imp.path}': {err.strerror}", imp.span) from None
    return str(path.resolve()), Source(str(path), text)
