"""The settings an `attention` declaration may fix, and their resolved, frozen form."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from mhadsl.front import ast
from mhadsl.front.builtin_functions import f32_math
from mhadsl.front.semantics import FLOAT_OPS
from mhadsl.front.diagnostics import Diagnostic, MhaError
from mhadsl.front.semantics import I32_MAX, I32_MIN, LiteralError, finite_f32, fold_literal
from mhadsl.front.types import BOOL, DTYPE, F32, I32, SCHEDULER

# name -> what the checker expects: a type, "int" (integer constant) or "int_pair".
ATTENTION_CONSTANTS: dict[str, object] = {
    "dtype": DTYPE,
    "head_dim": "int",
    "tile": "int_pair",
    "warps": "int",
    "stages": "int",
    "gqa": "int",
    "kv_heads": "int",
    "scheduler": SCHEDULER,
    "scale": F32,
    "return_lse": BOOL,
}
HEAD_DIMS = (64, 128, 256)
# An attention declaration's operands: run-time values of each call its mask and score read
# (`attention windowed(window: i32 = 256) { ... }`), passed by name at the call.
OPERAND_TYPES = {"i32": I32, "f32": F32}
# The keyword arguments of kernel calls (forward, against a KV cache, backward, the
# reference), which an operand may not take as its name.
CALL_KEYWORDS = frozenset((
    "q", "k", "v", "out", "lse", "dout", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
    "max_seqlen_k", "scale", "return_lse", "stream", "cache_seqlens", "page_table",
    "num_splits", "deterministic", "k_cache", "v_cache", "k_new", "v_new", "block_classes"))
# Other parameters of the calls that take operands as keywords (`Kernel.__call__`'s self and
# the decode scales, `Kernel.backward`'s operand_grads, the references' kernel and cell, the
# torch operators' schemas): an operand of one of these names could never be passed.
API_KEYWORDS = frozenset(("self", "kernel", "cell", "operand_grads", "k_scale", "v_scale"))


def operand_key(name: str) -> tuple[str, str]:
    """What an operand's references resolve to (`Symbol.node`): the key of its value in
    every walker's environment, apart from the rules' parameter roles."""
    return ("operand", name)


@dataclass(frozen=True)
class Operand:
    """A declared operand: its name, type ("i32" or "f32") and default (None: every call
    passes it)."""

    name: str
    type: str
    default: int | float | None = None
    axes: tuple[str, ...] = ()  # a tensor's: "batch", "heads" or "_" each

    @property
    def declared(self) -> str:
        """Its type as declared: `i32`, `f32[heads, _]`."""
        return f"{self.type}[{', '.join(self.axes)}]" if self.axes else self.type

    def value(self, given) -> int | float:
        """The operand's value in a call that passes `given` (None: its default), checked:
        a TypeError or ValueError names what is wrong."""
        if given is None:
            if self.default is None:
                raise TypeError(f"the call needs operand {self.name!r} ({self.declared})")
            return self.default
        if self.axes:  # a tensor: its call path checks it against the call's tensors
            return given
        integral = isinstance(given, numbers.Integral) and not isinstance(given, bool)
        if not (integral if self.type == "i32" else
                isinstance(given, numbers.Real) and not isinstance(given, bool)):
            want = "an int" if self.type == "i32" else "a number"
            raise TypeError(f"operand {self.name!r} is {self.type}: it takes {want}, got "
                            f"{type(given).__name__} {given!r}")
        if self.type == "i32":
            if not I32_MIN <= int(given) <= I32_MAX:
                raise ValueError(f"operand {self.name!r} is i32: {_shown(given)} is out of its "
                                 f"range ({I32_MIN} to {I32_MAX})")
            return int(given)
        try:
            value = float(given)
        except OverflowError:  # an int past any float's range
            value = math.inf
        if not finite_f32(value):
            raise ValueError(f"operand {self.name!r} must be a finite f32, got {_shown(given)}")
        return value


def _shown(value) -> str:
    """A value for a message: an int too long to print (or to read) by its size."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        bits = abs(int(value)).bit_length()
        return f"an integer of {bits} bits" if bits > 128 else str(int(value))
    return repr(value)


