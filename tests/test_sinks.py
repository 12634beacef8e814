"""Attention sinks (`sink(b, h) = ...`): the rule's checks, the float64 references against
a key that carries the sink's logit and a value of 0, the sink's gradient against finite
differences, and every design's kernels built with it (ptxas, no spills)."""
from __future__ import annotations

import re

import numpy as np
import pytest

import mhadsl
from helpers import EXAMPLES, checked
from mhadsl.analysis.reference import attention_reference, attention_reference_backward
from mhadsl.codegen.assemble import find_ptxas
from mhadsl.codegen.backends import CacheLayout, backends
from mhadsl.front.diagnostics import MhaError

SINKS = '''
attention sinks(logits: f32[heads]) {
    dtype = bf16
    head_dim = 64
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx
    sink(b, h) = logits[h] + 0.5 * f32(b)
}
'''


@pytest.fixture(scope="module")
def sinks():
    return mhadsl.compile(SINKS)["sinks"]


def errors_of(text: str) -> list[str]:
    with pytest.raises(MhaError) as err:
        checked(text)
    return [d.message for d in err.value.diagnostics]


@pytest.mark.parametrize("rule, message", [
    ("sink(b, h, q_idx) = 1.0", "rule 'sink'"),
    ("sink(b, h) = b < 2", "sink"),
    ("sink(b, h) = f32(kv_idx)", "kv_idx"),
    ("sank(b, h) = 1.0", "expected mask, score or sink"),
])
def test_bad_sink_rules_get_diagnostics(rule, message):
    text = f"attention a {{ dtype = bf16 head_dim = 64\n  {rule} }}"
    assert any(message in m for m in errors_of(text)), errors_of(text)


def test_a_sink_rule_twice_is_an_error():
    text = "attention a { dtype = bf16 head_dim = 64\n sink(b, h) = 1.0\n sink(b, h) = 2.0 }"
    assert any("defined twice" in m for m in errors_of(text))


def _with_sink_key(q, k, v, sink, scale, causal=True):
    """Attention where the sink is one more key: its logit is the sink's and its value 0."""
    B, S, H, D = q.shape
    out, lse = np.zeros_like(q), np.zeros((B, H, S))
    for b in range(B):
        for h in range(H):
            z = scale * q[b, :, h] @ k[b, :, h].T
            if causal:
                z = np.where(np.tril(np.ones((S, S), bool)), z, -np.inf)
            z = np.concatenate([z, np.full((S, 1), sink[b, h])], axis=1)
            m = z.max(axis=1, keepdims=True)
            e = np.exp(z - m)
            out[b, :, h] = (e[:, :-1] / e.sum(axis=1, keepdims=True)) @ v[b, :, h]
            lse[b, h] = (m + np.log(e.sum(axis=1, keepdims=True)))[:, 0]
    return out, lse


def test_the_reference_is_attention_with_one_more_key_of_value_zero(sinks):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 9, 3, 64)) for _ in range(3))
    logits = np.array([-1.0, 0.5, 4.0], np.float32)
    out, lse = mhadsl.reference(sinks, q, k, v, logits=logits, return_lse=True)
    sink = logits[None, :] + 0.5 * np.arange(2)[:, None]
    want_out, want_lse = _with_sink_key(q, k, v, sink, 1 / 8)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)
    plain = attention_reference(q, k, v, mask_rule=sinks.options.mask,
                                program=sinks.program.checked)
    assert np.abs(out - plain).max() > 1e-2  # the sink takes part of every row's weight


def test_a_row_with_no_key_gives_its_attention_to_the_sink(sinks):
    text = SINKS.replace("kv_idx <= q_idx", "kv_idx < q_idx")  # row 0 keeps no key
    kern = mhadsl.compile(text)["sinks"]
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 4, 2, 64)) for _ in range(3))
    out, lse = mhadsl.reference(kern, q, k, v, logits=np.array([1.5, -3.0], np.float32),
                                return_lse=True)
    assert np.all(out[0, 0] == 0)
    np.testing.assert_allclose(lse[0, :, 0], [1.5, -3.0])
    assert np.all(np.isfinite(lse))


