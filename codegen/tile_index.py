"""The tile index kernel: a ragged launch's valid work, built on the device from cu_seqlens.

`ts.num_valid_work()` and `ts.valid_work_info(...)` (`codegen.lower`) number only the valid
tiles of a ragged launch; they read the tile index that this kernel writes just before the
attention kernel, on the same stream (`runtime.tile_index`), so no host ever reads the
lengths and CUDA-graph replay with new cu_seqlens values stays correct. The layout and its
meaning are `mhadsl.analysis.valid_work.tile_index`'s: TILE_INDEX_WORDS(B) u32 words.

    mhadsl_tile_index(i32* cu_seqlens, u32 batch, u32 tile_m, u32* index)

Warp b (one per sequence) counts its sequence's query tiles and, in one pass over all
sequences (lane l takes l, l + 32, ...; then a warp sum), the tiles before it (its prefix),
its rank (sequences with more tiles, or as many and a lower batch index, come first) and the
tiles of the sequences ranked before it. That is O(B) per sequence and O(B^2) in all, with
no synchronisation between warps.
"""
from __future__ import annotations

from llvmlite import ir

from mhadsl.abi import CallValue, KernelABI, Param, Pointer, Workspace
from mhadsl.codegen import nvptx, signature, warp
from mhadsl.codegen.nvptx import i32

KERNEL_NAME = "mhadsl_tile_index"
THREADS = 256  # per CTA; the grid covers the batch with a warp per sequence
ABI = KernelABI(
    Param("cu_seqlens", "ptr", Pointer("cu_seqlens_q"), "int32 (B+1) query row offsets",
          align=4),
    Param("batch", "i32", CallValue("batch"), "sequences B"),
    Param("tile_m", "i32", CallValue("tile_m"), "query rows per work tile"),
    Param("index", "ptr", Workspace("tile_index"), "the u32 index it writes "
          "(mhadsl.abi.tile_index_words(B) words)", align=4),
)


def build_tile_index_kernel(module: ir.Module) -> ir.Function:
    fn, _ = signature.kernel(module, ABI, KERNEL_NAME)
    cu_seqlens, batch, tile_m, index = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))

    def row(k: ir.Value) -> ir.Value:
        return b.load(b.gep(cu_seqlens, [k], source_etype=i32), typ=i32)

    def tiles(j: ir.Value) -> ir.Value:
        start, end = row(j), row(b.add(j, i32(1)))
        rows = b.sub(end, start)
        rows = b.select(b.icmp_signed("<", rows, i32(0)), i32(0), rows)  # as builtins: 0
        return b.udiv(b.add(rows, b.sub(tile_m, i32(1))), tile_m)

    write_tile_index(b, *warp_per_sequence(b), batch, index, lambda me, lane: tiles)
    b.ret_void()
    return fn


def warp_per_sequence(b: ir.IRBuilder) -> tuple[ir.Value, ir.Value]:
    """(sequence, lane) of the thread in a grid that holds a warp per sequence."""
    thread = b.add(b.mul(nvptx.special_register(b, "block_idx", "x"),
                         nvptx.special_register(b, "block_dim", "x")),
                   nvptx.special_register(b, "thread_idx", "x"))
    return b.udiv(thread, i32(32)), b.urem(thread, i32(32))


def write_tile_index(b: ir.IRBuilder, me: ir.Value, lane: ir.Value, batch: ir.Value,
                     index: ir.Value, counter) -> None:
    """Warp `me`'s part of the tile index (none where `me` >= `batch`; the same in a whole
    warp), leaving `b` after it: `counter(me, lane)` (emitted once in the sequence's block,
    where it may read what every sequence's count depends on) returns `tiles(j)`, an i32
    count of sequence j's work tiles, which the warp emits once for its own sequence, then
    for every sequence in one lane-strided pass."""
    fn = b.function

    def word(k: ir.Value) -> ir.Value:
        return b.gep(index, [k], source_etype=i32)

    work = fn.append_basic_block("sequence")
    finish = fn.append_basic_block("finish")
    b.cbranch(b.icmp_unsigned("<", me, batch), work, finish)

    b.position_at_end(work)
    tiles = counter(me, lane)
    mine = tiles(me)
    entry = b.block
    head, body, done = (fn.append_basic_block(n) for n in ("scan", "scan_step", "scan_done"))
    b.branch(head)
    b.position_at_end(head)
    sums = ("total", "prefix", "rank", "before")
    j = b.phi(i32, name="j")
    j.add_incoming(lane, entry)
    phis = {n: b.phi(i32, name=n) for n in sums}
    for phi in phis.values():
        phi.add_incoming(i32(0), entry)
    b.cbranch(b.icmp_unsigned("<", j, batch), body, done)

    b.position_at_end(body)  # lane l takes sequences l, l + 32, ...
    theirs = tiles(j)
    earlier = b.icmp_unsigned("<", j, me)
    ahead = b.or_(b.icmp_unsigned(">", theirs, mine),
                  b.and_(b.icmp_unsigned("==", theirs, mine), earlier))
    step = {"total": b.add(phis["total"], theirs),
            "prefix": b.add(phis["prefix"], b.select(earlier, theirs, i32(0))),
            "rank": b.add(phis["rank"], b.zext(ahead, i32)),
            "before": b.add(phis["before"], b.select(ahead, theirs, i32(0)))}
    j.add_incoming(b.add(j, i32(32)), b.block)
    for n in sums:
        phis[n].add_incoming(step[n], b.block)
    b.branch(head)

    b.position_at_end(done)
    total, prefix, rank, before = (warp.warp_sum(b, phis[n]) for n in sums)
    with b.if_then(b.icmp_unsigned("==", lane, i32(0))):
        b.store(prefix, word(me))
        ranked_at = b.add(batch, i32(1))
        level_at = b.add(b.mul(batch, i32(2)), i32(1))
        b.store(me, word(b.add(ranked_at, rank)))
        b.store(b.sub(before, b.mul(rank, mine)), word(b.add(level_at, rank)))
        with b.if_then(b.icmp_unsigned("==", me, i32(0))):  # the two totals
            b.store(total, word(batch))
            b.store(total, word(b.add(level_at, batch)))
    b.branch(finish)

    b.position_at_end(finish)
