"""A decode call that appends the step's rows (`k_new`/`v_new`): its checks, the float64
reference against a cache written by hand, and the build's two kernels (the append, then
decode) with their parameters, assembled without spills."""
from __future__ import annotations

import re

import numpy as np
import pytest

import mhadsl
from mhadsl.codegen.assemble import find_ptxas
from mhadsl.codegen.backends import CacheLayout, decode

CAUSAL = "mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = kv_idx <= q_idx + seqlen_k - seqlen_q"
PROGRAM = mhadsl.compile(f"attention step {{ dtype = bf16  head_dim = 128  {CAUSAL} }}",
                         name="append")
KERN = PROGRAM["step"]


def _cache(batch=2, capacity=64, page_size=None, hkv=2, seed=0):
    rng = np.random.default_rng(seed)
    if page_size is None:
        k = rng.standard_normal((batch, capacity, hkv, 128))
        return k, rng.standard_normal(k.shape), None
    pages = -(-capacity // page_size)
    k = rng.standard_normal((batch * pages + 1, page_size, hkv, 128))
    table = rng.permutation(batch * pages).astype(np.int32).reshape(batch, pages)
    return k, rng.standard_normal(k.shape), table


def _new_rows(shape, seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape), rng.standard_normal(shape)


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("ragged", [False, True])
def test_the_reference_appends_to_a_copy_and_attends_over_the_new_rows(page_size, ragged):
    k, v, table = _cache(page_size=page_size)
    lengths = np.array([5, 40], np.int32)
    rng = np.random.default_rng(2)
    if ragged:
        rows = np.array([3, 1])
        cu = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
        q = rng.standard_normal((4, 8, 128))
        k_new, v_new = _new_rows((4, 2, 128))
        extra = dict(cu_seqlens_q=cu)
    else:
        rows = np.array([2, 2])
        q = rng.standard_normal((2, 2, 8, 128))
        k_new, v_new = _new_rows((2, 2, 2, 128))
        extra = {}
    k_before = k.copy()
    got = mhadsl.reference_decode(KERN, q, k, v, cache_seqlens=lengths, page_table=table,
                                  k_new=k_new, v_new=v_new, **extra)
    assert np.array_equal(k, k_before)  # the caller's cache is left as it was
    # by hand: the rows written at positions lengths[b]..., then the plain call over them
    k2, v2 = k.copy(), v.copy()
    flat_k, flat_v = k_new.reshape(-1, 2, 128), v_new.reshape(-1, 2, 128)
    row = 0
    for b in range(2):
        for i in range(rows[b]):
            pos = lengths[b] + i
            at = (b, pos) if table is None else (table[b, pos // 16], pos % 16)
            k2[at], v2[at] = flat_k[row], flat_v[row]
            row += 1
    want = mhadsl.reference_decode(KERN, q, k2, v2, cache_seqlens=lengths + rows.astype(np.int32),
                                   page_table=table, **extra)
    np.testing.assert_allclose(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("change, error, match", [
    (dict(v_new=None), TypeError, "k_new and v_new together"),
    (dict(k_new=np.zeros((2, 1, 8, 128), np.float32)), ValueError,
     "expected \\(2, 1, 2, 128\\)"),
    (dict(k_new=np.zeros((2, 1, 2, 128), np.float16)), TypeError, "q's is float32"),
    (dict(cache_seqlens=np.array([3, 64], np.int32)), ValueError,
     "sequence 1's 1 new rows after its 64 cached keys go beyond the cache's 64 positions"),
])
def test_bad_appends_are_refused_before_anything_runs(change, error, match):
    k, v, _ = (x.astype(np.float32) if x is not None else None for x in _cache())
    new = np.zeros((2, 1, 2, 128), np.float32)
    args = dict(q=np.zeros((2, 1, 8, 128), np.float32), k=k, v=v,
                cache_seqlens=np.array([3, 4], np.int32), k_new=new, v_new=new)
    args.update(change)
    for call in (KERN, lambda q, k, v, **kw: mhadsl.reference_decode(KERN, q, k, v, **kw)):
        with pytest.raises(error, match=match):
            call(**args)


def test_a_new_row_on_a_page_the_table_does_not_give_is_refused():
    k, v, table = _cache(capacity=32, page_size=16)
    table[0, 1] = 99  # positions 16..31 of sequence 0: only the appended row reaches them
    args = dict(cache_seqlens=np.array([16, 4], np.int32), page_table=table)
    mhadsl.reference_decode(KERN, np.zeros((2, 1, 8, 128)), k, v, **args)  # (unused: fine)
    with pytest.raises(ValueError, match="not a page of the cache"):
        mhadsl.reference_decode(KERN, np.zeros((2, 1, 8, 128)), k, v, **args,
                                k_new=np.zeros((2, 1, 2, 128)), v_new=np.zeros((2, 1, 2, 128)))


def test_an_operand_may_not_be_named_like_the_new_rows():
    with pytest.raises(mhadsl.MhaError, match="argument of every kernel call"):
        mhadsl.compile("attention a(k_new: i32) { dtype = bf16 head_dim = 64 }")


def _params(ptx: str, kernel: str) -> list[str]:
    entry = ptx[ptx.index(f".entry {kernel}("):]
    return re.findall(r"\.param \.(\w+)", entry[:entry.index(")")])


@pytest.mark.skipif(find_ptxas() is None, reason="needs ptxas")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("cache", [CacheLayout(1, 0, appends=True),
                                   CacheLayout(0, 64, appends=True),
                                   CacheLayout(16, 16, appends=True)])
def test_an_appending_build_runs_the_append_then_decode(arch, cache):
    build = KERN.build(arch, gqa_group=4, cache=cache)
    append, step = decode.BACKEND.kernels(build.config)
    assert (append.name, step.name) == (decode.APPEND_NAME, decode.KERNEL_NAME)
    assert append.abi is step.abi is decode.APPEND_ABI
    for kernel in (append, step):
        assert len(_params(build.ptx, kernel.name)) == len(decode.APPEND_ABI.params)
        assert build.assembled.kernels[kernel.name].spills == 0
    grid = append.grid
    from mhadsl.abi import CallSizes
    sizes = CallSizes(3, 8, 2, cache.query_rows, 64, 5, 64, 15 if cache.query_rows == 0 else 3,
                      cache.query_rows == 0, 0.1, query_rows=cache.query_rows)
    assert grid(sizes) == (3, cache.query_rows or 5, 1)
    plain = KERN.build(arch, gqa_group=4, cache=CacheLayout(cache.query_rows, cache.page_size))
    assert [k.name for k in decode.BACKEND.kernels(plain.config)] == [decode.KERNEL_NAME]
    assert decode.APPEND_NAME not in plain.ptx


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("cache", [CacheLayout(1, 64, appends=True),
                                   CacheLayout(1, 0, appends=True),
                                   CacheLayout(0, 16, appends=True),
                                   CacheLayout(1, 64, appends=True, fp8=True)])
def test_the_append_reads_both_pieces_before_it_stores(arch, cache):
    """Each thread of `mha_decode_append` reads its K and its V piece before the first
    store, so the reads overlap the page-table entry's and only the stores wait for it."""
    ptx = KERN.build(arch, gqa_group=4, cache=cache).ptx
    body = ptx[ptx.index(f".entry {decode.APPEND_NAME}("):]
    body = body[:body.index("\n}\n")]
    memory = re.findall(r"\b(ld\.global\S*v4\S*|st\.global\S*)", body)
    assert [op.split(".")[0] for op in memory] == ["ld", "ld", "st", "st"], memory
