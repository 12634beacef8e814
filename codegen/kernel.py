"""An attention declaration -> what every backend builds its kernel from (`KernelSource`).

The mask and score rules become the kernel's hooks (lowered by `codegen.lower` with their
parameters bound to the kernel's index values), the mask's interval classification becomes
the tile classifier, and the bound scheduler's rules become the work loop around the tile
body. Which kernel design is built around them is the backend's business
(`codegen.backends`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from llvmlite import ir

from mhadsl.abi import (
    GRAD_PREFIX, OPERAND_PREFIX, classifies_per_call, declaration_params, operand_params,
    tensor_params,
)
from mhadsl.front.attention_spec import operand_key, read_over_tile, rule_reads
from mhadsl.front.check import CheckedProgram
from mhadsl.front.diagnostics import MhaError
from mhadsl.analysis.classify import emit_classify
from mhadsl.analysis.kv_limits import emit_kv_limits, kv_limits, operand_term
from mhadsl.analysis.derivative import differentiate_score, float_reads, read_operand
from mhadsl.codegen import block_classes, nvptx, warp
from mhadsl.codegen.backends import ExprHooks, KernelArgs, KernelSource, TileSeq, WorkLoop
from mhadsl.codegen.lower import Builtins, FunctionLowering
from mhadsl.codegen.nvptx import i32
from mhadsl.codegen.handoff import runs_apart
from mhadsl.codegen.scheduler import SchedulerSpec, lower_scheduler
from mhadsl.codegen.target import Target
from mhadsl.codegen.work_loop import EnvParams, emit_work_loop, env_filler, shared_slots
from mhadsl.front.types import BOOL, F32, I32, POSITION_AXES

MASK_ROLES = ("b", "h", "q_idx", "kv_idx", "seqlen_q", "seqlen_k")
SCORE_ROLES = ("s", "b", "h", "q_idx", "kv_idx", "seqlen_q", "seqlen_k")
SINK_ROLES = ("b", "h", "seqlen_q", "seqlen_k")


class _NoBuiltins(Builtins):
    """Mask and score expressions see only their parameters (the checker enforces it)."""

    gpu = True


class TensorArgs(NamedTuple):
    """A tensor operand as the kernel takes it (`mhadsl.abi.operand_params`): its address,
    and each axis's size and stride (i32, elements); for a `queries` or `keys` axis, the
    sequence's (first row, rows) there (`positions`, None elsewhere): a read at index i is
    row first + i, of the sequence's rows only (`lower.FunctionLowering.tensor_read`)."""

    pointer: ir.Value
    sizes: tuple[ir.Value, ...]
    strides: tuple[ir.Value, ...]
    positions: tuple = ()


def _operand_values(builder: ir.IRBuilder, operands: tuple, extents=None) -> dict:
    """The operands' values in the kernel being emitted (its parameters), by name: a
    scalar's, or a tensor's `TensorArgs`, its `queries`/`keys` axes read at the sequence's
    rows where `extents` gives them (`TileRules.extents`: first query row, query rows,
    first key, keys)."""
    args = {a.name: a for a in builder.function.args}
    values = {}
    for o in operands:
        value = args[OPERAND_PREFIX + o.name]
        if o.axes:
            sizes, strides = tensor_params(o.name, len(o.axes))
            positions = () if extents is None else tuple(
                {"queries": extents[:2], "keys": extents[2:]}.get(axis) for axis in o.axes)
            value = TensorArgs(value, tuple(args[n] for n in sizes),
                               tuple(args[n] for n in strides), positions)
        values[o.name] = value
    return values


def _rule_hook(program: CheckedProgram, rule, roles: tuple[str, ...], result_ty,
               operands: tuple, branch_free_reads: bool = True):
    def emit(builder: ir.IRBuilder, *values: ir.Value, extents=None) -> ir.Value:
        bindings = dict(zip(roles, values))
        bindings.update({operand_key(name): value for name, value in
                         _operand_values(builder, operands, extents).items()})
        lower = FunctionLowering(builder, program, _NoBuiltins(), bindings, default_int=I32,
                                 per_element=True, branch_free_reads=branch_free_reads)
        slot = lower.lower_body(rule.body, result_ty)
        return lower.load_value(slot)
    return emit