def operand_values(options: "AttentionOptions", given: dict) -> dict[str, int | float]:
    """Each operand's value in a call that passes `given` (by name), checked; a name that
    is no operand of the declaration is a TypeError."""
    known = {o.name: o for o in options.operands}
    for name in given:
        if name not in known:
            have = ", ".join(known) or "none"
            raise TypeError(f"unexpected keyword argument {name!r}: kernel '{options.name}' "
                            f"has no such operand (its operands: {have})")
    return {o.name: o.value(given.get(o.name)) for o in options.operands}
# The default scheduler, by whether the declaration has a mask (benchmarks/schedulers.py).
# Under a mask, Adaptive: Queued or LPT (longest tiles first), chosen per launch on the
# device from the batch. With no mask every tile costs the same, and Queued's order (query
# tile fastest) keeps fewer heads' K/V in flight than LPT's.
DEFAULT_SCHEDULER = "Adaptive"
UNMASKED_DEFAULT_SCHEDULER = "Queued"
# ... with all heads in one of LPT's sections (`l2_rows = 0`) where the mask reads data
# (packed documents): its calls classify their tiles, and a query tile reads the keys its
# classes keep (its document's), not its head's every row, which the sections' L2 budget
# counts; the last section, handed out by position where the documents set the tiles'
# costs, left a tail. H100, packed documents (benchmarks/operands.py's rows, H16 D128,
# TFLOP/s): B1 S16384 312 -> 358, B1 S32768 438 -> 494, B4 S8192 257 -> 264, B8 S4096
# 186 -> 181 (benchmarks/log/BENCHMARKS_LOG.md).
DATA_MASK_DEFAULT_ARGS = (("l2_rows", 0),)
# The backward pass of a masked declaration that names no scheduler: its work tiles are K/V
# tiles, whose cost under a causal mask falls with their index; LPT starts the longest first.
BACKWARD_DEFAULT_SCHEDULER = "LPT"
# ... in sections of one head: a K/V tile rereads its group's Q, dO and dQ rows for every
# query tile, which the L2 budget of LPT's default sections (sized for the forward's K and V)
# does not count; one head's rows at a time stay in L2.
BACKWARD_DEFAULT_ARGS = (("heads_per_section", 1),)
# The deterministic backward of a declaration that names no scheduler: Queued hands out each
# (sequence, K/V head)'s K/V tiles in order, last K/V tile first, the order in which the
# Hopper design adds their dQ (`codegen.backends.backward_sm90`). Without a mask, in the
# INTERLEAVED order, a head a section: a head's K/V tiles start a level of the other
# sequences' tiles apart, not together, so each waits less for the one before it to add
# (plain D64 B4 H32 S4096, H100: 0.76x the atomic mode's speed -> 0.97x). Under a causal
# mask a K/V tile's first query tiles are its own, and INTERLEAVED only moves the longest
# tiles later.
DETERMINISTIC_BACKWARD_SCHEDULER = "Queued"
DETERMINISTIC_UNMASKED_ARGS = (("order", "INTERLEAVED"), ("heads_per_section", 1))
# Decode calls of a declaration that names no scheduler, with splits fixed per call: one
# work tile per CTA. A decode launch rarely holds more work tiles than CTAs fit at once,
# and every tile of a dense call costs the same, so a queue has nothing to balance, while
# its step (an atomic and a CTA-wide barrier, behind the tile's first K/V loads) delays
# every CTA's first tile (faster than LPT on decode rows: benchmarks/log/BENCHMARKS_LOG.md,
# decode). Where each sequence's splits follow its length (`CacheLayout.balanced`), the
# work tiles differ in number and cost per sequence: LPT, longest first from the queue.
DECODE_DEFAULT_SCHEDULER = "Transient"
BALANCED_DECODE_SCHEDULER = "LPT"


