"""Tensor operands along the call's query rows and keys (`queries`, `keys` axes): declared,
checked against each call, and read by position in the sequence, in the float64 references
(dense, ragged and decode) and in every design's build (no GPU needed)."""
import numpy as np
import pytest

import mhadsl
from mhadsl.codegen.assemble import find_ptxas
from mhadsl.codegen.backends import CacheLayout

SOURCE = """
import "std/schedulers.mha"
attention packed(qdoc: i32[queries], kdoc: i32[keys]) {
    dtype = bf16  head_dim = 64
    mask(b, h, q_idx, kv_idx) = qdoc[q_idx] == kdoc[kv_idx] && kv_idx <= q_idx
}
attention per_batch(qdoc: i32[batch, queries], kdoc: i32[batch, keys]) {
    dtype = bf16  head_dim = 64
    mask(b, h, q_idx, kv_idx) = qdoc[b][q_idx] == kdoc[b][kv_idx] && kv_idx <= q_idx
}
attention row_bias(bias: f32[heads, queries]) {
    dtype = bf16  head_dim = 64
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx
    score(s, b, h, q_idx, kv_idx) = s + bias[h][q_idx]
}
attention key_bias(bias: f32[batch, keys]) {
    dtype = bf16  head_dim = 64
    mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = kv_idx <= q_idx + seqlen_k - seqlen_q
    score(s, b, h, q_idx, kv_idx) = s + bias[b][kv_idx]
}
"""
PROGRAM = mhadsl.compile(SOURCE, name="position_operands")
RNG = np.random.default_rng(0)


def rand(*shape):
    return RNG.standard_normal(shape)


@pytest.mark.parametrize("declared, message", [
    ("t: i32[queries, queries]", "tensor operand 't' has two queries axes"),
    ("t: i32[keys, _, keys]", "tensor operand 't' has two keys axes"),
    ("t: i32[rows]", "an axis is batch (one per sequence), heads (one per query head), "
                     "queries or keys"),
])
def test_position_axes_are_declared_once_each(declared, message):
    source = f'attention a({declared}) {{ dtype = bf16  head_dim = 64 }}'
    with pytest.raises(mhadsl.MhaError, match=message.replace("(", r"\(").replace(")", r"\)")):
        mhadsl.compile(source, name="bad.mha")


def test_a_ragged_call_reads_each_sequences_own_rows():
    """Two packed documents per sequence, in a ragged call of three sequences: each row
    attends within its own document, causally; the same as each sequence alone, dense."""
    lens = [7, 1, 12]
    cu = np.concatenate(([0], np.cumsum(lens))).astype(np.int32)
    total = int(cu[-1])
    q, k, v = rand(total, 2, 64), rand(total, 2, 64), rand(total, 2, 64)
    docs = np.concatenate([np.sort(RNG.integers(0, 2, n)) for n in lens]).astype(np.int32)
    got = mhadsl.reference(PROGRAM["packed"], q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                           max_seqlen_q=12, max_seqlen_k=12, qdoc=docs, kdoc=docs)
    for b, n in enumerate(lens):
        rows = slice(cu[b], cu[b + 1])
        alone = mhadsl.reference(PROGRAM["packed"], q[None, rows], k[None, rows],
                                 v[None, rows], qdoc=docs[rows], kdoc=docs[rows])[0]
        np.testing.assert_allclose(got[rows], alone, atol=1e-12)
        # and as one sequence of a dense batch with a batch axis
        per = mhadsl.reference(PROGRAM["per_batch"], q[None, rows], k[None, rows],
                               v[None, rows], qdoc=docs[None, rows], kdoc=docs[None, rows])[0]
        np.testing.assert_allclose(per, alone, atol=1e-12)
    # the documents matter: one document for all rows is plain causal attention
    causal = mhadsl.reference(PROGRAM["packed"], q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                              max_seqlen_q=12, max_seqlen_k=12, qdoc=0 * docs, kdoc=0 * docs)
    assert not np.allclose(causal, got)


