"""An attention declaration -> one persistent kernel: scheduler loop around the tile body.

The mask and score rules become the tile body's hooks (lowered by `codegen.lower` with
their parameters bound to the kernel's index values), the mask's interval classification
becomes the tile classifier, and the bound scheduler's rules drive the work loop.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from llvmlite import ir

from mhadsl.check import CheckedProgram
from mhadsl.classify import emit_classify
from mhadsl.codegen.backends import sm80 as attention
from mhadsl.codegen.lower import Builtins, FunctionLowering
from mhadsl.codegen.nvptx import i32, i64
from mhadsl.codegen.scheduler import (
    EnvParams, SchedulerSpec, emit_work_loop, env_filler, lower_scheduler, shared_slots,
)
from mhadsl.codegen.assemble import Assembled, assemble, find_ptxas
from mhadsl.codegen.target import Target, emit_ptx, optimize
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
        args.persistent = lowered.may_advance

        def params(b: ir.IRBuilder) -> EnvParams:
            # In a persistent loop the scheduler's inputs pass through an opaque identity,
            # so what the rules derive from them is recomputed per step (from parameter
            # space) instead of being held in registers across the tile body.
            fence = _opaque if lowered.may_advance and args.tuning.opaque_env else \
                (lambda _, v: v)
            max_q = fence(b, args.max_seqlen_q)
            tiles = b.udiv(b.add(max_q, i32(spec.tile_m - 1)), i32(spec.tile_m))
            return EnvParams(fence(b, args.queue), fence(b, args.num_sms),
                             fence(b, args.ctas_per_sm),
                             fence(b, args.batch), tiles, fence(b, args.seqlen_q),
                             fence(b, args.num_heads), fence(b, args.cu_seqlens_q))

        fill_env = env_filler(builder, lowered, shared_slots(builder.module), params)
        emit_work_loop(builder, lowered, fill_env,
                       lambda b, seq: body(b, attention.TileSeq(**seq)))
    return work_loop


def _opaque(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    """`value`, through an empty volatile asm LLVM cannot see through or hoist."""
    ty = value.type
    if isinstance(ty, ir.PointerType):
        as_int = builder.ptrtoint(value, i64)
        return builder.inttoptr(_opaque(builder, as_int), ty)
    constraint = "=l,0" if ty == i64 else "=r,0"
    return builder.asm(ir.FunctionType(ty, [ty]), "", constraint, [value], True)


def build_configs(options, *, gqa_group: int = 1, ragged: bool = False,
                  return_lse: bool = False) -> tuple[attention.AttentionConfig, ...]:
    """The builds to try for a declaration (`AttentionOptions`) and one call's layout, best
    first: the arch's default tile for its dtype and head dim, overridden by what the
    declaration fixes; then, unless it fixes the tile, a 32-row KV tile, which leaves
    ptxas more registers."""
    base = attention.default_config(options.dtype, options.head_dim, gqa_group=gqa_group,
                                    return_lse=return_lse, ragged=ragged)
    overrides = {k: v for k, v in (("block_m", options.block_m), ("block_n", options.block_n),
                                   ("num_warps", options.warps), ("stages", options.stages))
                 if v is not None}
    primary = replace(base, **overrides).validate()
    if options.block_n is not None or primary.block_n <= 32:
        return (primary,)
    narrow = replace(primary, block_n=32)
    try:
        return (primary, narrow.validate())
    except ValueError:
        return (primary,)


def build_kernel_module(program: CheckedProgram, mask_rule, score_rule, spec: SchedulerSpec,
                        config: attention.AttentionConfig, target: Target,
                        tuning: attention.Tuning = attention.Tuning()) -> ir.Module:
    return attention.build_attention_module(
        config, expr_hooks(program, mask_rule, score_rule), target,
        scheduler_work_loop(program, spec, target), tuning)


@dataclass(frozen=True)
class KernelBuild:
    llvm: str
    ptx: str
    assembled: Assembled | None  # None when no ptxas is at hand
    config: attention.AttentionConfig  # the tile the build settled on
    tuning: attention.Tuning


def compile_kernel(program: CheckedProgram, mask_rule, score_rule, spec: SchedulerSpec,
                   configs: Sequence[attention.AttentionConfig], target: Target) -> KernelBuild:
    """LLVM IR, PTX and (with ptxas) the cubin of one attention kernel, spill-free if any
    candidate is. The IR shapes in `attention.TUNINGS` compute the same thing, but
    ptxas's allocation under the 255-register cap is chaotic, so the first shape that
    assembles without spills wins; after them come the fallback `configs` (a narrower KV
    tile), and with no spill-free candidate the one with the fewest spills."""
    have_ptxas = find_ptxas() is not None
    candidates = [(c, t) for c in configs for t in attention.TUNINGS]
    best = None
    for config, tuning in candidates if have_ptxas else candidates[:1]:
        module = build_kernel_module(program, mask_rule, score_rule, spec, config, target,
                                     tuning)
        ptx = emit_ptx(optimize(module, target), target)
        assembled = assemble(ptx, target.arch) if have_ptxas else None
        build = KernelBuild(str(module), ptx, assembled, config, tuning)
        spills = sum(k.spills for k in assembled.kernels.values()) if assembled else 0
        if best is None or spills < best[0]:
            best = (spills, build)
        if spills == 0:
            break
    return best[1]
