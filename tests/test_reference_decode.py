"""The decode reference: a paged or contiguous KV cache against the dense reference
on the gathered keys, and the decode call's argument checks."""
from __future__ import annotations

import numpy as np
import pytest

import mhadsl
from mhadsl import reference, reference_decode

BOTTOM_RIGHT = ("mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = "
                "kv_idx <= q_idx + seqlen_k - seqlen_q")
SOURCE = f"""
attention plain {{ head_dim = 64 }}
attention decode {{ head_dim = 64  {BOTTOM_RIGHT} }}
attention window {{
    head_dim = 64
    mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) =
        kv_idx <= q_idx + seqlen_k - seqlen_q && q_idx + seqlen_k - seqlen_q - kv_idx < 8
}}
attention alibi {{
    head_dim = 64
    {BOTTOM_RIGHT}
    score(s, b, h, q_idx, kv_idx) = s - 0.25 * f32(h + 1) * f32(abs(q_idx - kv_idx))
}}
attention softcap {{
    head_dim = 64
    {BOTTOM_RIGHT}
    score(s, b, h, q_idx, kv_idx) = 30.0 * tanh(s / 30.0)
}}
attention gqa {{ head_dim = 64  gqa = 2  {BOTTOM_RIGHT} }}
attention mqa {{ head_dim = 64  kv_heads = 1  {BOTTOM_RIGHT} }}
"""
D = 64
CAPACITY = 128  # positions per sequence; a multiple of the page sizes


@pytest.fixture(scope="module")
def program():
    return mhadsl.compile(SOURCE)


def contiguous_cache(rng, batch, hkv):
    """k_cache, v_cache (B, CAPACITY, Hkv, D): random everywhere, so positions beyond
    cache_seqlens hold values a wrong reference would read."""
    return (rng.standard_normal((batch, CAPACITY, hkv, D)),
            rng.standard_normal((batch, CAPACITY, hkv, D)))


def paged(rng, cache, cache_seqlens, page_size):
    """The same logical cache on shuffled pages (with spare ones), and its page table; the
    entries past a sequence's last page are -1, never to be read."""
    batch, capacity = cache.shape[:2]
    max_pages = capacity // page_size
    num_pages = batch * max_pages + 3
    page_table = rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages)
    pages = rng.standard_normal((num_pages, page_size) + cache.shape[2:])
    pages[page_table] = cache.reshape(batch, max_pages, page_size, *cache.shape[2:])
    pages_used = -(-np.asarray(cache_seqlens) // page_size)
    page_table[np.arange(max_pages) >= pages_used[:, None]] = -1
    return pages, page_table.astype(np.int32)


def queries(rng, rows, hq):
    return rng.standard_normal(rows + (hq, D))


def per_sequence_reference(kernel, q_seqs, k_cache, v_cache, cache_seqlens, **call):
    """`reference` on each sequence alone: its Sq_b query rows against its first
    cache_seqlens[b] keys, dense (Sq != Sk)."""
    return [reference(kernel, q[None], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n], **call)
            for b, (q, n) in enumerate(zip(q_seqs, cache_seqlens))]


@pytest.mark.parametrize("page_size", [16, 32])
def test_paged_and_contiguous_caches_agree(program, page_size):
    rng = np.random.default_rng(page_size)
    cache_seqlens = np.array([0, 1, 17, 100], np.int32)
    cu_q = np.array([0, 0, 1, 6, 22], np.int32)  # 0, 1, 5 and 16 query rows
    q = queries(rng, (22,), 4)
    k, v = contiguous_cache(rng, 4, 2)
    k_pages, page_table = paged(np.random.default_rng(1), k, cache_seqlens, page_size)
    v_pages, _ = paged(np.random.default_rng(1), v, cache_seqlens, page_size)
    contiguous = reference_decode(program["gqa"], q, k, v, cache_seqlens=cache_seqlens,
                                  cu_seqlens_q=cu_q, return_lse=True)
    from_pages = reference_decode(program["gqa"], q, k_pages, v_pages,
                                  cache_seqlens=cache_seqlens, page_table=page_table,
                                  cu_seqlens_q=cu_q, return_lse=True)
    for got, want in zip(from_pages, contiguous):
        assert np.array_equal(got, want)
    assert contiguous[0].shape == q.shape and contiguous[1].shape == (4, 22)
    assert np.all(np.isfinite(contiguous[1]))  # every query row sees a key


