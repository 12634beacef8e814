"""Tile classes found per call, for masks that read data (`AttentionOptions.mask_reads_data`).

The interval classification (`mhadsl.analysis.classify`) cannot see the values of a tensor
operand read per pair (`doc[q_idx] == doc_k[kv_idx]`): every such tile is partial to it, so a
packed-document mask would load and compute every KV tile and mask each element. Such a call
first runs the classes kernel built here on its stream. It evaluates the mask on every pair of
each cell of each sequence (and query head, where the mask reads `h`) and writes the cell's
class (`mhadsl.abi`: bit 0 some pair kept, bit 1 every pair kept). A cell is a tile of the
call's scheduled kernel (`cell_rows` query rows by `cell_keys` keys). Every kernel of the call
then classifies a box from the static analysis and its cell together (`lookup`: one byte), so
a design skips empty tiles and masks only partial ones by the same code as for a static mask.

    mha_block_classes(cu_seqlens_q, cu_seqlens_k, batch, seqlen_q, seqlen_k, block_classes,
                      block_rows, block_cols, block_heads, cell_rows, cell_keys, <operands>)

A warp classifies a cell. First the tile analysis, with each tensor read bounded by the least
and greatest element the cell can read (the lanes read them between them: `WarpReadOps`):
packed documents' cells within one document, or between two, are decided so, from a few
reads a lane. Else each lane walks its keys (lane, lane + 32, ...) over the cell's rows and
stops at the first key whose pairs it has seen both kept and dropped; a vote joins the
lanes. Both are functions of their own (`BOUNDS_FUNCTION`, `CELL_FUNCTION`), which the tests
compile for the host and compare with the mask's NumPy meaning.
"""
from __future__ import annotations

from llvmlite import ir

from mhadsl.abi import (
    BLOCK_CLASS_PARAMS, CELL_ALL, CELL_MAY, CallValue, KernelABI, Param, Pointer,
)
from mhadsl.analysis.classify import IrOps
from mhadsl.codegen import nvptx, signature, tensor_reads, warp
from mhadsl.codegen.backends import ExprHooks, ir_loop
from mhadsl.codegen.backends.blocks import (
    TileRules, TileSequence, last_index, sequence_rows,
)
from mhadsl.codegen.nvptx import i8, i32, i64

KERNEL_NAME = "mha_block_classes"
BLOCK_CLASS_NAMES = frozenset(p.name for p in BLOCK_CLASS_PARAMS)
CELL_FUNCTION = "mha_cell_class"
BOUNDS_FUNCTION = "mha_cell_bounds"
UNDECIDED = -1  # (`bounds_function`: the cell's pairs decide)
THREADS = 128  # a warp per cell
ABI = KernelABI(
    Param("cu_seqlens_q", "ptr", Pointer("cu_seqlens_q"), "int32 (B+1) query row offsets "
          "(ragged), else null", align=4),
    Param("cu_seqlens_k", "ptr", Pointer("cu_seqlens_k"), "int32 (B+1) key row offsets "
          "(ragged), else null", align=4),
    Param("batch", "i32", CallValue("batch"), "number of sequences B"),
    Param("seqlen_q", "i32", CallValue("seqlen_q"), "dense query length (ignored when ragged)"),
    Param("seqlen_k", "i32", CallValue("seqlen_k"), "dense key length (ignored when ragged)"),
    *BLOCK_CLASS_PARAMS,
)