def test_huge_sinks_and_scores_do_not_overflow(sinks):
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 5, 3, 64)) for _ in range(3))
    logits = np.array([900.0, -900.0, 0], np.float32)
    out, lse = mhadsl.reference(sinks, 4 * q, 4 * k, v, logits=logits, return_lse=True)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    assert np.abs(out[0, :, 0]).max() < 1e-12  # head 0's sink outweighs every key


def test_the_sinks_gradient_matches_finite_differences(sinks):
    rng = np.random.default_rng(3)
    shape = (2, 7, 3, 64)
    q, k, v, dout = (rng.standard_normal(shape) for _ in range(4))
    logits = np.array([0.3, -0.7, 1.1])
    rules = dict(mask_rule=sinks.options.mask, sink_rule=sinks.options.sink,
                 program=sinks.program.checked)

    def loss(logit_values):
        out = attention_reference(q, k, v, operands={"logits": logit_values}, **rules)
        return np.sum(out * dout)
    dq, dk, dv, dsink = attention_reference_backward(q, k, v, dout,
                                                     operands={"logits": logits}, **rules)
    eps = 1e-6
    for h in range(3):
        step = np.eye(3)[h] * eps
        numeric = (loss(logits + step) - loss(logits - step)) / (2 * eps)
        # the sink of (b, h) is logits[h] + 0.5 b: d loss / d logits[h] sums over b
        np.testing.assert_allclose(dsink[:, h].sum(), numeric, rtol=1e-6, atol=1e-9)
    # dq against finite differences of one element: the sink changes it as well
    i = (1, 3, 2, 5)
    dq_step = np.zeros(shape)
    dq_step[i] = eps

    def loss_q(q_):
        return np.sum(attention_reference(q_, k, v, operands={"logits": logits},
                                          **rules) * dout)
    numeric = (loss_q(q + dq_step) - loss_q(q - dq_step)) / (2 * eps)
    np.testing.assert_allclose(dq[i], numeric, rtol=1e-6, atol=1e-9)


def test_the_decode_reference_sees_the_sink(sinks):
    rng = np.random.default_rng(4)
    lengths = [5, 12]
    k_cache, v_cache = (rng.standard_normal((2, 16, 3, 64)) for _ in range(2))
    q = rng.standard_normal((2, 1, 3, 64))
    decl = SINKS.replace("mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx",
                         "mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = "
                         "kv_idx <= q_idx + seqlen_k - seqlen_q")
    kern = mhadsl.compile(decl)["sinks"]
    logits = np.array([0.0, 2.0, -1.0], np.float32)
    out = mhadsl.reference_decode(kern, q, k_cache, v_cache,
                                  cache_seqlens=np.array(lengths, np.int32), logits=logits)
    for b, n in enumerate(lengths):
        sink = (logits + 0.5 * b)[None, :]
        want, _ = _with_sink_key(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n],
                                 sink, 1 / 8, causal=False)
        np.testing.assert_allclose(out[b], want[0], rtol=1e-12, atol=1e-12)


LAYOUTS = {"prefill": dict(), "decode": dict(cache=CacheLayout(1, 64, 64), gqa_group=4),
           "backward": dict(backward=True)}


@pytest.mark.skipif(find_ptxas() is None, reason="needs ptxas")
@pytest.mark.parametrize("design", ["sm80", "sm90", "decode"])
def test_the_forward_designs_build_the_sink_without_spills(sinks, design):
    design_ = next(d for w in LAYOUTS for d in backends(w) if d.name == design)
    build = sinks.build(design_.targets[0], backend=design, **LAYOUTS[design_.workload])
    for kernel in design_.kernels(build.config):
        assert build.assembled.kernels[kernel.name].spills == 0
    plain = mhadsl.compile(SINKS.replace("    sink(b, h) = logits[h] + 0.5 * f32(b)\n", ""))
    other = plain["sinks"].build(design_.targets[0], backend=design, **LAYOUTS[design_.workload])
    # the kernel reads the sink's logits (nothing else reads the operand)
    read = 'getelementptr float, ptr addrspace(1) %"operand_logits"'
    assert read in build.llvm and read not in other.llvm


