"""Warp-level building blocks for the sm_80-class tensor-core path.

Register tiles are Python lists of SSA values; every helper here emits straight-line IR for
one warp-wide instruction (or a short fixed sequence) and is reused by every head dim, dtype
and kernel variant. The operand conventions are the PTX ones for `mma.m16n8k16.row.col`:

  lane = 4*g + t   (g = lane // 4 in [0, 8), t = lane % 4)
  A (16x16, row):  a0 = A[g][2t:2t+2]  a1 = A[g+8][2t:2t+2]  a2 = A[g][2t+8:2t+10]  a3 = A[g+8][2t+8:2t+10]
  B (16x8,  col):  b0 = B[2t:2t+2][g]  b1 = B[2t+8:2t+10][g]
  C (16x8, f32):   c0,c1 = C[g][2t:2t+2]  c2,c3 = C[g+8][2t:2t+2]

Each A/B register is an i32 holding two 16-bit elements, the lower column/row in the low half.
"""
from __future__ import annotations

from collections.abc import Callable

from llvmlite import ir

from mhadsl.codegen import nvptx
from mhadsl.codegen.nvptx import call, f32, i32, i64, void

DTYPES = ("bf16", "fp16")
ELEMENT_BYTES = 2
FULL_MASK = 0xFFFFFFFF
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
NEG_INF = float("-inf")  # the score of a pair the mask drops


class _BFloatType(ir.Type):
    """LLVM's `bfloat` (llvmlite 0.50 has no class for it)."""

    null = "0.0"

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other) -> bool:
        return isinstance(other, _BFloatType)

    def __hash__(self) -> int:
        return hash("bfloat")


BFLOAT = _BFloatType()
HALF = ir.HalfType()


def fconst(x: float) -> ir.Constant:
    """An f32 constant."""
    return ir.Constant(f32, x)


def element_type(dtype: str) -> ir.Type:
    if dtype == "bf16":
        return BFLOAT
    if dtype == "fp16":
        return HALF
    raise ValueError(f"unsupported dtype {dtype!r}; expected one of {DTYPES}")


# ----------------------------------------------------------------- tensor cores
def mma_m16n8k16(builder: ir.IRBuilder, dtype: str, a: list, b: list, c: list) -> list:
    """D = A*B + C for one m16n8k16 tile (16-bit inputs, f32 accumulate).

    a: 4 i32, b: 2 i32, c: 4 f32 -> 4 f32."""
    assert len(a) == 4 and len(b) == 2 and len(c) == 4
    ret = ir.LiteralStructType([f32] * 4)
    if dtype == "bf16":
        res = call(builder, "llvm.nvvm.mma.m16n8k16.row.col.bf16", ret, [*a, *b, *c])
    elif dtype == "fp16":
        h2 = ir.VectorType(HALF, 2)
        ops = [builder.bitcast(x, h2) for x in (*a, *b)]
        res = call(builder, "llvm.nvvm.mma.m16n8k16.row.col.f32.f32", ret, [*ops, *c])
    else:
        raise ValueError(dtype)
    return [builder.extract_value(res, i) for i in range(4)]


def ldmatrix_x4(builder: ir.IRBuilder, smem_ptr: ir.Value, trans: bool = False) -> list:
    """`ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16`: lane l supplies the address of
    row l % 8 of matrix l // 8; returns the 4 i32 registers (one per matrix)."""
    name = ("llvm.nvvm.ldmatrix.sync.aligned.m8n8.x4.trans.b16.p3" if trans
            else "llvm.nvvm.ldmatrix.sync.aligned.m8n8.x4.b16.p3")
    res = call(builder, name, ir.LiteralStructType([i32] * 4), [smem_ptr])
    return [builder.extract_value(res, i) for i in range(4)]


def vector(builder: ir.IRBuilder, values: list[ir.Value]) -> ir.Value:
    """The LLVM vector of `values` (one scalar type), for a vector store or conversion."""
    v = ir.Constant(ir.VectorType(values[0].type, len(values)), ir.Undefined)
    for e, x in enumerate(values):
        v = builder.insert_element(v, x, i32(e))
    return v


