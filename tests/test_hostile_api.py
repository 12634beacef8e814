"""Hostile arguments to the Python API: the references run their calls' checks (one function
each, shared), builds refuse what they cannot make, a call finds there is no GPU before it
copies anything, a program is a mapping of its kernels, and every argument of the wrong
type is a TypeError that names it."""
from __future__ import annotations

import inspect
import math
import time
import tracemalloc
from collections.abc import Mapping

import numpy as np
import pytest

import mhadsl
from mhadsl import Kernel, reference, reference_backward, reference_decode
from mhadsl.codegen.backends import CacheLayout

SOURCE = '''import "std/schedulers.mha"
attention h128 {
    dtype = fp16
    head_dim = 128
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx
}
attention grouped { dtype = fp16  head_dim = 128  gqa = 4 }
attention mqa { dtype = fp16  head_dim = 128  kv_heads = 1 }
attention two_kv { dtype = fp16  head_dim = 128  kv_heads = 2 }
'''
D = 128


@pytest.fixture(scope="module")
def program():
    return mhadsl.compile(SOURCE)


@pytest.fixture
def kernel(program):
    return program["h128"]


def array(*shape, dtype=np.float32):
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)


def dense(d=D):
    return dict(q=array(2, 8, 4, d), k=array(2, 10, 2, d), v=array(2, 10, 2, d))


def ragged():
    return dict(q=array(9, 4, D), k=array(12, 2, D), v=array(12, 2, D),
                cu_seqlens_q=np.array([0, 5, 9], np.int32),
                cu_seqlens_k=np.array([0, 7, 12], np.int32))


def changed(base, **changes):
    """`base()`'s arguments with some replaced."""
    return lambda: dict(base(), **changes)


# ------------------------------------------------------------ the forward call and reference
# (id, arguments, error, words both messages hold)
FORWARD = [
    ("cu_seqlens decreasing", changed(ragged, cu_seqlens_q=np.array([0, 6, 5], np.int32)),
     ValueError, "cu_seqlens_q must be non-decreasing, got [0, 6, 5]"),
    ("cu_seqlens negative inside", changed(ragged, cu_seqlens_q=np.array([0, -2, 9], np.int32)),
     ValueError, "cu_seqlens_q must be non-decreasing"),
    ("cu_seqlens starting below 0", changed(ragged, cu_seqlens_k=np.array([-1, 7, 12], np.int32)),
     ValueError, "cu_seqlens_k must start at 0 or above, got -1"),
    ("cu_seqlens past the rows", changed(ragged, cu_seqlens_q=np.array([0, 5, 12], np.int32)),
     ValueError, "cu_seqlens_q ends at 12, beyond the 9 rows of its tensor"),
    ("cu_seqlens of floats", changed(ragged, cu_seqlens_q=np.array([0.0, 5.0, 9.0])),
     TypeError, "cu_seqlens_q must be int32, got float64"),
    ("cu_seqlens a list", changed(ragged, cu_seqlens_k=[0, 7, 12]), TypeError,
     "'cu_seqlens_k'"),
    ("cu_seqlens lengths differ", changed(ragged, cu_seqlens_k=np.array([0, 7, 9, 12], np.int32)),
     ValueError, "cu_seqlens_q and cu_seqlens_k must have the same length"),
    ("one cu_seqlens", changed(ragged, cu_seqlens_k=None), ValueError,
     "ragged attention needs both cu_seqlens_q and cu_seqlens_k"),
    ("max_seqlen below the longest", changed(ragged, max_seqlen_q=4), ValueError,
     "max_seqlen_q = 4 is below the longest sequence (5)"),
    ("max_seqlen negative", changed(ragged, max_seqlen_k=-1), ValueError,
     "max_seqlen_k must be in [0, 2**31), got -1"),
    ("max_seqlen a float", changed(ragged, max_seqlen_q=5.0), TypeError,
     "max_seqlen_q must be an integer, got 5.0"),
    ("max_seqlen a str", changed(ragged, max_seqlen_k="7"), TypeError,
     "max_seqlen_k must be an integer, got '7'"),
    ("max_seqlen a bool", changed(ragged, max_seqlen_q=True), TypeError,
     "max_seqlen_q must be an integer, got True"),
    ("max_seqlen in a dense call", changed(dense, max_seqlen_q=8), ValueError,
     "max_seqlen_q/max_seqlen_k belong to ragged calls"),
    ("head dim 64", lambda: dense(64), ValueError,
     "tensor 'q' has head dim 64, but kernel 'h128' is declared head_dim = 128"),
    ("head dim 7", lambda: dense(7), ValueError, "tensor 'q' has head dim 7"),
    ("v of head dim 64", changed(dense, v=array(2, 10, 2, 64)), ValueError,
     "tensor 'v' has head dim 64"),
    ("k and v differ", changed(dense, v=array(2, 11, 2, D)), ValueError,
     "k and v must have the same shape"),
    ("rank 3 without cu_seqlens", changed(dense, q=array(16, 4, D)), ValueError,
     "tensor 'q' has shape (16, 4, 128); expected rank 4"),
    ("3 heads over 2", changed(dense, q=array(2, 8, 3, D)), ValueError,
     "query heads (3) must be a multiple of key/value heads (2)"),
    ("batch 2 against 3", changed(dense, k=array(3, 10, 2, D), v=array(3, 10, 2, D)),
     ValueError, "q has batch 2 but k/v have 3"),
    ("scale NaN", changed(dense, scale=math.nan), TypeError,
     "scale must be a finite number, got nan"),
    ("scale infinite", changed(dense, scale=-math.inf), TypeError,
     "scale must be a finite number, got -inf"),
    ("scale a str", changed(dense, scale="0.1"), TypeError,
     "scale must be a finite number, got '0.1'"),
    ("q None", changed(dense, q=None), TypeError, "'q'"),
    ("k a list", changed(dense, k=[[0.0]]), TypeError, "'k'"),
    ("v a str", changed(dense, v="v"), TypeError, "'v'"),
    ("q of int32", changed(dense, q=np.zeros((2, 8, 4, D), np.int32)), TypeError,
     "tensor 'q' has dtype int32"),
    ("return_lse a str", changed(dense, return_lse="yes"), TypeError,
     "return_lse must be True, False or None"),
    ("return_lse an int", changed(dense, return_lse=1), TypeError,
     "return_lse must be True, False or None"),
]