def expr_hooks(program: CheckedProgram, mask_rule, score_rule, operands=(),
               sink_rule=None, per_call: bool = False,
               branch_free_reads: bool = True) -> ExprHooks:
    """The hooks of a declaration's rules; `operands` its `AttentionOptions.operands`;
    `per_call`: the call classifies its tiles on the device (`mhadsl.abi.classifies_per_call`),
    whose classes the tile classification joins (`block_classes.lookup`);
    `branch_free_reads`: `FunctionLowering.branch_free_reads`. Their parameters are the
    operands'; a design build's are `kernel_source`'s."""
    mask, score, sink = (_rule_hook(program, rule, roles, ty, operands, branch_free_reads)
                         if rule else None for rule, roles, ty in (
                             (mask_rule, MASK_ROLES, BOOL), (score_rule, SCORE_ROLES, F32),
                             (sink_rule, SINK_ROLES, F32)))
    mask_uses_head = mask_rule is not None and rule_reads(mask_rule, "h")

    def classify(builder, b, h, q_lo, q_hi, kv_lo, kv_hi, seqlen_q, seqlen_k, q_rows=None,
                 kv_rows=None, ops=None, extents=None, cells=True, q_tile=None):
        values = _operand_values(builder, operands, extents)
        if per_call:  # (the call's classes are exact: the analysis reads no element, which
            # would be a load a KV tile for a box it rarely decides)
            values = {n: v for n, v in values.items() if not isinstance(v, TensorArgs)}
        may, every = emit_classify(builder, mask_rule, program, b, h, q_lo, q_hi, kv_lo,
                                   kv_hi, seqlen_q, seqlen_k, values, ops)
        if not (per_call and cells):
            return may, every
        found = block_classes.lookup(builder, b, h if mask_uses_head else None, q_lo, q_hi,
                                     kv_lo, kv_hi, q_rows, kv_rows, q_tile)
        return builder.and_(may, found[0]), builder.or_(every, found[1])
    limits = kv_limits(mask_rule, program)

    def row_limits(builder, b, h, q_idx, seqlen_q, seqlen_k):
        values = {operand_term(n): v for n, v in _operand_values(builder, operands).items()}
        return emit_kv_limits(builder, limits, {"b": b, "h": h, "q_idx": q_idx,
                                                "seqlen_q": seqlen_q, "seqlen_k": seqlen_k,
                                                **values})
    return ExprHooks(mask=mask, score=score, sink=sink,
                     positions=any(set(o.axes) & set(POSITION_AXES) for o in operands),
                     classify=classify if mask_rule is not None else None,
                     classify_loads=per_call,
                     mask_uses_head=mask_uses_head,
                     score_reads_lengths=score_rule is not None and any(
                         rule_reads(score_rule, n) for n in ("seqlen_q", "seqlen_k")),
                     kv_limits=row_limits if limits is not None else None,
                     operands=operand_params(operands))


def backward_hooks(program: CheckedProgram, mask_rule, score_rule, operands=(),
                   sink_rule=None, per_call: bool = False,
                   operand_grads: bool = False) -> ExprHooks:
    """The forward's hooks plus the score rule's derivative d score / d s
    (`mhadsl.analysis.derivative`), lowered like the score; raises `MhaError` where the score rule
    cannot be differentiated. With `operand_grads`, the hook that adds a pair's share of
    the gradients of the f32 tensors the score reads (`ExprHooks.scatter_reads`; their
    parameters are `kernel_source`'s)."""
    # (the backward designs hold more per element: a mask's reads stay behind its branch)
    hooks = expr_hooks(program, mask_rule, score_rule, operands, sink_rule, per_call,
                       branch_free_reads=False)
    if score_rule is None:
        return hooks
    rule, derived = differentiate_score(score_rule, program)
    hooks = replace(hooks, derivative=_rule_hook(derived, rule, SCORE_ROLES, F32, operands,
                                                 branch_free_reads=False))
    if not operand_grads:
        return hooks
    return replace(hooks, scatter_reads=scatter_hook(program, score_rule, operands))