def lookup(b: ir.IRBuilder, bidx: ir.Value, h: ir.Value | None, q_lo: ir.Value,
           q_hi: ir.Value, kv_lo: ir.Value, kv_hi: ir.Value, q_rows: int | None = None,
           kv_rows: int | None = None,
           q_tile: tuple[ir.Value, int] | None = None) -> tuple[ir.Value, ir.Value]:
    """(may hold a kept pair, every pair kept) of the inclusive box from the call's cell
    classes (the kernel's `BLOCK_CLASS_PARAMS`), of query head `h` (None: the classes do not
    differ by head): its cell's, where it lies in one; a box across cells, or in a cell
    outside the table (a sequence longer than the call said, which nothing checks on the
    device), is partial, so the mask decides its pairs. An empty box holds no kept pair.
    `q_rows`, `kv_rows`: the box's query rows and keys from q_lo and kv_lo at most (its
    tile's, which its cells share where the box is one of the call's tiles), constants
    where the caller knows them: the cell is then found by dividing by them. `q_tile`:
    (first row, constant rows) of a tile of the call holding the box's rows (a warpgroup's
    part of a work tile), whose cell is the box's: found so, without a division."""
    # (the table's sizes read where they are used: held across a design's KV loop, they
    # would take registers it needs)
    a = {arg.name: nvptx.opaque(b, arg) for arg in b.function.args
         if arg.name in BLOCK_CLASS_NAMES}

    def cell_of(lo, hi, size, static):
        """(the cell index along one axis, whether the box's span there lies in it)."""
        if static is None:
            index = b.udiv(lo, size)
            return index, b.icmp_unsigned("<", b.sub(hi, b.mul(index, size)), size)
        # a tile's span: in one cell where the cells are the call's tiles of its size
        return b.udiv(lo, i32(static)), b.and_(
            b.icmp_unsigned("==", size, i32(static)),
            b.icmp_unsigned("==", b.urem(lo, i32(static)), i32(0)))
    qc, q_one = cell_of(q_lo, q_hi, a["cell_rows"], q_rows) if q_tile is None else \
        cell_of(q_tile[0], None, a["cell_rows"], q_tile[1])
    kc, kv_one = cell_of(kv_lo, kv_hi, a["cell_keys"], kv_rows)
    one = b.and_(q_one, kv_one)
    one = b.and_(one, b.and_(b.icmp_unsigned("<", qc, a["block_rows"]),
                             b.icmp_unsigned("<", kc, a["block_cols"])))
    # (a call's classes hold fewer than 2**31 cells: 32-bit offsets, as cheap as the
    # kernel's other index math)
    plane = b.mul(bidx, a["block_heads"])
    if h is not None:
        plane = b.add(plane, h)
    cell = b.add(b.mul(b.add(b.mul(plane, a["block_rows"]), qc), a["block_cols"]), kc)
    at = b.gep(a["block_classes"], [b.select(one, cell, i32(0))], source_etype=i8)
    bits = b.select(one, b.zext(b.load(at, typ=i8), i32), i32(CELL_MAY))
    empty = b.or_(b.icmp_signed(">", q_lo, q_hi), b.icmp_signed(">", kv_lo, kv_hi))
    return (b.and_(b.not_(empty), b.icmp_unsigned("!=", b.and_(bits, i32(CELL_MAY)), i32(0))),
            b.or_(empty, b.icmp_unsigned("!=", b.and_(bits, i32(CELL_ALL)), i32(0))))


class _Cell:
    """Cell `cell` of the call (`ABI`'s arguments `a`, by name): its sequence, head, rows
    and keys."""

    def __init__(self, b: ir.IRBuilder, a: dict, cell: ir.Value, ragged: bool):
        # (a call has fewer than 2**31 cells, `mhadsl.host.launcher.MAX_CELLS`: 32-bit
        # divisions, which cost a fraction of 64-bit ones)
        rest = b.trunc(cell, i32)
        self.kc, rest = b.urem(rest, a["block_cols"]), b.udiv(rest, a["block_cols"])
        self.qc, rest = b.urem(rest, a["block_rows"]), b.udiv(rest, a["block_rows"])
        self.h, self.bidx = b.urem(rest, a["block_heads"]), b.udiv(rest, a["block_heads"])
        self.q_start, self.seqlen_q = sequence_rows(b, ragged, a["cu_seqlens_q"],
                                                    a["seqlen_q"], self.bidx)
        self.k_start, self.seqlen_k = sequence_rows(b, ragged, a["cu_seqlens_k"],
                                                    a["seqlen_k"], self.bidx)
        self.rows, self.keys = a["cell_rows"], a["cell_keys"]
        self.q_lo = b.mul(self.qc, self.rows)
        self.kv_lo = b.mul(self.kc, self.keys)
        self.inside = b.and_(b.icmp_signed("<", self.q_lo, self.seqlen_q),
                             b.icmp_signed("<", self.kv_lo, self.seqlen_k))

    def classify(self, b: ir.IRBuilder, hooks: ExprHooks, **options) -> tuple:
        """The cell's box through `hooks.classify` (`options`: its keywords): (may hold a
        kept pair, every pair kept, the last query row, the last key, the head it asks of)."""
        q_hi = last_index(b, self.q_lo, self.rows, self.seqlen_q)
        kv_hi = last_index(b, self.kv_lo, self.keys, self.seqlen_k)
        head = self.h if hooks.mask_uses_head else i32(0)
        may, every = hooks.classify(b, self.bidx, head, self.q_lo, q_hi, self.kv_lo, kv_hi,
                                    self.seqlen_q, self.seqlen_k, **options)
        return may, every, q_hi, kv_hi, head

    def tile_rules(self, hooks: ExprHooks) -> TileRules:
        return TileRules(hooks, TileSequence(self.bidx, self.seqlen_q, self.seqlen_k,
                                             self.q_start, self.k_start))