@pytest.mark.parametrize("make, error, words", [c[1:] for c in FORWARD],
                         ids=[c[0] for c in FORWARD])
def test_the_call_and_its_reference_refuse_alike(kernel, make, error, words):
    """The same checks, before any GPU work: with no GPU the call still says what is wrong."""
    with pytest.raises(error) as called:
        kernel(**make())
    with pytest.raises(error) as referenced:
        reference(kernel, **make())
    assert words in str(called.value)
    assert words in str(referenced.value)


def test_the_declared_head_ratio_is_checked_by_the_reference(program):
    args = dense()  # 4 query heads over 2: gqa = 2, but `grouped` is declared gqa = 4
    with pytest.raises(ValueError, match="declared gqa = 4"):
        reference(program["grouped"], **args)
    with pytest.raises(ValueError, match="declared kv_heads = 1"):
        reference(program["mqa"], **args)


def test_valid_calls_reach_the_reference(kernel):
    out, lse = reference(kernel, **ragged(), max_seqlen_q=5, max_seqlen_k=7, scale=0.5,
                         return_lse=True, out=None, stream=None)
    assert out.shape == (9, 4, D) and lse.shape == (4, 9)
    assert reference(kernel, **dense(), out=np.empty((2, 8, 4, D)), stream=0).shape == \
        (2, 8, 4, D)


def keyword_only(function) -> set[str]:
    return {p.name for p in inspect.signature(function).parameters.values()
            if p.kind is p.KEYWORD_ONLY}


