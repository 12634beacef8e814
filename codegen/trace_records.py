"""Tracing a kernel's work items: a record per tile (or decode work item) in the
workspace's trace buffer (`abi.TRACE_FIELDS`, decoded by `runtime.trace_records`).
"""
from __future__ import annotations

from typing import Callable

from llvmlite import ir

from mhadsl.codegen import nvptx
from mhadsl.codegen.faults import linear_cta, word
from mhadsl.codegen.nvptx import i32, i64
from mhadsl import abi


def record_work_item(builder: ir.IRBuilder, workspace: ir.Value, fields: dict[str, ir.Value],
                     thread: int, emit_body: Callable[[], None],
                     kind: int = abi.TRACE_WORK_ITEM) -> None:
    """Emit `emit_body()` between the two halves of a record (`abi.TRACE_FIELDS`, decoded by
    `runtime.trace_records`) of `kind`, which thread `thread` of the CTA writes: before the
    body it claims a record, writes the tile, CTA, SM and %globaltimer there and keeps the
    record's address and start time in shared memory (so no register stays live across the
    tile body, which sits at ptxas's register cap); after it, the duration
    (`end_record`, unless the body ended the record itself)."""
    b = builder
    scratch = _trace_scratch(b.module)
    gptr = workspace.type

    with b.if_then(_is_recorder(b, thread)):
        k = b.atomic_rmw("add", word(b, workspace, abi.TRACE_COUNT_WORD), i32(1), "monotonic")
        fits = b.icmp_unsigned("<", k, b.load(word(b, workspace, abi.TRACE_CAPACITY_WORD),
                                               typ=i32))
        at = b.add(i32(abi.TRACE_HEADER_WORDS), b.mul(k, i32(abi.TRACE_RECORD_WORDS)))
        record = b.select(fits, word(b, workspace, at), ir.Constant(gptr, None))
        smid = nvptx.opaque_special_register(b, "smid")
        start = nvptx.opaque_special_register(b, "globaltimer", i64)
        with b.if_then(fits):
            values = {"prompt_offset": fields["prompt_offset"], "head": fields["head_idx"],
                      "batch": fields["prompt_idx"], "cta": linear_cta(b), "sm": smid,
                      "start_lo": b.trunc(start, i32),
                      "start_hi": b.trunc(b.lshr(start, i64(32)), i32), "kind": i32(kind)}
            for name, v in values.items():
                b.store(v, word(b, record, abi.TRACE_FIELDS.index(name)))
        b.store(b.ptrtoint(record, i64), _scratch_slot(b, scratch, 0))
        b.store(start, _scratch_slot(b, scratch, 1))
    emit_body()
    end_record(b, thread)


def end_record(builder: ir.IRBuilder, thread: int) -> None:
    """Thread `thread` writes the duration of its open record (`record_work_item`) and
    closes it, so a second end does nothing: a body may end its work item's record early,
    at the point its work is done (the decode design: where a split has published its
    result, before a combine that must start after it)."""
    b = builder
    scratch = _trace_scratch(b.module)
    with b.if_then(_is_recorder(b, thread)):
        end = nvptx.opaque_special_register(b, "globaltimer", i64)
        address = b.load(_scratch_slot(b, scratch, 0), typ=i64)
        with b.if_then(b.icmp_unsigned("!=", address, i64(0))):
            duration = b.trunc(b.sub(end, b.load(_scratch_slot(b, scratch, 1), typ=i64)), i32)
            b.store(duration, word(b, b.inttoptr(address, nvptx.ptr(nvptx.GLOBAL)),
                                   abi.TRACE_FIELDS.index("duration")))
            b.store(i64(0), _scratch_slot(b, scratch, 0))


def _is_recorder(builder: ir.IRBuilder, thread: int) -> ir.Value:
    return builder.icmp_unsigned("==", nvptx.special_register(builder, "thread_idx", "x"),
                                 i32(thread))


def _scratch_slot(builder: ir.IRBuilder, scratch: ir.Value, k: int) -> ir.Value:
    return builder.gep(scratch, [i32(0), i32(k)], source_etype=_TRACE_SCRATCH)


_TRACE_SCRATCH = ir.ArrayType(i64, 2)


def _trace_scratch(module: ir.Module) -> ir.GlobalVariable:
    """The recording thread's shared-memory scratch: its record's address, its start time."""
    return nvptx.shared_array(module, "mhadsl.trace_scratch", _TRACE_SCRATCH)
