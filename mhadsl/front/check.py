"""Semantic checks: names, types, rules, arity, constants, where builtins may be used.

`check_program` walks every declaration once, reports every error it finds through a
`DiagnosticSink` (so one run lists them all) and returns a `CheckedProgram`: the
declarations by name plus side tables the lowering reads (each expression's type and
what each name refers to). Whether some kernel design runs an attention declaration is
asked of the caller's `design_problems` (the code generator's), so checking needs no code
generator.

It stays one module because the checker is one class: its methods walk declarations,
statements and expressions into one another and share its scopes, error count and side
tables.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from mhadsl.front import ast
from mhadsl.front.attention_spec import (
    API_KEYWORDS, ATTENTION_CONSTANTS, CALL_KEYWORDS, HEAD_DIMS, OPERAND_TYPES, AttentionOptions,
    constant_number, operand_key, resolve_attention, scale_problem,
)
from mhadsl.front.builtin_functions import DEVICE_FUNCTIONS, FUNCTIONS
from mhadsl.front.semantics import (
    ATTENTION, BUILTIN_VALUES, COMPARISONS, COMPILE_TIME_VALUES, DEVICE,
    FLOAT_OPS, HOST, INT_RANGES, INTEGER_ONLY_OPS, LITERAL_LIMIT, SLOT_COUNT, LiteralError,
    finite_f32, fits, fold_literal,
)
from mhadsl.front.diagnostics import DiagnosticSink, MhaError, Source, Span
from mhadsl.front.parse import MAX_EXPR_DEPTH, MAX_STMT_DEPTH
from mhadsl.front.types import (
    BOOL, DIM3, ERROR, F32, GRID, I32, INT_LITERAL, INTEGERS, MUTABLE_FIELDS,
    NONE, NUMBERS, RECORD_FIELDS, RECORD_PROPERTIES, SCHEDULE, SEQ_INFO,
    SLOTS, STATE, SYNC, TILE_SUMMARY, TILE_SUMMARY_FIELDS, TILE_SUMMARY_METHODS,
    POSITION_AXES, TENSOR_AXES, TYPE_NAMES, U32, VOID, WORK_INFO, TensorTy, Ty, tensor_type,
    unify,
)


@dataclass(frozen=True)
class RuleSpec:
    params: tuple[tuple[str, Ty], ...]
    returns: tuple[Ty, ...]
    context: str


# The trait's methods (BRIEF §3). Parameter names are the trait's; users may rename them.
SCHEDULER_RULES: dict[str, RuleSpec] = {
    "grid_dim": RuleSpec((("batch_size", U32), ("max_num_prompt_tiles", U32)), (GRID,), HOST),
    "initial_state": RuleSpec((("slots", SLOTS), ("ts", TILE_SUMMARY)), (STATE,), DEVICE),
    "get_current_work_info": RuleSpec((("ts", TILE_SUMMARY), ("state", STATE)), (WORK_INFO,),
                                      DEVICE),
    "advance": RuleSpec((("ts", TILE_SUMMARY), ("state", STATE), ("pipeline_idx", U32)),
                        (SEQ_INFO, NONE), DEVICE),
    "unsafe_seq_info": RuleSpec((("ts", TILE_SUMMARY), ("state", STATE)), (SEQ_INFO,), DEVICE),
    # decode: KV splits per (sequence, K/V head, query-row tile) group; `num_heads` is the
    # K/V heads there, 0 asks for the planner's default (`mhadsl.host.serving.default_splits`)
    "kv_splits": RuleSpec((("batch_size", U32), ("max_seq_len", U32)), (U32,), HOST),
}
OPTIONAL_RULES = ("kv_splits",)
SCHEDULER_CONSTANTS = {"may_advance": BOOL, "schedule": SCHEDULE}

ATTENTION_RULES: dict[str, tuple[tuple[tuple[str, Ty], ...], ...]] = {
    "mask": ((("b", I32), ("h", I32), ("q_idx", I32), ("kv_idx", I32)),
             (("b", I32), ("h", I32), ("q_idx", I32), ("kv_idx", I32), ("seqlen_q", I32),
              ("seqlen_k", I32))),
    "score": ((("s", F32), ("b", I32), ("h", I32), ("q_idx", I32), ("kv_idx", I32)),),
    # an attention sink: a logit per (sequence, query head) that joins every row's softmax
    # denominator and adds nothing to its output
    "sink": ((("b", I32), ("h", I32)),),
}
ATTENTION_RESULTS = {"mask": BOOL, "score": F32, "sink": F32}
# Names every mask/score body sees besides its parameters.
ATTENTION_IMPLICIT = {"seqlen_q": I32, "seqlen_k": I32}
MAX_TENSOR_AXES = 3

DTYPES = ("bf16", "fp16")
# Fns are inlined where they are called, and lowered by a recursive walk: a body with its
# calls inlined may nest about as deep as the parser lets one body nest, and its size is
# bounded so that a chain of fns each calling the last twice cannot grow exponentially.
MAX_INLINED_DEPTH = MAX_EXPR_DEPTH + MAX_STMT_DEPTH + 10
MAX_INLINED_NODES = 20_000
# An attention kernel evaluates its mask and score for every element of its register tiles
# (tens of copies, unrolled), and LLVM's optimiser grows faster than their size: a mask of
# 50 terms built in 2 s, 300 terms (600 nodes) in 15 s, 900 in 95 s, and 5,000 ran for
# minutes and once overflowed the stack. Masks and scores people write have tens of nodes.
MAX_KERNEL_RULE_NODES = 600
# `compile` builds a kernel of each scheduler and each attention declaration (imports
# included): about 1 MB and 10 ms a small scheduler, 1.7 kB per expression and statement of
# its rules once fns are inlined, 5 MB and 2 s an attention kernel. The scheduler limits keep
# the largest program's trace module well under 500 MB (2,000 schedulers took 1.8 GB).
MAX_SCHEDULERS = 64
MAX_SCHEDULER_NODES = 80_000
MAX_ATTENTIONS = 64
DECLARATION_LIMITS = {ast.SchedulerDecl: (MAX_SCHEDULERS, "schedulers"),
                      ast.AttentionDecl: (MAX_ATTENTIONS, "attention kernels")}

# What a declaration's name would hide; a cast (`u32`) is a function before it is a type.
BUILTIN_KINDS = {**{name: "type" for name in TYPE_NAMES},
                 **{name: "name" for name in BUILTIN_VALUES},
                 **{name: "function" for name in (*FUNCTIONS, *DEVICE_FUNCTIONS)}}

# Why no kernel design runs an attention declaration: its problems (each with the
# `settings` at fault and a `message`), empty when some design does.
DesignProblems = Callable[[AttentionOptions], list]


@dataclass(frozen=True)
class Symbol:
    """What a name refers to. `node` is the declaring AST node, where there is one."""

    kind: str  # local | rule_param | operand | sched_param | fn_param | constant | builtin
    name: str
    ty: Ty
    node: object = None
    mutable: bool = False


@dataclass
class CheckedProgram:
    schedulers: dict[str, ast.SchedulerDecl] = field(default_factory=dict)
    fns: dict[str, ast.FnDecl] = field(default_factory=dict)
    attentions: dict[str, ast.AttentionDecl] = field(default_factory=dict)
    types: dict[ast.Expr, Ty] = field(default_factory=dict)
    refs: dict[ast.Name, Symbol] = field(default_factory=dict)
    # For each rule: the role of each of its parameters ("ts", "state", ...).
    rule_roles: dict[ast.Rule, tuple[str, ...]] = field(default_factory=dict)
    # Every file the program loaded (its text is part of every build's cache key).
    sources: tuple[Source, ...] = ()
    # The exact value of every expression made of integer literals alone (a bool for a
    # comparison of two): they fold before they meet a type (mhadsl.front.semantics).
    literals: dict[ast.Expr, int | bool] = field(default_factory=dict)


class _Scope:
    def __init__(self, parent: _Scope | None = None):
        self.parent, self.names = parent, {}

    def lookup(self, name: str) -> Symbol | None:
        scope = self
        while scope is not None:
            if name in scope.names:
                return scope.names[name]
            scope = scope.parent
        return None


# Values of scheduler code that attention code (mask, score, sink) may not hold: records
# and grids (the reference and the attention lowering know none of them).
_SCHEDULER_VALUES = frozenset((WORK_INFO, SEQ_INFO, STATE, TILE_SUMMARY, SLOTS, GRID))


@dataclass
class _Context:
    where: str  # HOST, DEVICE or ATTENTION
    rule: str  # rule or fn name, for messages and rule-only builtins
    returns: tuple[Ty, ...]
    default_int: Ty = U32
    # Why threads of one CTA may be on different paths here (a barrier would hang), or None.
    divergent: str | None = None


class Checker:
    """Walks declarations and expressions; the one place user errors are found."""

    def __init__(self, sink: DiagnosticSink, design_problems: DesignProblems):
        self.sink = sink
        self.design_problems = design_problems
        self.out = CheckedProgram()
        self.checked_fns: set[str] = set()  # a fn may only call fns checked before it
        self.errors = 0  # found so far (the sink may keep fewer)
        # The value of every f32 expression of literals alone: checked to stay finite.
        self.float_constants: dict[ast.Expr, float] = {}

    def error(self, span: Span, message: str) -> Ty:
        self.errors += 1
        self.sink.error(span, message)
        return ERROR

    # ------------------------------------------------------------ declarations
    def check_modules(self, modules: list[ast.Module]) -> CheckedProgram:
        self.out.sources = tuple(m.span.source for m in modules)
        seen: dict[str, ast.Decl] = {}
        for module in modules:
            for decl in module.decls:
                if decl.name in BUILTIN_KINDS:
                    # Not declared: the builtin keeps its meaning everywhere, std included.
                    self.error(decl.span, f"'{decl.name}' is a builtin "
                                          f"{BUILTIN_KINDS[decl.name]} and cannot be redefined")
                    continue
                if decl.name in seen:
                    self.error(decl.span, f"'{decl.name}' is already declared at "
                                          f"{seen[decl.name].span!r}")
                    continue
                seen[decl.name] = decl
                table = {ast.SchedulerDecl: self.out.schedulers, ast.FnDecl: self.out.fns,
                         ast.AttentionDecl: self.out.attentions}[type(decl)]
                table[decl.name] = decl
                limit, what = DECLARATION_LIMITS.get(type(decl), (0, ""))
                if limit and len(table) == limit + 1:
                    self.error(decl.span, f"too many {what}: a program declares at most "
                                          f"{limit}, imports included (each is compiled to a "
                                          f"kernel of its own)")
        for fn in self.out.fns.values():
            self.check_fn(fn)
        for sched in self.out.schedulers.values():
            self.check_scheduler(sched)
        for attn in self.out.attentions.values():
            self.check_attention(attn)
        self.check_inlining()
        self.check_attention_loops()
        return self.out

    def check_inlining(self) -> None:
        """Bound how deep and how big each body grows once the fns it calls are inlined."""
        # fn -> (depth, nodes) with its calls inlined; None once reported (its callers are not).
        inlined: dict[str, tuple[int, int] | None] = {}
        for fn in self.out.fns.values():
            inlined[fn.name] = self.inlined_size(fn.body, inlined, fn.span, f"fn '{fn.name}'")
        # (too many schedulers are reported already, as such)
        total, reported = 0, len(self.out.schedulers) > MAX_SCHEDULERS
        for decl in self.out.schedulers.values():
            for part in ast.children(decl):
                size = self.inlined_size((part,), inlined, part.span, f"'{part.name}'")
                total += size[1] if size else 0
            if total > MAX_SCHEDULER_NODES and not reported:
                reported = True
                self.error(decl.span, f"the schedulers up to '{decl.name}' are too big "
                                      f"together: {total} expressions and statements once the "
                                      f"fns they call are inlined (limit {MAX_SCHEDULER_NODES} "
                                      f"in a program, imports included)")
        for decl in self.out.attentions.values():
            for part in ast.children(decl):
                self.inlined_size((part,), inlined, part.span, f"'{part.name}'",
                                  MAX_KERNEL_RULE_NODES, ": the kernel evaluates it for every "
                                  "element of its register tiles")

    def check_attention_loops(self) -> None:
        """Refuse `while` in mask and score rules and in the fns they call, transitively: they
        run once per (query, key) pair, and the kernel has no fuel to stop an endless loop."""
        # fn -> the first `while` it runs and the fns that lead there from it, or None.
        loops: dict[str, tuple[ast.While, tuple[str, ...]] | None] = {}
        for fn in self.out.fns.values():
            found = self.first_loop(fn.body, loops)
            loops[fn.name] = None if found is None else (found[0], (fn.name, *found[1]))
        for attn in self.out.attentions.values():
            for rule in attn.rules:
                found = self.first_loop((rule,), loops)
                if found is None:
                    continue
                loop, chain = found
                rule_name = f"attention '{attn.name}''s {rule.name}"
                where = f"in {rule_name}"
                if chain:
                    *via, holder = chain
                    where = f"fn '{holder}' is called by {rule_name}"
                    if via:
                        names = ", ".join(f"'{name}'" for name in via)
                        where += f" through fn{'s' if len(via) > 1 else ''} {names}"
                self.error(loop.span, f"`while` loops are not allowed in a mask or score rule, "
                                      f"nor in a fn one calls ({where}): these rules run once "
                                      f"per (query, key) pair")

    @staticmethod
    def first_loop(roots, loops: dict) -> tuple[ast.While, tuple[str, ...]] | None:
        """The first `while` in source order that `roots` run, directly or in a fn they call
        (only fns in `loops`: a call of any other is an error already), with that chain."""
        stack = list(reversed(roots))
        while stack:
            node = stack.pop()
            if isinstance(node, ast.While):
                return node, ()
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and loops.get(node.func.id):
                return loops[node.func.id]
            stack.extend(reversed(list(ast.children(node))))
        return None

    def inlined_size(self, roots, inlined: dict[str, tuple[int, int] | None], span: Span,
                     what: str, max_nodes: int = MAX_INLINED_NODES, why: str = ""
                     ) -> tuple[int, int] | None:
        """Walks without recursion; only calls to earlier fns inline (others are errors)."""
        depth = nodes = 0
        calls_reported = False
        stack = [(root, 1) for root in roots]
        while stack:
            node, level = stack.pop()
            nodes += 1
            depth = max(depth, level)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in inlined:
                callee = inlined[node.func.id]
                if callee is None:
                    calls_reported = True
                else:
                    depth, nodes = max(depth, level + callee[0]), nodes + callee[1]
            stack.extend((child, level + 1 - ast.continues_chain(node, child))
                         for child in ast.children(node))
        if calls_reported:
            return None
        if depth > MAX_INLINED_DEPTH:
            self.error(span, f"{what} nests {depth} levels deep once the fns it calls are "
                             f"inlined (limit {MAX_INLINED_DEPTH})")
        elif nodes > max_nodes:
            self.error(span, f"{what} is too big: {nodes} expressions and statements once the "
                             f"fns it calls are inlined (limit {max_nodes}{why})")
        else:
            return depth, nodes
        return None

    def check_type_ref(self, ref: ast.TypeRef) -> Ty:
        ty = TYPE_NAMES.get(ref.name)
        if ty and ref.axes:
            return self.error(ref.span, f"'{ref.name}[...]' is a tensor: only an attention "
                                        f"declaration's operand is one")
        return ty if ty else self.error(ref.span, f"unknown type '{ref.name}'")

    def operand_type(self, p: ast.Param) -> Ty:
        """An operand's type: a run-time i32 or f32, or a tensor of them along axes."""
        ref = p.type
        ty = TYPE_NAMES.get(ref.name)
        if ty is None:
            return self.error(ref.span, f"unknown type '{ref.name}'")
        if ty not in OPERAND_TYPES.values():
            return self.error(ref.span, f"operand '{p.name}' is {ty}; an attention operand is "
                                        f"a run-time {' or '.join(OPERAND_TYPES)}, or a "
                                        f"tensor of them (i32[batch], f32[heads, _])")
        if not ref.axes:
            return ty
        for axis in ref.axes:
            if axis not in TENSOR_AXES:
                return self.error(ref.span, f"unknown axis '{axis}' of tensor operand "
                                            f"'{p.name}': an axis is batch (one per sequence), "
                                            f"heads (one per query head), queries or keys (one "
                                            f"per query row or key, as q and k lay them out) "
                                            f"or _ (any size)")
        for axis in POSITION_AXES:
            if ref.axes.count(axis) > 1:
                return self.error(ref.span, f"tensor operand '{p.name}' has two {axis} axes; "
                                            f"a tensor follows the call's {axis} once")
        if len(ref.axes) > MAX_TENSOR_AXES:
            return self.error(ref.span, f"tensor operand '{p.name}' has {len(ref.axes)} axes; "
                                        f"at most {MAX_TENSOR_AXES}")
        if p.default is not None:
            self.error(p.default.span, f"tensor operand '{p.name}' takes no default: every "
                                       f"call passes it")
        return tensor_type(ty, ref.axes)

    def check_fn(self, fn: ast.FnDecl) -> None:
        scope = _Scope()
        for p in fn.params:
            ty = self.check_type_ref(p.type)
            if p.default is not None:
                self.error(p.default.span, "fn parameters take no default value")
            self.declare(scope, p.span, Symbol("fn_param", p.name, ty, p))
        ret = self.check_type_ref(fn.ret)
        ctx = _Context(DEVICE, fn.name, (ret,))
        self.check_body(fn.body, scope, ctx, fn.span, f"fn '{fn.name}'")
        self.checked_fns.add(fn.name)

    def scheduler_scope(self, sched: ast.SchedulerDecl) -> _Scope:
        scope = _Scope()
        param_ctx = _Context(HOST, sched.name, ())
        for p in sched.params:
            ty = self.check_type_ref(p.type)
            if p.default is not None:
                self.expect_value(p.default, self.expr(p.default, scope, param_ctx), ty,
                                  f"default of parameter '{p.name}'")
            self.declare(scope, p.span, Symbol("sched_param", p.name, ty, p))
        for c in sched.constants:
            if c.name not in SCHEDULER_CONSTANTS:
                self.error(c.span, f"unknown scheduler constant '{c.name}'; expected "
                                   f"{' or '.join(SCHEDULER_CONSTANTS)}")
                continue
            ty = SCHEDULER_CONSTANTS[c.name]
            self.expect(self.expr(c.value, scope, param_ctx), ty, c.value.span, f"'{c.name}'")
            self.declare(scope, c.span, Symbol("constant", c.name, ty, c))
        for name, ty in SCHEDULER_CONSTANTS.items():
            if scope.lookup(name) is None:
                self.error(sched.span, f"scheduler '{sched.name}' does not define '{name}'")
        return scope

    def check_scheduler(self, sched: ast.SchedulerDecl) -> None:
        scope = self.scheduler_scope(sched)
        seen: dict[str, ast.Rule] = {}
        for rule in sched.rules:
            spec = SCHEDULER_RULES.get(rule.name)
            if spec is None:
                self.error(rule.span, f"unknown rule '{rule.name}'; a scheduler defines "
                                      f"{', '.join(SCHEDULER_RULES)}")
                continue
            if rule.name in seen:
                self.error(rule.span, f"rule '{rule.name}' is defined twice")
                continue
            seen[rule.name] = rule
            self.check_rule(rule, spec.params, spec.returns, spec.context, scope)
        for name in SCHEDULER_RULES:
            if name not in seen and name not in OPTIONAL_RULES:
                self.error(sched.span, f"scheduler '{sched.name}' is missing rule '{name}'")

    def check_rule(self, rule: ast.Rule, params, returns, where: str, outer: _Scope,
                   default_int: Ty = U32) -> None:
        if len(rule.params) != len(params):
            self.error(rule.span, f"rule '{rule.name}' takes {len(params)} parameters "
                                  f"({', '.join(n for n, _ in params)}), got {len(rule.params)}")
            return
        scope = _Scope(outer)
        for p, (role, ty) in zip(rule.params, params):
            self.declare(scope, p.span, Symbol("rule_param", p.name, ty, role))
        self.out.rule_roles[rule] = tuple(role for role, _ in params)
        ctx = _Context(where, rule.name, returns, default_int)
        self.check_body(rule.body, scope, ctx, rule.span, f"rule '{rule.name}'")

    def check_attention(self, attn: ast.AttentionDecl) -> None:
        errors_before = self.errors
        seen: set[str] = set()
        for c in attn.constants:
            if c.name in seen:
                self.error(c.span, f"'{c.name}' is set twice")
            seen.add(c.name)
            self.check_attention_constant(c)
        outer = self.attention_scope(attn)
        for rule in attn.rules:
            if rule.name not in ATTENTION_RULES:
                self.error(rule.span, f"unknown rule '{rule.name}' in an attention "
                                      f"declaration; expected mask, score or sink")
                continue
            if rule.name in seen:
                self.error(rule.span, f"rule '{rule.name}' is defined twice")
            seen.add(rule.name)
            shapes = ATTENTION_RULES[rule.name]
            params = next((s for s in shapes if len(s) == len(rule.params)), shapes[0])
            for p in rule.params:
                if p.name in outer.names and outer.names[p.name].kind == "operand":
                    self.error(p.span, f"'{p.name}' is an operand of attention "
                                       f"'{attn.name}'; give the parameter another name")
            self.check_rule(rule, params, (ATTENTION_RESULTS[rule.name],), ATTENTION, outer,
                            default_int=I32)
        if self.errors == errors_before:
            self.check_attention_backends(attn)

    def attention_scope(self, attn: ast.AttentionDecl) -> _Scope:
        """What the mask and score rules see besides their parameters: the implicit
        lengths, and the declaration's operands (run-time values of each call: an i32 or
        an f32, with an optional constant default)."""
        scope = _Scope()
        for name, ty in ATTENTION_IMPLICIT.items():
            scope.names[name] = Symbol("rule_param", name, ty, name)
        for p in attn.operands:
            ty = self.operand_type(p)
            if p.name in CALL_KEYWORDS:
                self.error(p.span, f"'{p.name}' is an argument of every kernel call; give "
                                   f"the operand another name")
            elif p.name in API_KEYWORDS:
                self.error(p.span, f"'{p.name}' is a parameter of the calls that take "
                                   f"operands by name (the kernel's, its backward's, the "
                                   f"references'); give the operand another name")
            elif p.name in FUNCTIONS or p.name in DEVICE_FUNCTIONS:
                self.error(p.span, f"'{p.name}' is a builtin function; give the operand "
                                   f"another name")
            if p.default is not None and ty in OPERAND_TYPES.values():
                self.check_operand_default(p, ty)
            self.declare(scope, p.span, Symbol("operand", p.name, ty, operand_key(p.name)))
        return scope

    def check_operand_default(self, p: ast.Param, ty: Ty) -> None:
        """An operand's default is a constant of its type."""
        errors_before = self.errors
        got = self.expr(p.default, _Scope(), _Context(HOST, p.name, (), I32))
        if self.errors != errors_before:
            return
        if ty == I32:
            self.expect_value(p.default, got, I32, f"default of operand '{p.name}'")
            if self.errors == errors_before and not isinstance(self.out.literals.get(p.default),
                                                               int):
                self.error(p.default.span, f"the default of operand '{p.name}' must be an "
                                           f"integer constant")
            return
        if got not in NUMBERS:
            self.error(p.default.span, f"the default of operand '{p.name}' must be a number")
            return
        try:  # (the checker has refused a constant that is no finite f32)
            constant_number(p.default, number=True)
        except MhaError as err:
            for d in err.diagnostics:
                self.error(d.span, d.message)

    def check_attention_backends(self, attn: ast.AttentionDecl) -> None:
        """Ask the kernel designs (the one place their limits live) whether any of them runs
        the declaration on a target we build for; if none does, say why at the setting at
        fault, so `check` rejects what a build would."""
        try:
            options = resolve_attention(attn)
        except MhaError as err:
            for d in err.diagnostics:
                self.error(d.span, d.message)
            return
        if problems := self.design_problems(options):
            for d in options.backend_error(problems).diagnostics:
                self.error(d.span, d.message)

    def check_attention_constant(self, c: ast.Constant) -> None:
        if c.name not in ATTENTION_CONSTANTS:
            self.error(c.span, f"unknown attention setting '{c.name}'; expected one of "
                               f"{', '.join(ATTENTION_CONSTANTS)}")
            return
        if c.name == "scheduler":
            self.check_scheduler_binding(c.value)
            return
        if c.name == "dtype":
            if not (isinstance(c.value, ast.Name) and c.value.id in DTYPES):
                self.error(c.value.span, f"dtype must be one of {', '.join(DTYPES)}")
            return
        errors_before = self.errors
        ty = self.expr(c.value, _Scope(), _Context(HOST, c.name, (), I32))
        want = ATTENTION_CONSTANTS[c.name]
        if want == "int_pair":
            if not (isinstance(c.value, ast.Tuple) and len(c.value.items) == 2
                    and all(isinstance(i, ast.IntLit) for i in c.value.items)):
                self.error(c.value.span, f"'{c.name}' must be a pair of integers, like (128, 64)")
            elif any(i.value % 16 or not 16 <= i.value <= 256 for i in c.value.items):
                self.error(c.value.span, "tile sizes must be multiples of 16 between 16 and 256")
        elif want == F32:
            if ty not in (*NUMBERS, ERROR):
                self.error(c.value.span, f"'{c.name}' must be a number")
            elif c.name == "scale" and self.errors == errors_before:
                self.check_scale(c.value)
        elif want == BOOL:
            if not isinstance(c.value, ast.BoolLit):
                self.error(c.value.span, f"'{c.name}' must be true or false")
        elif not isinstance(c.value, ast.IntLit):
            self.error(c.value.span, f"'{c.name}' must be an integer constant")
        elif c.name == "head_dim" and c.value.value not in HEAD_DIMS:
            self.error(c.value.span, f"head_dim must be one of {', '.join(map(str, HEAD_DIMS))}")
        elif c.value.value < 1:
            self.error(c.value.span, f"'{c.name}' must be at least 1")

    def tensor_read(self, e: ast.Index, tensor: TensorTy, scope: _Scope, ctx: _Context) -> Ty:
        """`t[i]`: an element of a rank-1 tensor operand, or the rest of a larger one (to
        index again: `t[h][j]`); an index outside the axis reads 0."""
        index = self.expr(e.index, scope, ctx)
        if index not in (*INTEGERS, ERROR):
            return self.error(e.index.span, f"a tensor index is an integer, not {index}")
        if index == INT_LITERAL:
            self.fit(e.index, I32)
        if len(tensor.axes) == 1:
            return tensor.element
        return tensor_type(tensor.element, tensor.axes[1:])

    def check_scale(self, value: ast.Expr) -> None:
        try:
            problem = scale_problem(constant_number(value, number=True))
        except MhaError as err:
            problem = err.diagnostics[0].message
        if problem:
            self.error(value.span, problem)

    def check_scheduler_binding(self, value: ast.Expr) -> None:
        func, kwargs = value, ()
        if isinstance(value, ast.Call):
            func, kwargs = value.func, value.kwargs
            if value.args:
                self.error(value.args[0].span, "scheduler arguments are passed by name, "
                                               "like Queued(num_ctas = 264)")
        if not isinstance(func, ast.Name) or func.id not in self.out.schedulers:
            self.error(func.span, "scheduler must name a declared scheduler "
                                  f"({', '.join(self.out.schedulers) or 'none declared'})")
            return
        sched = self.out.schedulers[func.id]
        params = {p.name: p for p in sched.params}
        for kw in kwargs:
            if kw.name not in params:
                self.error(kw.span, f"scheduler '{sched.name}' has no parameter '{kw.name}'")
                continue
            want = self.check_type_ref(params[kw.name].type)
            self.expect_value(kw.value, self.expr(kw.value, _Scope(), _Context(HOST, "scheduler", ())),
                              want, f"argument '{kw.name}'")

    # ------------------------------------------------------------ statements
    def declare(self, scope: _Scope, span: Span, sym: Symbol) -> None:
        if sym.name in scope.names:
            self.error(span, f"'{sym.name}' is already defined here")
        elif sym.name in BUILTIN_VALUES or sym.name in SCHEDULER_RULES:
            self.error(span, f"'{sym.name}' is a builtin name and cannot be redefined")
        scope.names[sym.name] = sym

    def check_body(self, body, scope: _Scope, ctx: _Context, span: Span, what: str) -> None:
        if not self.block(body, _Scope(scope), ctx):
            self.error(span, f"{what} can reach its end without returning a value")

    def block(self, stmts, scope: _Scope, ctx: _Context) -> bool:
        """Check statements; True when every path through them returns."""
        returns = False
        for stmt in stmts:
            if returns:
                self.error(stmt.span, "unreachable statement after return")
                break
            returns = self.stmt(stmt, scope, ctx)
        return returns

    def stmt(self, s: ast.Stmt, scope: _Scope, ctx: _Context) -> bool:
        if isinstance(s, ast.Let):
            ty = self.expr(s.value, scope, ctx)
            if s.type is not None:
                want = self.check_type_ref(s.type)
                self.expect_value(s.value, ty, want, f"'{s.name}'")
                ty = want
            if ty == INT_LITERAL:
                ty = ctx.default_int
                self.fit(s.value, ty)
            if ty in (VOID, NONE):
                ty = self.error(s.value.span, f"'{s.name}' cannot hold a value of type {ty}")
            elif ty == GRID:  # (a grid is grid_dim's result, returned where it is built)
                ty = self.error(s.value.span, f"'{s.name}' cannot hold a grid: return the "
                                              f"grid (x, y, z) where it is built")
            elif isinstance(ty, TensorTy):  # a tensor is read where it is indexed
                ty = self.error(s.value.span, f"'{s.name}' cannot hold a tensor ({ty}): index "
                                              f"the operand once per axis where its element "
                                              f"is read (t[h][d])")
            self.declare(scope, s.span, Symbol("local", s.name, ty, s, s.mutable))
            return False
        if isinstance(s, ast.Assign):
            self.assign(s, scope, ctx)
            return False
        if isinstance(s, ast.If):
            self.expect(self.expr(s.cond, scope, ctx), BOOL, s.cond.span, "if condition")
            inner = self.branch_context(s.cond, "`if`", ctx)
            then = self.block(s.then, _Scope(scope), inner)
            other = self.branch_context(s.cond, "`if`", ctx)
            orelse = self.block(s.orelse, _Scope(scope), other)
            if inner.divergent and self.may_return(s.then) or \
                    other.divergent and self.may_return(s.orelse):
                # Some threads may have left the rule: what follows must not wait for them.
                ctx.divergent = ctx.divergent or "after a `return` that only some threads " \
                                                 "may take"
            return then and orelse
        if isinstance(s, ast.While):
            self.expect(self.expr(s.cond, scope, ctx), BOOL, s.cond.span, "while condition")
            self.block(s.body, _Scope(scope), self.branch_context(s.cond, "`while`", ctx))
            return False
        if isinstance(s, ast.Return):
            ty = self.expr(s.value, scope, ctx)
            if ty == INT_LITERAL and ctx.default_int in ctx.returns:
                ty = ctx.default_int
            if ty != ERROR and not any(self.compatible(ty, r) for r in ctx.returns):
                self.error(s.value.span, f"'{ctx.rule}' returns "
                                         f"{' or '.join(map(str, ctx.returns))}, not {ty}")
            elif ty == INT_LITERAL:
                self.fit(s.value, next(r for r in ctx.returns if r in NUMBERS))
            elif ty in INT_RANGES:
                self.fit(s.value, ty)
            return True
        assert isinstance(s, ast.ExprStmt)
        if not isinstance(s.expr, ast.Call):
            self.error(s.span, "this expression does nothing; only calls can stand alone")
        self.expr(s.expr, scope, ctx)
        return False

    def assign(self, s: ast.Assign, scope: _Scope, ctx: _Context) -> None:
        target = s.target
        if isinstance(target, ast.Name):
            sym = scope.lookup(target.id)
            if sym is None:
                self.error(target.span, f"unknown name '{target.id}'")
                return
            if not sym.mutable:
                what = "a `let` constant (use `var`)" if sym.kind == "local" else \
                    {"rule_param": "a parameter", "fn_param": "a parameter",
                     "operand": "an operand of the kernel",
                     "sched_param": "a scheduler parameter", "constant": "a constant",
                     "builtin": "a builtin"}[sym.kind]
                self.error(target.span, f"cannot assign to '{target.id}': it is {what}")
                return
            self.out.refs[target] = sym
            want = sym.ty
        elif isinstance(target, ast.Attr):
            obj_ty = self.expr(target.obj, scope, ctx)
            if obj_ty == ERROR:
                return
            if target.name not in MUTABLE_FIELDS.get(obj_ty, ()):
                self.error(target.span, f"cannot assign to field '{target.name}' of {obj_ty}")
                return
            want = RECORD_FIELDS[obj_ty][target.name]
        elif isinstance(target, ast.Index):
            want = self.expr(target, scope, ctx)
            if want == ERROR:
                return
        else:
            self.error(target.span, "cannot assign to this expression")
            return
        self.out.types[target] = want
        value = self.expr(s.value, scope, ctx)
        if s.op != "=":
            value = self.binary_type(s.op[:-1], want, value, s.span)
        self.expect(value, want, s.value.span, "assigned value")
        self.fit(s.value, want)  # `x += 5000000000` too

    # ------------------------------------------------------------ expressions
    def compatible(self, got: Ty, want: Ty) -> bool:
        return got == want or (got == INT_LITERAL and want in NUMBERS) or ERROR in (got, want)

    def expect(self, got: Ty, want: Ty, span: Span, what: str) -> None:
        if not self.compatible(got, want):
            self.error(span, f"{what} must be {want}, not {got}")

    def expect_value(self, e: ast.Expr, got: Ty, want: Ty, what: str) -> None:
        """`expect`, and a literal that meets an integer type must fit it."""
        self.expect(got, want, e.span, what)
        if got == INT_LITERAL:
            self.fit(e, want)

    def fit(self, e: ast.Expr, ty: Ty) -> None:
        value = self.out.literals.get(e)
        if ty in INT_RANGES and isinstance(value, int) and not isinstance(value, bool) \
                and not fits(value, ty):
            lo, hi = INT_RANGES[ty]
            self.error(e.span, f"integer constant {value} does not fit in {ty} ({lo} to "
                               f"{hi}); {ty}(...) wraps it explicitly")

    def fold(self, e: ast.Expr, value) -> Ty:
        """Record the exact value of a literal expression (an error past 64 bits)."""
        if isinstance(value, LiteralError):
            return self.error(e.span, str(value))
        self.out.literals[e] = value
        return BOOL if isinstance(value, bool) else INT_LITERAL

    def fold_float(self, e: ast.Binary) -> Ty:
        """An f32 operation: a constant divisor must not be 0, and an operation of two
        constants must stay finite (a kernel would compute inf or NaN everywhere)."""
        a, b = self.constant_value(e.left), self.constant_value(e.right)
        if e.op == "/" and b == 0:
            return self.error(e.span, "division by zero: dividing by a constant 0 gives "
                                      "inf or NaN")
        if a is not None and b is not None:
            value = FLOAT_OPS[e.op](a, b)
            if not finite_f32(value):
                return self.error(e.span, f"constant expression is not a finite f32 value "
                                          f"({value:g})")
            self.float_constants[e] = value
        return F32

    def fold_float_call(self, e: ast.Call, builtin, types: list[Ty]) -> Ty:
        """An f32 builtin of constants (`sqrt(-1.0)`, `exp(1000.0)`) follows the rule of
        `fold_float`: its value must stay finite."""
        args = [self.constant_value(a) for a in e.args]
        if None in args:
            return F32
        with np.errstate(all="ignore"):
            value = float(builtin.numpy(args, types, F32))
        if not finite_f32(value):
            return self.error(e.span, f"constant expression is not a finite f32 value "
                                      f"({value:g})")
        self.float_constants[e] = value
        return F32

    def constant_value(self, e: ast.Expr) -> float | None:
        """The value of an expression of literals alone (int or float), else None."""
        value = self.float_constants.get(e, self.out.literals.get(e))
        return None if isinstance(value, bool) else value

    def branch_context(self, cond: ast.Expr, what: str, ctx: _Context) -> _Context:
        """The context inside a branch on `cond`: divergent unless `cond` is a compile-time
        constant (the same in every thread)."""
        if ctx.divergent or self.compile_time(cond):
            return replace(ctx)
        return replace(ctx, divergent=f"under an {what} whose condition may differ between "
                                      f"threads")

    def compile_time(self, e: ast.Expr) -> bool:
        if e in self.out.literals or isinstance(e, ast.BoolLit):
            return True
        if isinstance(e, ast.Name):
            sym = self.out.refs.get(e)
            return sym is not None and (sym.kind in ("sched_param", "constant") or
                                        sym.kind == "builtin" and sym.name in COMPILE_TIME_VALUES)
        if isinstance(e, ast.Unary):
            return self.compile_time(e.operand)
        if isinstance(e, ast.Binary):
            first, ops = ast.left_chain(e)
            return self.compile_time(first) and all(self.compile_time(op.right) for op in ops)
        return False

    @staticmethod
    def may_return(stmts) -> bool:
        for s in stmts:
            if isinstance(s, ast.Return):
                return True
            if isinstance(s, ast.If) and (Checker.may_return(s.then) or
                                          Checker.may_return(s.orelse)):
                return True
            if isinstance(s, ast.While) and Checker.may_return(s.body):
                return True
        return False

    def expr(self, e: ast.Expr, scope: _Scope, ctx: _Context) -> Ty:
        if isinstance(e, ast.Binary):  # a chain of operators, in a loop
            first, ops = ast.left_chain(e)
            ty = self.expr(first, scope, ctx)
            for op in ops:
                ty = self.out.types[op] = self.binary(op, ty, scope, ctx)
            return ty
        ty = self._expr(e, scope, ctx)
        if ctx.where == ATTENTION and ty in _SCHEDULER_VALUES:
            ty = self.error(e.span, f"a {ty} value has no meaning in attention code: a mask, "
                                    f"score or sink computes with i32, u32, f32 and bool "
                                    f"(records and grids are a scheduler's)")
        self.out.types[e] = ty
        return ty

    def _expr(self, e: ast.Expr, scope: _Scope, ctx: _Context) -> Ty:
        if isinstance(e, ast.IntLit):
            if e.value >= LITERAL_LIMIT:
                return self.error(e.span, "integer constant does not fit in 64 bits")
            self.out.literals[e] = e.value
            return INT_LITERAL
        if isinstance(e, ast.FloatLit):
            if not finite_f32(e.value):
                return self.error(e.span, f"float constant {_text(e.span)} is not a finite f32 "
                                          f"value (the largest is about 3.4e38)")
            self.float_constants[e] = e.value
            return F32
        if isinstance(e, ast.BoolLit):
            return BOOL
        if isinstance(e, ast.NoneLit):
            return NONE
        if isinstance(e, ast.Name):
            return self.name(e, scope, ctx)
        if isinstance(e, ast.Attr):
            return self.attr(e, scope, ctx)
        if isinstance(e, ast.Index):
            obj = self.expr(e.obj, scope, ctx)
            if isinstance(obj, TensorTy):
                return self.tensor_read(e, obj, scope, ctx)
            if obj == ERROR:  # (reported): check the index alone
                self.expr(e.index, scope, ctx)
                return ERROR
            self.expect_value(e.index, self.expr(e.index, scope, ctx), U32, "index")
            if obj not in (SLOTS, ERROR):
                return self.error(e.span, f"cannot index a value of type {obj}")
            index = self.out.literals.get(e.index)
            if isinstance(index, int) and 0 <= index < 2**32 and index >= SLOT_COUNT:
                self.error(e.index.span, f"slot index {index} is out of range: a CTA has "
                                         f"{SLOT_COUNT} slots (0 to {SLOT_COUNT - 1})")
            return U32
        if isinstance(e, ast.Unary):
            ty = self.expr(e.operand, scope, ctx)
            if ty == ERROR:
                return ERROR
            if e.op == "!":
                self.expect(ty, BOOL, e.operand.span, "operand of '!'")
                return BOOL
            allowed = NUMBERS if e.op == "-" else INTEGERS
            if ty not in allowed:
                return self.error(e.span, f"operator '{e.op}' does not apply to {ty}")
            if e.op == "-" and ty == U32:
                return self.error(e.span, "cannot negate an unsigned u32 value; use i32()")
            if e.operand in self.out.literals:
                value = self.out.literals[e.operand]
                return self.fold(e, -value if e.op == "-" else ~value)
            if e.operand in self.float_constants:
                self.float_constants[e] = -self.float_constants[e.operand]
            return ty
        if isinstance(e, ast.Tuple):
            for item in e.items:
                self.expect_value(item, self.expr(item, scope, ctx), U32, "grid dimension")
                if self.out.literals.get(item) == 0 and ctx.rule == "grid_dim":
                    self.error(item.span, "grid dimension 0: CUDA launches at least one CTA "
                                          "along each axis")
            if not 1 <= len(e.items) <= 3:
                return self.error(e.span, "a grid has 1 to 3 dimensions")
            return GRID
        assert isinstance(e, ast.Call)
        return self.call(e, scope, ctx)

    def binary(self, e: ast.Binary, left: Ty, scope: _Scope, ctx: _Context) -> Ty:
        """One operator of a chain, its left operand already checked (of type `left`)."""
        right = self.expr(e.right, scope, ctx)
        ty = self.binary_type(e.op, left, right, e.span)
        if ty == ERROR or e.op in ("&&", "||"):
            return ty
        if e.left in self.out.literals and e.right in self.out.literals:
            try:
                value = fold_literal(e.op, self.out.literals[e.left], self.out.literals[e.right])
            except LiteralError as err:
                value = err
            return self.fold(e, value)
        if ty == F32 and e.op in FLOAT_OPS:
            return self.fold_float(e)
        common = unify(left, right)
        for side in (e.left, e.right):  # a literal meets the other side's type
            self.fit(side, ctx.default_int if common == INT_LITERAL else common)
        return ty

    def binary_type(self, op: str, left: Ty, right: Ty, span: Span) -> Ty:
        if ERROR in (left, right):
            return ERROR
        if op in ("&&", "||"):
            if left != BOOL or right != BOOL:
                return self.error(span, f"operands of '{op}' must be bool, not {left} and {right}")
            return BOOL
        if op in ("==", "!=") and left == right and left in (BOOL, SCHEDULE, SYNC):
            return BOOL
        common = unify(left, right)
        if common is None or common not in NUMBERS:
            return self.error(span, f"operator '{op}' does not apply to {left} and {right}")
        if op in INTEGER_ONLY_OPS and common == F32:
            return self.error(span, f"operator '{op}' needs integers, not f32")
        if op in COMPARISONS:
            return BOOL
        return common

    def name(self, e: ast.Name, scope: _Scope, ctx: _Context) -> Ty:
        sym = scope.lookup(e.id)
        if sym is not None:
            self.out.refs[e] = sym
            return sym.ty
        if e.id in BUILTIN_VALUES:
            ty, contexts, rules = BUILTIN_VALUES[e.id]
            if ctx.where not in contexts:
                place = {HOST: "host-side code (grid_dim, parameter defaults)",
                         ATTENTION: "mask and score expressions"}.get(ctx.where, ctx.rule)
                return self.error(e.span, f"'{e.id}' is not available in {place}")
            if rules is not None and ctx.rule not in rules:
                return self.error(e.span, f"'{e.id}' is only available in {', '.join(rules)}")
            self.out.refs[e] = Symbol("builtin", e.id, ty)
            return ty
        return self.error(e.span, f"unknown name '{e.id}'")

    def attr(self, e: ast.Attr, scope: _Scope, ctx: _Context) -> Ty:
        obj = self.expr(e.obj, scope, ctx)
        if obj == ERROR:
            return ERROR
        if obj == DIM3:
            if e.name not in ("x", "y", "z"):
                return self.error(e.span, f"'{e.name}' is not x, y or z")
            return U32
        if obj == TILE_SUMMARY:
            if e.name in TILE_SUMMARY_FIELDS:
                return TILE_SUMMARY_FIELDS[e.name]
            if e.name in TILE_SUMMARY_METHODS:
                return self.error(e.span, f"'ts.{e.name}' is a method; call it")
            return self.error(e.span, f"the tile summary has no field '{e.name}'")
        fields = {**RECORD_FIELDS.get(obj, {}), **RECORD_PROPERTIES.get(obj, {})}
        if e.name in fields:
            return fields[e.name]
        return self.error(e.span, f"{obj} has no field '{e.name}'")

    def call(self, e: ast.Call, scope: _Scope, ctx: _Context) -> Ty:
        func = e.func
        if isinstance(func, ast.Attr):  # ts.method(...)
            obj = self.expr(func.obj, scope, ctx)
            if obj == ERROR:
                return ERROR
            if obj != TILE_SUMMARY or func.name not in TILE_SUMMARY_METHODS:
                return self.error(func.span, f"{obj} has no method '{func.name}'")
            params, result = TILE_SUMMARY_METHODS[func.name]
            self.call_args(e, params, scope, ctx, f"ts.{func.name}")
            return result
        if not isinstance(func, ast.Name):
            return self.error(e.span, "only named functions can be called")
        name = func.id
        if name in self.out.fns and scope.lookup(name) is None:
            fn = self.out.fns[name]
            if ctx.rule in self.out.fns and name not in self.checked_fns:
                return self.error(e.span, f"fn '{ctx.rule}' may only call fns declared before "
                                          f"it (no recursion)")
            types = tuple(TYPE_NAMES.get(p.type.name, ERROR) for p in fn.params)
            self.call_args(e, types, scope, ctx, name)
            return TYPE_NAMES.get(fn.ret.name, ERROR)
        record = TYPE_NAMES.get(name)
        if record in RECORD_FIELDS:
            return self.constructor(e, record, scope, ctx)
        if name in DEVICE_FUNCTIONS and ctx.where != DEVICE:
            return self.error(e.span, f"'{name}' is not available in "
                                      f"{'grid_dim' if ctx.where == HOST else 'attention code'}")
        if name in DEVICE_FUNCTIONS and ctx.rule in self.out.fns:
            return self.error(e.span, f"'{name}' is not available inside a fn; call it from a rule")
        if name in DEVICE_FUNCTIONS:
            return DEVICE_FUNCTIONS[name].type_rule(self, e, scope, ctx)
        builtin = FUNCTIONS.get(name)
        if builtin is not None:
            types = self.call_args(e, (None,) * builtin.arity, scope, ctx, name)
            ty = builtin.type_rule(self, e, types, ctx) if types else ERROR
            return self.fold_float_call(e, builtin, types) if ty == F32 else ty
        if scope.lookup(name) is not None or name in BUILTIN_VALUES:
            return self.error(func.span, f"'{name}' is not a function")
        return self.error(func.span, f"unknown function '{name}'")

    def call_args(self, e: ast.Call, params, scope, ctx, name: str) -> list[Ty]:
        if e.kwargs:
            self.error(e.kwargs[0].span, f"'{name}' takes no named arguments")
        if len(e.args) != len(params):
            self.error(e.span, f"'{name}' takes {len(params)} argument"
                               f"{'' if len(params) == 1 else 's'}, got {len(e.args)}")
            return []
        types = []
        for arg, want in zip(e.args, params):
            ty = self.expr(arg, scope, ctx)
            if want is not None:
                self.expect_value(arg, ty, want, f"argument of '{name}'")
            types.append(ty)
        return types

    def constructor(self, e: ast.Call, record: Ty, scope, ctx) -> Ty:
        fields = RECORD_FIELDS[record]
        if e.args:
            self.error(e.args[0].span, f"{record} fields are passed by name, like "
                                       f"{record}({next(iter(fields))} = ...)")
        given = set()
        for kw in e.kwargs:
            if kw.name not in fields:
                self.error(kw.span, f"{record} has no field '{kw.name}'")
                continue
            if kw.name in given:
                self.error(kw.span, f"field '{kw.name}' is given twice")
            given.add(kw.name)
            self.expect_value(kw.value, self.expr(kw.value, scope, ctx), fields[kw.name],
                              f"field '{kw.name}'")
        missing = [f for f in fields if f not in given]
        if missing:
            self.error(e.span, f"{record} is missing field{'s' if len(missing) > 1 else ''} "
                               f"{', '.join(missing)}")
        return record


def _text(span: Span) -> str:
    """The source text of a one-token span."""
    return span.source.line(span.line)[span.column - 1:span.end_column - 1]


def check_program(modules: list[ast.Module], design_problems: DesignProblems
                  ) -> CheckedProgram:
    """Check parsed modules; raise `MhaError` listing every error found. `design_problems`
    says why no kernel design runs an attention declaration (empty: some design does)."""
    sink = DiagnosticSink()
    program = Checker(sink, design_problems).check_modules(modules)
    sink.raise_if_any()
    return program