def _class_bits(b: ir.IRBuilder, may: ir.Value, every: ir.Value) -> ir.Value:
    """A cell's class bits (`mhadsl.abi`) from (may hold a kept pair, every pair kept)."""
    return b.select(may, b.select(every, i32(CELL_MAY | CELL_ALL), i32(CELL_MAY)), i32(0))


def _cell_function(module: ir.Module, abi: KernelABI, pointer: ir.Type, name: str,
                   extra: list[ir.Type]) -> tuple[ir.Function, dict, ir.IRBuilder]:
    """Function `name` returning i32 of `abi`'s arguments (`pointer`: the type of its
    pointers) then `extra`: the function, its ABI arguments by name, a builder at its entry."""
    types = [pointer if p.kind == "ptr" else signature.llvm_type(p) for p in abi]
    fn = ir.Function(module, ir.FunctionType(i32, types + extra), name)
    for p, arg in zip(abi, fn.args):
        arg.name = p.name
    return fn, {p.name: arg for p, arg in zip(abi, fn.args)}, \
        ir.IRBuilder(fn.append_basic_block("entry"))


def bounds_function(module: ir.Module, abi: KernelABI, hooks: ExprHooks, ragged: bool,
                    pointer: ir.Type, lanes: int) -> ir.Function:
    """`BOUNDS_FUNCTION(<abi's arguments>, cell, lane) -> i32`: the class bits of cell
    `cell` from the tile analysis with the reads of its tensors bounded over the cell
    (`WarpReadOps`, by lane `lane` of `lanes`: 32 in the kernel, whose warp calls it
    together), 0 for a cell outside its sequence, `UNDECIDED` where the analysis leaves the
    cell partial (its pairs then decide). `hooks` classify statically only."""
    fn, a, b = _cell_function(module, abi, pointer, BOUNDS_FUNCTION, [i64, i32])
    cell, lane = fn.args[-2:]
    c = _Cell(b, a, cell, ragged)
    may, every, *_ = c.classify(b, hooks, ops=WarpReadOps(b, lane, lanes), extents=(
        c.q_start, c.seqlen_q, c.k_start, c.seqlen_k) if hooks.positions else None)
    known = b.select(b.or_(b.not_(may), every), _class_bits(b, may, every), i32(UNDECIDED))
    b.ret(b.select(c.inside, known, i32(0)))
    return fn


