"""The NumPy float64 reference: what an attention declaration computes, without a GPU.

`evaluate_rule` runs a mask or score rule elementwise over NumPy arrays (broadcasting: pass
`q_idx` as a column and `kv_idx` as a row). Integers keep the kernel's semantics, written
once in `mhadsl.front.semantics` (i32/u32 wrap modulo 2**32, C division with 0 for a zero
divisor, saturating shifts and float-to-int casts); literal expressions take the checker's
exact values. Floats are float64: this is the reference the f32 kernel is measured
against. Block-form rules run with per-element control flow (a lane mask), so `if`, `var`
and calls to `fn`s work too (`check` refuses `while` in these rules and the fns they call).

`attention_reference` is softmax attention in FlashAttention's tensor layout with those rules
applied: the score rule sees the scaled logit (FlexAttention's convention), the mask removes
keys, rows with no key left give output 0 and LSE -inf. `attention_reference_backward` is its
gradient as FlashAttention's backward defines it, through the score rule's derivative
(`mhadsl.analysis.derivative`). `reference` and `reference_backward` take a kernel and its call's
arguments, `reference_decode` a decode call's, against a (paged) KV cache; each checks them
with its call's own checks (`mhadsl.host.calls`, `mhadsl.host.paged`), before any GPU work.
"""
from __future__ import annotations

import operator
from typing import NamedTuple

import numpy as np

from mhadsl.abi import CELL_ALL, CELL_MAY
from mhadsl.front import ast
from mhadsl.front.attention_spec import operand_key, operand_values
from mhadsl.front.builtin_functions import FUNCTIONS
from mhadsl.front.semantics import attention_type, convert, int_binary, wrap
from mhadsl.host.calls import (
    AttentionCall, check_attention_call, check_cell, check_flag, check_operand_grads,
    check_shape, check_tensor_operand, dtype_name,
)
from mhadsl.front.check import CheckedProgram
from mhadsl.analysis.derivative import differentiate_score, float_reads, read_operand
from mhadsl.host.paged import check_decode_call, decode_operand_rows
from mhadsl.front.types import BOOL, F32, I32, TYPE_NAMES, U32, Ty, unify

_ROLE_TYPES = {"s": F32, "b": I32, "h": I32, "q_idx": I32, "kv_idx": I32, "seqlen_q": I32,
               "seqlen_k": I32}
_CMP = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
        ">": operator.gt, ">=": operator.ge}
_DTYPES = {BOOL: np.bool_, F32: np.float64, I32: np.int64, U32: np.int64}
_FLOAT_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


# ------------------------------------------------------------------ the evaluator
class _Return:
    """Where one body's lanes have returned, and with what."""

    def __init__(self, shape: tuple[int, ...], ty: Ty):
        self.ty = ty
        self.value = np.zeros(shape, _DTYPES.get(ty, np.int64))
        self.done = np.zeros(shape, bool)