def test_references_take_exactly_their_calls_keywords():
    decode_only = {"cache_seqlens", "page_table", "num_splits", "k_new", "v_new", "k_scale",
                   "v_scale"}
    call = keyword_only(Kernel.__call__)
    assert keyword_only(reference) == call - decode_only
    assert keyword_only(reference_decode) == call - {"cu_seqlens_k", "max_seqlen_k",
                                                     "block_classes"}
    assert keyword_only(reference_backward) == keyword_only(Kernel.backward)


@pytest.mark.parametrize("name, value", [
    ("cache_seqlens", np.array([3, 4], np.int32)),
    ("page_table", np.zeros((2, 1), np.int32)),
    ("num_splits", 2),
])
def test_reference_given_decode_arguments_points_to_reference_decode(kernel, name, value):
    args = dict(dense(), **{name: value})
    with pytest.raises(TypeError) as info:
        reference(kernel, **args)
    assert name in str(info.value) and "mhadsl.reference_decode" in str(info.value)


def test_reference_refuses_an_unknown_keyword(kernel):
    with pytest.raises(TypeError, match="unexpected keyword argument 'causal'"):
        reference(kernel, **dense(), causal=True)


@pytest.mark.parametrize("not_a_kernel", [None, "h128"])
def test_references_take_a_kernel(not_a_kernel):
    q, k, v = dense().values()
    for call in (lambda: reference(not_a_kernel, q, k, v),
                 lambda: reference_backward(not_a_kernel, q, k, v, q),
                 lambda: reference_decode(not_a_kernel, q[:, :1], k, v,
                                          cache_seqlens=np.array([3, 4], np.int32))):
        with pytest.raises(TypeError, match="a Kernel"):
            call()


# ------------------------------------------------------------ decode
def decode():
    """A contiguous cache's decode call (as the call's keywords: k and v are the cache)."""
    return dict(q=array(2, 1, 4, D), k=array(2, 64, 2, D), v=array(2, 64, 2, D),
                cache_seqlens=np.array([3, 4], np.int32))


def ragged_decode():
    return dict(decode(), q=array(3, 4, D), cu_seqlens_q=np.array([0, 1, 3], np.int32))


DECODE = [
    ("num_splits a str", changed(decode, num_splits="4"), TypeError,
     "num_splits must be an integer from 1 to 128, got '4'"),
    ("num_splits a float", changed(decode, num_splits=4.0), TypeError,
     "num_splits must be an integer from 1 to 128, got 4.0"),
    ("num_splits 0", changed(decode, num_splits=0), ValueError,
     "num_splits must be an integer from 1 to 128, got 0"),
    ("num_splits 129", changed(decode, num_splits=129), ValueError, "got 129"),
    ("max_seqlen_q in a dense call", changed(decode, max_seqlen_q=1), ValueError,
     "max_seqlen_q belongs to ragged calls"),
    ("max_seqlen_q below the longest", changed(ragged_decode, max_seqlen_q=1), ValueError,
     "max_seqlen_q = 1 is below the longest sequence (2)"),
    ("max_seqlen_q a float", changed(ragged_decode, max_seqlen_q=2.0), TypeError,
     "max_seqlen_q must be an integer"),
    ("scale NaN", changed(decode, scale=math.nan), TypeError, "scale must be a finite number"),
    ("scale a str", changed(decode, scale="1"), TypeError, "scale must be a finite number"),
    ("return_lse a str", changed(decode, return_lse="no"), TypeError,
     "return_lse must be True, False or None"),
    ("cache_seqlens a list", changed(decode, cache_seqlens=[3, 4]), TypeError,
     "'cache_seqlens'"),
    ("page_table a list", changed(decode, page_table=[[0], [1]]), TypeError, "'page_table'"),
    ("q None", changed(decode, q=None), TypeError, "'q'"),
    ("head dim 64", changed(decode, q=array(2, 1, 4, 64)), ValueError,
     "q has head dim 64, but kernel 'h128' is declared head_dim = 128"),
]


@pytest.mark.parametrize("make, error, words", [c[1:] for c in DECODE],
                         ids=[c[0] for c in DECODE])