def cell_function(module: ir.Module, abi: KernelABI, hooks: ExprHooks, ragged: bool,
                  pointer: ir.Type) -> ir.Function:
    """`CELL_FUNCTION(<abi's arguments>, cell, lane, lanes) -> i32`: the class bits of the
    pairs of cell `cell` whose keys are the cell's `lane`-th, then every `lanes`-th after
    (none: CELL_ALL, which joins any other class as nothing); 0 for a cell outside its
    sequence. `hooks` classify statically only; `pointer` is the type of the ABI's
    pointers (the kernel's, or the host's in the tests)."""
    fn, a, b = _cell_function(module, abi, pointer, CELL_FUNCTION, [i64, i32, i32])
    cell, lane, lanes = fn.args[-3:]
    c = _Cell(b, a, cell, ragged)
    outside, decided, scan = (fn.append_basic_block(n) for n in ("outside", "decided", "scan"))
    b.cbranch(c.inside, decided, outside)
    b.position_at_end(outside)
    b.ret(i32(0))

    b.position_at_end(decided)
    rules = c.tile_rules(hooks)
    may, every, q_hi, kv_hi, head = c.classify(b, hooks)
    static = _class_bits(b, may, every)
    known = fn.append_basic_block("known")
    b.cbranch(b.or_(b.not_(may), every), known, scan)
    b.position_at_end(known)
    b.ret(static)

    b.position_at_end(scan)
    first = b.add(c.kv_lo, lane)

    def mixed(some, every):
        """Both a kept and a dropped pair seen: the cell is partial whatever the rest are."""
        return b.and_(b.icmp_unsigned("!=", some, i32(0)), b.icmp_unsigned("==", every, i32(0)))

    def key(bk, kv, acc):
        def row(br, q, carried):
            keep = rules.keeps(br, head, q, kv, bounds=False)
            some = br.or_(carried[0], br.zext(keep, i32))
            every = br.and_(carried[1], br.select(keep, i32(CELL_ALL), i32(0)))
            return br.select(mixed(some, every), br.add(q_hi, i32(1)),
                             br.add(q, i32(1))), [some, every]
        some, every = ir_loop(bk, c.q_lo, bk.add(q_hi, i32(1)), acc, row)
        return bk.select(mixed(some, every), bk.add(kv_hi, i32(1)),
                         bk.add(kv, lanes)), [some, every]
    some, every = ir_loop(b, first, b.add(kv_hi, i32(1)), [i32(0), i32(CELL_ALL)], key)
    b.ret(b.or_(some, every))
    return fn


class WarpReadOps(IrOps):
    """The tile analysis (`mhadsl.analysis.classify`) in the classes kernel, where a warp
    classifies one cell together: a read whose indices vary over the cell is bounded by the
    least and greatest of the elements in the indices' intervals (0 among them where an
    interval leaves its axis), which the lanes read between them: at most `RANGE_LIMIT`,
    else any i32."""

    RANGE_LIMIT = 4096
    UNROLL = 4  # elements a lane reads a round

    def __init__(self, builder: ir.IRBuilder, lane: ir.Value, lanes: int):
        super().__init__(builder)
        self.lane, self.lanes = lane, lanes  # (lanes 1: one thread reads them all)

    def when(self, needed: ir.Value, emit, otherwise: tuple) -> tuple:
        """The fields of the boolean `emit()` evaluates, emitted in a branch taken where
        `needed` holds (the warp's cell: the same for every lane), else `otherwise`: a
        cell the indices alone decide (above a causal diagonal) reads no element."""
        def fields(_):
            value = emit()
            return [value.may, value.must]
        return tuple(warp.guarded(self.b, needed, fields, list(otherwise)))

    def tensor_range(self, tensor, bounds: list) -> tuple[ir.Value, ir.Value]:
        b, limit = self.b, self.RANGE_LIMIT
        count = i64(1)
        for lo, hi in bounds:  # (each extent capped first: the product cannot overflow)
            extent = b.add(b.sub(hi, lo), i64(1))
            count = b.mul(count, b.select(b.icmp_signed(">", extent, i64(limit)),
                                          i64(limit + 1), extent))
        small = b.and_(b.icmp_signed(">", count, i64(0)),
                       b.icmp_signed("<=", count, i64(limit)))

        n = b.trunc(b.select(small, count, i64(0)), i32)

        def read(bk, e):
            """Element e of the indices' box (the last axis fastest), 0 outside the tensor."""
            rest, indices = e, []
            for axis, (lo, hi) in reversed(list(enumerate(bounds))):  # (all fit an i32 here)
                offset = rest
                if axis:  # (the first axis's offset is what is left)
                    extent = bk.trunc(bk.add(bk.sub(hi, lo), i64(1)), i32)
                    offset, rest = bk.urem(rest, extent), bk.udiv(rest, extent)
                indices.append(bk.add(bk.trunc(lo, i32), offset))
            inside, address, _ = tensor_reads.bounds(
                bk, tensor, [lambda v=v: v for v in reversed(indices)], False)
            return tensor_reads.load(bk, tensor, i32, inside, address, False)

        def elements(bk, e, acc):
            # UNROLL reads a round, all issued before any is used: one memory latency
            # a round, not one a read
            at = [bk.add(e, i32(k * self.lanes)) for k in range(self.UNROLL)]
            values = [read(bk, x) for x in at]
            lo, hi = acc
            for x, value in zip(at, values):
                valid = bk.icmp_signed("<", x, n)
                lo = bk.select(valid, _smin(bk, lo, value), lo)
                hi = bk.select(valid, _smax(bk, hi, value), hi)
            return bk.add(e, i32(self.UNROLL * self.lanes)), [lo, hi]
        lo, hi = ir_loop(b, self.lane, n, [i32(2**31 - 1), i32(-2**31)], elements)
        if self.lanes > 1:
            lo = warp.warp_allreduce(b, lo, lambda x, y: _smin(b, x, y))
            hi = warp.warp_allreduce(b, hi, lambda x, y: _smax(b, x, y))
        return (b.select(small, b.sext(lo, i64), i64(-2**31)),
                b.select(small, b.sext(hi, i64), i64(2**31 - 1)))


