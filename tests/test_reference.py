"""The float64 reference against a naive per-element loop, and its integer semantics."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from mhadsl.front.check import check_program
from mhadsl.codegen.backends import declaration_problems
from mhadsl.front.parse import load_program
from mhadsl.analysis.reference import attention_reference, evaluate_rule, rule_roles


def rules_of(members: str, prelude: str = ""):
    """(mask rule or None, score rule or None, program) of one attention declaration."""
    src = f"{prelude}\nattention a {{ dtype = bf16  head_dim = 64  {members} }}"
    program = check_program(load_program(src, "t.mha", Path(".")), declaration_problems)
    rules = {r.name: r for r in program.attentions["a"].rules}
    return rules.get("mask"), rules.get("score"), program


def naive(seqs, hq, hkv, scale, mask=None, score=None):
    """Per-element softmax attention over [(q, k, v)] sequences; Python floats throughout."""
    outs, lses = [], []
    for b, (q, k, v) in enumerate(seqs):
        sq, sk = len(q), len(k)
        out = np.zeros((sq, hq, v.shape[-1]))
        lse = np.full((hq, sq), -math.inf)
        for h in range(hq):
            kh = h // (hq // hkv)
            for i in range(sq):
                logits = []
                for j in range(sk):
                    if mask is not None and not mask(b, h, i, j, sq, sk):
                        continue
                    s = scale * sum(float(x) * float(y) for x, y in zip(q[i, h], k[j, kh]))
                    logits.append((j, s if score is None else score(s, b, h, i, j)))
                if not logits:
                    continue
                m = max(s for _, s in logits)
                weights = [(j, math.exp(s - m)) for j, s in logits]
                total = sum(w for _, w in weights)
                out[i, h] = sum(w * v[j, kh].astype(np.float64) for j, w in weights) / total
                lse[h, i] = m + math.log(total)
        outs.append(out)
        lses.append(lse)
    return outs, lses


def dense_inputs(rng, batch, sq, sk, hq, hkv, d=8, dv=8, dtype=np.float32, amp=1.0):
    q = (amp * rng.standard_normal((batch, sq, hq, d))).astype(dtype)
    k = (amp * rng.standard_normal((batch, sk, hkv, d))).astype(dtype)
    v = rng.standard_normal((batch, sk, hkv, dv)).astype(dtype)
    return q, k, v


CAUSAL = "mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx"
BOTTOM_RIGHT = "mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx + seqlen_k - seqlen_q"
CASES = {
    # name: (members, python mask, python score, (batch, sq, sk, hq, hkv), amplitude)
    "plain": ("", None, None, (2, 5, 7, 2, 2), 1.0),
    "causal": (CAUSAL, lambda b, h, i, j, sq, sk: j <= i, None, (2, 6, 6, 2, 2), 1.0),
    "bottom_right_long_k": (BOTTOM_RIGHT, lambda b, h, i, j, sq, sk: j <= i + sk - sq, None,
                            (2, 4, 9, 2, 1), 1.0),
    # Sk < Sq: the first rows see no key at all.
    "bottom_right_short_k": (BOTTOM_RIGHT, lambda b, h, i, j, sq, sk: j <= i + sk - sq, None,
                             (1, 7, 3, 2, 2), 1.0),
    "gqa_causal": (CAUSAL, lambda b, h, i, j, sq, sk: j <= i, None, (2, 5, 5, 4, 2), 1.0),
    "mqa_window_by_head": ("mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx && q_idx - kv_idx < h + 2",
                           lambda b, h, i, j, sq, sk: j <= i and i - j < h + 2, None,
                           (2, 6, 6, 3, 1), 1.0),
    "softcap": ("score(s, b, h, q_idx, kv_idx) = 30.0 * tanh(s / 30.0)", None,
                lambda s, b, h, i, j: 30.0 * math.tanh(s / 30.0), (2, 5, 6, 2, 2), 6.0),
    "alibi": ("score(s, b, h, q_idx, kv_idx) = s - 0.1 * f32(abs(q_idx - kv_idx))", None,
              lambda s, b, h, i, j: s - 0.1 * abs(i - j), (2, 5, 6, 2, 2), 1.0),
    "alibi_slopes_causal": (
        CAUSAL + "  score(s, b, h, q_idx, kv_idx) = s - f32(h + 1) * 0.25 * f32(kv_idx - q_idx)",
        lambda b, h, i, j, sq, sk: j <= i, lambda s, b, h, i, j: s - (h + 1) * 0.25 * (j - i),
        (2, 5, 5, 4, 2), 1.0),
    "by_batch": ("mask(b, h, q_idx, kv_idx) = (kv_idx + b) % 2 == 0",
                 lambda b, h, i, j, sq, sk: (j + b) % 2 == 0, None, (3, 4, 5, 1, 1), 1.0),
    "nothing_kept": ("mask(b, h, q_idx, kv_idx) = kv_idx < 0", lambda *a: False, None,
                     (1, 3, 4, 2, 2), 1.0),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_dense_matches_naive(name):
    members, mask, score, (batch, sq, sk, hq, hkv), amp = CASES[name]
    mask_rule, score_rule, program = rules_of(members)
    rng = np.random.default_rng(sorted(CASES).index(name))
    q, k, v = dense_inputs(rng, batch, sq, sk, hq, hkv, amp=amp)
    out, lse = attention_reference(q, k, v, mask_rule=mask_rule, score_rule=score_rule,
                                   program=program, return_lse=True)
    assert out.shape == (batch, sq, hq, 8) and out.dtype == np.float64
    assert lse.shape == (batch, hq, sq)
    outs, lses = naive([(q[i], k[i], v[i]) for i in range(batch)], hq, hkv, 1 / math.sqrt(8),
                       mask, score)
    np.testing.assert_allclose(out, np.stack(outs), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, np.stack(lses), rtol=1e-12, atol=1e-12)


def test_fully_masked_rows_are_zero():
    mask_rule, _, program = rules_of(BOTTOM_RIGHT)
    q, k, v = dense_inputs(np.random.default_rng(7), 1, 6, 2, 2, 2)
    out, lse = attention_reference(q, k, v, mask_rule=mask_rule, program=program,
                                   return_lse=True)
    # Rows 0..3 have q_idx + 2 - 6 < 0: no key.
    assert np.all(out[0, :4] == 0) and np.all(np.isneginf(lse[0, :, :4]))
    assert np.all(np.isfinite(lse[0, :, 4:])) and np.any(out[0, 4:] != 0)


def test_ragged_with_empty_sequences():
    mask_rule, score_rule, program = rules_of(
        BOTTOM_RIGHT + "  score(s, b, h, q_idx, kv_idx) = 30.0 * tanh(s / 30.0)")
    # Sequences: (3 q, 4 k), (0 q, 2 k), (5 q, 0 k), (4 q, 6 k).
    cu_q = np.array([0, 3, 3, 8, 12], np.int32)
    cu_k = np.array([0, 4, 6, 6, 12], np.int32)
    hq, hkv = 4, 2
    rng = np.random.default_rng(3)
    q = rng.standard_normal((12, hq, 8)).astype(np.float16)
    k = rng.standard_normal((12, hkv, 8)).astype(np.float16)
    v = rng.standard_normal((12, hkv, 16))
    out, lse = attention_reference(q, k, v, mask_rule=mask_rule, score_rule=score_rule,
                                   program=program, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                   return_lse=True)
    assert out.shape == (12, hq, 16) and lse.shape == (hq, 12)
    seqs = [(q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]])
            for i in range(4)]
    outs, lses = naive(seqs, hq, hkv, 1 / math.sqrt(8),
                       lambda b, h, i, j, sq, sk: j <= i + sk - sq,
                       lambda s, b, h, i, j: 30.0 * math.tanh(s / 30.0))
    np.testing.assert_allclose(out, np.concatenate(outs), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, np.concatenate(lses, axis=1), rtol=1e-12, atol=1e-12)
    assert np.all(out[3:8] == 0) and np.all(np.isneginf(lse[:, 3:8]))  # the k-less sequence


def test_scale_and_plain_lse():
    q, k, v = dense_inputs(np.random.default_rng(5), 1, 3, 4, 1, 1, dtype=np.float64)
    out, lse = attention_reference(q, k, v, scale=0.3, return_lse=True)
    s = 0.3 * q[0, :, 0] @ k[0, :, 0].T
    p = np.exp(s) / np.exp(s).sum(1, keepdims=True)
    np.testing.assert_allclose(out[0, :, 0], p @ v[0, :, 0], rtol=1e-13)
    np.testing.assert_allclose(lse[0, 0], np.log(np.exp(s).sum(1)), rtol=1e-13)


def test_bad_shapes():
    q, k, v = dense_inputs(np.random.default_rng(0), 1, 2, 2, 3, 2)
    with pytest.raises(ValueError, match="multiple"):
        attention_reference(q, k, v)
    with pytest.raises(ValueError, match="both"):
        attention_reference(q[0], k[0], v[0], cu_seqlens_q=[0, 2])
    mask_rule, _, _ = rules_of(CAUSAL)
    with pytest.raises(ValueError, match="program"):
        attention_reference(q, k, v, mask_rule=mask_rule)


# ------------------------------------------------------------------ integer semantics
def c_div(a: int, b: int) -> int:
    if b == 0:
        return 0
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


def c_rem(a: int, b: int) -> int:
    return a - b * c_div(a, b) if b else 0


def i32(x: int) -> int:
    x &= 0xFFFFFFFF
    return x - 2**32 if x >= 2**31 else x


IDX = list(range(-20, 21)) + [2**31 - 1, -2**31, 123456789, -987654321]
SEMANTICS = {
    "f32((q_idx - 7) / 2)": lambda q, s: c_div(i32(q - 7), 2),
    "f32((q_idx - 7) % 3)": lambda q, s: c_rem(i32(q - 7), 3),
    "f32(q_idx % -4)": lambda q, s: c_rem(q, -4),
    "f32(q_idx * 1000000007)": lambda q, s: i32(q * 1000000007),
    "f32(q_idx + 2147483647)": lambda q, s: i32(q + 2147483647),
    "f32(~q_idx)": lambda q, s: i32(~q),
    "f32(-q_idx)": lambda q, s: i32(-q),
    "f32(u32(q_idx - 1))": lambda q, s: (q - 1) & 0xFFFFFFFF,
    "f32(u32(q_idx) / 3)": lambda q, s: (q & 0xFFFFFFFF) // 3,
    "f32(q_idx >> 1)": lambda q, s: q >> 1,
    "f32(u32(q_idx) >> 28)": lambda q, s: (q & 0xFFFFFFFF) >> 28,
    "f32(q_idx << 3)": lambda q, s: i32(q << 3),
    "f32(q_idx & -8 | 3 ^ q_idx)": lambda q, s: i32(q & -8 | 3 ^ q),
    "f32(cdiv(q_idx, 4))": lambda q, s: c_div(i32(q + 3), 4),
    "f32(q_idx / (kv_idx - kv_idx))": lambda q, s: 0,
    "f32(q_idx % (kv_idx - kv_idx))": lambda q, s: 0,
    "f32(abs(q_idx - 5))": lambda q, s: i32(abs(i32(q - 5))),
    "f32(where(q_idx > 3, 1, 2) + (7 - 10) / 2)": lambda q, s: (1 if q > 3 else 2) - 1,
    "f32(min(q_idx, 3) * max(q_idx, -2))": lambda q, s: i32(min(q, 3) * max(q, -2)),
    "f32(i32(s))": lambda q, s: math.trunc(s),
    "f32(i32(q_idx < 0) + i32(true))": lambda q, s: int(q < 0) + 1,
    "min(s, f32(q_idx)) + sqrt(4.0) * exp2(3.0) - log2(8.0)":
        lambda q, s: min(s, float(q)) + 2.0 * 8.0 - 3.0,
    "where(s > 0.0 && q_idx != 0 || !(q_idx >= -3), s, -s)":
        lambda q, s: s if (s > 0 and q != 0) or not q >= -3 else -s,
}


@pytest.mark.parametrize("expr", sorted(SEMANTICS))
def test_integer_semantics(expr):
    _, score_rule, program = rules_of(f"score(s, b, h, q_idx, kv_idx) = {expr}")
    q = np.array(IDX)[:, None]
    s = np.array([-2.7, -0.5, 0.0, 1.5, 2.9])[None, :]
    got = evaluate_rule(score_rule, program, s=s, b=0, h=0, q_idx=q, kv_idx=5)
    want = np.array([[SEMANTICS[expr](qi, float(si)) for si in s[0]] for qi in IDX], float)
    np.testing.assert_array_equal(got, want)


def test_block_rules_and_fns():
    prelude = """fn tri(n: i32) -> i32 {
        return n * (n + 1) / 2
    }"""
    members = """score(s, b, h, q_idx, kv_idx) {
        var x = s
        if q_idx > kv_idx { x = x * 2.0 } else if q_idx == kv_idx { return -1.0 }
        return x + f32(tri(q_idx))
    }
    mask(b, h, q_idx, kv_idx) {
        let doc = 4
        if q_idx / doc != kv_idx / doc { return false }
        return kv_idx <= q_idx
    }"""
    mask_rule, score_rule, program = rules_of(members, prelude)
    qi, ki = np.arange(9)[:, None], np.arange(9)[None, :]
    s = np.linspace(-1, 1, 81).reshape(9, 9)
    got = evaluate_rule(score_rule, program, s=s, b=0, h=0, q_idx=qi, kv_idx=ki)
    want = [[-1.0 if i == j else (2 * s[i, j] if i > j else s[i, j]) + i * (i + 1) // 2
             for j in range(9)] for i in range(9)]
    np.testing.assert_array_equal(got, want)
    keep = evaluate_rule(mask_rule, program, b=0, h=0, q_idx=qi, kv_idx=ki)
    assert keep.dtype == bool and keep.shape == (9, 9)
    np.testing.assert_array_equal(keep, [[i // 4 == j // 4 and j <= i for j in range(9)]
                                         for i in range(9)])


def test_rule_roles():
    mask_rule, score_rule, program = rules_of(
        BOTTOM_RIGHT + "  score(s, b, h, q_idx, kv_idx) = s * f32(h)")
    assert rule_roles(mask_rule, program) == {"q_idx", "kv_idx", "seqlen_q", "seqlen_k"}
    assert rule_roles(score_rule, program) == {"s", "h"}


def test_reference_refuses_a_head_count_the_kernel_refuses():
    """The same check, in the same words, as the kernel's own call."""
    import mhadsl
    from helpers import REPO
    program = mhadsl.compile(REPO / "examples/gqa.mha")
    q, kv = np.zeros((1, 4, 6, 128), np.float32), np.zeros((1, 4, 2, 128), np.float32)
    for kernel, message in ((program["gqa_causal"], "kernel 'gqa_causal' is declared gqa = 4, "
                                                    "but q has 6 heads and k/v 2"),
                            (program["mqa"], "kernel 'mqa' is declared kv_heads = 1, but k/v "
                                             "have 2")):
        with pytest.raises(ValueError) as called:
            kernel(q, kv, kv)
        with pytest.raises(ValueError) as referenced:
            mhadsl.reference(kernel, q, kv, kv)
        assert str(called.value) == str(referenced.value) == message
