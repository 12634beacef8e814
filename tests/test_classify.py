"""Tile classification: sound against brute force, exact for the standard masks (`EXACT`), and the
LLVM backend agrees with the Python one bit for bit."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from llvmlite import ir

from mhadsl.front.check import check_program
from mhadsl.front.diagnostics import MhaError
from mhadsl.analysis.classify import (
    I32_MAX, I32_MIN, classify_bounds, classify_tile, count_visited_kv_tiles, emit_classify,
    kv_band_tiles,
)
from mhadsl.analysis.kv_limits import emit_kv_limits, kv_limits
from mhadsl.codegen import warp
from mhadsl.codegen.backends import declaration_problems
from mhadsl.codegen.target import HOST, HostJit, emit_ptx, gpu_target, new_module, optimize
from mhadsl.front.parse import load_program
from mhadsl.analysis.reference import evaluate_rule

# name -> the mask member of an attention declaration
MASKS = {
    "causal": "mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx",
    "bottom_right": "mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx + seqlen_k - seqlen_q",
    "window": "mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx && q_idx - kv_idx < 256",
    "bottom_right_window": "mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = "
                           "kv_idx <= q_idx + seqlen_k - seqlen_q && "
                           "kv_idx >= q_idx + seqlen_k - seqlen_q - 100",
    "weird": "mask(b, h, q_idx, kv_idx) = where(q_idx % 3 == 0 || abs(q_idx - kv_idx) < 5, "
             "kv_idx / 7 <= q_idx / 5 + h, (q_idx * kv_idx) % 11 != 4 && !(kv_idx - q_idx > -3))",
    "negative": "mask(b, h, q_idx, kv_idx) = (q_idx - 300) / 7 - (kv_idx - 500) % 13 "
                "> min(h, 2) * -3 || max(q_idx, kv_idx) == 17",
    "bits": "mask(b, h, q_idx, kv_idx) = (q_idx >> 4) == (kv_idx >> 4) || "
            "(q_idx & 63) < ((kv_idx | 1) ^ 5) || ~kv_idx < -1000 || (kv_idx << 2) > q_idx * 3",
    "unsigned": "mask(b, h, q_idx, kv_idx) = u32(q_idx - kv_idx) < 100 || "
                "i32(u32(kv_idx)) == cdiv(q_idx, 64) * 64",
    "document": "mask(b, h, q_idx, kv_idx) { let doc = 512 "
                "if q_idx / doc != kv_idx / doc { return false } return kv_idx <= q_idx }",
    "float": "mask(b, h, q_idx, kv_idx) = f32(q_idx) * 0.5 >= f32(kv_idx) || kv_idx == 0",
    "bool_eq": "mask(b, h, q_idx, kv_idx) = ((kv_idx <= q_idx) == (b == 1)) != (h > 0)",
    "literals": "mask(b, h, q_idx, kv_idx) = where(q_idx > 10, 1, 2) + 3 < kv_idx - (7 - 10) / 2",
    "by_head": "mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx + h * 16 - b",
    "literal_abs": "mask(b, h, q_idx, kv_idx) = "
                   "kv_idx + abs(where(q_idx % 2 == 0, -300, 40)) <= q_idx + 100",
    "assign": "mask(b, h, q_idx, kv_idx) { var x = q_idx if x > kv_idx { x -= 1000 } "
              "return x == kv_idx }",
}
# The masks whose classification loses no precision: (may, must) equals brute force.
EXACT = ("causal", "bottom_right", "window", "bottom_right_window")


@functools.cache
def mask_of(name: str):
    src = f"attention a {{ dtype = bf16  head_dim = 128  {MASKS[name]} }}"
    program = check_program(load_program(src, "t.mha", Path(".")), declaration_problems)
    rule = next(r for r in program.attentions["a"].rules if r.name == "mask")
    return rule, program


def brute(name: str, *box, **named) -> tuple[bool, bool]:
    return brute_rule(*mask_of(name), *box, **named)


def brute_rule(rule, program, b, h, q_lo, q_hi, kv_lo, kv_hi, seqlen_q, seqlen_k
               ) -> tuple[bool, bool]:
    """(whether any pair of the box is kept, whether all are), pair by pair."""
    grid = evaluate_rule(rule, program, b=b, h=h, q_idx=np.arange(q_lo, q_hi + 1)[:, None],
                         kv_idx=np.arange(kv_lo, kv_hi + 1)[None, :], seqlen_q=seqlen_q,
                         seqlen_k=seqlen_k)
    return bool(grid.any()), bool(grid.all())


@st.composite
def boxes(draw, span: int = 200):
    seqlen_q, seqlen_k = draw(st.integers(1, 3000)), draw(st.integers(1, 3000))
    q_lo = draw(st.integers(0, seqlen_q - 1))
    q_hi = draw(st.integers(q_lo, min(seqlen_q - 1, q_lo + span)))
    kv_lo = draw(st.integers(0, seqlen_k - 1))
    kv_hi = draw(st.integers(kv_lo, min(seqlen_k - 1, kv_lo + span)))
    return dict(b=draw(st.integers(0, 3)), h=draw(st.integers(0, 7)), q_lo=q_lo, q_hi=q_hi,
                kv_lo=kv_lo, kv_hi=kv_hi, seqlen_q=seqlen_q, seqlen_k=seqlen_k)


def check_sound(name: str, box: dict, may: bool, must: bool) -> None:
    any_true, all_true = brute(name, **box)
    assert may or not any_true, f"{name}: called EMPTY but an element is true: {box}"
    assert all_true or not must, f"{name}: called FULL but an element is false: {box}"


# ------------------------------------------------------------------ soundness
@pytest.mark.parametrize("name", sorted(MASKS))
@settings(max_examples=150, deadline=None)
@given(box=boxes())
def test_sound(name, box):
    rule, program = mask_of(name)
    check_sound(name, box, *classify_bounds(rule, program, **box))


@pytest.mark.parametrize("name", ["by_head", "bool_eq", "weird"])
@settings(max_examples=60, deadline=None)
@given(box=boxes(span=60))
def test_sound_for_any_batch_and_head(name, box):
    rule, program = mask_of(name)
    may, must = classify_bounds(rule, program, **{**box, "b": None, "h": None})
    for b in range(4):
        for h in range(8):
            check_sound(name, {**box, "b": b, "h": h}, may, must)


@settings(max_examples=100, deadline=None)
@given(box=boxes())
def test_sound_near_i32_limits(box):
    """Indices shifted near 2**31: the kernel's sums wrap, the bounds must not lie."""
    rule, program = mask_of("bottom_right")
    shift = I32_MAX - 3000
    big = {**box, "q_lo": box["q_lo"] + shift, "q_hi": box["q_hi"] + shift}
    check_sound("bottom_right", big, *classify_bounds(rule, program, **big))