class _Evaluator:
    """Evaluates rules and fns over arrays; statements run per lane under `self.live`."""

    def __init__(self, program: CheckedProgram, shape: tuple[int, ...], reads: dict | None = None):
        self.program, self.types, self.refs = program, program.types, program.refs
        self.shape = shape
        self.live = np.ones(shape, bool)
        self.reads = {} if reads is None else reads  # (`evaluate_rule`'s)

    def body(self, stmts: tuple[ast.Stmt, ...], env: dict, ret_ty: Ty) -> np.ndarray:
        frame = _Return(self.shape, ret_ty)
        self.block(stmts, env, self.live, frame)
        return frame.value

    def block(self, stmts, env: dict, active: np.ndarray, frame: _Return) -> None:
        for s in stmts:
            live = active & ~frame.done
            if not live.any():
                return
            self.live = live
            if isinstance(s, ast.Let):
                env[s] = (self.expr(s.value, env), self.types[s.value])
            elif isinstance(s, ast.Assign):
                self.assign(s, env, live)
            elif isinstance(s, ast.If):
                cond = np.asarray(self.expr(s.cond, env), bool)
                self.block(s.then, env, live & cond, frame)
                self.block(s.orelse, env, live & ~cond, frame)
            elif isinstance(s, ast.Return):
                value = convert(self.expr(s.value, env), self.types[s.value], frame.ty)
                frame.value = np.where(live, value, frame.value)
                frame.done = frame.done | live
            # An expression statement is a call; calls here have no effects.

    def assign(self, s: ast.Assign, env: dict, live: np.ndarray) -> None:
        if not isinstance(s.target, ast.Name):
            raise NotImplementedError("only local variables can be assigned in attention code")
        sym = self.refs[s.target]
        old = convert(*env[sym.node], sym.ty)
        new, new_ty = self.expr(s.value, env), self.types[s.value]
        if s.op != "=":
            common = unify(sym.ty, new_ty)
            new = self.arith(s.op[:-1], convert(old, sym.ty, common),
                             convert(new, new_ty, common), common)
            new_ty = common
        env[sym.node] = (np.where(live, convert(new, new_ty, sym.ty), old), sym.ty)

    # ---- expressions: each returns its value in the representation of its checked type
    def expr(self, e: ast.Expr, env: dict):
        ty = self.types[e]
        literal = self.program.literals.get(e)
        if literal is not None:  # folded exactly by the checker
            return literal
        if isinstance(e, ast.BoolLit):
            return e.value
        if isinstance(e, ast.FloatLit):
            return np.float64(e.value)
        if isinstance(e, ast.Name):
            return self.name(e, env, ty)
        if isinstance(e, ast.Index):
            return self.tensor_read(e, env)
        if isinstance(e, ast.Unary):
            v = convert(self.expr(e.operand, env), self.types[e.operand], ty)
            if e.op == "!":
                return np.logical_not(v)
            r = -v if e.op == "-" else ~v
            return r if ty == F32 else wrap(r, attention_type(ty))
        if isinstance(e, ast.Binary):
            return self.binary(e, env, ty)
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name):
            return self.call(e, e.func.id, env, ty)
        raise NotImplementedError(f"{type(e).__name__} has no meaning in attention code")

    def name(self, e: ast.Name, env: dict, ty: Ty):
        sym = self.refs[e]
        if sym.kind not in ("rule_param", "operand", "fn_param", "local"):
            raise NotImplementedError(f"'{e.id}' has no meaning in attention code")
        if sym.node not in env:
            what = f"operand '{sym.name}'" if sym.kind == "operand" else f"'{sym.node}'"
            raise ValueError(f"the rule needs a value for {what}")
        value, src = env[sym.node]
        return convert(value, src, ty)

    def tensor_read(self, e: ast.Index, env: dict):
        """An element of a tensor operand, 0 where an index lies outside its axis."""
        indices, node = [], e
        while isinstance(node, ast.Index):
            indices.append(np.asarray(self.expr(node.index, env), np.int64))
            node = node.obj
        indices.reverse()
        tensor, _ = env[self.refs[node].node]
        inside = np.ones(np.broadcast_shapes(*(i.shape for i in indices)), bool)
        for index, size in zip(indices, tensor.shape):
            inside = inside & (index >= 0) & (index < size)
        picked = tensor[tuple(np.where(inside, index, 0) for index in indices)]
        if e in self.reads:
            full = np.broadcast_shapes(inside.shape, self.shape)
            self.reads[e] = (tuple(np.broadcast_to(i, full) for i in indices),
                             np.broadcast_to(inside & self.live, full))
        return np.where(inside, picked, 0)

    def binary(self, e: ast.Binary, env: dict, ty: Ty):
        """A chain of operators (`ast.left_chain`), in a loop."""
        first, ops = ast.left_chain(e, self.program.literals)
        value = self.expr(first, env)
        for op in ops:
            value = self.binary_step(op, value, self.expr(op.right, env), self.types[op])
        return value

    def binary_step(self, e: ast.Binary, a, b, ty: Ty):
        lt, rt = self.types[e.left], self.types[e.right]
        if e.op == "&&":
            return np.logical_and(a, b)
        if e.op == "||":
            return np.logical_or(a, b)
        if ty == BOOL and e.op in _CMP:
            common = unify(lt, rt)
            return _CMP[e.op](convert(a, lt, common), convert(b, rt, common))
        return self.arith(e.op, convert(a, lt, ty), convert(b, rt, ty), ty)

    @staticmethod
    def arith(op: str, a, b, ty: Ty):
        if ty == F32:
            return _FLOAT_OPS[op](a, b)
        return int_binary(op, a, b, attention_type(ty))

    def call(self, e: ast.Call, name: str, env: dict, ty: Ty):
        args = [self.expr(a, env) for a in e.args]
        types = [self.types[a] for a in e.args]
        if name in self.program.fns:
            return self.call_fn(self.program.fns[name], args, types)
        if name in FUNCTIONS:
            return FUNCTIONS[name].numpy(args, types, ty)
        raise NotImplementedError(f"'{name}' has no meaning in attention code")

    def call_fn(self, fn: ast.FnDecl, args: list, types: list[Ty]):
        env = {}
        for p, v, t in zip(fn.params, args, types):
            want = TYPE_NAMES[p.type.name]
            env[p] = (convert(v, t, want), want)
        saved = self.live
        result = self.body(fn.body, env, TYPE_NAMES[fn.ret.name])
        self.live = saved
        return result


def rule_roles(rule: ast.Rule, program: CheckedProgram) -> set[str]:
    """The parameter roles (q_idx, h, seqlen_k, ...) a rule's body actually reads."""
    used: set[str] = set()
    todo = list(rule.body)
    while todo:  # without recursion: a long flat chain is as deep as it is long
        node = todo.pop()
        if isinstance(node, ast.Name):
            sym = program.refs.get(node)
            if sym is not None and sym.kind == "rule_param":
                used.add(sym.node)
        todo.extend(ast.children(node))
    return used


def evaluate_rule(rule: ast.Rule, program: CheckedProgram, operands: dict | None = None,
                  reads: dict | None = None, **inputs) -> np.ndarray:
    """Evaluate a mask (bool) or score (float64) rule elementwise.

    `inputs` are the roles the rule reads — `s`, `b`, `h`, `q_idx`, `kv_idx`, `seqlen_q`,
    `seqlen_k` — as scalars or arrays; they broadcast together and so does the result.
    `operands`: the declaration's operands by name (an int is an i32, a float an f32, a
    NumPy array a tensor: int64 for i32 elements, float64 for f32).
    """
    unknown = set(inputs) - set(_ROLE_TYPES)
    if unknown:
        raise TypeError(f"unknown rule inputs: {', '.join(sorted(unknown))}")
    env = {}
    for role, value in inputs.items():
        ty = _ROLE_TYPES[role]
        env[role] = (np.asarray(value, np.float64) if ty == F32 else
                     wrap(np.asarray(value).astype(np.int64), ty), ty)
    for name, value in (operands or {}).items():
        if isinstance(value, np.ndarray):  # a tensor: int64 or float64 elements
            env[operand_key(name)] = (value, None)
        else:
            env[operand_key(name)] = (np.int64(value), I32) if isinstance(value, int) else \
                (np.float64(value), F32)
    shape = np.broadcast_shapes(*(np.shape(v) for v, ty in env.values() if ty is not None))
    ret = BOOL if rule.name == "mask" else F32
    with np.errstate(all="ignore"):  # wrapping products, 0/0 in floats: the values are defined
        return _Evaluator(program, shape, reads).body(rule.body, env, ret)


