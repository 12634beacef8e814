"""Parse driver: `.mha` text -> `ast.Module`, and import resolution.

Lark runs in LALR mode with positions propagated; the tree is turned into frozen AST
nodes by a non-recursive Transformer applied after parsing. Syntax errors become
`MhaError`s. Nothing here recurses on the input's nesting, and the AST's nesting is
bounded (`MAX_EXPR_DEPTH`, `MAX_STMT_DEPTH`) so the recursive walkers of later stages
(checker, lowering, simulator, reference) stay far from Python's recursion limit. A flat
chain of operators (`a + b - c + ...`) is not nesting: the walkers loop over it
(`ast.left_chain`), so its length is not limited.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from lark import Lark, Token, Transformer_NonRecursive, v_args
from lark.parsers.lalr_analysis import Shift
from lark.exceptions import (
    UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError,
)

from mhadsl.front import ast
from mhadsl.front.diagnostics import Diagnostic, MhaError, Source, Span
from mhadsl.front.sources import read_source_file

STD_PREFIX = "std/"
STD_DIR = Path(__file__).resolve().parent.parent / "std"
# Operators and calls nested in one expression (a flat chain `a + b + c` is one level),
# and `if`/`while` blocks nested in one body (an `else if` nests in its `else`). Far past
# any hand-written code, and low enough
# that every later stage's recursive walk fits Python's default recursion limit.
MAX_EXPR_DEPTH = 100
MAX_STMT_DEPTH = 50
# Tokens (names, numbers, operators) a program may hold, imports included. The parser keeps
# about 750 bytes a token until the AST is built (16 MB of schedulers took 3.3 GB), so this
# keeps reading under ~300 MB; 2,000 small schedulers are 270,000 tokens.
MAX_TOKENS = 300_000

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


@functools.cache
def _keyword_terminals() -> dict[str, str]:
    """The grammar's reserved words by their terminals' names."""
    return {t.name: t.pattern.value for t in _parser().terminals
            if t.pattern.type == "str" and t.pattern.value.isidentifier()}


@functools.cache
def keywords() -> frozenset[str]:
    """The language's reserved words (`if`, `let`, `true`, ...), read from the grammar."""
    return frozenset(_keyword_terminals().values())


class _ToAst(Transformer_NonRecursive):
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

    def _declared_name(self, tok: Token) -> str:
        """A name being declared; the contextual lexer reads a keyword as a name where
        the keyword cannot stand, but a variable named `if` could never be used."""
        if tok in keywords():
            raise MhaError(f"'{tok}' is a keyword and cannot be used as a name", self._span(tok))
        return str(tok)

    # --- atoms
    @v_args(inline=True, meta=True)
    def int_lit(self, meta, tok: Token):
        # Nothing in the language is wider than 64 bits; longer digit strings are not even
        # converted (Python refuses to convert over 4,300 decimal digits).
        base = 16 if tok[:2].lower() == "0x" else 10
        digits = (tok[2:] if base == 16 else tok).lstrip("0") or "0"
        if len(digits) > (16 if base == 16 else 20) or int(digits, base) >= 2**64:
            raise MhaError("integer constant does not fit in 64 bits", self._span(tok))
        return ast.IntLit(self._span(tok), int(digits, base))

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
        return ast.Let(self._span(meta), self._declared_name(name), typ, value, mutable=False)

    @v_args(inline=True, meta=True)
    def var_stmt(self, meta, name, typ, value):
        return ast.Let(self._span(meta), self._declared_name(name), typ, value, mutable=True)

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
    def type(self, children):
        tok, *axes = children
        return ast.TypeRef(self._span(tok), str(tok),
                           tuple(str(a) for a in axes if a is not None))

    @v_args(inline=True)
    def param(self, name: Token, typ, default):
        return ast.Param(self._span(name), self._declared_name(name), typ, default)

    def params(self, items):
        return tuple(p for p in items if p is not None)

    @v_args(inline=True)
    def rule_param(self, tok: Token):
        return ast.RuleParam(self._span(tok), self._declared_name(tok))

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
            self._span(name), self._declared_name(name), params or (),
            tuple(m for m in members if isinstance(m, ast.Constant)),
            tuple(m for m in members if isinstance(m, ast.Rule)))

    def attention_decl(self, children):
        name, params, *members = children
        return ast.AttentionDecl(
            self._span(name), self._declared_name(name), params or (),
            tuple(m for m in members if isinstance(m, ast.Constant)),
            tuple(m for m in members if isinstance(m, ast.Rule)))

    @v_args(inline=True)
    def fn_decl(self, name: Token, params, ret, body):
        return ast.FnDecl(self._span(name), self._declared_name(name), params, ret, body)

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
    """Parse one file's text; raise `MhaError` on a syntax error, too deep nesting or more
    than MAX_TOKENS tokens.

    A leading byte-order mark is dropped, and CR LF and a lone CR (old Mac files) end lines
    as LF does: the grammar and the diagnostics count lines by LF alone.
    """
    return _parse(source, MAX_TOKENS)[0]