def test_a_score_reads_query_rows_and_the_backward_follows():
    lens = [5, 9]
    cu = np.concatenate(([0], np.cumsum(lens))).astype(np.int32)
    q, k, v, dout = (rand(14, 4, 64) for _ in range(4))
    bias = rand(4, 14).astype(np.float32)
    args = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=9, max_seqlen_k=9, bias=bias)
    got = mhadsl.reference(PROGRAM["row_bias"], q, k, v, **args)
    # a bias per query row shifts all of that row's scores alike: softmax ignores it
    plain = mhadsl.reference(PROGRAM["row_bias"], q, k, v, **{**args, "bias": 0 * bias})
    np.testing.assert_allclose(got, plain, atol=1e-12)
    grads = mhadsl.reference_backward(PROGRAM["row_bias"], q, k, v, dout, **args)
    assert all(np.isfinite(g).all() for g in grads)


def test_decode_reads_keys_by_cache_position():
    """A `keys` axis of a decode call holds the cache's positions (per sequence, with its
    batch axis); a bias of -inf-like size on one position removes that key."""
    batch, capacity, page = 2, 32, 16
    q = rand(batch, 1, 2, 64)
    k, v = rand(batch * 2, page, 1, 64), rand(batch * 2, page, 1, 64)
    table = np.arange(batch * 2, dtype=np.int32).reshape(batch, 2)
    lens = np.array([20, 9], np.int32)
    bias = np.zeros((batch, capacity), np.float32)
    kern = PROGRAM["key_bias"]
    base = mhadsl.reference_decode(kern, q, k, v, cache_seqlens=lens, page_table=table,
                                   bias=bias)
    bias[1, 3] = -1e30
    got = mhadsl.reference_decode(kern, q, k, v, cache_seqlens=lens, page_table=table,
                                  bias=bias)
    np.testing.assert_allclose(got[0], base[0], atol=1e-12)
    keys = np.concatenate([k[table[1, 0]], k[table[1, 1]]])[:9, 0]
    vals = np.concatenate([v[table[1, 0]], v[table[1, 1]]])[:9, 0]
    for h in range(2):
        s = keys @ q[1, 0, h] / 8.0
        s[3] = -np.inf
        p = np.exp(s - s.max())
        np.testing.assert_allclose(got[1, 0, h], p @ vals / p.sum(), atol=1e-12)


@pytest.mark.parametrize("kernel, args, error", [
    ("packed", dict(qdoc=np.zeros(13, np.int32), kdoc=np.zeros(14, np.int32)),
     "axis 0 \\(queries\\) has 13 entries, but the call has 14 query rows"),
    ("per_batch", dict(qdoc=np.zeros((2, 14), np.int32), kdoc=np.zeros((2, 14), np.int32)),
     "ragged, so its queries axis holds every sequence's query rows"),
    ("packed", dict(qdoc=np.zeros(14, np.int32), kdoc=np.zeros(15, np.int32)),
     "axis 0 \\(keys\\) has 15 entries, but the call has 14 keys"),
])
def test_a_call_checks_the_position_axes(kernel, args, error):
    cu = np.array([0, 5, 14], np.int32)
    q = k = v = np.zeros((14, 2, 64))
    with pytest.raises(ValueError, match=error):
        mhadsl.reference(PROGRAM[kernel], q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                         max_seqlen_q=9, max_seqlen_k=9, **args)
    dense = np.zeros((2, 9, 2, 64))
    with pytest.raises(ValueError, match="\\(queries\\) has 3 entries, but the call has 9"):
        mhadsl.reference(PROGRAM["packed"], dense, dense, dense,
                         qdoc=np.zeros(3, np.int32), kdoc=np.zeros(9, np.int32))


needs_ptxas = pytest.mark.skipif(find_ptxas() is None, reason="needs ptxas")


@needs_ptxas
@pytest.mark.parametrize("name", ["packed", "row_bias"])
@pytest.mark.parametrize("arch, backend, layout", [
    ("sm_90a", "sm90", dict(ragged=True)),
    ("sm_80", "sm80", dict(ragged=True)),
    ("sm_90a", "sm80", dict()),
    ("sm_90a", "decode", dict(gqa_group=4, cache=CacheLayout(0, 16, 64, balanced=True))),
    ("sm_80", "decode", dict(gqa_group=4, cache=CacheLayout(1, 0, 64))),
    ("sm_90a", "backward_sm90", dict(ragged=True, backward=True)),
    ("sm_80", "backward", dict(ragged=True, backward=True)),
    ("sm_80", "backward", dict(ragged=True, backward=True, deterministic=True)),
])
def test_every_design_reads_position_operands_without_spills(name, arch, backend, layout):
    """Each design hands its rules the sequence's first query row and key: the build reads
    the operand at them (a load past a base it adds), and assembles without spills."""
    kern = mhadsl.compile(SOURCE, name="position_operands_build")[name]
    build = kern.build(arch, backend=backend, **layout)
    assert build.backend == backend
    assert all(k.spill_stores == 0 and k.spill_loads == 0
               for k in build.assembled.kernels.values()), build.assembled.kernels


