"""The float64 backward reference against central finite differences of the forward one."""
from __future__ import annotations

import numpy as np
import pytest

import mhadsl
from mhadsl.analysis.reference import attention_reference, attention_reference_backward

SOURCE = """
attention plain { head_dim = 64 }
attention causal {
    head_dim = 64
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx
}
attention bottom_right {
    head_dim = 64
    mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = kv_idx <= q_idx + seqlen_k - seqlen_q
}
attention window {
    head_dim = 64
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx && q_idx - kv_idx < 3
}
attention alibi {
    head_dim = 64
    score(s, b, h, q_idx, kv_idx) = s - 0.5 * f32(q_idx - kv_idx)
}
attention softcap {
    head_dim = 64
    score(s, b, h, q_idx, kv_idx) = 30.0 * tanh(s / 30.0)
}
attention user_score {
    head_dim = 64
    score(s, b, h, q_idx, kv_idx) = where(q_idx >= kv_idx, max(s, -0.5) + exp(0.3 * s), 2.0 * s)
}
attention undefined_where_masked {
    head_dim = 64
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx
    score(s, b, h, q_idx, kv_idx) = s * sqrt(f32(q_idx - kv_idx) + 1.0)
}
attention gqa_causal {
    head_dim = 64
    gqa      = 2
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx
}
attention mqa_softcap {
    head_dim = 64
    kv_heads = 1
    score(s, b, h, q_idx, kv_idx) = 30.0 * tanh(s / 30.0)
}
attention ragged_bottom_right_softcap {
    head_dim = 64
    mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = kv_idx <= q_idx + seqlen_k - seqlen_q
    score(s, b, h, q_idx, kv_idx) = 30.0 * tanh(s / 30.0)
}
"""


@pytest.fixture(scope="module")
def program():
    return mhadsl.compile(SOURCE)


def rules(kernel, scale=None, max_seqlen_q=None, max_seqlen_k=None, **offsets):
    """A kernel's rules, scale and offsets, for the references that take rules: the
    finite differences need head dims far below the declared ones, which `mhadsl.reference`
    refuses as the kernel's call does."""
    o = kernel.options
    return dict(mask_rule=o.mask, score_rule=o.score, program=kernel.program.checked,
                scale=o.softmax_scale() if scale is None else scale, **offsets)


def numeric_gradients(kernel, q, k, v, dout, eps=1e-5, **call):
    """d sum(O ∘ dO) / d q, k, v, entry by entry, by central differences of the forward."""
    def loss():
        return np.sum(attention_reference(q, k, v, **rules(kernel, **call)) * dout)

    grads = []
    for x in (q, k, v):
        grad = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            saved = x[i]
            x[i] = saved + eps
            up = loss()
            x[i] = saved - eps
            down = loss()
            x[i] = saved
            grad[i] = (up - down) / (2 * eps)
        grads.append(grad)
    return grads


def output_gradient(q, v):
    """The dO the checks use, in the output's layout."""
    return np.random.default_rng(1).standard_normal(q.shape[:-1] + v.shape[-1:])


def check_against_finite_differences(kernel, q, k, v, **call):
    """Checks every entry of dq, dk, dv (relative to each tensor's largest gradient) and
    returns them."""
    dout = output_gradient(q, v)
    analytic = attention_reference_backward(q, k, v, dout, **rules(kernel, **call))
    for name, x, got, want in zip("qkv", (q, k, v), analytic,
                                  numeric_gradients(kernel, q, k, v, dout, **call)):
        assert got.shape == x.shape and got.dtype == np.float64, name
        assert np.abs(want).max() > 1e-3, name  # the check means something
        error = np.abs(got - want).max() / np.abs(want).max()
        assert error < 1e-6, f"d{name}: relative error {error:.2e}"
    return analytic


def dense_inputs(seed, batch, sq, sk, hq, hkv, d=4, dv=6, amp=1.0):
    rng = np.random.default_rng(seed)
    return (amp * rng.standard_normal((batch, sq, hq, d)),
            amp * rng.standard_normal((batch, sk, hkv, d)),
            rng.standard_normal((batch, sk, hkv, dv)))