def pack2(builder: ir.IRBuilder, dtype: str, lo: ir.Value, hi: ir.Value) -> ir.Value:
    """Two f32 -> one i32 holding two 16-bit values (lo in the low half), round to nearest."""
    narrow = builder.fptrunc(vector(builder, [lo, hi]), ir.VectorType(element_type(dtype), 2))
    return builder.bitcast(narrow, i32)


def unpack2(builder: ir.IRBuilder, dtype: str, word: ir.Value) -> list[ir.Value]:
    """`pack2`'s inverse: an i32 of two 16-bit values -> [lo, hi] as f32 (exact)."""
    pair = builder.fpext(builder.bitcast(word, ir.VectorType(element_type(dtype), 2)),
                         ir.VectorType(f32, 2))
    return [builder.extract_element(pair, i32(e)) for e in range(2)]


def mul2(builder: ir.IRBuilder, dtype: str, x: ir.Value, y: ir.Value) -> ir.Value:
    """The elementwise product of two i32s of two 16-bit values each (`pack2`'s), rounded
    to nearest: one `mul.rn.{bf16,f16}x2`."""
    pair = ir.VectorType(element_type(dtype), 2)
    return builder.bitcast(builder.fmul(builder.bitcast(x, pair), builder.bitcast(y, pair)), i32)


# ----------------------------------------------------------------- FP8 (e4m3)
E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value
# an e4m3 byte's bits in an f16's places (`e4m3_pair_to_f16`) make the value / 256
E4M3_PER_F16 = 256.0


def e4m3_pair_to_f16(builder: ir.IRBuilder, word: ir.Value, odd: bool) -> ir.Value:
    """Two e4m3 bytes of the i32 `word` -> one i32 of two f16 holding each value / 256
    (`E4M3_PER_F16`), exactly, subnormals too: bytes 1 and 3 (`odd`) or 0 and 2, the lower
    byte in the low half. An e4m3 byte after its sign is an f16's exponent (top bit clear)
    and mantissa bits, 7 places lower: two masks and a shift, no conversion unit."""
    if not odd:
        word = builder.shl(word, i32(8))
    sign = builder.and_(word, i32(0x80008000))
    return builder.or_(sign, builder.and_(builder.lshr(word, i32(1)), i32(0x3F803F80)))


def e4m3_quad_to_f16(builder: ir.IRBuilder, word: ir.Value) -> tuple[ir.Value, ir.Value]:
    """The four e4m3 bytes of the i32 `word` -> two i32 of two f16 each, at their values
    (not / 256): bytes 0 and 2, then 1 and 3, the lower byte in the low half, as
    `e4m3_pair_to_f16`'s pairs. One `prmt` and two `cvt.rn.f16x2.e4m3x2` (sm_89 and later):
    a third of the integer steps' instructions."""
    pair = ir.LiteralStructType([i32, i32])
    both = builder.asm(
        ir.FunctionType(pair, [i32]),
        "{ .reg .b32 %t; .reg .b16 %lo, %hi; prmt.b32 %t, $2, 0, 0x3120; "
        "mov.b32 {%lo, %hi}, %t; cvt.rn.f16x2.e4m3x2 $0, %lo; cvt.rn.f16x2.e4m3x2 $1, %hi; }",
        "=r,=r,r", [word], False)
    return builder.extract_value(both, 0), builder.extract_value(both, 1)


