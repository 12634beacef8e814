"""The scheduler trace kernel: the work loop over the whole grid, recording each CTA's
steps instead of running a tile body, so a test can compare them with the simulator's (and
`mhadsl.pipeline` builds one per scheduler of a program).
"""
from __future__ import annotations

from llvmlite import ir

from mhadsl.codegen import nvptx
from mhadsl.codegen.faults import linear_cta
from mhadsl.codegen.lower import alloca
from mhadsl.codegen.nvptx import i32
from mhadsl.codegen.scheduler import LoweredScheduler
from mhadsl.codegen.work_loop import EnvParams, count_exit, emit_work_loop, env_filler, shared_slots

TRACE_FIELDS = 4  # per step: prompt_offset, head_idx, prompt_idx, 1 (0 past the last step)


def build_trace_kernel(module: ir.Module, sched: LoweredScheduler) -> ir.Function:
    """A kernel that drives the scheduler over the whole grid and records every tile.

    Params: (u32* workspace, u32 num_sms, u32 batch, u32 max_tiles, u32 max_seq_len,
    u32 num_heads, i32* valid_length or null, u32* out, u32 max_steps, u32* overflow,
    u32* tile_index or null); the workspace is the stream's (`mhadsl.abi`), the tile index
    what `codegen.tile_index` builds from valid_length.
    Thread 0 of CTA c writes step s at out[(c * max_steps + s) * 4 ...].
    """
    g = nvptx.ptr(nvptx.GLOBAL)
    fnty = ir.FunctionType(nvptx.void, [g, i32, i32, i32, i32, i32, g, g, i32, g, g])
    fn = ir.Function(module, fnty, name=f"trace_{sched.spec.name}")
    nvptx.mark_kernel(fn)
    counter, num_sms, batch, tiles, max_len, heads, vl, out, max_steps, overflow, index = \
        fn.args
    for a in (counter, vl, out, overflow, index):
        a.add_attribute("noalias")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    fill_env = env_filler(b, sched, shared_slots(module),
                          lambda _: EnvParams(counter, num_sms, i32(1), batch, tiles, max_len,
                                              heads, vl, index))
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
        count_exit(b, counter)
    b.ret_void()
    return fn