# Random masks from the i32 builtins and operators (ill-typed ones are diagnostics, skipped):
# the classification must neither fail nor lie on them.
ATOMS = ["b", "h", "q_idx", "kv_idx", "seqlen_q", "seqlen_k", "0", "1", "-3", "64", "300",
         "where(q_idx > kv_idx, 3, -5)", "where(h > 1, 9, 4)"]


@st.composite
def integer_exprs(draw, depth: int = 3):
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        return draw(st.sampled_from(ATOMS))
    kind = draw(st.sampled_from(["binary", "call", "call2", "where", "neg"]))
    a, b = draw(integer_exprs(depth - 1)), draw(integer_exprs(depth - 1))
    if kind == "binary":
        op = draw(st.sampled_from(["+", "-", "*", "/", "%", "&", "|", "^", "<<", ">>"]))
        return f"({a} {op} {b})"
    if kind == "call":
        return f"{draw(st.sampled_from(['abs', 'i32', 'u32']))}({a})"
    if kind == "call2":
        return f"{draw(st.sampled_from(['min', 'max', 'cdiv']))}({a}, {b})"
    if kind == "where":
        return f"where({a} < {b}, {b}, {a})"
    return f"-{a}"


@settings(max_examples=300, deadline=None)
@given(left=integer_exprs(), right=integer_exprs(),
       op=st.sampled_from(["==", "!=", "<", "<=", ">", ">="]), box=boxes(span=40))
def test_sound_for_random_masks(left, right, op, box):
    src = (f"attention a {{ dtype = bf16  head_dim = 128  "
           f"mask(b, h, q_idx, kv_idx) = {left} {op} {right} }}")
    try:
        program = check_program(load_program(src, "t.mha", Path(".")), declaration_problems)
    except MhaError:
        return  # (a type error, or a constant the checker refuses)
    rule = next(r for r in program.attentions["a"].rules if r.name == "mask")
    may, must = classify_bounds(rule, program, **box)
    any_true, all_true = brute_rule(rule, program, **box)
    assert may or not any_true, f"called EMPTY, an element is kept: {src} {box}"
    assert not must or all_true, f"called FULL, an element is dropped: {src} {box}"