def _smin(b: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:
    return b.select(b.icmp_signed("<", x, y), x, y)


def _smax(b: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:
    return b.select(b.icmp_signed(">", x, y), x, y)


def build_block_classes_kernel(module: ir.Module, hooks: ExprHooks, ragged: bool) -> ir.Function:
    """The classes kernel (the module's docstring) of a declaration's static-only `hooks`
    (`codegen.kernel.expr_hooks(..., per_call=False)`), for dense or ragged calls."""
    abi = hooks.kernel_abi(ABI)
    walk = cell_function(module, abi, hooks, ragged, nvptx.ptr(nvptx.GLOBAL))
    decide = bounds_function(module, abi, hooks, ragged, nvptx.ptr(nvptx.GLOBAL), 32)
    walk.linkage = decide.linkage = "internal"
    # (no launch bound: with one, ptxas caps the registers at 32 for a full multiprocessor
    # of CTAs, and the reads' bounds then spill)
    fn, a = signature.kernel(module, abi, KERNEL_NAME)
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    thread = b.add(b.mul(b.zext(nvptx.special_register(b, "block_idx", "x"), i64),
                         i64(THREADS)),
                   b.zext(nvptx.special_register(b, "thread_idx", "x"), i64))
    cell, lane = b.udiv(thread, i64(32)), b.trunc(b.urem(thread, i64(32)), i32)
    total = i64(1)
    for n in ("batch", "block_heads", "block_rows", "block_cols"):
        total = b.mul(total, b.zext(a[n], i64))
    work, done = fn.append_basic_block("cell"), fn.append_basic_block("done")
    b.cbranch(b.icmp_unsigned("<", cell, total), work, done)  # the same in a whole warp
    b.position_at_end(work)
    # the analysis with the cell's reads bounded decides most cells: no pair walked
    known = b.call(decide, [*fn.args, cell, lane])
    decided_bb, scan, store = b.block, *(fn.append_basic_block(n) for n in ("scan", "store"))
    b.cbranch(b.icmp_signed("!=", known, i32(UNDECIDED)), store, scan)
    b.position_at_end(scan)
    bits = b.call(walk, [*fn.args, cell, lane, i32(32)])
    some = warp.any_lane(b, b.icmp_unsigned("!=", b.and_(bits, i32(CELL_MAY)), i32(0)))
    short = warp.any_lane(b, b.icmp_unsigned("==", b.and_(bits, i32(CELL_ALL)), i32(0)))
    walked = b.or_(b.select(some, i32(CELL_MAY), i32(0)),
                   b.select(short, i32(0), i32(CELL_ALL)))
    # a cell outside its sequence, or with no kept pair, is 0 alike
    walked = b.select(some, walked, i32(0))
    scanned_bb = b.block
    b.branch(store)
    b.position_at_end(store)
    value = b.phi(i32)
    value.add_incoming(known, decided_bb)
    value.add_incoming(walked, scanned_bb)
    with b.if_then(b.icmp_unsigned("==", lane, i32(0))):
        b.store(b.trunc(value, i8), b.gep(a["block_classes"], [cell], source_etype=i8))
    b.branch(done)
    b.position_at_end(done)
    b.ret_void()
    return fn