@dataclass(frozen=True)
class AttentionOptions:
    """A checked attention declaration with defaults filled in (None: chosen per call)."""

    name: str
    dtype: str = "bf16"
    head_dim: int = 128
    block_m: int | None = None  # None: the per-arch default tile
    block_n: int | None = None
    warps: int | None = None
    stages: int | None = None  # None: the design's default
    gqa: int | None = None  # Hq // Hkv fixed by the declaration, or taken from the tensors
    kv_heads: int | None = None
    scheduler: str = DEFAULT_SCHEDULER
    scheduler_args: tuple[tuple[str, object], ...] = ()
    scheduler_named: bool = False  # whether the declaration names it (else a default)
    scale: float | None = None  # None: 1 / sqrt(head_dim)
    return_lse: bool = False
    operands: tuple[Operand, ...] = ()
    mask: ast.Rule | None = None
    score: ast.Rule | None = None
    sink: ast.Rule | None = None
    # the KV tiles a mid-sequence query tile visits where the mask bounds them (a sliding
    # window; `classify.kv_band_tiles`), set when a build is planned; None: unbounded
    kv_band: int | None = None
    # the mask reads a tensor operand at elements that differ between a tile's pairs
    # (`mask_reads_data`): a call classifies its tiles on the device (`codegen.block_classes`)
    mask_reads_data: bool = False
    decl: ast.AttentionDecl | None = field(default=None, compare=False, repr=False)

    def scheduler_for(self, workload: str, balanced: bool = False,
                      deterministic: bool = False
                      ) -> tuple[str, tuple[tuple[str, object], ...]]:
        """The scheduler (name, arguments) that runs a `workload` build ("prefill",
        "decode", "backward"): the one named, else the default: for decode calls
        DECODE_DEFAULT_SCHEDULER, or BALANCED_DECODE_SCHEDULER where a decode build's splits
        follow the lengths (`balanced`); for a `deterministic` backward
        DETERMINISTIC_BACKWARD_SCHEDULER (with DETERMINISTIC_UNMASKED_ARGS without a mask),
        else for a masked declaration's backward
        BACKWARD_DEFAULT_SCHEDULER with BACKWARD_DEFAULT_ARGS; a forward call whose mask
        reads data, the default with DATA_MASK_DEFAULT_ARGS."""
        if not self.scheduler_named:
            if workload == "prefill" and self.mask_reads_data:
                return self.scheduler, DATA_MASK_DEFAULT_ARGS
            if workload == "decode":
                return (BALANCED_DECODE_SCHEDULER if balanced else DECODE_DEFAULT_SCHEDULER), ()
            if workload == "backward" and deterministic:
                return DETERMINISTIC_BACKWARD_SCHEDULER, \
                    (() if self.mask is not None else DETERMINISTIC_UNMASKED_ARGS)
            if workload == "backward" and self.mask is not None:
                return BACKWARD_DEFAULT_SCHEDULER, BACKWARD_DEFAULT_ARGS
        return self.scheduler, self.scheduler_args

    def scheduler_for_layout(self, layout) -> tuple[str, tuple[tuple[str, object], ...]]:
        """`scheduler_for` the call a `codegen.backends.Layout` describes: its workload, its
        decode splits by length and its deterministic mode."""
        return self.scheduler_for(layout.workload, layout.splits_by_length,
                                  layout.deterministic)

    @property
    def mask_reads_head(self) -> bool:
        """Whether the mask reads `h` (its tiles' classes may differ per query head)."""
        return self.mask is not None and rule_reads(self.mask, "h")

    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)

    def heads_problem(self, heads: int, kv_heads: int) -> str | None:
        """Why the kernel cannot run `heads` query heads on `kv_heads` K/V heads, if it
        cannot (the kernel's call and `mhadsl.reference` say the same)."""
        if kv_heads == 0 or heads % kv_heads:
            return f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})"
        if self.gqa is not None and heads != self.gqa * kv_heads:
            return (f"kernel '{self.name}' is declared gqa = {self.gqa}, but q has {heads} "
                    f"heads and k/v {kv_heads}")
        if self.kv_heads is not None and kv_heads != self.kv_heads:
            return f"kernel '{self.name}' is declared kv_heads = {self.kv_heads}, but k/v have " \
                   f"{kv_heads}"
        return None

    def problem_span(self, settings: tuple[str, ...]):
        """Where to report a problem caused by `settings`: the value of the first one the
        declaration sets, else the declaration (its defaults are at fault)."""
        values = {c.name: c.value.span for c in self.decl.constants}
        return next((values[s] for s in settings if s in values), self.decl.span)

    def backend_error(self, problems) -> MhaError:
        """A backend's `Problem`s as diagnostics at the settings that cause them."""
        return MhaError([Diagnostic(self.problem_span(p.settings),
                                    f"attention '{self.name}': {p.message}")
                         for p in problems])