def _parse(source: Source, max_tokens: int) -> tuple[ast.Module, int]:
    """`parse_source`, stopping at the first token past `max_tokens` (what is left of the
    program's MAX_TOKENS); the module and how many tokens it holds."""
    text = source.text.removeprefix("\ufeff")
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if text != source.text:
        source = dataclasses.replace(source, text=text)
    tokens = 0
    try:
        with no_cyclic_gc():
            parser = _parser().parse_interactive(source.text)
            keyword_types = _keyword_terminals()
            for token in parser.lexer_thread.lex(parser.parser_state):
                tokens += 1
                if tokens > max_tokens:
                    raise MhaError(f"too much source: a program holds at most {MAX_TOKENS} "
                                   f"tokens (names, numbers, operators), imports included",
                                   Span(source, token.line, token.column))
                if token.type in keyword_types:
                    token = _keyword_or_name(parser.parser_state, token)
                parser.feed_token(token)
            module = _ToAst(source).transform(parser.feed_eof())
    except UnexpectedInput as err:
        raise _syntax_error(source, err) from None
    except VisitError as err:
        if isinstance(err.orig_exc, MhaError):
            raise err.orig_exc from None
        raise
    _check_nesting(module)
    return module, tokens


def _keyword_or_name(state, token: Token) -> Token:
    """`token`, a keyword, as the parser in `state` takes it: a name where it takes a name
    and not the keyword. (LALR merges the states after a block's '}', so the contextual
    lexer offers a declaration's keyword where a body takes a name: `scheduler = LPT()`
    after a rule written as a block.)"""
    if _shifts(state, token.type) or not _shifts(state, "NAME"):
        return token
    return Token.new_borrow_pos("NAME", token, token)


def _shifts(state, terminal: str) -> bool:
    """Whether the parser in `state` takes `terminal` next, its reductions played on a copy
    of its state stack alone (the values' trees are shared and would change)."""
    table, stack = state.parse_conf.states, state.state_stack
    copied = False
    while (action := table[stack[-1]].get(terminal)) is not None:
        kind, arg = action
        if kind is Shift:
            return True
        if not copied:
            stack, copied = list(stack), True
        if arg.expansion:
            del stack[-len(arg.expansion):]
        stack.append(table[stack[-1]][arg.origin.name][1])
    return False