@pytest.mark.parametrize("backend, layout", [
    ("sm90", dict(ragged=True)), ("sm80", dict(ragged=True)),
    ("decode", dict(gqa_group=4, cache=CacheLayout(0, 16, 64))),
    ("backward", dict(ragged=True, backward=True))])
def test_a_position_axis_is_read_at_the_sequences_rows(backend, layout):
    """Every design takes the position path: the same rule over free axes (`_`: index as
    given) builds other code (what the path reads: the host test above)."""
    free = SOURCE.replace("qdoc: i32[queries], kdoc: i32[keys]", "qdoc: i32[_], kdoc: i32[_]")
    builds = [mhadsl.compile(text, name=f"positions_ir_{n}")["packed"].build(
        "sm_90a", backend=backend, **layout).llvm for n, text in enumerate((SOURCE, free))]
    assert builds[0] != builds[1]


def test_the_flop_count_of_a_ragged_call_reads_each_sequences_rows():
    """`mhadsl run`'s FLOPs count the pairs the mask keeps, each sequence reading its own
    rows of a ragged tensor: two documents of 3 and 2 rows, then one of 4."""
    from mhadsl.host.bench import Problem, allowed_pairs
    docs = np.array([0, 0, 0, 1, 1, 7, 7, 7, 7], np.int64)
    p = Problem(0, 0, 0, 1, 1, 64, (5, 4))
    pairs = allowed_pairs(PROGRAM["packed"], p, dict(qdoc=docs, kdoc=docs))
    assert pairs == (6 + 3) + 10  # causal within each document


def test_the_kernels_rule_reads_each_sequences_own_rows():
    """The mask hook every design calls, compiled for the host with a ragged call's
    extents (`TileRules`: first query row, query rows, first key, keys): it reads
    qdoc[first + q_idx], 0 past the sequence's rows, as the reference does."""
    import ctypes

    from llvmlite import ir

    from mhadsl.abi import operand_params
    from mhadsl.codegen.kernel import expr_hooks
    from mhadsl.codegen.target import HOST, HostJit, new_module
    kern = PROGRAM["packed"]
    params = operand_params(kern.options.operands)
    i32 = ir.IntType(32)
    types = {"ptr": ir.PointerType(), "i32": i32}
    module = new_module("position_reads", HOST)
    fn = ir.Function(module, ir.FunctionType(i32, [i32] * 5 + [types[p.kind] for p in params]),
                     name="keeps")
    for arg, p in zip(fn.args[5:], params):
        arg.name = p.name
    b = ir.IRBuilder(fn.append_basic_block())
    seq, q, k, first, rows = fn.args[:5]  # (self-attention: keys are the rows)
    hooks = expr_hooks(kern.program.checked, kern.options.mask, None, kern.options.operands)
    keep = hooks.mask(b, seq, i32(0), q, k, rows, rows, extents=(first, rows, first, rows))
    b.ret(b.zext(keep, i32))
    jit = HostJit(module)
    run = ctypes.CFUNCTYPE(ctypes.c_int32, *[ctypes.c_int32] * 5, *(
        ctypes.c_void_p if p.kind == "ptr" else ctypes.c_int32 for p in params))(
        jit.address("keeps"))
    lens = [5, 9, 4]
    cu = np.concatenate(([0], np.cumsum(lens)))
    docs = np.array([0, 0, 1, 1, 1, 3, 3, 3, 5, 5, 5, 5, 5, 6, 2, 2, 9, 9], np.int32)
    tensor = (docs.ctypes.data, len(docs), 1)  # address, size, stride (one axis)
    checked = 0
    for b_ in range(3):
        for q_ in range(-1, lens[b_] + 1):
            for k_ in range(-1, lens[b_] + 1):
                got = run(b_, q_, k_, cu[b_], lens[b_], *tensor, *tensor)

                def doc(i):  # the reference's read: the sequence's own rows, else 0
                    return docs[cu[b_] + i] if 0 <= i < lens[b_] else 0
                assert got == int(doc(q_) == doc(k_) and k_ <= q_), (b_, q_, k_)
                checked += 1
    assert checked == sum((n + 2) ** 2 for n in lens)