def scatter_hook(program: CheckedProgram, score_rule, operands: tuple,
                 add_if=nvptx.red_add_f32_if):
    """`ExprHooks.scatter_reads`: per f32 tensor read r of the score rule and pair, dz *
    d score / d (the element r picks) added into that element of the operand's gradient
    (contiguous, in the operand's shape), where the read lies inside the tensor
    (`add_if(builder, pointer, value, predicate)`: the GPU's predicated reduction; the
    tests' host build adds without one).

    A read whose element is one over the tile (`gain[h]`: `read_over_tile`) sums its terms
    over the thread's pairs and the warp's lanes first, and lane 0 adds the sum: one
    reduction per warp and step, not one per pair. For any other read the score rule is
    lowered again per pair with its reads observed (`FunctionLowering.on_read`), so a read
    adds where, and only where, the rule's own control flow reads it (a predicated
    reduction, skipped for a term of 0); the score it computes is dead code."""
    slopes = {}
    for read in float_reads(score_rule, program):
        try:
            slopes[read] = _rule_hook(*differentiate_score(score_rule, program, read)[::-1],
                                      SCORE_ROLES, F32, operands, branch_free_reads=False)
        except MhaError:  # (no call asks for its gradient: `check_operand_grads`)
            continue
    over_tile = [r for r in slopes if read_over_tile(r, score_rule, operands)]
    per_pair = [r for r in slopes if r not in over_tile]

    def scatter(builder: ir.IRBuilder, pairs, b: ir.Value, h: ir.Value, *lengths: ir.Value,
                extents=None) -> None:
        tensors = _operand_values(builder, operands, extents)
        args = {a.name: a for a in builder.function.args}
        zero = ir.Constant(ir.FloatType(), 0.0)

        def lowering(s, q_idx, kv_idx, on_read) -> FunctionLowering:
            bindings = dict(zip(SCORE_ROLES, (s, b, h, q_idx, kv_idx, *lengths)))
            bindings.update({operand_key(name): value for name, value in tensors.items()})
            lower = FunctionLowering(builder, program, _NoBuiltins(), bindings,
                                     default_int=I32)
            lower.on_read = on_read
            return lower

        def add(read, at_axes, inside, term, predicate) -> None:
            name = read_operand(read)
            offset = i32(0)
            for index, size in zip(at_axes, tensors[name].sizes):  # (row-major)
                offset = builder.add(builder.mul(offset, size), index)
            base = args[GRAD_PREFIX + name]
            asked = builder.icmp_unsigned("!=", builder.ptrtoint(base, nvptx.i64),
                                          nvptx.i64(0))
            pointer = builder.gep(base, [builder.select(inside, offset, i32(0))],
                                  source_etype=ir.FloatType())
            add_if(builder, pointer, term, builder.and_(builder.and_(inside, asked), predicate))

        def term(read, dz, s, q_idx, kv_idx) -> ir.Value:
            """dz * the slope, 0 where dz is (a pair outside the mask or the sequence, or
            of P = 0, where the slope may not be finite: the reference's convention)."""
            slope = slopes[read](builder, s, b, h, q_idx, kv_idx, *lengths, extents=extents)
            return builder.select(builder.fcmp_ordered("==", dz, zero), zero,
                                  builder.fmul(dz, slope))

        for read in over_tile:
            total = None
            for dz, s, q_idx, kv_idx in pairs:
                x = term(read, dz, s, q_idx, kv_idx)
                total = x if total is None else builder.fadd(total, x)
            total = warp.warp_sum(builder, total)
            once = builder.and_(builder.icmp_unsigned("==", nvptx.lane_id(builder), i32(0)),
                                builder.fcmp_unordered("!=", total, zero))

            def on_read(r, at_axes, inside, read=read, total=total, once=once) -> None:
                if r is read:  # (not a read inside its index)
                    add(r, at_axes, inside, total, once)
            dz, s, q_idx, kv_idx = pairs[0]  # (its indices are the same at every pair)
            lowering(s, q_idx, kv_idx, on_read).expr(read)
        if not per_pair:
            return
        for dz, s, q_idx, kv_idx in pairs:
            terms = {r: term(r, dz, s, q_idx, kv_idx) for r in per_pair}

            def on_read(read, at_axes, inside) -> None:
                if read in terms:  # (not an i32 tensor's, nor a read over the tile)
                    add(read, at_axes, inside, terms[read],
                        builder.fcmp_unordered("!=", terms[read], zero))
            lowering(s, q_idx, kv_idx, on_read).lower_body(score_rule.body, F32)
    return scatter