def scale_problem(scale) -> str | None:
    """The one rule for a softmax scale, declared (`check`) or given at the call (the API)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        return f"scale must be a finite number, got {scale!r}"
    return None


def constant_number(e: ast.Expr, number: bool = False) -> float | int:
    """The value of a constant number setting (`scale = 1.0 / sqrt(128.0)`) or operand
    default, as the language computes it: integer literals that meet only integer literals
    stay exact integers (`7 / 2` is 3, `1 / 0` is 0: `fold_literal`, the checker's folding),
    anything meeting a float is a float. `number`: the value is an f32 (a scale, an f32
    operand's default), where a division of integer literals that is not exact (`1 / 8`,
    0 in the language, not 0.125) is an error at it rather than a surprise."""
    if isinstance(e, ast.Unary) and e.op == "-":
        return -constant_number(e.operand, number)
    if isinstance(e, (ast.IntLit, ast.FloatLit)):
        return e.value
    if isinstance(e, ast.Binary):
        first, ops = ast.left_chain(e)  # a loop: a long sum is not deep
        if all(op.op in FLOAT_OPS for op in ops):
            value = constant_number(first, number)
            for op in ops:  # the checker has refused a division by a constant 0.0
                right = constant_number(op.right, number)
                if isinstance(value, int) and isinstance(right, int):
                    if number and op.op == "/" and (right == 0 or value % right):
                        raise MhaError(
                            f"{value} / {right} divides two integers, which gives "
                            f"{fold_literal('/', value, right)} (integer division); write "
                            f"{value}.0 / {right} for a float", op.span)
                    try:
                        value = fold_literal(op.op, value, right)
                    except LiteralError as err:  # (the checker has reported it)
                        raise MhaError(str(err), op.span) from None
                else:
                    value = FLOAT_OPS[op.op](value, right)
            return value
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and not e.kwargs and (
            fold := f32_math(e.func.id, len(e.args))) is not None:
        return fold([constant_number(a, number) for a in e.args])
    raise MhaError("this must be a constant number", e.span)


def _scheduler_binding(e: ast.Expr) -> tuple[str, tuple[tuple[str, object], ...]]:
    func, kwargs = (e.func, e.kwargs) if isinstance(e, ast.Call) else (e, ())
    args = []
    for kw in kwargs:
        value = kw.value
        if isinstance(value, ast.BoolLit):
            args.append((kw.name, value.value))
        elif isinstance(value, ast.IntLit):
            args.append((kw.name, value.value))
        elif isinstance(value, ast.Name):
            args.append((kw.name, value.id))
        else:
            raise MhaError("scheduler arguments must be constants", value.span)
    return func.id, tuple(args)


def _operand(p: ast.Param) -> Operand:
    if p.default is None:
        return Operand(p.name, p.type.name, None, p.type.axes)
    value = constant_number(p.default)
    return Operand(p.name, p.type.name, int(value) if p.type.name == "i32" else float(value))


def resolve_attention(decl: ast.AttentionDecl) -> AttentionOptions:
    """Turn a checked declaration (the checker vetted every value) into options."""
    fields: dict[str, object] = {"name": decl.name, "decl": decl}
    for c in decl.constants:
        v = c.value
        if c.name == "dtype":
            fields["dtype"] = v.id
        elif c.name == "head_dim":
            fields["head_dim"] = v.value
        elif c.name == "tile":
            fields["block_m"], fields["block_n"] = (i.value for i in v.items)
        elif c.name in ("warps", "stages", "gqa", "kv_heads"):
            fields[c.name] = v.value
        elif c.name == "scheduler":
            fields["scheduler"], fields["scheduler_args"] = _scheduler_binding(v)
            fields["scheduler_named"] = True
        elif c.name == "scale":
            fields["scale"] = float(constant_number(v))
        elif c.name == "return_lse":
            fields["return_lse"] = v.value
    if "gqa" in fields and "kv_heads" in fields:
        raise MhaError("give either 'gqa' (the ratio) or 'kv_heads', not both", decl.span)
    fields["operands"] = tuple(_operand(p) for p in decl.operands)
    for rule in decl.rules:
        fields[rule.name] = rule
    if "scheduler" not in fields and "mask" not in fields:
        fields["scheduler"] = UNMASKED_DEFAULT_SCHEDULER
    if "mask" in fields:
        fields["mask_reads_data"] = mask_reads_data(fields["mask"], fields["operands"])
    return AttentionOptions(**fields)


# each rule's parameter roles by position (`check.ATTENTION_RULES`: a rule names its
# parameters as it likes), and the roles that are one value over a box of pairs
RULE_ROLES = {"mask": ("b", "h", "q_idx", "kv_idx", "seqlen_q", "seqlen_k"),
              "score": ("s", "b", "h", "q_idx", "kv_idx"), "sink": ("b", "h")}
_BOX_ROLES = ("b", "h", "seqlen_q", "seqlen_k")


def read_over_tile(read: ast.Index, rule: ast.Rule, operands: tuple[Operand, ...]) -> bool:
    """Whether a tensor read of `rule` picks one element for every pair of a (query tile,
    KV tile) box: its indices made of the sequence, the head, the lengths, scalar operands
    and literals (`table[h][0]`, not `table[h][q_idx]`)."""
    base = read
    while isinstance(base, ast.Index):
        base = base.obj
    return _over_box(read, base, _fixed_names(rule, operands))


def _fixed_names(rule: ast.Rule, operands: tuple[Operand, ...]) -> set[str]:
    """The names in `rule` that are one value over a box of pairs: its parameters in those
    roles, and the lengths and scalar operands no parameter's name hides."""
    params = [p.name for p in rule.params]
    fixed = {n for n, role in zip(params, RULE_ROLES[rule.name]) if role in _BOX_ROLES}
    return fixed | {n for n in ("seqlen_q", "seqlen_k", *(o.name for o in operands
                                                          if not o.axes)) if n not in params}


def mask_reads_data(mask: ast.Rule, operands: tuple[Operand, ...]) -> bool:
    """Whether `mask` reads a tensor operand at an element that may differ between the
    pairs of one (query tile, KV tile) box: along a `queries` or `keys` axis, or at an index
    made of anything but the sequence, the head, the lengths, scalar operands and literals
    (a local, a tensor element, `q_idx`, `kv_idx`). The interval classification takes such
    an element as any value, so these masks' tiles are classified per call."""
    tensors = {o.name: o for o in operands if o.axes}
    if not tensors:
        return False
    fixed = _fixed_names(mask, operands)
    todo = list(mask.body)
    while todo:
        node = todo.pop()
        todo.extend(ast.children(node))
        if not isinstance(node, ast.Index):
            continue
        base = node
        while isinstance(base, ast.Index):
            base = base.obj
        if not (isinstance(base, ast.Name) and base.id in tensors):
            continue
        if set(tensors[base.id].axes) & {"queries", "keys"} or not _over_box(
                node, base, fixed):
            return True
    return False


def rule_reads(rule: ast.Rule, name: str) -> bool:
    """Whether the rule's body reads its parameter (or implicit length) `name`."""
    stack = list(rule.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Name) and node.id == name:
            return True
        stack.extend(ast.children(node))
    return False


def _over_box(read: ast.Index, base: ast.Name, fixed: set[str]) -> bool:
    """Whether every index of the tensor read `read` (of `base`) is one value over a box:
    made of the names in `fixed`, literals and builtin calls on them."""
    node = read
    while node is not base:
        todo = [node.index]
        while todo:
            e = todo.pop()
            if isinstance(e, ast.Name) and e.id not in fixed:
                return False
            if isinstance(e, ast.Index):
                return False
            todo.extend(x for x in ast.children(e) if not (
                isinstance(e, ast.Call) and x is e.func))
        node = node.obj
    return True