def evaluate_score_derivative(rule: ast.Rule, program: CheckedProgram, **inputs) -> np.ndarray:
    """d score / d s of a score rule, elementwise (float64; the same inputs as
    `evaluate_rule`): the rule `mhadsl.analysis.derivative` derives, evaluated."""
    derivative, derived = differentiate_score(rule, program)
    return evaluate_rule(derivative, derived, **inputs)


# ------------------------------------------------------------------ attention
def attention_reference(q, k, v, *, mask_rule: ast.Rule | None = None,
                        score_rule: ast.Rule | None = None,
                        program: CheckedProgram | None = None, scale: float | None = None,
                        cu_seqlens_q=None, cu_seqlens_k=None, return_lse: bool = False,
                        operands: dict | None = None, sink_rule: ast.Rule | None = None):
    """Softmax attention in float64, FlashAttention layout.

    Dense: q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D[v]). Ragged: q (total_q, Hq, D), k and v
    (total_k, Hkv, D[v]) with `cu_seqlens_q`/`cu_seqlens_k` row offsets (B + 1 each). Query head
    h reads KV head h // (Hq // Hkv). Scores are `scale * q.k` (default 1/sqrt(D)), then the
    score rule, then the mask; the rules read `operands` (by name). A sink rule gives each
    sequence and query head a logit that joins every row's softmax denominator (a key whose
    value is 0). Returns O in q's layout (last dim Dv), and with `return_lse` the
    log-sum-exp, (B, Hq, Sq) dense or (Hq, total_q) ragged; a row with no key is 0 / -inf
    (0 / the sink's logit with a sink).
    """
    problem = _Problem(q, k, v, mask_rule, score_rule, program, scale, cu_seqlens_q,
                       cu_seqlens_k, operands, sink_rule)
    out = np.zeros(problem.q.shape[:-1] + problem.v.shape[-1:])
    lse = np.full(problem.q.shape[:-1], -np.inf)  # in q's layout; moved to (..., Hq, rows) below
    for head in problem.heads():
        out[head.q_rows][:, head.h] = head.p @ problem.v[head.k_rows][:, head.kh]
        lse[head.q_rows][:, head.h] = head.lse
    return (out, np.moveaxis(lse, -1, -2)) if return_lse else out


def attention_reference_backward(q, k, v, dout, *, mask_rule: ast.Rule | None = None,
                                 score_rule: ast.Rule | None = None,
                                 program: CheckedProgram | None = None,
                                 scale: float | None = None, cu_seqlens_q=None,
                                 cu_seqlens_k=None, operands: dict | None = None,
                                 sink_rule: ast.Rule | None = None,
                                 operand_grads: tuple[str, ...] = ()):
    """The gradients (dq, dk, dv) of `attention_reference` for the output gradient `dout`,
    in float64 and the layouts of q, k and v (same arguments; `dout` in the output's layout).
    With a sink rule, also the gradient of each sequence's and query head's sink logit,
    (B, Hq): -sum over the rows of P_sink * D, P_sink = exp(sink - LSE). With
    `operand_grads` (names of f32 tensor operands), last a dict of their gradients, each in
    its operand's shape: per pair, dZ times d score / d the element a read of the score rule
    picks, summed into that element (`mhadsl.analysis.derivative.float_reads`).

    As FlashAttention's backward defines them, per sequence and query head: P the softmax of
    the scores (0 where masked), O = P V, dV = Pᵀ dO, dP = dO Vᵀ, D = rowsum(dO ∘ O),
    dZ = P ∘ (dP - D), dS = dZ ∘ score'(S) (S = scale·Q Kᵀ, score' from
    `mhadsl.analysis.derivative`), dQ = scale·dS K, dK = scale·dSᵀ Q. A KV head's dK and dV sum over its query heads; rows
    and sequences with no key get zero gradients.
    """
    problem = _Problem(q, k, v, mask_rule, score_rule, program, scale, cu_seqlens_q,
                       cu_seqlens_k, operands, sink_rule)
    q, k, v = problem.q, problem.k, problem.v
    dout = np.asarray(dout, dtype=np.float64)
    if dout.shape != q.shape[:-1] + v.shape[-1:]:
        raise ValueError(f"dout {dout.shape} does not have the output's shape "
                         f"{q.shape[:-1] + v.shape[-1:]}")
    # Differentiated once; evaluated per sequence and head.
    derivative = None if score_rule is None else differentiate_score(score_rule, program)
    reads = [] if score_rule is None or not operand_grads else [
        (read, differentiate_score(score_rule, program, read))
        for read in float_reads(score_rule, program) if read_operand(read) in operand_grads]
    grads = {name: np.zeros(np.shape(getattr(problem.operands[name], "array",
                                             problem.operands[name])))
             for name in operand_grads}
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dsink = np.zeros((len(problem.sequences), q.shape[-2]))
    for head in problem.heads():
        q_head, k_head = q[head.q_rows][:, head.h], k[head.k_rows][:, head.kh]
        v_head, dout_head = v[head.k_rows][:, head.kh], dout[head.q_rows][:, head.h]
        p = head.p
        dv[head.k_rows][:, head.kh] += p.T @ dout_head
        delta = np.sum(dout_head * (p @ v_head), axis=1)  # D = rowsum(dO ∘ O)
        dz = p * (dout_head @ v_head.T - delta[:, None])
        if head.sink is not None:
            dsink[head.b, head.h] = -np.sum(np.exp(head.sink - head.lse) * delta)
        if derivative is None:
            ds = dz
        else:  # where P is 0 (masked keys) so is dS, even where score' is not finite
            score_slope = evaluate_rule(*derivative, head.operands, s=head.s,
                                        **head.rule_inputs)
            ds = dz * np.where(p > 0, score_slope, 0.0)
        dq[head.q_rows][:, head.h] = problem.scale * ds @ k_head
        dk[head.k_rows][:, head.kh] += problem.scale * ds.T @ q_head
        if reads:
            _scatter_reads(problem, head, reads, dz, grads)
    out = (dq, dk, dv) if sink_rule is None else (dq, dk, dv, dsink)
    return out + (grads,) if operand_grads else out


