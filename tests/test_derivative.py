"""d score / d s (mhadsl.analysis.derivative) against central finite differences, on CPU."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import EXAMPLES, checked, host_score
from mhadsl.codegen.assemble import find_ptxas
from mhadsl.front import ast
from mhadsl.front.builtin_functions import FUNCTIONS
from mhadsl.analysis.derivative import differentiate_score
from mhadsl.front.diagnostics import MhaError
from mhadsl.analysis.reference import evaluate_rule, evaluate_score_derivative
from mhadsl.front.types import BOOL, F32

RNG = np.random.default_rng(22)
N = 400  # random points per case


def score_rule(body: str, prelude: str = ""):
    """(score rule, program) of `score(s, b, h, q_idx, kv_idx) = body` (or a `{ block }`)."""
    form = body if body.lstrip().startswith("{") else f"= {body}"
    program = checked(f"{prelude}\nattention a {{ dtype = bf16  head_dim = 64\n"
                      f"    score(s, b, h, q_idx, kv_idx) {form} }}", "t.mha")
    (rule,) = program.attentions["a"].rules
    return rule, program


def central_difference(f, s):
    step = 1e-6 * np.maximum(1.0, np.abs(s))
    return (f(s + step) - f(s - step)) / (2 * step)


def meaning(name: str, *args):
    """The builtin's NumPy meaning, on f32 arguments (a bool one: where's condition)."""
    types = [BOOL if np.asarray(a).dtype == bool else F32 for a in args]
    return FUNCTIONS[name].numpy(list(args), types, F32)


# ------------------------------------------------------------------ each builtin
# name -> [(score expression, the same function of (s, t) through the NumPy meanings, the
# range of s)], where t = 0.01 * q_idx is a second operand that does not depend on s.
T = "(0.01 * f32(q_idx))"
BUILTIN_CASES = {
    "exp": [("exp(s)", lambda s, t: meaning("exp", s), (-5, 5))],
    "exp2": [("exp2(s)", lambda s, t: meaning("exp2", s), (-5, 5))],
    "log": [("log(s)", lambda s, t: meaning("log", s), (0.05, 20))],
    "log2": [("log2(s)", lambda s, t: meaning("log2", s), (0.05, 20))],
    "tanh": [("tanh(s)", lambda s, t: meaning("tanh", s), (-4, 4))],
    "sqrt": [("sqrt(s)", lambda s, t: meaning("sqrt", s), (0.05, 20))],
    "abs": [("abs(s)", lambda s, t: meaning("abs", s), (-5, 5))],
    "min": [(f"min(s, {T})", lambda s, t: meaning("min", s, t), (-5, 5)),
            (f"min({T}, s)", lambda s, t: meaning("min", t, s), (-5, 5))],
    "max": [(f"max(s, {T})", lambda s, t: meaning("max", s, t), (-5, 5)),
            (f"max({T}, s)", lambda s, t: meaning("max", t, s), (-5, 5))],
    "where": [(f"where(q_idx % 3 == 0, s, {T})",
               lambda s, t: meaning("where", np.round(t * 100) % 3 == 0, s, t), (-5, 5)),
              (f"where(q_idx % 3 == 0, {T}, s)",
               lambda s, t: meaning("where", np.round(t * 100) % 3 == 0, t, s), (-5, 5))],
    "f32": [("f32(s)", lambda s, t: meaning("f32", s), (-5, 5))],
}


def test_every_differentiable_builtin_has_a_case():
    assert set(BUILTIN_CASES) == {n for n, b in FUNCTIONS.items() if b.derivative}


@pytest.mark.parametrize("name, case", [(n, c) for n, cases in BUILTIN_CASES.items()
                                        for c in cases], ids=lambda x: str(x)[:20])
def test_builtin_derivative_matches_finite_differences(name, case):
    expr, f, (lo, hi) = case
    rule, program = score_rule(expr)
    s = RNG.uniform(lo, hi, N)
    q_idx = RNG.integers(-500, 500, N)
    t = 0.01 * q_idx
    away = np.abs(s) > 1e-3 if name == "abs" else np.abs(s - t) > 1e-3  # from the kinks
    s, q_idx, t = s[away], q_idx[away], t[away]
    got = evaluate_score_derivative(rule, program, s=s, q_idx=q_idx)
    want = central_difference(lambda x: f(x, t), s)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("expr, s, want", [
    ("abs(s)", 0.0, 0.0),
    ("max(s, 0.0)", 0.0, 1.0),  # max follows its first operand on a tie
    ("max(0.0, s)", 0.0, 0.0),
    ("min(s, 0.0)", 0.0, 1.0),
    ("min(-s, 0.0)", 0.0, -1.0),
    ("where(s >= 0.0, s, -2.0 * s)", 0.0, 1.0),  # the branch taken
    ("where(s > 0.0, s, -2.0 * s)", 0.0, -2.0),
])
def test_one_sided_derivative_at_kinks(expr, s, want):
    rule, program = score_rule(expr)
    assert evaluate_score_derivative(rule, program, s=s) == want


# ------------------------------------------------------------------ the chain rule
COMPOSITES = [
    "30.0 * tanh(s / 30.0)",  # softcap
    "s - 0.5 * f32(q_idx - kv_idx)",  # ALiBi-like
    "s - exp2(-1.0 - f32(h)) * f32(q_idx - kv_idx)",
    "s * q_idx * kv_idx / 7",  # integers promote to f32 where they meet s
    "where(s > 0.0, log(1.0 + s), exp(s) - 1.0) * max(abs(s), 0.5)",
    "sqrt(1.0 + s * s) / (2.0 + tanh(s)) - min(s, f32(kv_idx) * 0.1)",
    "-exp(-s * s / 2.0) + log2(abs(s) + 1.0) * exp2(s / 4.0)",
    "where(q_idx >= kv_idx, s, s * 0.5 - 1.0) / (1.0 + f32(abs(q_idx - kv_idx)))",
    "{ let t = s / 30.0\n let k = i32(s * 4.0)\n if k > 2 { return 30.0 * tanh(t) }\n"
    " return where(q_idx > 7, t * t, max(t, 0.25)) }",  # an integer of s in conditions only
    "{ var x = s\n if q_idx > kv_idx { x = x * 2.0 }\n return x }",
    # vars assigned in branches and by every f32 compound operator, an integer var beside
    # them, a var whose first value does not depend on s, a let read from vars
    "{ var x = s\n var k = 3\n k += q_idx\n var y = 0.0\n y += tanh(x * 0.1) * f32(k)\n"
    " if kv_idx % 2 == 0 { y *= x } else { y /= 1.0 + x * x }\n let z = y - x * 0.5\n"
    " x -= z\n return x * 1.5 + y }",
]


@pytest.mark.parametrize("expr", COMPOSITES)
def test_chain_rule_matches_finite_differences_of_the_reference(expr):
    rule, program = score_rule(expr)
    s = RNG.uniform(-6, 6, N)
    idx = dict(b=0, h=RNG.integers(0, 8, N), q_idx=RNG.integers(0, 20, N),
               kv_idx=RNG.integers(0, 20, N))
    got = evaluate_score_derivative(rule, program, s=s, **idx)
    want = central_difference(lambda x: evaluate_rule(rule, program, s=x, **idx), s)
    # Skip points within a step of a kink or a branch switch of the score.
    smooth = np.abs(want - central_difference(
        lambda x: evaluate_rule(rule, program, s=x, **idx), s + 1e-4)) < 1e-2
    np.testing.assert_allclose(got[smooth], want[smooth], rtol=1e-5, atol=1e-9)
    assert smooth.mean() > 0.9


@pytest.mark.parametrize("example", [p for p in EXAMPLES if p.stem in ("softcap", "alibi")],
                         ids=lambda p: p.stem)
def test_examples_score_derivative(example):
    program = checked(example.read_text(), str(example))
    (attn,) = program.attentions.values()
    rule = next(r for r in attn.rules if r.name == "score")
    s = RNG.uniform(-40, 40, N)
    idx = dict(b=0, h=RNG.integers(0, 8, N), q_idx=RNG.integers(0, 99, N),
               kv_idx=RNG.integers(0, 99, N))
    got = evaluate_score_derivative(rule, program, s=s, **idx)
    want = central_difference(lambda x: evaluate_rule(rule, program, s=x, **idx), s)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)


def test_identity_score_simplifies_to_one():
    rule, program = score_rule("s + 0.0 * f32(q_idx)")
    derivative, _ = differentiate_score(rule, program)
    (ret,) = derivative.body
    assert isinstance(ret.value, ast.FloatLit) and ret.value.value == 1.0


# ------------------------------------------------------------------ what is not differentiable
@pytest.mark.parametrize("body, at, message", [
    ("s * f32(i32(s))", "i32(s)", "'i32' makes an integer of a value computed from s"),
    ("s + f32(s > 0.0)", "s > 0.0", "'>' makes a bool of a value computed from s"),
    ("{ let k = u32(s * 2.0)\n return s * f32(k % 3) }", "u32(s",
     "'u32' makes an integer of a value computed from s"),
    ("twice(s)", "twice(s)", "cannot differentiate the score through fn 'twice'"),
])
def test_not_differentiable_is_a_located_error(body, at, message):
    rule, program = score_rule(body, "fn twice(x: f32) -> f32 { return 2.0 * x }")
    with pytest.raises(MhaError) as info:
        differentiate_score(rule, program)
    (diagnostic,) = info.value.diagnostics
    first, line, caret = diagnostic.render().splitlines()
    span = diagnostic.span
    assert first.startswith(f"t.mha:{span.line}:{span.column}: error: cannot differentiate")
    assert message in first
    assert line[span.column - 1:].startswith(at)  # the place s stops being differentiable
    assert caret == " " * (span.column - 1) + "^"


def test_an_assignment_updates_the_derivative_from_the_values_before_it():
    """`x *= v` becomes `dx = dx * v + x * dv` then `x *= v`: the derivative's assignment
    comes first, reading the value the primal one replaces."""
    rule, program = score_rule("{ var x = s\n x *= s\n return x }")
    derivative, derived = differentiate_score(rule, program)
    let, dlet, dassign, assign, ret = derivative.body
    assert isinstance(dlet, ast.Let) and dlet.mutable and dlet.value.value == 1.0
    assert isinstance(dassign, ast.Assign) and derived.refs[dassign.target].node is dlet
    assert assign is rule.body[1] and derived.refs[ret.value].node is dlet
    s = np.array([-2.0, 0.5, 3.0])
    np.testing.assert_allclose(evaluate_score_derivative(rule, program, s=s, b=0, h=0,
                                                         q_idx=0, kv_idx=0), 2 * s)


# ------------------------------------------------------------------ the lowering compiles it
@pytest.mark.parametrize("expr", COMPOSITES[:3] + COMPOSITES[4:5] + COMPOSITES[-3:])
def test_lowered_derivative_matches_the_reference(expr):
    rule, program = score_rule(expr)
    derivative, derived = differentiate_score(rule, program)
    run = host_score(derivative, derived)
    for s, h, q, kv in zip(RNG.uniform(-6, 6, 50), RNG.integers(0, 8, 50),
                           RNG.integers(0, 20, 50), RNG.integers(0, 20, 50)):
        s = float(np.float32(s))
        want = evaluate_rule(derivative, derived, s=s, b=0, h=h, q_idx=q, kv_idx=kv)
        assert run(s, 0, h, q, kv) == pytest.approx(float(want), rel=1e-4, abs=1e-6)



@pytest.mark.skipif(find_ptxas() is None, reason="ptxas not found")
def test_a_score_that_assigns_vars_builds_the_hopper_backward_without_spills():
    import mhadsl
    build = mhadsl.compile(f"""attention a {{ dtype = bf16  head_dim = 128
        mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx
        score(s, b, h, q_idx, kv_idx) {COMPOSITES[-2]} }}""")["a"].backward_build("sm_90a")
    assert build.backend == "backward_sm90"
    assert all(k.spills == 0 for k in build.assembled.kernels.values())


NAN_BESIDE_S = "log(f32(q_idx) - 10.0)"  # a NaN at q_idx < 10, 2.30 at q_idx = 20


@pytest.mark.parametrize("expr", [f"min(s, {NAN_BESIDE_S})", f"max(s, {NAN_BESIDE_S})",
                                  f"min({NAN_BESIDE_S}, s)", f"max({NAN_BESIDE_S}, s)"])
def test_min_and_max_follow_a_number_past_a_nan(expr):
    """min / max of s and a NaN are s (minnum/maxnum, NumPy's fmin/fmax), so their derivative
    is 1, in the reference and in the lowering; beside a number it follows the operand
    returned, as before."""
    rule, program = score_rule(expr)
    derivative, derived = differentiate_score(rule, program)
    run = host_score(derivative, derived)
    pick = np.fmin if expr.startswith("min") else np.fmax
    for q_idx in (3, 9, 20):
        for s in (-2.0, 0.5, 3.0):
            value = evaluate_rule(rule, program, s=s, b=0, h=0, q_idx=q_idx, kv_idx=0)
            assert value == pick(s, np.log(q_idx - 10.0) if q_idx > 10 else np.nan)
            want = 1.0 if value == s else 0.0
            assert evaluate_score_derivative(rule, program, s=s, b=0, h=0, q_idx=q_idx,
                                             kv_idx=0) == want
            assert run(s, 0, 0, q_idx, 0) == want