def e4m3_from_f32(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """The float8_e4m3fn byte (low byte of an i32) nearest f32 `x`, ties to even, saturated
    to +-448 (infinities too), NaN to 0x7f: `cvt.rn.satfinite.e4m3x2.f32`'s rounding,
    written in integer steps that every target runs."""
    bits = builder.bitcast(x, i32)
    sign = builder.and_(builder.lshr(bits, i32(24)), i32(0x80))
    magnitude = builder.and_(bits, i32(0x7FFFFFFF))
    a = builder.bitcast(magnitude, f32)
    # normal: the mantissa rounded to 3 bits (a carry moves into the exponent), rebiased
    lsb = builder.and_(builder.lshr(magnitude, i32(20)), i32(1))
    rounded = builder.add(magnitude, builder.add(i32(0x7FFFF), lsb))
    normal = builder.sub(builder.lshr(rounded, i32(20)), i32((127 - 7) << 3))
    # below 2^-6: multiples of 2^-9 (a code of 8 is the smallest normal)
    tiny = builder.fptosi(call(builder, "llvm.rint.f32", f32, [builder.fmul(a, fconst(512.0))]),
                          i32)
    code = builder.select(builder.fcmp_ordered("<", a, fconst(2.0 ** -6)), tiny, normal)
    code = builder.select(builder.fcmp_ordered(">=", a, fconst(E4M3_MAX)), i32(0x7E), code)
    code = builder.select(builder.fcmp_unordered("uno", a, a), i32(0x7F), code)
    return builder.or_(code, sign)


# ----------------------------------------------------------------- async copies
def cp_async_16(builder: ir.IRBuilder, dst_smem: ir.Value, src_global: ir.Value,
                src_bytes: ir.Value | None = None) -> None:
    """`cp.async.cg.shared.global` of 16 bytes; with `src_bytes` (i32, 0 or 16) the rest of
    the 16 bytes is zero-filled (src_bytes = 0: nothing is read, the destination is zeroed)."""
    if src_bytes is None:
        call(builder, "llvm.nvvm.cp.async.cg.shared.global.16", void, [dst_smem, src_global])
    else:
        call(builder, "llvm.nvvm.cp.async.cg.shared.global.16.s", void,
             [dst_smem, src_global, src_bytes])


def cp_async_commit(builder: ir.IRBuilder) -> None:
    call(builder, "llvm.nvvm.cp.async.commit.group", void, [])


def cp_async_wait(builder: ir.IRBuilder, pending: int = 0) -> None:
    """Wait until at most `pending` of this thread's committed groups are in flight."""
    call(builder, "llvm.nvvm.cp.async.wait.group", void, [i32(pending)])


# ----------------------------------------------------------------- lanes and math
def shfl_bfly(builder: ir.IRBuilder, value: ir.Value, lane_mask: int) -> ir.Value:
    """The f32, i32 or i64 `value` of lane (this lane xor `lane_mask`)."""
    if value.type == i64:  # as two 32-bit halves
        halves = [shfl_bfly(builder, builder.trunc(builder.lshr(value, i64(s)), i32), lane_mask)
                  for s in (0, 32)]
        return builder.or_(builder.zext(halves[0], i64),
                           builder.shl(builder.zext(halves[1], i64), i64(32)))
    kind = "i32" if value.type == i32 else "f32"
    return call(builder, f"llvm.nvvm.shfl.sync.bfly.{kind}", value.type,
                [i32(FULL_MASK), value, i32(lane_mask), i32(31)])


def uniform(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    """The i32 `value` of lane 0 (every lane must run it): for a value each lane of the warp
    already holds alike, a form ptxas knows is uniform (uniform registers, no R2UR)."""
    return call(builder, "llvm.nvvm.shfl.sync.idx.i32", i32,
                [i32(FULL_MASK), value, i32(0), i32(31)])


def uniform_flag(builder: ir.IRBuilder, flag: ir.Value) -> ir.Value:
    """The i1 `flag` of lane 0 (`uniform`): a branch on it is one ptxas knows the warp takes
    together, so it needs no reconvergence and leaves what runs after it uniform."""
    return builder.trunc(uniform(builder, builder.zext(flag, i32)), ir.IntType(1))


def quad_transpose(builder: ir.IRBuilder, values: list[ir.Value]) -> list[ir.Value]:
    """The 4 x 4 transpose of a quad's (four consecutive lanes') four i32 values each: lane
    t's values[u] becomes lane u's [t]. An accumulator row's quad, holding two columns of
    each of four 8-column groups per lane, then holds one whole group (16 bytes) per lane.
    Two butterfly rounds of two shuffles; every lane of the warp must run it."""
    b = builder
    t = b.and_(nvptx.lane_id(b), i32(3))
    v = list(values)
    for mask, pairs in ((2, ((0, 2), (1, 3))), (1, ((0, 1), (2, 3)))):
        upper = b.icmp_unsigned("!=", b.and_(t, i32(mask)), i32(0))
        # a lane without the mask's bit gives its partner the pair's second, one with it
        # the first, and puts what it gets where it gave
        got = [shfl_bfly(b, b.select(upper, v[lo], v[hi]), mask) for lo, hi in pairs]
        for (lo, hi), g in zip(pairs, got):
            v[lo], v[hi] = b.select(upper, g, v[lo]), b.select(upper, v[hi], g)
    return v


def active_lanes(builder: ir.IRBuilder) -> ir.Value:
    """The mask of the warp's lanes running this instruction with this one (asm with side
    effects: never merged with another read)."""
    return builder.asm(ir.FunctionType(i32, []), "activemask.b32 $0;", "=r", [], True)


def sync_lanes(builder: ir.IRBuilder, mask: ir.Value = ir.Constant(i32, FULL_MASK)) -> None:
    """`bar.warp.sync`: each lane of `mask` waits here until all of them have come."""
    builder.asm(ir.FunctionType(void, [i32]), "bar.warp.sync $0;", "r", [mask], True)


def _popc(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    return call(builder, "llvm.ctpop.i32", i32, [value])


def first_true(builder: ir.IRBuilder, start: ir.Value, end: ir.Value,
               pred: Callable[[ir.IRBuilder, ir.Value], ir.Value],
               together: bool = True) -> ir.Value:
    """The first n in [start, end) for which `pred(b, n)` (i1, pure: it is also asked of
    n >= end, whose answer is ignored) holds, else `end`. The warp's active lanes search
    together, so all must be on the same search (a caller whose lanes may be at different
    work tiles meets them first: `sync_lanes`): each asks of its own candidate (start plus
    its rank among them) and a ballot picks the first that holds, so k candidates that do
    not cost k / 32 rounds instead of k (a single lane searches alone). `together=False`:
    each lane asks of one candidate per round, which holds fewer registers (a loop at
    ptxas's register cap)."""
    if not together:
        return _rounds(builder, start, end, lambda b, n: (pred(b, n), n, i32(1)))

    def round_(b, base):
        # the lanes that run this search, read in each round (asm: never hoisted, so
        # nothing of it is held across the caller's loop)
        active = active_lanes(b)
        below = nvptx.opaque_special_register(b, "lanemask_lt")
        candidate = b.add(base, _popc(b, b.and_(active, below)))
        holds = b.and_(b.icmp_signed("<", candidate, end), pred(b, candidate))
        votes = b.asm(ir.FunctionType(i32, [i32, i32]),
                      "{ .reg .pred p; setp.ne.u32 p, $1, 0; vote.sync.ballot.b32 $0, p, $2; }",
                      "=r,r,r", [b.zext(holds, i32), active], True)
        lowest = b.and_(votes, b.sub(i32(0), votes))  # (the first lane whose candidate holds)
        return (b.icmp_unsigned("!=", votes, i32(0)),
                b.add(base, _popc(b, b.and_(active, b.sub(lowest, i32(1))))), _popc(b, active))
    n = _rounds(builder, start, end, round_)
    return builder.select(builder.icmp_signed("<", n, end), n, end)


def last_true(builder: ir.IRBuilder, start: ir.Value, end: ir.Value,
              pred: Callable[[ir.IRBuilder, ir.Value], ir.Value]) -> ir.Value:
    """One past the last n in [start, end) for which `pred(b, n)` holds, else `start`: the
    warp's active lanes search down from `end - 1` together, as `first_true` searches up
    (`pred` is also asked of n < start, whose answer is ignored)."""
    last = builder.sub(end, i32(1))
    return builder.sub(end, first_true(builder, i32(0), builder.sub(end, start),
                                       lambda b, d: pred(b, b.sub(last, d))))


def _rounds(b: ir.IRBuilder, start: ir.Value, end: ir.Value, round_) -> ir.Value:
    """From base = start while base < end: (hit, found, width) = round_(b, base); found if
    hit, else base += width. Returns found, or the base at or past `end`."""
    fn = b.function
    pre = b.block
    hdr, chk, nxt, done = (fn.append_basic_block(f"skip.{s}")
                           for s in ("hdr", "chk", "next", "done"))
    b.branch(hdr)
    b.position_at_end(hdr)
    base = b.phi(i32, "skip.n")
    base.add_incoming(start, pre)
    b.cbranch(b.icmp_signed("<", base, end), chk, done)
    b.position_at_end(chk)
    hit, found, width = round_(b, base)
    b.cbranch(hit, done, nxt)
    checked = b.block
    b.position_at_end(nxt)
    base.add_incoming(b.add(base, width), nxt)
    b.branch(hdr)
    b.position_at_end(done)
    n = b.phi(i32, "skip.found")
    n.add_incoming(base, hdr)
    n.add_incoming(found, checked)
    return n


def kept_fragment_bits(builder: ir.IRBuilder, lo: ir.Value | None, hi: ir.Value,
                       count: int) -> list[ir.Value]:
    """Which of this thread's `count` values of an accumulator row (fragment index i at
    column 8 * (i // 2) + i % 2 from the thread's first) have their column in [lo, hi] (lo
    None: from the first), as words of 32 bits; `keep_bit` tests one. FlashAttention-4's
    masks: ptxas tests consecutive bits of a word with R2P (seven predicates an
    instruction), where a compare per value took two or three."""
    b = builder
    i64 = ir.IntType(64)

    def kept_up_to(x):  # how many of the row's values lie at a column <= x: 2 a group of 8
        n = b.add(b.shl(b.ashr(x, i32(3)), i32(1)),
                  b.select(b.icmp_signed(">", b.and_(x, i32(7)), i32(0)), i32(2), i32(1)))
        return b.select(b.icmp_signed(">", n, i32(0)), n, i32(0))

    def first_bits(n, word):  # the word's bits below value n, as i32
        k = b.sub(n, i32(32 * word))
        k = b.select(b.icmp_signed(">", k, i32(0)), k, i32(0))
        k = b.select(b.icmp_signed("<", k, i32(32)), k, i32(32))
        return b.trunc(b.sub(b.shl(ir.Constant(i64, 1), b.zext(k, i64)), ir.Constant(i64, 1)),
                       i32)
    upto_hi = kept_up_to(hi)
    below_lo = None if lo is None else kept_up_to(b.sub(lo, i32(1)))
    words = []
    for word in range(-(-count // 32)):
        bits = first_bits(upto_hi, word)
        if below_lo is not None:
            bits = b.and_(bits, b.xor(first_bits(below_lo, word), i32(-1)))
        words.append(bits)
    return words


def keep_bit(builder: ir.IRBuilder, value: ir.Value, words: list[ir.Value],
             i: int) -> ir.Value:
    """`value` where bit i of `words` (`kept_fragment_bits`) is set, else -inf."""
    bit = builder.and_(words[i // 32], i32(1 << (i % 32)))
    return builder.select(builder.icmp_unsigned("!=", bit, i32(0)), value, fconst(NEG_INF))


def warp_sum(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    """The i32 or f32 `value` summed over the warp's 32 lanes (every lane gets the sum)."""
    return warp_allreduce(builder, value, builder.fadd if value.type == f32 else builder.add)


def warp_allreduce(builder: ir.IRBuilder, value: ir.Value, op) -> ir.Value:
    """`op(a, b)` over the warp's 32 lanes' `value` (every lane gets the result)."""
    for m in (16, 8, 4, 2, 1):
        value = op(value, shfl_bfly(builder, value, m))
    return value


def quad_allreduce(builder: ir.IRBuilder, value: ir.Value, op) -> ir.Value:
    """Reduce over the 4 lanes of a quad (the lanes holding one accumulator row)."""
    for m in (1, 2):
        value = op(builder, value, shfl_bfly(builder, value, m))
    return value


# the online softmax's lazy rescale: a row keeps its max until it grows by more than 2**8,
# so P stays below 256 (which bf16, fp16 and the fp32 sums hold with room to spare)
RESCALE_THRESHOLD = 8.0


def online_softmax_row(builder: ir.IRBuilder, scores: list[ir.Value], m_old: ir.Value,
                       l_old: ir.Value, scale_log2: ir.Value, rescale_threshold: float = 0.0,
                       defer_alpha: bool = False):
    """One KV tile's step of the online softmax for one row, in the log2 domain, over this
    thread's `scores` of the row (its quad holds the rest): (P, the new running max, the new
    running sum of this thread's part, alpha = the factor the row's O and sum are rescaled
    by). A row with no kept score so far (max -inf) gets P = 0 and alpha = 1, not NaN.
    `rescale_threshold` t > 0: the row keeps its old max (alpha exactly 1) unless the new
    one exceeds it by more than 2**t in the exponent's scale, so P stays below 2**t and
    most tiles need no rescale of O (FlashAttention-4's Blackwell softmax).
    `defer_alpha` (with a threshold): alpha comes back as its log2 (exactly 0 where the row
    keeps its max) and the sum as this tile's alone, for `rescale_where_moved(exponent=True)`
    to rescale the old sum with O: alpha's exponential then runs only where a row moved."""
    mx = scores[0]
    for v in scores[1:]:
        mx = fmax(builder, mx, v)
    mx = quad_allreduce(builder, mx, fmax)
    m_new = fmax(builder, m_old, mx)
    m_scaled = builder.fmul(m_new, scale_log2)
    m_scaled = builder.select(builder.fcmp_ordered("==", m_new, fconst(NEG_INF)), fconst(0.0),
                              m_scaled)
    old_scaled = builder.fmul(m_old, scale_log2)
    alpha_log2 = builder.fsub(old_scaled, m_scaled)
    deferred = defer_alpha and bool(rescale_threshold)
    alpha = None if deferred else ex2(builder, alpha_log2)
    if rescale_threshold:  # (a row whose old max is -inf never keeps it: alpha_log2 -inf)
        keep = builder.fcmp_ordered(">=", alpha_log2, fconst(-rescale_threshold))
        m_new = builder.select(keep, m_old, m_new)
        m_scaled = builder.select(keep, old_scaled, m_scaled)
        alpha = builder.select(keep, fconst(0.0), alpha_log2) if deferred else \
            builder.select(keep, fconst(1.0), alpha)
    neg = builder.fneg(m_scaled)
    p, total = [], None
    for v in scores:
        p.append(ex2(builder, fma(builder, v, scale_log2, neg)))
        total = p[-1] if total is None else builder.fadd(total, p[-1])
    if deferred:
        return p, m_new, total, alpha
    return p, m_new, builder.fadd(builder.fmul(l_old, alpha), total), alpha


def merge(b: ir.IRBuilder, first: list[ir.Value], first_block: ir.Block,
          second: list[ir.Value], second_block: ir.Block) -> list[ir.Value]:
    """At the top of a join block: one phi per pair, `first` coming from `first_block` and
    `second` from `second_block` (as many of each)."""
    merged = []
    for x, y in zip(first, second, strict=True):
        phi = b.phi(x.type)
        phi.add_incoming(x, first_block)
        phi.add_incoming(y, second_block)
        merged.append(phi)
    return merged


def guarded(b: ir.IRBuilder, cond: ir.Value, make, default: list[ir.Value]) -> list[ir.Value]:
    """`make(b)`'s values where `cond` holds (emitted under a branch), else `default`."""
    pre = b.block
    with b.if_then(cond):
        values = make(b)
        then = b.block
    return merge(b, values, then, default, pre)


def either(b: ir.IRBuilder, cond: ir.Value, make_then, make_else) -> list[ir.Value]:
    """`make_then(b)`'s values where `cond` holds, else `make_else(b)`'s (alike in number
    and type), each emitted under its branch."""
    with b.if_else(cond) as (then, otherwise):
        with then:
            first = make_then(b)
            first_block = b.block
        with otherwise:
            second = make_else(b)
            second_block = b.block
    return merge(b, first, first_block, second, second_block)


def rescale_rows(builder: ir.IRBuilder, values: list[ir.Value], alpha: list[ir.Value],
                 row_of) -> list[ir.Value]:
    """values[i] *= alpha[row_of(i)]: O's rescale over this thread's two rows."""
    return [builder.fmul(v, alpha[row_of(i)]) for i, v in enumerate(values)]


def rescale_where_moved(builder: ir.IRBuilder, values: list[ir.Value], alpha: list[ir.Value],
                        row_of, exponent: bool = False) -> list[ir.Value]:
    """`rescale_rows` after a softmax step with a `rescale_threshold`, under a branch uniform
    per warp that is taken only where some row of the warp moved its max (alpha not 1):
    rarely, after a row's first tiles. `exponent`: `alpha` holds log2s (`defer_alpha`; 0
    where the row kept its max), raised to powers of two under the branch alone."""
    unmoved = fconst(0.0 if exponent else 1.0)
    moved = any_lane(builder, builder.or_(builder.fcmp_unordered("!=", alpha[0], unmoved),
                                          builder.fcmp_unordered("!=", alpha[1], unmoved)))

    def rescale(b):
        return rescale_rows(b, values, [ex2(b, a) for a in alpha] if exponent else alpha, row_of)
    return guarded(builder, moved, rescale, values)


def any_lane(builder: ir.IRBuilder, pred: ir.Value) -> ir.Value:
    """Whether `pred` (i1) holds on any lane of the (whole, converged) warp: uniform."""
    return call(builder, "llvm.nvvm.vote.any.sync", nvptx.i1, [i32(-1), pred])


def row_sum(builder: ir.IRBuilder, partial: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
    """The online softmax's final row sum from this thread's `partial` (summed over the
    row's quad): (sum, no key kept (sum 0 or NaN), 1 / sum or 0 where none was kept)."""
    total = quad_allreduce(builder, partial, fadd)
    empty = builder.fcmp_unordered("==", total, fconst(0.0))
    return total, empty, builder.select(empty, fconst(0.0), rcp(builder, total))


def row_lse(builder: ir.IRBuilder, row_max: ir.Value, scale_log2: ir.Value, total: ir.Value,
            empty: ir.Value) -> ir.Value:
    """The row's log-sum-exp (natural log) from its running max (raw scores; `scale_log2`
    takes them to the log2 domain) and final sum; -inf where no key was kept."""
    value = builder.fmul(builder.fadd(builder.fmul(row_max, scale_log2), lg2(builder, total)),
                         fconst(LN2))
    return builder.select(empty, fconst(NEG_INF), value)


def sink_finish(builder: ir.IRBuilder, row_max: ir.Value, scale_log2: ir.Value,
                total: ir.Value, empty: ir.Value, sink_log2: ir.Value
                ) -> tuple[ir.Value, Callable[[], ir.Value]]:
    """A row's end with a sink logit in its denominator (log2 domain, finite): (what O's
    accumulators are multiplied by, a function that emits the row's LSE). Both terms are
    taken relative to the larger of the row's max and the sink, so neither overflows; a row
    with no key kept has output 0 and the sink's logit as its LSE."""
    top = builder.fmul(row_max, scale_log2)  # -inf where no key was kept
    big = fmax(builder, top, sink_log2)
    rescale = ex2(builder, builder.fsub(top, big))
    kept = builder.select(empty, fconst(0.0), builder.fmul(total, rescale))
    denominator = builder.fadd(kept, ex2(builder, builder.fsub(sink_log2, big)))
    inv = builder.fmul(rescale, rcp(builder, denominator))
    return inv, lambda: builder.fmul(builder.fadd(big, lg2(builder, denominator)), fconst(LN2))


def fmax(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    return call(builder, "llvm.maxnum.f32", f32, [a, b])


def fadd(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    return builder.fadd(a, b)


def ex2(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """2**x via `ex2.approx.ftz.f32` (ex2(-inf) = +0)."""
    return call(builder, "llvm.nvvm.ex2.approx.ftz.f", f32, [x])


def lg2(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    return call(builder, "llvm.nvvm.lg2.approx.ftz.f", f32, [x])


def rcp(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    return call(builder, "llvm.nvvm.rcp.approx.ftz.f", f32, [x])


def fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    return call(builder, "llvm.fma.f32", f32, [a, b, c])


# ----------------------------------------------------------------- swizzled tiles
def swizzle_chunk(builder: ir.IRBuilder, chunk: ir.Value, row: ir.Value) -> ir.Value:
    """XOR swizzle of a 16-byte chunk index within a row: chunk ^ (row % 8).

    Rows are a multiple of 128 bytes, so 8 consecutive rows at one logical chunk land in 8
    different 16-byte bank groups: ldmatrix (8 rows x 16 B) and the cp.async fill of 8
    consecutive chunks are both conflict-free."""
    return builder.xor(chunk, builder.and_(row, i32(7)))


def store(builder: ir.IRBuilder, value: ir.Value, ptr: ir.Value, align: int | None = None):
    """A store that tolerates llvmlite's typed view of a global's pointer (the module is
    printed with opaque pointers either way)."""
    from llvmlite.ir import instructions
    st = instructions.StoreInstr(builder.block, value, ptr)
    st.align = align
    builder._insert(st)
    return st


def smem_ptr(builder: ir.IRBuilder, base: ir.Value, byte_offset: ir.Value) -> ir.Value:
    return builder.gep(base, [builder.zext(byte_offset, nvptx.i64)], inbounds=True,
                       source_etype=nvptx.i8)