def _scatter_reads(problem, head, reads, dz, grads: dict) -> None:
    """Adds one head's share to the operands' gradients: at each pair, dZ times d score /
    d the element each float read picks, into that element (of the sequence's rows, where
    the operand follows them)."""
    where = {read: None for read, _ in reads}
    evaluate_rule(problem.score_rule, problem.program, head.operands, reads=where, s=head.s,
                  **head.rule_inputs)
    for read, slope_rule in reads:
        if where[read] is None:  # (on no path of this head's pairs)
            continue
        indices, inside = where[read]
        slope = evaluate_rule(*slope_rule, head.operands, s=head.s, **head.rule_inputs)
        term = dz * np.where(head.p > 0, slope, 0.0)
        take = inside & (term != 0)
        name = read_operand(read)
        given = problem.operands[name]
        grad = grads[name]
        if isinstance(given, _Positions):  # the sequence's rows of the gradient, as a view
            grad = given._replace(array=grad).of_sequence(head.q_rows, head.k_rows)
        np.add.at(grad, tuple(i[take] for i in indices), term[take])


class _Head(NamedTuple):
    """One query head of one sequence: where its rows are, its scaled logits and softmax."""
    q_rows: int | slice  # q[q_rows] is the sequence's (Sq, Hq, D) queries, dense or ragged
    k_rows: int | slice
    h: int
    kh: int  # the KV head it reads
    s: np.ndarray  # scale * q.k, (Sq, Sk)
    p: np.ndarray  # the softmax of the scored, masked logits; 0 where masked
    lse: np.ndarray  # (Sq,)
    rule_inputs: dict  # b, h, q_idx, kv_idx, seqlen_q, seqlen_k
    b: int
    sink: float | None  # the sink's logit, if a rule gives one
    operands: dict  # the rules' operands, as the sequence's rules read them


class _Problem:
    """Checked attention inputs as float64, and the walk over their sequences and heads that
    the forward and backward references share."""

    def __init__(self, q, k, v, mask_rule, score_rule, program, scale, cu_seqlens_q,
                 cu_seqlens_k, operands=None, sink_rule=None):
        if any(r is not None for r in (mask_rule, score_rule, sink_rule)) and program is None:
            raise ValueError("mask, score and sink rules need the checked program they come "
                             "from")
        if (cu_seqlens_q is None) != (cu_seqlens_k is None):
            raise ValueError("give both cu_seqlens_q and cu_seqlens_k, or neither")
        q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
        ragged = cu_seqlens_q is not None
        want_ndim = 3 if ragged else 4
        if q.ndim != want_ndim or k.ndim != want_ndim or v.ndim != want_ndim:
            raise ValueError(f"{'ragged' if ragged else 'dense'} q, k, v must have {want_ndim} "
                             f"dimensions, got {q.shape}, {k.shape}, {v.shape}")
        if k.shape[:-1] != v.shape[:-1] or q.shape[-1] != k.shape[-1]:
            raise ValueError(f"q {q.shape}, k {k.shape} and v {v.shape} do not fit together")
        hq, hkv = q.shape[-2], k.shape[-2]
        if hq % hkv:
            raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
        if ragged:
            cq, ck = (np.asarray(c, np.int64) for c in (cu_seqlens_q, cu_seqlens_k))
            if cq.shape != ck.shape or cq.ndim != 1 or len(cq) < 1:
                raise ValueError("cu_seqlens_q and cu_seqlens_k must be 1-D of the same "
                                 "length B+1")
            self.sequences = [(slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1]))
                              for i in range(len(cq) - 1)]
        else:
            if k.shape[0] != q.shape[0]:
                raise ValueError(f"q has batch {q.shape[0]}, k has {k.shape[0]}")
            self.sequences = [(i, i) for i in range(q.shape[0])]
        self.q, self.k, self.v = q, k, v
        self.group = hq // hkv
        self.scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
        self.mask_rule, self.score_rule, self.program = mask_rule, score_rule, program
        self.sink_rule = sink_rule
        self.operands = operands or {}

    def heads(self):
        """Yields a `_Head` per sequence and query head, one (Sq, Sk) matrix at a time (a
        loop over heads rather than a batched einsum keeps long sequences' memory small)."""
        mask_rule, score_rule, program = self.mask_rule, self.score_rule, self.program
        mask_per_head = mask_rule is not None and "h" in rule_roles(mask_rule, program)
        for b, (q_rows, k_rows) in enumerate(self.sequences):
            qb, kb = self.q[q_rows], self.k[k_rows]
            sq, sk = len(qb), len(kb)
            operands = {n: v.of_sequence(q_rows, k_rows) if isinstance(v, _Positions) else v
                        for n, v in self.operands.items()}
            idx = dict(b=b, q_idx=np.arange(sq)[:, None], kv_idx=np.arange(sk)[None, :],
                       seqlen_q=sq, seqlen_k=sk)
            keep = None
            for h in range(qb.shape[1]):
                kh = h // self.group
                s = self.scale * (qb[:, h] @ kb[:, kh].T)
                z = s if score_rule is None else evaluate_rule(score_rule, program,
                                                               operands, s=s, h=h, **idx)
                if mask_rule is not None:
                    if keep is None or mask_per_head:  # most masks ignore h: evaluate them once
                        keep = evaluate_rule(mask_rule, program, operands, h=h, **idx)
                    z = np.where(keep, z, -np.inf)
                sink = None if self.sink_rule is None else float(evaluate_rule(
                    self.sink_rule, program, operands, b=b, h=h, seqlen_q=sq,
                    seqlen_k=sk))
                p, lse = _softmax_rows(z, sink)
                yield _Head(q_rows, k_rows, h, kh, s, p, lse, {**idx, "h": h}, b, sink,
                            operands)


