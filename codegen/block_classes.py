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

A warp classifies a cell: where the static analysis already decides it, that class; else each
lane walks its keys (lane, lane + 32, ...) over the cell's rows and stops at the first key
whose pairs it has seen both kept and dropped; a vote joins the lanes. The lanes' walk is a
function of its own (`CELL_FUNCTION`), which the tests compile for the host and compare with
the mask's NumPy meaning.
"""
from __future__ import annotations

from llvmlite import ir

from mhadsl.abi import (
    BLOCK_CLASS_PARAMS, CELL_ALL, CELL_MAY, CallValue, KernelABI, Param, Pointer,
)
from mhadsl.codegen import nvptx, signature, warp
from mhadsl.codegen.backends import ExprHooks, ir_loop
from mhadsl.codegen.backends.blocks import (
    TileRules, TileSequence, last_index, sequence_rows,
)
from mhadsl.codegen.nvptx import i8, i32, i64

KERNEL_NAME = "mha_block_classes"
BLOCK_CLASS_NAMES = frozenset(p.name for p in BLOCK_CLASS_PARAMS)
CELL_FUNCTION = "mha_cell_class"
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
           kv_rows: int | None = None) -> tuple[ir.Value, ir.Value]:
    """(may hold a kept pair, every pair kept) of the inclusive box from the call's cell
    classes (the kernel's `BLOCK_CLASS_PARAMS`), of query head `h` (None: the classes do not
    differ by head): its cell's, where it lies in one; a box across cells, or in a cell
    outside the table (a sequence longer than the call said, which nothing checks on the
    device), is partial, so the mask decides its pairs. An empty box holds no kept pair.
    `q_rows`, `kv_rows`: the box's query rows and keys from q_lo and kv_lo at most (its
    tile's, which its cells share where the box is one of the call's tiles), constants
    where the caller knows them: the cell is then found by dividing by them."""
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
    qc, q_one = cell_of(q_lo, q_hi, a["cell_rows"], q_rows)
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
        cols, rows, heads = (b.zext(a[n], i64) for n in ("block_cols", "block_rows",
                                                          "block_heads"))
        self.kc = b.trunc(b.urem(cell, cols), i32)
        rest = b.udiv(cell, cols)
        self.qc = b.trunc(b.urem(rest, rows), i32)
        rest = b.udiv(rest, rows)
        self.h, self.bidx = b.trunc(b.urem(rest, heads), i32), b.trunc(b.udiv(rest, heads), i32)
        self.q_start, self.seqlen_q = sequence_rows(b, ragged, a["cu_seqlens_q"],
                                                    a["seqlen_q"], self.bidx)
        self.k_start, self.seqlen_k = sequence_rows(b, ragged, a["cu_seqlens_k"],
                                                    a["seqlen_k"], self.bidx)
        self.rows, self.keys = a["cell_rows"], a["cell_keys"]
        self.q_lo = b.mul(self.qc, self.rows)
        self.kv_lo = b.mul(self.kc, self.keys)
        self.inside = b.and_(b.icmp_signed("<", self.q_lo, self.seqlen_q),
                             b.icmp_signed("<", self.kv_lo, self.seqlen_k))

    def tile_rules(self, hooks: ExprHooks) -> TileRules:
        return TileRules(hooks, TileSequence(self.bidx, self.seqlen_q, self.seqlen_k,
                                             self.q_start, self.k_start))


def cell_function(module: ir.Module, abi: KernelABI, hooks: ExprHooks, ragged: bool,
                  pointer: ir.Type) -> ir.Function:
    """`CELL_FUNCTION(<abi's arguments>, cell, lane, lanes) -> i32`: the class bits of the
    pairs of cell `cell` whose keys are the cell's `lane`-th, then every `lanes`-th after
    (none: CELL_ALL, which joins any other class as nothing); 0 for a cell outside its
    sequence. `hooks` classify statically only; `pointer` is the type of the ABI's
    pointers (the kernel's, or the host's in the tests)."""
    types = [pointer if p.kind == "ptr" else signature.llvm_type(p) for p in abi]
    fn = ir.Function(module, ir.FunctionType(i32, types + [i64, i32, i32]), CELL_FUNCTION)
    for p, arg in zip(abi, fn.args):
        arg.name = p.name
    cell, lane, lanes = fn.args[-3:]
    a = {p.name: arg for p, arg in zip(abi, fn.args)}
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    c = _Cell(b, a, cell, ragged)
    outside, decided, scan = (fn.append_basic_block(n) for n in ("outside", "decided", "scan"))
    b.cbranch(c.inside, decided, outside)
    b.position_at_end(outside)
    b.ret(i32(0))

    b.position_at_end(decided)
    rules = c.tile_rules(hooks)
    q_hi = last_index(b, c.q_lo, c.rows, c.seqlen_q)
    kv_hi = last_index(b, c.kv_lo, c.keys, c.seqlen_k)
    head = c.h if hooks.mask_uses_head else i32(0)
    may, every = hooks.classify(b, c.bidx, head, c.q_lo, q_hi, c.kv_lo, kv_hi,
                                      c.seqlen_q, c.seqlen_k)
    static = b.select(may, b.select(every, i32(CELL_MAY | CELL_ALL), i32(CELL_MAY)), i32(0))
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


def build_block_classes_kernel(module: ir.Module, hooks: ExprHooks, ragged: bool) -> ir.Function:
    """The classes kernel (the module's docstring) of a declaration's static-only `hooks`
    (`codegen.kernel.expr_hooks(..., per_call=False)`), for dense or ragged calls."""
    abi = hooks.kernel_abi(ABI)
    walk = cell_function(module, abi, hooks, ragged, nvptx.ptr(nvptx.GLOBAL))
    walk.linkage = "internal"
    fn, a = signature.kernel(module, abi, KERNEL_NAME, threads=THREADS)
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
    bits = b.call(walk, [*fn.args, cell, lane, i32(32)])
    some = warp.any_lane(b, b.icmp_unsigned("!=", b.and_(bits, i32(CELL_MAY)), i32(0)))
    short = warp.any_lane(b, b.icmp_unsigned("==", b.and_(bits, i32(CELL_ALL)), i32(0)))
    value = b.or_(b.select(some, i32(CELL_MAY), i32(0)), b.select(short, i32(0), i32(CELL_ALL)))
    # a cell outside its sequence, or with no kept pair, is 0 alike
    value = b.select(some, value, i32(0))
    with b.if_then(b.icmp_unsigned("==", lane, i32(0))):
        b.store(b.trunc(value, i8), b.gep(a["block_classes"], [cell], source_etype=i8))
    b.branch(done)
    b.position_at_end(done)
    b.ret_void()
    return fn