def test_the_decode_call_and_its_reference_refuse_alike(kernel, make, error, words):
    with pytest.raises(error) as called:
        kernel(**make())
    args = make()
    args["k_cache"], args["v_cache"] = args.pop("k"), args.pop("v")
    with pytest.raises(error) as referenced:
        reference_decode(kernel, **args)
    assert words in str(called.value)
    assert words in str(referenced.value)


def test_reference_decode_needs_cache_seqlens(kernel):
    args = decode()
    with pytest.raises(TypeError, match="cache_seqlens"):
        reference_decode(kernel, args["q"], args["k"], args["v"], cache_seqlens=None)


def test_reference_decode_takes_no_keys_of_a_call_with_k_and_v(kernel):
    args = decode()
    with pytest.raises(TypeError, match="cu_seqlens_k"):
        reference_decode(kernel, args["q"], args["k"], args["v"],
                         cache_seqlens=args["cache_seqlens"], cu_seqlens_k=np.zeros(3, np.int32))


def test_reference_decode_takes_the_calls_launch_arguments(kernel):
    args = decode()
    out = reference_decode(kernel, args["q"], args["k"], args["v"],
                           cache_seqlens=args["cache_seqlens"], num_splits=3, out=None,
                           stream=None)
    assert out.shape == args["q"].shape


# ------------------------------------------------------------ backward
def backward_args(base=dense):
    args = base()
    q = args["q"]
    lse_shape = (q.shape[1], q.shape[0]) if q.ndim == 3 else (q.shape[0], q.shape[2], q.shape[1])
    return dict(args, out=np.zeros_like(q), lse=np.zeros(lse_shape, np.float32),
                dout=array(*q.shape))


BACKWARD = [
    ("deterministic a str", dict(deterministic="yes"), TypeError,
     "deterministic must be True, False or None"),
    ("scale NaN", dict(scale=math.nan), TypeError, "scale must be a finite number"),
    ("dout of another shape", dict(dout=array(2, 8, 4, 64)), ValueError,
     "dout has shape (2, 8, 4, 64), expected (2, 8, 4, 128) (like q)"),
    ("dout None", dict(dout=None), TypeError, "'dout'"),
    ("head dim 64", dict(q=array(2, 8, 4, 64)), ValueError, "tensor 'q' has head dim 64"),
    ("max_seqlen in a dense call", dict(max_seqlen_k=10), ValueError,
     "belong to ragged calls"),
    ("max_seqlen below the longest",
     dict(ragged(), max_seqlen_k=6, out=np.zeros((9, 4, D), np.float32),
          lse=np.zeros((4, 9), np.float32), dout=array(9, 4, D)),
     ValueError, "max_seqlen_k = 6 is below the longest sequence (7)"),
    ("cu_seqlens decreasing",
     dict(ragged(), cu_seqlens_k=np.array([0, 7, 6], np.int32),
          out=np.zeros((9, 4, D), np.float32), lse=np.zeros((4, 9), np.float32),
          dout=array(9, 4, D)),
     ValueError, "cu_seqlens_k must be non-decreasing"),
]


@pytest.mark.parametrize("change, error, words", [c[1:] for c in BACKWARD],
                         ids=[c[0] for c in BACKWARD])
def test_the_backward_and_its_reference_refuse_alike(kernel, change, error, words):
    args = dict(backward_args(), **change)
    q, k, v, out, lse, dout = (args.pop(n) for n in ("q", "k", "v", "out", "lse", "dout"))
    with pytest.raises(error) as called:
        kernel.backward(q, k, v, out, lse, dout, **args)
    with pytest.raises(error) as referenced:
        reference_backward(kernel, q, k, v, dout, **args)
    assert words in str(called.value)
    assert words in str(referenced.value)


# ------------------------------------------------------------ builds
@pytest.mark.parametrize("backend, hint", [
    ("decode", "cache=CacheLayout"),
    ("backward", "Kernel.backward_build"),
    ("backward_sm90", "Kernel.backward_build"),
])
def test_a_forward_build_refuses_the_designs_of_other_calls(kernel, backend, hint):
    with pytest.raises(ValueError) as info:
        kernel.build("sm_90a", backend=backend)
    message = str(info.value)
    assert f"backend {backend!r}" in message and "'sm80' or 'sm90'" in message
    assert hint in message


