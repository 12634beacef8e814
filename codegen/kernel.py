"""An attention declaration -> one persistent kernel: scheduler loop around the tile body.

The mask and score rules become the tile body's hooks (lowered by `codegen.lower` with
their parameters bound to the kernel's index values), the mask's interval classification
becomes the tile classifier, and the bound scheduler's rules drive the work loop.
"""
from __future__ import annotations

from llvmlite import ir

from mhadsl.check import CheckedProgram
from mhadsl.classify import emit_classify
from mhadsl.codegen import attention
from mhadsl.codegen.lower import Builtins, FunctionLowering
from mhadsl.codegen.nvptx import i32
from mhadsl.codegen.scheduler import (
    SchedulerSpec, emit_kernel_env, emit_work_loop, lower_scheduler, shared_slots,
)
from mhadsl.codegen.target import Target
from mhadsl.types import BOOL, F32, I32

MASK_ROLES = ("b", "h", "q_idx", "kv_idx", "seqlen_q", "seqlen_k")
SCORE_ROLES = ("s", "b", "h", "q_idx", "kv_idx")


class _NoBuiltins(Builtins):
    """Mask and score expressions see only their parameters (the checker enforces it)."""

    gpu = True


def _rule_hook(program: CheckedProgram, rule, roles: tuple[str, ...], result_ty):
    def emit(builder: ir.IRBuilder, *values: ir.Value) -> ir.Value:
        bindings = dict(zip(roles, values))
        lower = FunctionLowering(builder, program, _NoBuiltins(), bindings, default_int=I32)
        slot = lower.lower_body(rule.body, result_ty)
        return lower.load_value(slot)
    return emit


def expr_hooks(program: CheckedProgram, mask_rule, score_rule) -> attention.ExprHooks:
    mask = _rule_hook(program, mask_rule, MASK_ROLES, BOOL) if mask_rule else None
    score = _rule_hook(program, score_rule, SCORE_ROLES, F32) if score_rule else None
    def classify(builder, b, h, q_lo, q_hi, kv_lo, kv_hi, seqlen_q, seqlen_k):
        return emit_classify(builder, mask_rule, program, b, h, q_lo, q_hi, kv_lo, kv_hi,
                             seqlen_q, seqlen_k)
    return attention.ExprHooks(mask=mask, score=score,
                               classify=classify if mask_rule is not None else None)


def scheduler_work_loop(program: CheckedProgram, spec: SchedulerSpec, target: Target):
    """The work loop `attention.build_attention_module` calls: the scheduler's rules."""
    def work_loop(builder: ir.IRBuilder, args: attention.KernelArgs, body) -> None:
        lowered = lower_scheduler(builder.module, program, spec, target)
        bm = i32(spec.tile_m)
        tiles = builder.udiv(builder.add(args.max_seqlen_q, i32(spec.tile_m - 1)), bm)
        kenv = emit_kernel_env(
            builder, lowered, counter=args.queue, num_sms=args.num_sms, batch_size=args.batch,
            max_num_prompt_tiles=tiles, max_seq_len=args.seqlen_q, num_heads=args.num_heads,
            valid_length=args.cu_seqlens_q, slots=shared_slots(builder.module))
        emit_work_loop(builder, lowered, kenv,
                       lambda b, seq: body(b, attention.TileSeq(**seq)))
    return work_loop


def build_kernel_module(program: CheckedProgram, mask_rule, score_rule, spec: SchedulerSpec,
                        config: attention.AttentionConfig, target: Target) -> ir.Module:
    return attention.build_attention_module(
        config, expr_hooks(program, mask_rule, score_rule), target,
        scheduler_work_loop(program, spec, target))