def scheduler_work_loop(program: CheckedProgram, spec: SchedulerSpec, target: Target,
                        trace: bool = False) -> WorkLoop:
    """The work loop a backend's kernel runs: the scheduler's rules, for `spec.tile_m`;
    with `trace`, the loop's `args.trace_thread` records every work item (`mhadsl trace`)."""
    def work_loop(builder: ir.IRBuilder, args: KernelArgs, body) -> None:
        aligned = not args.divergent_roles
        handoff = args.handoff
        decl = program.schedulers.get(spec.name)  # (lower_scheduler reports a missing one)
        if handoff is not None and (decl is None or not runs_apart(program, decl)):
            handoff = None  # its roles step together
        variants = ((True, "ALL"),) if handoff is None else \
            ((True, "PRODUCER"),) if handoff.role == "producer" else ((False, "NONE"),)
        lowered = lower_scheduler(builder.module, program, spec, target,
                                  advance_variants=variants,
                                  producer_threads=handoff.producer_threads if handoff else 0,
                                  aligned_barriers=aligned, handoff=handoff is not None,
                                  zero_after_none=args.zero_after_none)
        args.persistent = lowered.may_advance
        args.counts_exits = lowered.uses_queue

        def params(b: ir.IRBuilder) -> EnvParams:
            # In a persistent loop the scheduler's inputs pass through an opaque identity,
            # so what the rules derive from them is recomputed per step (from parameter
            # space) instead of being held in registers across the tile body.
            fence = nvptx.opaque if lowered.may_advance and args.opaque_env else (lambda _, v: v)
            max_q = fence(b, args.max_seqlen_q)
            tiles = b.udiv(b.add(max_q, i32(spec.tile_m - 1)), i32(spec.tile_m))
            # A dense build has no tile index: the valid-work lookups fold to closed forms.
            index = fence(b, args.tile_index) if args.config.ragged else \
                ir.Constant(args.tile_index.type, None)
            return EnvParams(fence(b, args.queue), fence(b, args.num_sms),
                             fence(b, args.ctas_per_sm),
                             fence(b, args.batch), tiles, fence(b, args.seqlen_q),
                             fence(b, args.num_heads), fence(b, args.cu_seqlens_q), index)

        fill_env = env_filler(builder, lowered, shared_slots(builder.module), params)
        emit_work_loop(builder, lowered, fill_env, lambda b, seq: body(b, TileSeq(**seq)),
                       aligned=aligned, trace_thread=args.trace_thread if trace else None,
                       handoff=handoff, advance_in_tile=args.advance_in_tile)
    return work_loop


def kernel_source(program: CheckedProgram, options, target: Target,
                  trace: bool = False, workload: str = "prefill",
                  operand_grads: bool = False) -> KernelSource:
    """The hooks and work loop of a `workload` build of declaration `options`
    (`AttentionOptions`); `trace` builds the loop that records every work item; a backward
    build's hooks add the score rule's derivative (`backward_hooks`), and with
    `operand_grads` the gradients of the f32 tensors it reads. The hooks' parameters are
    the build's after its design's own (`mhadsl.abi.declaration_params`)."""
    def work_loop(tile_m: int, gqa_group: int, search_ways: int = 2) -> WorkLoop:
        spec = SchedulerSpec(options.scheduler, options.scheduler_args, tile_m, gqa_group,
                             search_ways)
        return scheduler_work_loop(program, spec, target, trace)
    per_call = classifies_per_call(options, workload)
    if workload == "backward":
        hooks = backward_hooks(program, options.mask, options.score, options.operands,
                               options.sink, per_call, operand_grads)
    else:
        hooks = expr_hooks(program, options.mask, options.score, options.operands,
                           options.sink, per_call)
    hooks = replace(hooks, operands=declaration_params(options, workload, operand_grads))
    return KernelSource(hooks, work_loop, trace, (options.scheduler, options.scheduler_args))