@pytest.mark.parametrize("layout, takes", [
    (dict(backward=True), "'backward' or 'backward_sm90'"),
    (dict(cache=CacheLayout()), "'decode'"),
])
def test_builds_of_other_calls_refuse_a_forward_design(kernel, layout, takes):
    with pytest.raises(ValueError) as info:
        kernel.build("sm_80", backend="sm80", **layout)
    assert "backend 'sm80'" in str(info.value) and takes in str(info.value)


@pytest.mark.parametrize("group", [0, -4, 2**31])
def test_a_build_refuses_a_group_no_call_can_have(kernel, group):
    with pytest.raises(ValueError, match=f"gqa_group must be from 1 to 2\\*\\*31 - 1, got {group}"):
        kernel.build("sm_80", gqa_group=group)


@pytest.mark.parametrize("name, group", [("grouped", 2), ("grouped", 10**6), ("two_kv", 2**30)])
def test_a_build_refuses_a_group_the_declaration_rules_out(program, name, group):
    with pytest.raises(ValueError) as info:
        program[name].build("sm_80", gqa_group=group)
    assert f"gqa_group = {group}" in str(info.value) and "declared" in str(info.value)


def test_a_declared_ratio_is_the_group_its_builds_take(program):
    assert program["grouped"].config(arch="sm_80", gqa_group=4).gqa_group == 4
    assert program["mqa"].config(arch="sm_80", gqa_group=10**6).gqa_group == 10**6
    assert program["two_kv"].config(arch="sm_80", gqa_group=2**30 - 1).gqa_group == 2**30 - 1


# ------------------------------------------------------------ no GPU
def no_gpu() -> bool:
    from mhadsl.runtime import driver
    return not driver.gpu_available()


def huge_view():
    """A (1, 2**22, 2, 128) float16 array of one row repeated: 2 GiB as a copy, 256 bytes as
    this stride-0 view."""
    return np.broadcast_to(np.zeros(D, np.float16), (1, 2**22, 2, D))


@pytest.mark.skipif(not no_gpu(), reason="the path of a machine without a GPU")
@pytest.mark.parametrize("call", [
    lambda kern, big: kern(big, big, big),
    lambda kern, big: kern(big, big, big, return_lse=True),
    lambda kern, big: kern(np.zeros((1, 1, 2, D), np.float16), big, big,
                           cache_seqlens=np.array([5], np.int32)),
], ids=["forward", "forward with lse", "decode"])
def test_a_call_finds_there_is_no_gpu_before_it_copies_anything(kernel, call):
    big = huge_view()
    started = time.monotonic()
    tracemalloc.start()
    try:
        with pytest.raises(mhadsl.NoGpuError):
            call(kernel, big)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 * 2**20, f"{peak / 2**20:.0f} MiB"
    assert time.monotonic() - started < 10


# ------------------------------------------------------------ the program
def test_a_program_is_a_mapping_of_its_attention_kernels(program):
    assert isinstance(program, Mapping)
    assert list(program) == ["h128", "grouped", "mqa", "two_kv"] == list(program.keys())
    assert len(program) == 4
    assert "h128" in program and "LPT" not in program and "missing" not in program
    assert 0 not in program and None not in program and [] not in program
    assert dict(program.items())["grouped"] is program["grouped"]
    assert program.get("missing") is None and program.get("mqa") is program["mqa"]
    assert hash(program) == hash(program) and program == program
    assert program != mhadsl.compile(SOURCE)  # a program is itself, not its names


def test_a_missing_kernel_is_a_key_error_naming_what_there_is(program):
    with pytest.raises(KeyError, match=r"no attention kernel named 'missing' in <string> "
                                       r"\(it has: h128, grouped, mqa, two_kv\)"):
        program["missing"]


@pytest.mark.parametrize("key", [0, None, b"h128"])
def test_a_kernel_name_is_a_str(program, key):
    with pytest.raises(TypeError, match="attention kernel name must be a str"):
        program[key]