# ------------------------------------------------------------------ precision
@pytest.mark.parametrize("name", EXACT)
@settings(max_examples=200, deadline=None)
@given(box=boxes(span=300))
def test_exact(name, box):
    rule, program = mask_of(name)
    assert classify_bounds(rule, program, **box) == brute(name, **box)


@settings(max_examples=300, deadline=None)
@given(q_lo=st.integers(0, 5000), q_len=st.integers(1, 256), kv_lo=st.integers(0, 5000),
       kv_len=st.integers(1, 256))
def test_causal_classes(q_lo, q_len, kv_lo, kv_len):
    rule, program = mask_of("causal")
    q_hi, kv_hi = q_lo + q_len - 1, kv_lo + kv_len - 1
    want = "full" if kv_hi <= q_lo else "empty" if kv_lo > q_hi else "partial"
    assert classify_tile(rule, program, b=0, h=0, q_lo=q_lo, q_hi=q_hi, kv_lo=kv_lo,
                         kv_hi=kv_hi, seqlen_q=10000, seqlen_k=10000) == want


def test_unknown_forms_are_partial():
    rule, program = mask_of("assign")  # an assignment is beyond the analysis
    box = dict(b=0, h=0, q_lo=0, q_hi=0, kv_lo=5, kv_hi=5, seqlen_q=1, seqlen_k=10)
    assert classify_tile(rule, program, **box) == "partial"
    assert classify_tile(None, None, **box) == "full"


# ------------------------------------------------------------------ the cost model
def brute_count(name, q_tile, block_m, block_n, seqlen_q, seqlen_k) -> int:
    q_lo = q_tile * block_m
    q_hi = min(q_lo + block_m, seqlen_q) - 1
    return sum(brute(name, 0, 0, q_lo, q_hi, kv_lo, min(kv_lo + block_n, seqlen_k) - 1,
                     seqlen_q, seqlen_k)[0] for kv_lo in range(0, seqlen_k, block_n))