class _Positions(NamedTuple):
    """A tensor operand with `queries`/`keys` axes (`_kernel_rules`): its elements, axes and
    whether those axes hold every sequence's rows one after another (`ragged`: query rows,
    keys), where a sequence reads its own (`of_sequence`)."""

    array: np.ndarray
    axes: tuple[str, ...]
    ragged: tuple[bool, bool]

    def of_sequence(self, q_rows, k_rows) -> np.ndarray:
        """The tensor as the rules of the sequence of rows `q_rows` and keys `k_rows`
        (slices, where ragged) read it: its ragged position axes cut to those rows."""
        cut = [slice(None)] * len(self.axes)
        for axis, ragged, rows in (("queries", self.ragged[0], q_rows),
                                   ("keys", self.ragged[1], k_rows)):
            if ragged and axis in self.axes:
                cut[self.axes.index(axis)] = rows
        return self.array[tuple(cut)]


def ragged_sequence_operands(options, operands: dict, q_rows: slice, k_rows: slice) -> dict:
    """A ragged call's operand values as the rules of its sequence of rows `q_rows` and
    keys `k_rows` read them: tensors along the query rows or keys cut to the sequence's."""
    axes = {o.name: o.axes for o in options.operands}
    return {n: _Positions(np.asarray(v), axes[n], (True, True)).of_sequence(q_rows, k_rows)
            if set(axes.get(n, ())) & {"queries", "keys"} else v for n, v in operands.items()}