CASES = {
    # name: (kernel, (batch, sq, sk, hq, hkv), amplitude)
    "plain": ("plain", (2, 3, 5, 2, 2), 1.0),
    "causal": ("causal", (1, 6, 6, 2, 2), 1.0),
    "bottom_right_long_k": ("bottom_right", (1, 4, 7, 2, 2), 1.0),
    "window": ("window", (1, 7, 7, 2, 2), 1.0),
    "alibi": ("alibi", (1, 4, 5, 2, 2), 1.0),
    "softcap": ("softcap", (1, 4, 5, 2, 2), 12.0),  # scores near the cap: tanh bends
    "user_score": ("user_score", (1, 5, 5, 2, 2), 2.0),
    # The score and its derivative are NaN on the masked keys (sqrt of a negative).
    "undefined_where_masked": ("undefined_where_masked", (1, 5, 5, 2, 2), 1.0),
    "gqa": ("gqa_causal", (1, 5, 5, 4, 2), 1.0),
    "mqa": ("mqa_softcap", (2, 3, 4, 2, 1), 12.0),
}


@pytest.mark.parametrize("name", CASES)
def test_dense_matches_finite_differences(program, name):
    kernel, shape, amp = CASES[name]
    check_against_finite_differences(program[kernel], *dense_inputs(0, *shape, amp=amp))


def test_scale_argument(program):
    check_against_finite_differences(program["causal"], *dense_inputs(2, 1, 4, 4, 2, 2),
                                     scale=0.9)


def test_rows_without_keys_get_zero_gradients(program):
    # Bottom-right with Sk = 3 < Sq = 6: rows 0..2 see no key, row 3 one (P = 1 whatever q
    # is, so its dq is 0 up to rounding), rows 4 and 5 two and three.
    q, k, v = dense_inputs(4, 1, 6, 3, 2, 2)
    dq, dk, dv = check_against_finite_differences(program["bottom_right"], q, k, v)
    assert np.all(dq[0, :3] == 0) and np.all(dq[0, 4:] != 0)
    assert np.all(dk != 0) and np.all(dv != 0)


def test_ragged_with_empty_and_single_sequences(program):
    # Sequences (q, k): (3, 4), (0, 2), (1, 0), (1, 1), (4, 5).
    cu_q = np.array([0, 3, 3, 4, 5, 9], np.int32)
    cu_k = np.array([0, 4, 6, 6, 7, 12], np.int32)
    rng = np.random.default_rng(5)
    q = 6.0 * rng.standard_normal((9, 4, 4))
    k = 6.0 * rng.standard_normal((12, 2, 4))
    v = rng.standard_normal((12, 2, 3))
    call = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4, max_seqlen_k=5)
    dout = output_gradient(q, v)  # the one the check used
    dq, dk, dv = check_against_finite_differences(program["ragged_bottom_right_softcap"],
                                                  q, k, v, **call)
    assert np.all(dk[4:6] == 0) and np.all(dv[4:6] == 0)  # keys no query reads
    assert np.all(dq[3] == 0)  # a query with no key
    # One query, one key: P = 1, so dV of KV head j is the sum of dO over query heads 2j, 2j+1.
    np.testing.assert_allclose(dv[6], dout[4].reshape(2, 2, 3).sum(axis=1), rtol=1e-14)


def test_dout_shape_is_checked(program):
    q, k, v = dense_inputs(0, 1, 3, 3, 2, 2, d=64, dv=64)
    with pytest.raises(ValueError, match="dout"):
        mhadsl.reference_backward(program["plain"], q, k, v, np.zeros((1, 3, 2, 4)))


def test_heads_are_checked_as_the_forward_checks_them(program):
    q, k, v = dense_inputs(0, 1, 3, 3, 6, 2, d=64, dv=64)
    with pytest.raises(ValueError, match="gqa = 2"):
        mhadsl.reference_backward(program["gqa_causal"], q, k, v, np.zeros((1, 3, 6, 64)))