# ------------------------------------------------------------ every argument's type
# (id, the call, the argument its message names)
WRONG_TYPES = [
    ("build arch an int", lambda k: k.build(90), "arch"),
    ("build arch None", lambda k: k.build(None), "arch"),
    ("build gqa_group a str", lambda k: k.build(gqa_group="2"), "gqa_group"),
    ("build gqa_group a float", lambda k: k.build(gqa_group=2.0), "gqa_group"),
    ("build gqa_group a bool", lambda k: k.build(gqa_group=True), "gqa_group"),
    ("build ragged an int", lambda k: k.build(ragged=1), "ragged"),
    ("build return_lse a str", lambda k: k.build(return_lse="yes"), "return_lse"),
    ("build backward None", lambda k: k.build(backward=None), "backward"),
    ("build deterministic an int", lambda k: k.build(deterministic=0), "deterministic"),
    ("build backend an int", lambda k: k.build(backend=80), "backend"),
    ("build cache a str", lambda k: k.build(cache="paged"), "cache"),
    ("ptx arch bytes", lambda k: k.ptx(b"sm_80"), "arch"),
    ("ptx gqa_group a str", lambda k: k.ptx(gqa_group="4"), "gqa_group"),
    ("backward_build ragged a str", lambda k: k.backward_build(ragged="no"), "ragged"),
    ("backward_build gqa_group a float", lambda k: k.backward_build(gqa_group=1.0),
     "gqa_group"),
    ("backward_build deterministic None", lambda k: k.backward_build(deterministic=None),
     "deterministic"),
    ("config gqa_group a str", lambda k: k.config(gqa_group="1"), "gqa_group"),
    ("specialize q None", lambda k: k.specialize(None, *list(dense().values())[1:]), "'q'"),
    ("specialize max_seqlen_q a str",
     lambda k: k.specialize(**ragged(), max_seqlen_q="5"), "max_seqlen_q"),
    ("specialize return_lse a str", lambda k: k.specialize(**dense(), return_lse="no"),
     "return_lse"),
    ("call out a list", lambda k: k(**dense(), out=[0.0]), "'out'"),
    ("call stream a str", lambda k: k(**dense(), stream="s0"), "stream"),
    ("call stream a float", lambda k: k(**dense(), stream=0.5), "stream"),
    ("call max_seqlen_k a float", lambda k: k(**ragged(), max_seqlen_k=7.0), "max_seqlen_k"),
    ("backward out None",
     lambda k: k.backward(**dict(backward_args(), out=None)), "'out'"),
    ("backward lse a list", lambda k: k.backward(**dict(backward_args(), lse=[0.0])),
     "'lse'"),
    ("backward scale a str", lambda k: k.backward(**dict(backward_args(), scale="1")),
     "scale"),
    ("reference scale a list", lambda k: reference(k, **dense(), scale=[0.1]), "scale"),
    ("reference q a list", lambda k: reference(k, **dict(dense(), q=[[0.0]])), "'q'"),
    ("reference_backward deterministic an int",
     lambda k: reference_backward(k, **dense(), dout=array(2, 8, 4, D), deterministic=1),
     "deterministic"),
    ("reference_backward dout a str",
     lambda k: reference_backward(k, **dense(), dout="dout"), "'dout'"),
    ("reference_decode num_splits a str",
     lambda k: reference_decode(k, decode()["q"], decode()["k"], decode()["v"],
                                cache_seqlens=decode()["cache_seqlens"], num_splits="2"),
     "num_splits"),
    ("program key an int", lambda k: k.program[1], "name"),
]


@pytest.mark.parametrize("call, argument", [c[1:] for c in WRONG_TYPES],
                         ids=[c[0] for c in WRONG_TYPES])
def test_an_argument_of_the_wrong_type_is_a_type_error_naming_it(kernel, call, argument):
    with pytest.raises(TypeError) as info:
        call(kernel)
    assert argument in str(info.value)


def test_a_build_without_a_group_takes_the_declared_one(program, kernel):
    assert program["grouped"].config(arch="sm_80").gqa_group == 4
    assert kernel.config(arch="sm_80").gqa_group == 1