@pytest.mark.skipif(find_ptxas() is None, reason="needs ptxas")
@pytest.mark.parametrize("design", ["sm80", "sm90", "decode", "backward"])
def test_a_score_may_read_the_sequences_lengths(design):
    text = ('attention a { dtype = bf16 head_dim = 64\n'
            '  mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = '
            'kv_idx <= q_idx + seqlen_k - seqlen_q\n'
            '  score(s, b, h, q_idx, kv_idx) = '
            's - 0.1 * f32(q_idx + seqlen_k - seqlen_q - kv_idx) }')
    design_ = next(d for w in LAYOUTS for d in backends(w) if d.name == design)
    build = mhadsl.compile(text)["a"].build(design_.targets[0], backend=design,
                                            **LAYOUTS[design_.workload])
    assert build.backend == design
    for kernel in design_.kernels(build.config):
        assert build.assembled.kernels[kernel.name].spills == 0


def test_the_sinks_example_runs_in_the_reference():
    kern = mhadsl.compile(str(next(p for p in EXAMPLES if p.name == "sinks.mha")))["sinks"]
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 200, 4, 64)) for _ in range(3))
    out = mhadsl.reference(kern, q, k, v, sink_logits=np.zeros(4, np.float32))
    plain = mhadsl.reference(kern, q, k, v, sink_logits=np.full(4, -1e4, np.float32))
    # a sink of logit 0 takes weight 1 / (1 + sum of the row's exp(scores - 0))
    assert np.abs(out).max() < np.abs(plain).max()


def _params(ptx: str, kernel: str) -> list[str]:
    entry = ptx[ptx.index(f".entry {kernel}("):]
    return re.findall(r"\.param \.(\w+)", entry[:entry.index(")")])


@pytest.mark.skipif(find_ptxas() is None, reason="needs ptxas")
@pytest.mark.parametrize("design, deterministic", [("backward", False), ("backward", True),
                                                   ("backward_sm90", False)])
def test_the_backward_preprocess_writes_each_rows_sink_term(sinks, design, deterministic):
    design_ = next(d for d in backends("backward") if d.name == design)
    build = sinks.build(design_.targets[0], backend=design, backward=True,
                        deterministic=deterministic)
    assert build.backend == design and build.config.sink
    preprocess, *others = design_.kernels(build.config)
    assert [p.name for p in preprocess.abi.params][-1] == "sink_terms"
    assert all("sink_terms" not in [p.name for p in k.abi.params] for k in others)
    for kernel in (preprocess, *others):
        # the design's parameters, then the operand's address, size and stride
        assert len(_params(build.ptx, kernel.name)) == len(kernel.abi.params) + 3
        assert build.assembled.kernels[kernel.name].spills == 0
    plain = mhadsl.compile(SINKS.replace("    sink(b, h) = logits[h] + 0.5 * f32(b)\n", ""))
    other = plain["sinks"].build(design_.targets[0], backend=design, backward=True,
                                 deterministic=deterministic)
    assert not other.config.sink
    assert "sink_terms" not in [p.name for p in design_.kernels(other.config)[0].abi.params]


@pytest.mark.parametrize("decl, rule, want", [
    ("logits: f32[heads]", "logits[h]", (0, True)),
    ("w: i32, logits: f32[batch, heads]", "logits[b][h]", (1, False)),
    ("logits: f32[heads]", "logits[h] + 0.5 * f32(b)", None),
    ("logits: f32[batch, heads]", "logits[h][b]", None),
    ("logits: f32[heads]", "logits[0]", None),
    ("logits: f32[heads]", "{ return logits[h] }", (0, True)),
    ("logits: f32[heads]", "{ let x = logits[h]\n return x }", None),
])
def test_autograd_sends_the_sinks_gradient_to_the_tensor_it_reads_whole(decl, rule, want):
    from mhadsl.host.torch_op import sink_operand
    body = f"sink(b, h) {rule}" if rule.startswith("{") else f"sink(b, h) = {rule}"
    kern = mhadsl.compile(f"attention a({decl}) {{ dtype = bf16 head_dim = 64\n {body} }}")["a"]
    assert sink_operand(kern) == want