def _softmax_rows(z: np.ndarray, sink: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """softmax(z) and the log-sum-exp per row, with the `sink` logit in every row's
    denominator where there is one; a row without a finite score (or sink) is 0, -inf."""
    m = z.max(axis=1, initial=-np.inf)
    if sink is not None:
        m = np.maximum(m, sink)
    dead = np.isneginf(m)
    e = np.exp(z - np.where(dead, 0.0, m)[:, None])
    total = e.sum(axis=1) + (0.0 if sink is None else np.exp(sink - np.where(dead, 0.0, m)))
    total = np.where(dead, 1.0, total)
    return e / total[:, None], np.where(dead, -np.inf, m + np.log(total))


def _to_numpy(x):
    """Any array the kernels accept (torch, CuPy, NumPy), as a host float64/int array."""
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("torch"):
        return x.detach().float().cpu().numpy() if x.is_floating_point() else x.cpu().numpy()
    return x.get()  # CuPy


def _host_ints(x) -> np.ndarray:
    return _to_numpy(x).astype(np.int64)


def _read_offsets(offsets, name: str, max_seqlen) -> np.ndarray:
    return _host_ints(offsets)  # the reference reads every value: it checks them all


def _tensor(x, name: str):
    """A tensor argument as the kernels' call takes one: a NumPy array, or a torch or CuPy
    one (on any device: the reference copies it to the host)."""
    if not (isinstance(x, np.ndarray) or type(x).__module__.split(".")[0] in ("torch", "cupy")):
        raise TypeError(f"argument {name!r}: expected a NumPy array, a torch tensor or a CuPy "
                        f"array, got {type(x).__qualname__}")
    return x


def _float_tensor(x, name: str):
    dtype = dtype_name(_tensor(x, name))
    if not (dtype.startswith("float") or dtype == "bfloat16"):
        raise TypeError(f"tensor {name!r} has dtype {dtype}; the reference needs "
                        f"floating-point values")


def _check_kernel(kernel, function: str) -> None:
    from mhadsl.host.api import Kernel
    if not isinstance(kernel, Kernel):
        raise TypeError(f"mhadsl.{function}() takes a Kernel (program[name]) first, got "
                        f"{type(kernel).__name__}")


def _checked_call(kernel, function: str, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k, scale) -> AttentionCall:
    """The forward call's arguments, checked as the call checks them."""
    _check_kernel(kernel, function)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _float_tensor(t, name)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t is not None:
            _tensor(t, name)
    return check_attention_call(kernel.options, q, k, v, cu_seqlens_q=cu_seqlens_q,
                                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                max_seqlen_k=max_seqlen_k, scale=scale, read=_read_offsets)


DECODE_ARGUMENTS = ("cache_seqlens", "page_table", "num_splits", "k_new", "v_new", "k_scale",
                    "v_scale")


def reference(kernel, q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
              max_seqlen_k=None, scale: float | None = None, out=None,
              return_lse: bool | None = None, stream=None, block_classes=None, **operands):
    """What `kernel(q, k, v, ...)` computes, in NumPy float64: the call's arguments, checked
    as the call checks them (`mhadsl.host.calls.check_attention_call`), the declaration's
    operands by name. `out`, `stream` and `block_classes` are taken so that a call's
    arguments pass as they are, and not used: the result is a new array. A call against a
    KV cache has its own reference, `reference_decode`."""
    given = [n for n in operands if n in DECODE_ARGUMENTS]
    if given:
        raise TypeError(f"mhadsl.reference() got {', '.join(given)}: the reference of a "
                        f"call against a KV cache is mhadsl.reference_decode()")
    _check_kernel(kernel, "reference")
    values = operand_values(kernel.options, operands)
    check_flag(return_lse, "return_lse")
    call = _checked_call(kernel, "reference", q, k, v, cu_seqlens_q, cu_seqlens_k,
                         max_seqlen_q, max_seqlen_k, scale)
    want_lse = kernel.options.return_lse if return_lse is None else bool(return_lse)
    return attention_reference(*map(_to_numpy, (q, k, v)), return_lse=want_lse,
                               **_kernel_rules(kernel, call.scale, call.cu_seqlens_q,
                                               call.cu_seqlens_k, values, call.batch,
                                               call.heads, *_operand_rows(q, k, call)))


def reference_block_classes(kernel, q, k, *, cell: tuple[int, int], cu_seqlens_q=None,
                            cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                            **operands) -> np.ndarray:
    """The tile classes a call `kernel(q, k, v, ...)` of a declaration whose mask reads data
    finds on the device before its kernels run (`codegen.block_classes`), for cells of
    `cell` (query rows, keys: the scheduled kernel's tile), from the mask's NumPy meaning:
    uint8 (B, heads the classes differ by (Hq where the mask reads h, else 1),
    ceil(max_seqlen_q / rows), ceil(max_seqlen_k / keys)), each cell's bits as `mhadsl.abi`
    lays them out (0 for a cell outside its sequence). q and k give the call's shapes
    only."""
    _check_kernel(kernel, "reference_block_classes")
    opts = kernel.options
    if not opts.mask_reads_data:
        raise ValueError(f"kernel '{kernel.name}' classifies its tiles at compile time: its "
                         f"mask reads no tensor operand per pair")
    values = operand_values(opts, operands)
    call = _checked_call(kernel, "reference_block_classes", q, k, k, cu_seqlens_q,
                         cu_seqlens_k, max_seqlen_q, max_seqlen_k, None)
    rules = _kernel_rules(kernel, call.scale, call.cu_seqlens_q, call.cu_seqlens_k, values,
                          call.batch, call.heads, *_operand_rows(q, k, call))
    cell_rows, cell_keys = cell = check_cell(cell)
    rows, cols = -(-call.max_seqlen_q // cell_rows), -(-call.max_seqlen_k // cell_keys)
    heads = call.heads if opts.mask_reads_head else 1
    found = np.zeros((call.batch, heads, rows, cols), np.uint8)
    for b in range(call.batch):
        if call.ragged:
            q_rows = slice(call.cu_seqlens_q[b], call.cu_seqlens_q[b + 1])
            k_rows = slice(call.cu_seqlens_k[b], call.cu_seqlens_k[b + 1])
            sq, sk = q_rows.stop - q_rows.start, k_rows.stop - k_rows.start
        else:
            q_rows = k_rows = b
            sq, sk = call.seqlen_q, call.seqlen_k
        seq_operands = {n: v.of_sequence(q_rows, k_rows) if isinstance(v, _Positions) else v
                        for n, v in rules["operands"].items()}
        for h in range(heads):
            keep = np.broadcast_to(evaluate_rule(
                opts.mask, rules["program"], seq_operands, b=b, h=h,
                q_idx=np.arange(sq)[:, None], kv_idx=np.arange(sk)[None, :], seqlen_q=sq,
                seqlen_k=sk), (sq, sk))
            some, every = cell_classes(keep, cell, rows, cols)
            found[b, h] = np.where(some, CELL_MAY | np.where(every, CELL_ALL, 0), 0)
    return found


def cell_classes(keep: np.ndarray, cell: tuple[int, int], rows: int,
                 cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(some pair kept, every pair kept) of each of `rows` x `cols` cells of `cell` (query
    rows, keys) pairs, the first starting at `keep`'s pair (0, 0) (bool; the cells hold all
    of it): pairs past `keep` are neither kept nor dropped."""
    some, every = np.zeros((rows, cols), bool), np.ones((rows, cols), bool)
    (sq, sk), (cell_rows, cell_keys) = keep.shape, cell
    # the cells that hold pairs of `keep` (counted, not padded: a cell larger than the
    # sequence costs no memory); the others keep none and drop none
    r, c = min(rows, -(-sq // cell_rows)), min(cols, -(-sk // cell_keys))
    if r and c:
        starts_q, starts_k = np.arange(r) * cell_rows, np.arange(c) * cell_keys
        held = keep[:r * cell_rows, :c * cell_keys].astype(np.int64)
        kept = np.add.reduceat(np.add.reduceat(held, starts_q, axis=0), starts_k, axis=1)
        pairs = np.outer(np.minimum(starts_q + cell_rows, held.shape[0]) - starts_q,
                         np.minimum(starts_k + cell_keys, held.shape[1]) - starts_k)
        some[:r, :c], every[:r, :c] = kept > 0, kept == pairs
    return some, every


def _operand_rows(q, k, call) -> tuple[tuple[int, int], tuple[bool, bool]]:
    """A forward call's query rows and keys for tensor operands' position axes (as
    `host.forward.operand_rows`)."""
    if call.cu_seqlens_q is not None:
        return (q.shape[0], k.shape[0]), (True, True)
    return (q.shape[1], k.shape[1]), (False, False)


def reference_backward(kernel, q, k, v, dout, *, cu_seqlens_q=None, cu_seqlens_k=None,
                       max_seqlen_q=None, max_seqlen_k=None, scale: float | None = None,
                       deterministic: bool | None = None, operand_grads=(), **operands):
    """The gradients (dq, dk, dv) of what `kernel(q, k, v, ...)` computes, for the output
    gradient `dout`, in NumPy float64 and the layouts of q, k, v
    (`attention_reference_backward`; with a sink rule also dsink, and with `operand_grads`
    the dict of those operands' gradients, as `Kernel.backward`).
    The arguments are `Kernel.backward`'s, checked as it checks them, but the forward's `out`
    and `lse` (the reference recomputes them);
    `deterministic` is taken and not used (the reference is one computation)."""
    check_flag(deterministic, "deterministic")
    _check_kernel(kernel, "reference_backward")
    values = operand_values(kernel.options, operands)
    call = _checked_call(kernel, "reference_backward", q, k, v, cu_seqlens_q, cu_seqlens_k,
                         max_seqlen_q, max_seqlen_k, scale)
    _float_tensor(dout, "dout")
    check_shape(dout, "dout", q.shape)
    return attention_reference_backward(
        *map(_to_numpy, (q, k, v, dout)),
        **_kernel_rules(kernel, call.scale, call.cu_seqlens_q, call.cu_seqlens_k, values,
                        call.batch, call.heads, *_operand_rows(q, k, call)),
        operand_grads=check_operand_grads(kernel.options, kernel.program.checked,
                                          operand_grads))


def reference_decode(kernel, q, k_cache, v_cache, *, cache_seqlens, page_table=None,
                     cu_seqlens_q=None, max_seqlen_q=None, scale: float | None = None,
                     out=None, return_lse: bool | None = None, stream=None,
                     num_splits: int | None = None, k_new=None, v_new=None, k_scale=None,
                     v_scale=None, **operands):
    """What the decode call `kernel(q, k_cache, v_cache, cache_seqlens=..., ...)` computes, in
    NumPy float64: attention of the query rows over their sequence's cached keys.

    The layouts and argument checks are `mhadsl.host.paged`'s, which the decode call shares:
    q dense (B, Sq, Hq, D) with Sq 1..16, or ragged (total_q, Hq, D) with `cu_seqlens_q`;
    k_cache/v_cache paged (num_pages, page_size, Hkv, D) through the int32 `page_table`
    (B, max_pages), or contiguous (B, max_cache_len, Hkv, D); sequence b's keys are its first
    `cache_seqlens[b]` positions. Its Sq_b query rows are the last Sq_b of those positions: the
    rules see q_idx 0..Sq_b-1, seqlen_q = Sq_b and seqlen_k = cache_seqlens[b]. The mask is
    the declaration's, as it is: one without a mask sees every cached key, so decode kernels
    declare the bottom-right causal mask `kv_idx <= q_idx + seqlen_k - seqlen_q` (row i then
    sees positions up to seqlen_k - Sq_b + i). With `k_new`/`v_new` (the step's rows, q's
    layout with Hkv heads) the call first writes them at positions cache_seqlens[b] ... of a
    copy of the cache (the caller's arrays are left as they are) and attends over
    cache_seqlens[b] + Sq_b keys. A float8_e4m3fn cache holds keys / k_scale and values /
    v_scale: the reference reads it as elements x scale, and stores new rows as
    `e4m3_bytes(row / scale)` (the kernel's rounding). All index values are checked here (they are
    read to the host); the kernels' call checks device-side ones only under MHADSL_DEBUG=1.
    Returns O in q's layout and, with `return_lse` (default: the declaration's), the LSE:
    (B, Hq, Sq) dense, (Hq, total_q) ragged. `out`, `stream` and `num_splits` (checked) are
    the call's, taken so that its arguments pass as they are, and not used.
    """
    _check_kernel(kernel, "reference_decode")
    values = operand_values(kernel.options, operands)
    check_flag(return_lse, "return_lse")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _float_tensor(t, name)
    for name, t in (("cache_seqlens", cache_seqlens), ("page_table", page_table),
                    ("cu_seqlens_q", cu_seqlens_q), ("k_new", k_new), ("v_new", v_new)):
        if t is not None:
            _tensor(t, name)
    call = check_decode_call(kernel.options, q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                             page_table=page_table, cu_seqlens_q=cu_seqlens_q,
                             max_seqlen_q=max_seqlen_q, scale=scale, num_splits=num_splits,
                             k_new=k_new, v_new=v_new, k_scale=k_scale, v_scale=v_scale,
                             read=_host_ints)
    rules = _kernel_rules(kernel, call.scale, call.cu_seqlens_q, None, values, call.batch,
                          q.shape[-2], *decode_operand_rows(
                              call, q.shape, k_cache.shape,
                              None if page_table is None else page_table.shape))
    q, k_cache, v_cache = (_to_numpy(x) for x in (q, k_cache, v_cache))
    scales = call.kv_scales
    if scales is not None:  # an FP8 cache, dequantised (new arrays)
        k_cache, v_cache = (c.astype(np.float64) * s for c, s in zip((k_cache, v_cache), scales))
    pages = None if page_table is None else _host_ints(page_table)
    if call.appends:  # the new rows, written into copies of the cache
        if scales is None:
            k_cache, v_cache = k_cache.copy(), v_cache.copy()
        cu_q = call.cu_seqlens_q
        first = call.cache_seqlens - np.diff(cu_q)  # each sequence's first new position
        rows = np.arange(cu_q[-1] - cu_q[0])
        sequence = np.searchsorted(cu_q, rows + cu_q[0], side="right") - 1
        position = first[sequence] + rows + cu_q[0] - cu_q[sequence]
        where = (sequence, position) if pages is None else \
            (pages[sequence, position // call.page_size], position % call.page_size)
        for cache, new, s in ((k_cache, k_new, scales and scales[0]),
                              (v_cache, v_new, scales and scales[1])):
            new = _to_numpy(new)
            if s is not None:  # stored quantised, read back dequantised
                new = e4m3_values(e4m3_bytes(np.float32(new) / np.float32(s))) * s
            cache[where] = new.reshape(-1, *new.shape[-2:])[rows + cu_q[0]]
    # Each sequence's keys gathered into one ragged K/V; dense q goes ragged too (B*Sq rows).
    cu_k = np.concatenate([[0], np.cumsum(call.cache_seqlens)])
    sequence = np.repeat(np.arange(call.batch), call.cache_seqlens)
    position = np.arange(cu_k[-1]) - cu_k[sequence]
    if page_table is None:
        where = (sequence, position)
    else:
        where = (pages[sequence, position // call.page_size], position % call.page_size)
    out, lse = attention_reference(q.reshape(-1, *q.shape[-2:]), k_cache[where], v_cache[where],
                                   return_lse=True, **{**rules, "cu_seqlens_k": cu_k})
    if cu_seqlens_q is None:  # back to the dense layouts
        out = out.reshape(q.shape)
        lse = np.moveaxis(lse.reshape(-1, *q.shape[:2]), 0, 1)
    want_lse = kernel.options.return_lse if return_lse is None else bool(return_lse)
    return (out, lse) if want_lse else out


def e4m3_values(codes) -> np.ndarray:
    """float8_e4m3fn bytes as float64: sign, 4 exponent bits (bias 7), 3 mantissa bits;
    exponent 0 subnormal; 0x7f / 0xff NaN."""
    codes = np.asarray(codes, np.int64)
    exponent, mantissa = (codes >> 3) & 15, codes & 7
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0 ** -6,
                         (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    magnitude = np.where(codes & 0x7F == 0x7F, np.nan, magnitude)
    return np.where(codes & 0x80, -magnitude, magnitude)


def e4m3_bytes(x) -> np.ndarray:
    """The float8_e4m3fn byte nearest each float32 of `x`, ties to the even byte, +-448 for
    anything beyond (infinities too), NaN as 0x7f: the FP8 cache append's rounding."""
    x = np.asarray(x, np.float32)
    a = np.abs(x).astype(np.float64)
    finite = e4m3_values(np.arange(127))  # ascending: 0 .. 448
    hi = np.clip(np.searchsorted(finite, a), 1, 126)
    lo = hi - 1
    below, above = a - finite[lo], finite[hi] - a
    code = np.where(below < above, lo, np.where(above < below, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a >= 448, 126, np.where(a <= 0, 0, code))
    code = np.where(np.isnan(a), 127, code)
    return (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


def _kernel_rules(kernel, scale: float, cu_seqlens_q, cu_seqlens_k, operands: dict,
                  batch: int, heads: int, rows: tuple, ragged_rows: tuple[bool, bool]) -> dict:
    """The reference's keyword arguments for a kernel's checked call: its rules, scale,
    offsets (host arrays) and operand values, its tensors checked against the call's
    `batch` sequences, `heads` query heads and `rows` (`calls.check_tensor_operand`), as host
    arrays; one with `queries`/`keys` axes as `_Positions`."""
    opts = kernel.options
    values = dict(operands)
    for o in opts.operands:
        if o.axes:
            t = _tensor(values[o.name], o.name)
            check_tensor_operand(o, t, batch, heads, rows, ragged_rows)
            values[o.name] = _to_numpy(t).astype(np.int64 if o.type == "i32" else np.float64)
            if set(o.axes) & {"queries", "keys"}:
                values[o.name] = _Positions(values[o.name], o.axes, ragged_rows)
    return dict(mask_rule=opts.mask, score_rule=opts.score, sink_rule=opts.sink,
                program=kernel.program.checked,
                scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                operands=values)