@pytest.mark.parametrize("name", EXACT + ("document",))
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1000, 1000), (300, 1000), (1000, 300), (64, 1)])
def test_count_visited_kv_tiles(name, seqlen_q, seqlen_k):
    rule, program = mask_of(name)
    for q_tile in range(-(-seqlen_q // 128)):
        got = count_visited_kv_tiles(rule, program, q_tile=q_tile, block_m=128, block_n=64,
                                     seqlen_q=seqlen_q, seqlen_k=seqlen_k)
        assert got == brute_count(name, q_tile, 128, 64, seqlen_q, seqlen_k)


def test_count_visited_causal_and_edges():
    rule, program = mask_of("causal")
    counts = [count_visited_kv_tiles(rule, program, q_tile=i, block_m=128, block_n=128,
                                     seqlen_q=1000, seqlen_k=1000) for i in range(8)]
    assert counts == [1, 2, 3, 4, 5, 6, 7, 8]
    assert count_visited_kv_tiles(None, None, q_tile=0, block_m=128, block_n=128,
                                  seqlen_q=100, seqlen_k=1000) == 8
    assert count_visited_kv_tiles(None, None, q_tile=1, block_m=128, block_n=128,
                                  seqlen_q=100, seqlen_k=1000) == 0  # past the sequence
    assert count_visited_kv_tiles(rule, program, q_tile=0, block_m=128, block_n=128,
                                  seqlen_q=100, seqlen_k=0) == 0


@pytest.mark.parametrize("name, band", [
    ("window", 3),  # 128 rows see keys from 255 before the first to the last: 3 tiles of 128
    ("bottom_right_window", 2), ("document", 1),  # a 512-key document: one 128 x 128 tile
    ("causal", None), ("bottom_right", None), ("by_head", None)])
def test_kv_band_tiles_is_bounded_only_where_the_mask_bounds_the_keys(name, band):
    rule, program = mask_of(name)
    assert kv_band_tiles(rule, program) == band
    assert kv_band_tiles(None, None) is None  # no mask: every key


# ------------------------------------------------------------------ the LLVM backend
def build_classifier(module: ir.Module, name: str, exact_bh: bool) -> None:
    """`i32 classify_<name>(b, h, q_lo, q_hi, kv_lo, kv_hi, seqlen_q, seqlen_k)` returning
    may | must << 1."""
    i32 = ir.IntType(32)
    fn = ir.Function(module, ir.FunctionType(i32, [i32] * 8),
                     name=f"classify_{name}_{'exact' if exact_bh else 'any'}")
    builder = ir.IRBuilder(fn.append_basic_block())
    b, h, *rest = fn.args
    rule, program = mask_of(name)
    may, must = emit_classify(builder, rule, program, b if exact_bh else None,
                              h if exact_bh else None, *rest)
    builder.ret(builder.or_(builder.zext(may, i32), builder.shl(builder.zext(must, i32),
                                                                i32(1))))


@functools.cache
def host_classifiers():
    module = new_module("classify_test", HOST)
    for name in MASKS:
        for exact_bh in (True, False):
            build_classifier(module, name, exact_bh)
    jit = HostJit(module)
    proto = ctypes.CFUNCTYPE(ctypes.c_int32, *[ctypes.c_int32] * 8)
    fns = {(n, e): proto(jit.address(f"classify_{n}_{'exact' if e else 'any'}"))
           for n in MASKS for e in (True, False)}
    return jit, fns  # the engine must outlive the function pointers


i32s = st.integers(I32_MIN, I32_MAX)
small = st.integers(-3000, 3000)


@st.composite
def any_box(draw):
    """Boxes anywhere in i32, often near the limits, where the 64-bit bounds matter."""
    value = st.one_of(small, i32s, st.sampled_from([I32_MIN, I32_MAX, 0, -1, 1]))
    q = sorted((draw(value), draw(value)))
    kv = sorted((draw(value), draw(value)))
    return dict(b=draw(value), h=draw(value), q_lo=q[0], q_hi=q[1], kv_lo=kv[0], kv_hi=kv[1],
                seqlen_q=draw(value), seqlen_k=draw(value))


@pytest.mark.parametrize("name", sorted(MASKS))
@settings(max_examples=300, deadline=None)
@given(box=any_box())
def test_llvm_matches_python(name, box):
    _, fns = host_classifiers()
    rule, program = mask_of(name)
    args = [box[k] for k in ("b", "h", "q_lo", "q_hi", "kv_lo", "kv_hi", "seqlen_q",
                             "seqlen_k")]
    for exact_bh in (True, False):
        bits = fns[(name, exact_bh)](*args)
        py_box = box if exact_bh else {**box, "b": None, "h": None}
        assert (bool(bits & 1), bool(bits & 2)) == classify_bounds(rule, program, **py_box)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_emits_ptx(arch):
    target = gpu_target(arch)
    module = new_module("classify_ptx", target)
    build_classifier(module, "weird", exact_bh=True)
    ptx = emit_ptx(optimize(module, target), target)
    assert "classify_weird_exact" in ptx


# ------------------------------------------------------------------ a row's run of keys
RUNS = {  # masks that keep one run of keys per query row, beside MASKS' causal and window
    "band": "mask(b, h, q_idx, kv_idx) = kv_idx >= q_idx - 100 && kv_idx - 5 < q_idx",
    "diagonal": "mask(b, h, q_idx, kv_idx) = kv_idx == q_idx",
    "flipped": "mask(b, h, q_idx, kv_idx) = -kv_idx + 2 * 3 > -q_idx && 7 <= kv_idx",
    "late_keys": "mask(b, h, q_idx, kv_idx) = kv_idx - 2000000000 >= q_idx - 2000000000 + 1",
}
MASKS.update(RUNS)
# Masks kv_limits refuses: not one run per row (chunks, holes, a disjunction, a product),
# unsigned, or an index sum that may leave i32 (bottom-right: q_idx + seqlen_k)
NOT_RUNS = sorted(set(MASKS) - set(RUNS) - {"causal", "window"})


def test_kv_limits_know_a_run_of_keys_where_the_mask_is_one():
    found = {name for name in MASKS if kv_limits(*mask_of(name)) is not None}
    assert found == set(RUNS) | {"causal", "window"}, found
    assert kv_limits(*mask_of("window")).lows == ((("", -255), ("q_idx", 1)),)


@functools.cache
def host_kv_limits():
    """`i64 limits_<name>(b, h, q_idx, seqlen_q, seqlen_k)`: lo | hi << 32 (none: -2**31)."""
    i32, i64 = ir.IntType(32), ir.IntType(64)
    module = new_module("kv_limits_test", HOST)
    names = sorted(set(RUNS) | {"causal", "window"})
    for name in names:
        fn = ir.Function(module, ir.FunctionType(i64, [i32] * 5), name=f"limits_{name}")
        b = ir.IRBuilder(fn.append_basic_block())
        roles = dict(zip(("b", "h", "q_idx", "seqlen_q", "seqlen_k"), fn.args))
        lo, hi = emit_kv_limits(b, kv_limits(*mask_of(name)), roles)
        lo, hi = (ir.Constant(i32, I32_MIN) if v is None else v for v in (lo, hi))
        b.ret(b.or_(b.zext(lo, i64), b.shl(b.zext(hi, i64), ir.Constant(i64, 32))))
    jit = HostJit(module)
    proto = ctypes.CFUNCTYPE(ctypes.c_int64, *[ctypes.c_int32] * 5)
    return jit, {n: proto(jit.address(f"limits_{n}")) for n in names}


@pytest.mark.parametrize("name", sorted(set(RUNS) | {"causal", "window"}))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_a_rows_run_of_keys_is_the_mask(name, data):
    """Per query row, [lo, hi] from the kernel's IR (run on the host) holds exactly the keys
    the mask keeps, anywhere in i32's lengths (keys looked at: 300 from a drawn one)."""
    seqlen_q = data.draw(st.one_of(st.integers(1, 3000), st.integers(1, I32_MAX)))
    seqlen_k = data.draw(st.one_of(st.integers(1, 3000), st.integers(1, I32_MAX)))
    q = data.draw(st.integers(0, seqlen_q - 1))
    near = min(max(0, q - 400), seqlen_k - 1)  # keys near the row's diagonal, if any
    kv0 = data.draw(st.one_of(st.integers(0, seqlen_k - 1),
                              st.integers(near, max(near, min(q + 100, seqlen_k - 1)))))
    kv = np.arange(kv0, min(kv0 + 300, seqlen_k), dtype=np.int64)
    b, h = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 7))
    bits = host_kv_limits()[1][name](b, h, q, seqlen_q, seqlen_k)
    lo, hi = ((bits & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000, bits >> 32
    rule, program = mask_of(name)
    kept = evaluate_rule(rule, program, b=b, h=h, q_idx=np.int64(q), kv_idx=kv,
                         seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    lo = 0 if lo == I32_MIN else lo
    hi = I32_MAX if hi == I32_MIN else hi
    assert np.array_equal(np.broadcast_to(kept, kv.shape), (kv >= lo) & (kv <= hi))


@functools.cache
def host_fragment_bits():
    """`void bits_<count>(lo, hi, has_lo, u32 *words)`: `warp.kept_fragment_bits`."""
    i32 = ir.IntType(32)
    module = new_module("fragment_bits_test", HOST)
    for count in (32, 40, 64):
        fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [i32, i32, i32,
                                                                 i32.as_pointer()]),
                         name=f"bits_{count}")
        b = ir.IRBuilder(fn.append_basic_block())
        lo, hi, has_lo, out = fn.args
        for lower in (True, False):  # the words with the low bound, then without
            words = warp.kept_fragment_bits(b, lo if lower else None, hi, count)
            for k, w in enumerate(words):
                old = b.load(b.gep(out, [ir.Constant(i32, k)]))
                b.store(b.select(b.icmp_unsigned("!=", has_lo, ir.Constant(i32, 0)), w, old)
                        if lower else b.select(b.icmp_unsigned("!=", has_lo, ir.Constant(i32, 0)),
                                               old, w), b.gep(out, [ir.Constant(i32, k)]))
        b.ret_void()
    jit = HostJit(module)
    proto = ctypes.CFUNCTYPE(None, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                             ctypes.POINTER(ctypes.c_uint32))
    return jit, {c: proto(jit.address(f"bits_{c}")) for c in (32, 40, 64)}


@pytest.mark.parametrize("count", [32, 40, 64])
@settings(max_examples=300, deadline=None)
@given(lo=st.one_of(st.none(), st.integers(-300, 300), st.integers(I32_MIN + 1, I32_MAX)),
       hi=st.one_of(st.integers(-300, 300), st.integers(I32_MIN, I32_MAX)))
def test_fragment_bits_are_the_columns_in_the_run(count, lo, hi):
    """Bit i of a row's words is set iff the value's column, 8 (i // 2) + i % 2 (the
    accumulator layout), lies in [lo, hi] (bits past `count` are never read)."""
    words = (ctypes.c_uint32 * 2)(0xDEAD, 0xBEEF)
    host_fragment_bits()[1][count](0 if lo is None else lo, hi, lo is not None, words)
    for i in range(count):
        col = 8 * (i // 2) + i % 2
        kept = (lo is None or lo <= col) and col <= hi
        assert bool(words[i // 32] >> (i % 32) & 1) == kept, (i, col)
