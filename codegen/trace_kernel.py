"""The scheduler trace kernel: the work loop over the whole grid, recording each CTA's
steps instead of running a tile body, so a test can compare them with the simulator's (and
`mhadsl.pipeline` builds one per scheduler of a program).
"""
from __future__ import annotations

from llvmlite import ir

from mhadsl.abi import CallValue, KernelABI, Param, Pointer, Workspace
from mhadsl.codegen import nvptx, signature
from mhadsl.codegen.faults import linear_cta
from mhadsl.codegen.lower import alloca
from mhadsl.codegen.nvptx import i32
from mhadsl.codegen.scheduler import LoweredScheduler
from mhadsl.codegen.work_loop import EnvParams, count_exit, emit_work_loop, env_filler, shared_slots

TRACE_FIELDS = 4  # per step: prompt_offset, head_idx, prompt_idx, 1 (0 past the last step)
TRACE_ABI = KernelABI(
    Param("queue", "ptr", Workspace("queue"), "the stream's u32 workspace (mhadsl.abi): the "
          "work-queue counter, then the scheduler fault record; never null"),
    Param("num_sms", "i32", CallValue("num_sms"), "multiprocessors the scheduler sees"),
    Param("batch", "i32", CallValue("batch"), "number of sequences B"),
    Param("max_num_prompt_tiles", "i32", CallValue("max_num_prompt_tiles"),
          "query tiles of the longest sequence"),
    Param("max_seqlen_q", "i32", CallValue("max_seqlen_q"), "longest query sequence"),
    Param("num_heads", "i32", CallValue("num_heads"), "query heads"),
    Param("cu_seqlens_q", "ptr", Pointer("cu_seqlens_q"), "int32 (B+1) query row offsets "
          "(ragged), else null"),
    Param("trace", "ptr", Pointer("trace"), "the u32 record: CTA c's step s at words "
          "(c * max_steps + s) * TRACE_FIELDS ..."),
    Param("max_steps", "i32", CallValue("max_steps"), "steps recorded per CTA"),
    Param("overflow", "ptr", Pointer("overflow"), "one u32, set to 1 when a CTA took more "
          "than max_steps steps"),
    Param("tile_index", "ptr", Workspace("tile_index"), "u32 tile index of a ragged launch "
          "(codegen.tile_index), built from cu_seqlens_q; null when dense"),
)


def build_trace_kernel(module: ir.Module, sched: LoweredScheduler) -> ir.Function:
    """A kernel that drives the scheduler over the whole grid and records every tile; its
    parameters are `TRACE_ABI`'s. Thread 0 of each CTA records its steps.
    """
    fn, arg = signature.kernel(module, TRACE_ABI, f"trace_{sched.spec.name}")
    out, max_steps, overflow = arg["trace"], arg["max_steps"], arg["overflow"]
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    fill_env = env_filler(b, sched, shared_slots(module), lambda _: EnvParams(
        arg["queue"], arg["num_sms"], i32(1), arg["batch"], arg["max_num_prompt_tiles"],
        arg["max_seqlen_q"], arg["num_heads"], arg["cu_seqlens_q"], arg["tile_index"]))
    step = alloca(b, i32, "step")
    b.store(i32(0), step)
    tid = nvptx.special_register(b, "thread_idx", "x")
    cta = linear_cta(b)

    def record(bb: ir.IRBuilder, fields: dict[str, ir.Value]) -> None:
        s = bb.load(step, typ=i32)
        fits = bb.icmp_unsigned("<", s, max_steps)
        with bb.if_else(bb.and_(fits, bb.icmp_unsigned("==", tid, i32(0)))) as (then, other):
            with then:
                base = bb.mul(bb.add(bb.mul(cta, max_steps), s), i32(TRACE_FIELDS))
                for k, v in enumerate((fields["prompt_offset"], fields["head_idx"],
                                       fields["prompt_idx"], i32(1))):
                    bb.store(v, bb.gep(out, [bb.add(base, i32(k))], source_etype=i32))
            with other:
                with bb.if_then(bb.not_(fits)):
                    bb.store(i32(1), overflow)
        bb.store(bb.add(s, i32(1)), step)

    emit_work_loop(b, sched, fill_env, record)
    if sched.uses_queue:
        count_exit(b, arg["queue"])
    b.ret_void()
    return fn
