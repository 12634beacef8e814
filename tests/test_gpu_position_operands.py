"""Tensor operands along the call's query rows and keys on the GPU, against the float64
references: packed documents in ragged calls of both forward designs, a per-row score
bias and the backward of both designs, and decode reading a bias by cache position."""
import numpy as np
import pytest

import mhadsl

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from test_gpu_attention import assert_matches, backend, dense, ragged  # noqa: E402,F401
from test_gpu_backward import assert_close  # noqa: E402
from test_gpu_decode import cache, check, queries  # noqa: E402
from test_position_operands import SOURCE  # noqa: E402


def kernel(name, design=None):
    kern = mhadsl.compile(SOURCE, name="gpu_position_operands")[name]
    kern.backend = design
    return kern


def documents(lengths, seed=0):
    """Each sequence's rows split into a few documents, ids rising (int32, on the GPU)."""
    rng = np.random.default_rng(seed)
    return torch.tensor(np.concatenate([np.sort(rng.integers(0, 4, n)) for n in lengths]),
                        dtype=torch.int32, device="cuda")


def test_packed_documents_in_a_ragged_call(backend):
    kern = kernel("packed", backend)
    lens = [1, 300, 129, 700, 70]
    docs = documents(lens)
    assert_matches(kern, ragged(kern, lens, lens, 8, 2, qdoc=docs, kdoc=docs), lse=True)
    assert_matches(kern, ragged(kern, lens, lens, 8, 2, one_offsets=True, qdoc=docs,
                                kdoc=docs))
    per = kernel("per_batch", backend)  # the same documents, dense with a batch axis
    doc = torch.stack([documents([600], 1), documents([600], 2)])
    assert_matches(per, dense(per, 2, 600, 600, 8, 2, qdoc=doc, kdoc=doc), lse=True)


def test_a_row_bias_and_the_backward():
    kern = kernel("row_bias")
    lens = [64, 257, 5]
    bias = torch.randn(8, sum(lens), device="cuda")
    args = ragged(kern, lens, lens, 8, 2, bias=bias)
    assert_matches(kern, args)
    for design in ("backward", "backward_sm90"):
        for deterministic in (False, True):
            if design == "backward_sm90" and deterministic:
                continue
            kern.backend = design
            out, lse = kern(**args, return_lse=True)
            dout = torch.randn_like(out)
            grads = kern.backward(args["q"], args["k"], args["v"], out, lse, dout,
                                  cu_seqlens_q=args["cu_seqlens_q"],
                                  cu_seqlens_k=args["cu_seqlens_k"], max_seqlen_q=257,
                                  max_seqlen_k=257, bias=bias, deterministic=deterministic)
            ref = mhadsl.reference_backward(kern, args["q"], args["k"], args["v"], dout,
                                            cu_seqlens_q=args["cu_seqlens_q"],
                                            cu_seqlens_k=args["cu_seqlens_k"],
                                            max_seqlen_q=257, max_seqlen_k=257, bias=bias)
            for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
                assert_close(name, got, want, dout)


@pytest.mark.parametrize("page_size", [None, 64])
def test_decode_reads_a_bias_by_cache_position(page_size):
    kern = kernel("key_bias")
    k, v, seqlens, pages = cache([4, 700, 4000], 2, 64, page_size=page_size)
    capacity = k.shape[1] if page_size is None else pages.shape[1] * page_size
    bias = torch.randn(3, capacity, device="cuda")
    check(kern, queries(3, 2, 8, 64), k, v, seqlens, pages, bias=bias)