@contextlib.contextmanager
def no_cyclic_gc():
    """Pause the cyclic garbage collector while a stage builds millions of objects that
    all stay alive (a parse tree, an LLVM IR module): it would only rescan them, over and
    over, and its time grows faster than the input (twice the parse time; 10 times the
    lowering of 600 schedulers)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _check_nesting(module: ast.Module) -> None:
    """Bound how deep statements and expressions nest, walking without recursion."""
    stack = [(decl, 0, 0) for decl in module.decls]
    while stack:
        node, exprs, stmts = stack.pop()
        if isinstance(node, ast.Expr):
            exprs += 1
            if exprs > MAX_EXPR_DEPTH:
                raise MhaError(f"expression nested too deeply (limit {MAX_EXPR_DEPTH} "
                               f"operators or calls inside each other)", node.span)
        elif isinstance(node, ast.Stmt):
            exprs, stmts = 0, stmts + 1
            if stmts > MAX_STMT_DEPTH:
                raise MhaError(f"statements nested too deeply (limit {MAX_STMT_DEPTH} blocks "
                               f"inside each other; an 'else if' counts as one)", node.span)
        # Reversed, so nodes come off the stack in source order: the first too deep is reported.
        stack.extend(reversed([(child, exprs - ast.continues_chain(node, child), stmts)
                               for child in ast.children(node)]))


def load_program(text: str, name: str, base_dir: Path,
                 include_dirs: Sequence[str | os.PathLike] = ()) -> list[ast.Module]:
    """Parse a file and, transitively, everything it imports: each file once, after the
    files it imports. An import cycle is an error naming the chain.

    An import names a file of the standard library (`std/...`), or a file inside the
    importing file's folder or one of `include_dirs`, searched in that order.
    """
    include_dirs = tuple(_real_path(d) for d in include_dirs)
    modules: list[ast.Module] = []
    loaded: set[str] = set()
    top_key = name if name.startswith(STD_PREFIX) else str(_real_path(base_dir / Path(name).name))
    # The files being loaded (each importing the next), with their imports still to visit.
    top, tokens = _parse(Source(name, text), MAX_TOKENS)
    chain = [(top_key, top, base_dir)]
    pending = [iter(chain[0][1].imports)]
    while chain:
        key, module, directory = chain[-1]
        imp = next(pending[-1], None)
        if imp is None:
            chain.pop(), pending.pop()
            loaded.add(key)
            modules.append(module)
            continue
        imp_key, file = _resolve_import(imp, directory, include_dirs)
        if imp_key in loaded:
            continue
        keys = [k for k, _, _ in chain]
        if imp_key in keys:
            names = [m.span.source.name for _, m, _ in chain[keys.index(imp_key):]]
            raise MhaError(f"import cycle: {' -> '.join(names + [names[0]])}", imp.span)
        try:
            source = read_source_file(file, imp_key)
        except OSError as err:
            raise MhaError(f"cannot import '{_shown(imp.path)}': {err.strerror}", imp.span) from None
        imported, more = _parse(source, MAX_TOKENS - tokens)
        tokens += more
        chain.append((imp_key, imported, file.parent))
        pending.append(iter(imported.imports))
    return modules


def _shown(path: str, most: int = 200) -> str:
    """An import's path as a message quotes it: the caret already points at the whole."""
    return path if len(path) <= most else f"{path[:most]}... ({len(path)} characters)"


def _real_path(path: str | os.PathLike) -> Path:
    """The path with every symbolic link resolved (a loop of links is left as it is)."""
    return Path(os.path.realpath(path))


def std_file(name: str) -> Path | None:
    """The file of standard-library name `std/...`; None when it would lie outside the
    standard library's folder (a name with `..`)."""
    file = _real_path(STD_DIR / name[len(STD_PREFIX):])
    return file if file.is_relative_to(STD_DIR) else None


def _resolve_import(imp: ast.Import, directory: Path, include_dirs: tuple[Path, ...]
                    ) -> tuple[str, Path]:
    """What identifies an imported file (its standard-library name or resolved path), and
    the file. A path that leads out of the folders an import may read is an `MhaError`:
    symbolic links are resolved first, so neither `..` nor a link escapes."""
    if "\0" in imp.path:
        raise MhaError("cannot import a path with a NUL character", imp.span)
    if imp.path.startswith(STD_PREFIX):
        file = std_file(imp.path)
        if file is None or not os.path.isfile(file):  # False, not OSError, for a name too long
            raise MhaError(f"no standard library file '{_shown(imp.path)}'", imp.span)
        return STD_PREFIX + file.relative_to(STD_DIR).as_posix(), file
    folders = (_real_path(directory), *include_dirs)
    candidates = [_real_path(folder / imp.path) for folder in folders]
    file = next((c for c in candidates if os.path.exists(c)), candidates[0])  # as above
    if not any(file.is_relative_to(folder) for folder in folders):
        raise MhaError(f"cannot import '{_shown(imp.path)}': it is outside the importing file's folder "
                       f"and the include folders (add one with -I DIR, or include_dirs= in "
                       f"mhadsl.compile)", imp.span)
    return str(file), file