CASES = {
    # name: (kernel, query heads, KV heads)
    "bottom_right": ("decode", 2, 2),
    "window": ("window", 2, 2),
    "alibi": ("alibi", 2, 2),
    "softcap": ("softcap", 2, 2),
    "gqa": ("gqa", 4, 2),
    "mqa": ("mqa", 3, 1),
}


@pytest.mark.parametrize("sq", [1, 16])
@pytest.mark.parametrize("name", CASES)
def test_paged_decode_matches_the_dense_reference(program, name, sq):
    kernel_name, hq, hkv = CASES[name]
    kernel = program[kernel_name]
    rng = np.random.default_rng(sq)
    cache_seqlens = np.array([16, 37, 100], np.int32)
    q = queries(rng, (3, sq), hq)
    k, v = contiguous_cache(rng, 3, hkv)
    k_pages, page_table = paged(np.random.default_rng(1), k, cache_seqlens, 16)
    v_pages, _ = paged(np.random.default_rng(1), v, cache_seqlens, 16)
    out, lse = reference_decode(kernel, q, k_pages, v_pages, cache_seqlens=cache_seqlens,
                                page_table=page_table, return_lse=True)
    assert out.shape == q.shape and lse.shape == (3, hq, sq)
    for b, (want_out, want_lse) in enumerate(per_sequence_reference(
            kernel, q, k, v, cache_seqlens, return_lse=True)):
        np.testing.assert_allclose(out[b], want_out[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[b], want_lse[0], rtol=1e-12)


def test_the_query_rows_are_the_last_cache_positions(program):
    """Bottom-right causal by hand: row i of Sq = 2 over 5 cached keys sees positions 0..3+i."""
    rng = np.random.default_rng(3)
    q = queries(rng, (1, 2), 1)
    k, v = rng.standard_normal((2, 1, 5, 1, D))
    out = reference_decode(program["decode"], q, k, v, cache_seqlens=np.array([5], np.int32))
    for i in range(2):
        logits = k[0, :4 + i, 0] @ q[0, i, 0] / np.sqrt(D)
        p = np.exp(logits - logits.max())
        np.testing.assert_allclose(out[0, i, 0], p @ v[0, :4 + i, 0] / p.sum(), rtol=1e-12)


def test_a_kernel_without_a_mask_sees_every_cached_key(program):
    rng = np.random.default_rng(4)
    q = queries(rng, (1, 3), 2)
    k, v = contiguous_cache(rng, 1, 2)
    out = reference_decode(program["plain"], q, k, v, cache_seqlens=np.array([9], np.int32))
    np.testing.assert_allclose(out, reference(program["plain"], q, k[:, :9], v[:, :9]),
                               rtol=1e-12)


def test_chunked_prefill_with_ragged_queries(program):
    rng = np.random.default_rng(5)
    cache_seqlens = np.array([5, 0, 30, 1], np.int32)
    cu_q = np.array([0, 3, 3, 23, 24], np.int32)  # 3, 0, 20 (more than 16) and 1 rows
    q = queries(rng, (24,), 4)
    k, v = contiguous_cache(rng, 4, 2)
    k_pages, page_table = paged(np.random.default_rng(2), k, cache_seqlens, 32)
    v_pages, _ = paged(np.random.default_rng(2), v, cache_seqlens, 32)
    out, lse = reference_decode(program["softcap"], q, k_pages, v_pages,
                                cache_seqlens=cache_seqlens, page_table=page_table,
                                cu_seqlens_q=cu_q, max_seqlen_q=20, return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, 24)
    q_seqs = [q[a:b] for a, b in zip(cu_q[:-1], cu_q[1:])]
    wants = per_sequence_reference(program["softcap"], q_seqs, k, v, cache_seqlens,
                                   return_lse=True)
    for a, b, (want_out, want_lse) in zip(cu_q[:-1], cu_q[1:], wants):
        np.testing.assert_allclose(out[a:b], want_out[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[:, a:b], want_lse[0], rtol=1e-12)


def test_lse_and_scale_follow_the_declaration_and_the_arguments(program):
    rng = np.random.default_rng(6)
    q = queries(rng, (2, 1), 2)
    k, v = contiguous_cache(rng, 2, 2)
    cache_seqlens = np.array([3, 4], np.int32)
    out = reference_decode(program["decode"], q, k, v, cache_seqlens=cache_seqlens)
    out_again, lse = reference_decode(program["decode"], q, k, v, cache_seqlens=cache_seqlens,
                                      return_lse=True)
    assert isinstance(out, np.ndarray) and np.array_equal(out, out_again)
    assert out.dtype == lse.dtype == np.float64 and lse.shape == (2, 2, 1)
    scaled = reference_decode(program["decode"], q, k, v, cache_seqlens=cache_seqlens,
                              scale=0.5)
    for b, want in enumerate(per_sequence_reference(program["decode"], q, k, v, cache_seqlens,
                                                    scale=0.5)):
        np.testing.assert_allclose(scaled[b], want[0], rtol=1e-12)
    assert not np.allclose(scaled, out)


def good_call(rng):
    """A valid paged call (2 sequences, Sq = 2, page size 16), as keyword arguments."""
    k = rng.standard_normal((5, 16, 2, D))
    return dict(q=queries(rng, (2, 2), 4), k_cache=k, v_cache=k.copy(),
                cache_seqlens=np.array([20, 2], np.int32),
                page_table=np.array([[3, 0], [4, -1]], np.int32))


def ragged_call(rng):
    call = good_call(rng)
    return dict(call, q=queries(rng, (5,), 4), cu_seqlens_q=np.array([0, 3, 5], np.int32))


ERRORS = {
    # name: (change to the good call, error, words of its message)
    "cache_shapes_differ": (lambda c: dict(c, v_cache=c["v_cache"][:4]), ValueError,
                            "k_cache and v_cache must have the same shape"),
    "cache_rank": (lambda c: dict(c, k_cache=c["k_cache"][0], v_cache=c["v_cache"][0]),
                   ValueError, "k_cache has shape .*expected rank 4"),
    "q_rank": (lambda c: dict(c, q=c["q"][0]), ValueError, "q has shape .*expected rank 4"),
    "head_dim": (lambda c: dict(c, q=c["q"][..., :32]), ValueError,
                 "q has head dim 32, but kernel 'gqa' is declared head_dim = 64"),
    "cache_head_dim": (lambda c: dict(c, k_cache=c["k_cache"][..., :32],
                                      v_cache=c["v_cache"][..., :32]), ValueError,
                       "k_cache has head dim 32"),
    "heads_not_a_multiple": (lambda c: dict(c, q=c["q"][:, :, :3]), ValueError,
                             r"query heads \(3\) must be a multiple of key/value heads \(2\)"),
    "heads_against_gqa": (lambda c: dict(c, q=np.concatenate([c["q"]] * 2, axis=2)), ValueError,
                          "kernel 'gqa' is declared gqa = 2, but q has 8 heads"),
    "page_size_not_a_power_of_two": (lambda c: dict(c, k_cache=c["k_cache"][:, :12],
                                                    v_cache=c["v_cache"][:, :12]),
                                     ValueError, "page size .* power of two from 16 to 512, "
                                                 "got 12"),
    "page_size_too_small": (lambda c: dict(c, k_cache=c["k_cache"][:, :8],
                                           v_cache=c["v_cache"][:, :8]), ValueError, "got 8"),
    "page_table_dtype": (lambda c: dict(c, page_table=c["page_table"].astype(np.int64)),
                         TypeError, "page_table must be int32, got int64"),
    "page_table_rank": (lambda c: dict(c, page_table=c["page_table"][0]), ValueError,
                        "page_table must be 2-D"),
    "page_table_rows": (lambda c: dict(c, page_table=c["page_table"][:1]), ValueError,
                        "page_table has 1 rows for 2 sequences"),
    "page_past_the_cache": (lambda c: dict(c, page_table=np.array([[3, 5], [4, -1]], np.int32)),
                            ValueError, r"page_table\[0, 1\] = 5 is not a page of the cache "
                                        r"\(0 to 4\)"),
    "negative_page": (lambda c: dict(c, page_table=np.array([[3, 0], [-1, -1]], np.int32)),
                      ValueError, r"page_table\[1, 0\] = -1"),
    "cache_seqlens_dtype": (lambda c: dict(c, cache_seqlens=c["cache_seqlens"].astype(float)),
                            TypeError, "cache_seqlens must be int32, got float64"),
    "cache_seqlens_rank": (lambda c: dict(c, cache_seqlens=c["cache_seqlens"][None]),
                           ValueError, "cache_seqlens must be 1-D"),
    "cache_seqlens_count": (lambda c: dict(c, cache_seqlens=c["cache_seqlens"][:1]),
                            ValueError, "cache_seqlens has 1 entries for 2 sequences"),
    "cache_seqlens_negative": (lambda c: dict(c, cache_seqlens=np.array([20, -1], np.int32)),
                               ValueError, "cache_seqlens must not be negative"),
    "beyond_the_pages": (lambda c: dict(c, cache_seqlens=np.array([33, 2], np.int32)),
                         ValueError, "go beyond the cache's 32 positions per sequence"),
    "beyond_the_contiguous_cache": (
        lambda c: dict(c, page_table=None, k_cache=c["k_cache"][:2], v_cache=c["v_cache"][:2],
                       cache_seqlens=np.array([17, 2], np.int32)),
        ValueError, "go beyond the cache's 16 positions"),
    "contiguous_batch": (lambda c: dict(c, page_table=None), ValueError,
                         "a contiguous k_cache/v_cache has batch 5 but there are 2 sequences"),
    "no_query_rows": (lambda c: dict(c, q=c["q"][:, :0]), ValueError,
                      "1 to 16 query rows per sequence, got 0"),
    "too_many_query_rows": (lambda c: dict(c, q=np.concatenate([c["q"]] * 9, axis=1),
                                           cache_seqlens=np.array([20, 20], np.int32)),
                            ValueError, "1 to 16 query rows per sequence, got 18"),
    "more_query_rows_than_keys": (lambda c: dict(c, cache_seqlens=np.array([20, 1], np.int32)),
                                  ValueError, "sequence 1 has 2 query rows but 1 cached keys"),
}


@pytest.mark.parametrize("name", ERRORS)
def test_argument_errors(program, name):
    change, error, message = ERRORS[name]
    call = change(good_call(np.random.default_rng(7)))
    reference_decode(program["gqa"], **good_call(np.random.default_rng(7)))  # the good one runs
    with pytest.raises(error, match=message):
        reference_decode(program["gqa"], **call)


RAGGED_ERRORS = {
    "cu_seqlens_q_dtype": (lambda c: dict(c, cu_seqlens_q=c["cu_seqlens_q"].astype(np.int64)),
                           TypeError, "cu_seqlens_q must be int32, got int64"),
    "cu_seqlens_q_empty": (lambda c: dict(c, cu_seqlens_q=np.zeros(0, np.int32)), ValueError,
                           "cu_seqlens_q must have batch \\+ 1 entries, got none"),
    "cu_seqlens_q_decreasing": (lambda c: dict(c, cu_seqlens_q=np.array([0, 3, 2], np.int32)),
                                ValueError, "cu_seqlens_q must be non-decreasing"),
    "cu_seqlens_q_past_q": (lambda c: dict(c, cu_seqlens_q=np.array([0, 3, 6], np.int32)),
                            ValueError, "cu_seqlens_q ends at 6, beyond the 5 rows of q"),
    "ragged_q_rank": (lambda c: dict(c, q=c["q"][None]), ValueError,
                      "q has shape .*expected rank 3"),
    "chunk_longer_than_its_cache": (lambda c: dict(c, cu_seqlens_q=np.array([0, 2, 5], np.int32)),
                                    ValueError, "sequence 1 has 3 query rows but 2 cached keys"),
}


@pytest.mark.parametrize("name", RAGGED_ERRORS)
def test_ragged_argument_errors(program, name):
    change, error, message = RAGGED_ERRORS[name]
    reference_decode(program["gqa"], **ragged_call(np.random.default_rng(8)))
    with pytest.raises(error, match=message):
        reference_decode(program["gqa"], **change(ragged_call(np.random.default_rng(8))))


def test_unread_index_values_are_left_unchecked(program):
    """The decode kernels' call reads device-side index values only under MHADSL_DEBUG=1:
    without them the shapes and dtypes are still checked, the values are not."""
    from mhadsl.host.paged import check_decode_call
    call = dict(good_call(np.random.default_rng(9)), cache_seqlens=np.array([99, -1], np.int32),
                page_table=np.full((2, 2), 7, np.int32))
    checked = check_decode_call(program["gqa"].options, **call, read=lambda t: None)
    assert (checked.batch, checked.page_size, checked.cache_seqlens) == (2, 16, None)
    with pytest.raises(TypeError, match="page_table must be int32"):
        check_decode_call(program["gqa"].options, **dict(call, page_table=np.zeros((2, 2))),
                          read=lambda t: None)
    with pytest.raises(ValueError, match="cache_seqlens must not be negative"):
        check_decode_call(program["gqa"].options, **call)
