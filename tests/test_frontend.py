"""Parsing, diagnostics and semantic checks of the .mha language."""
import math
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mhadsl
from helpers import EXAMPLES, REPO, STD, checked
from mhadsl.front import ast
from mhadsl.front.diagnostics import MhaError, Source
from mhadsl.front.parse import parse_source
from mhadsl.pipeline import front_end


def errors_of(text: str) -> list[str]:
    with pytest.raises(MhaError) as info:
        checked(text, "bad.mha")
    return [d.render() for d in info.value.diagnostics]


def test_std_library_and_examples_check():
    program = checked(STD)
    assert set(program.schedulers) == {"Transient", "Persistent", "Queued", "LPT",
                                       "Adaptive"}
    for path in EXAMPLES:
        front_end(path.read_text(), str(path), REPO / "examples")


def test_ast_nodes_carry_spans_and_are_frozen():
    module = parse_source(Source("t.mha", "fn f(a: u32) -> u32 {\n  return a * 2 + 1\n}"))
    fn = module.decls[0]
    assert isinstance(fn, ast.FnDecl) and fn.span.line == 1 and fn.span.column == 4
    ret = fn.body[0]
    assert isinstance(ret, ast.Return) and (ret.span.line, ret.span.column) == (2, 3)
    assert isinstance(ret.value, ast.Binary) and ret.value.op == "+"
    assert ret.value.left.op == "*"  # precedence
    with pytest.raises(AttributeError):
        fn.name = "g"


def test_syntax_error_has_location_line_and_caret():
    (msg,) = errors_of("scheduler S {\n    may_advance = true +\n}\n")
    lines = msg.splitlines()
    assert lines[0].startswith("bad.mha:3:1: error: syntax error")
    assert lines[1] == "}"
    assert lines[2] == "^"


@pytest.mark.parametrize("rule", [
    "mask(b, h, q_idx, kv_idx) { return kv_idx <= q_idx }",
    "score(s, b, h, q_idx, kv_idx) { if q_idx > kv_idx { return s } return s * 0.5 }",
    "sink(b, h) { return 0.5 }",
])
def test_a_scheduler_setting_may_follow_a_rule_written_as_a_block(rule):
    """After a block's '}' LALR's merged state offers the top-level keyword `scheduler`;
    inside a declaration's body it is read as the setting's name, as everywhere else."""
    program = mhadsl.compile(f"""import "std/schedulers.mha"
attention a {{
    {rule}
    scheduler = LPT(heads_per_section = 1)
}}
fn twice(x: i32) -> i32 {{ return 2 * x }}
attention b {{ mask(b, h, q_idx, kv_idx) = kv_idx <= twice(q_idx) }}
""")
    options = program["a"].options
    assert (options.scheduler, options.scheduler_args) == ("LPT", (("heads_per_section", 1),))
    assert program["b"].options.scheduler_named is False


def test_a_keyword_where_a_name_would_do_is_still_refused():
    """A declared name that is a keyword stays an error at its place, after a block too."""
    with pytest.raises(MhaError, match="'scheduler' is a keyword") as err:
        mhadsl.compile("fn f(x: i32) -> i32 { if x > 0 { return x } let scheduler = 2 "
                       "return scheduler }")
    assert ":1:" in str(err.value)


def test_unexpected_character():
    (msg,) = errors_of("fn f() -> u32 { return 1 $ 2 }")
    assert msg.startswith("bad.mha:1:26: error: syntax error: unexpected character '$'")


@pytest.mark.parametrize("body, message", [
    ("let x = 1\n x = 2\n return none", "cannot assign to 'x': it is a `let` constant"),
    ("n = 4\n return none", "cannot assign to 'n': it is a scheduler parameter"),
    ("return 5", "'advance' returns SeqInfo or none, not integer literal"),
    ("if state.idx { return none }\n return none", "if condition must be bool, not u32"),
    ("var t = true + 1\n return none", "operator '+' does not apply to bool and integer literal"),
    ("foo(1)\n return none", "unknown function 'foo'"),
    ("return ts.work_info(state.idx)", "'ts.work_info' takes 2 arguments, got 1"),
    ("return ts.seq_info(ts.valid_work_info(state.idx, schedule))",
     "'ts.valid_work_info' takes 3 arguments, got 2"),
    ("return ts.seq_info(ts.valid_work_info(state.idx, 1, 0))",
     "argument of 'ts.valid_work_info' must be Schedule, not integer literal"),
    ("return ts.seq_info(ts.valid_work_info(state.idx, schedule, true))",
     "argument of 'ts.valid_work_info' must be u32, not bool"),
    ("let n: i32 = ts.num_valid_work()\n return none", "'n' must be i32, not u32"),
    ("let n = ts.num_valid_work\n return none", "'ts.num_valid_work' is a method; call it"),
    ("state.slots = state.slots\n return none", "cannot assign to field 'slots' of State"),
    ("let a = undefined_thing\n return none", "unknown name 'undefined_thing'"),
    ("if true { return none }", "can reach its end without returning"),
])
def test_type_errors_in_advance(body, message):
    text = ("scheduler S(n: u32 = 3) {\n may_advance = true\n schedule = DEFAULT\n"
            " grid_dim(b, t) = (1, 1, 1)\n"
            " initial_state(slots, ts) = State(idx = 0, slots = slots, max_idx = 0)\n"
            " get_current_work_info(ts, state) = ts.work_info(state.idx, schedule)\n"
            f" advance(ts, state, p) {{\n {body}\n }}\n"
            " unsafe_seq_info(ts, state) = ts.seq_info(ts.work_info(state.idx, schedule))\n}\n")
    msgs = errors_of(text)
    assert any(message in m for m in msgs), msgs
    assert all(m.startswith("bad.mha:") for m in msgs)


def test_rule_checks_missing_duplicate_arity_and_builtins():
    text = """scheduler S {
  may_advance = true
  grid_dim(b) = (1, 1, 1)
  initial_state(slots, ts) = State(idx = 0, slots = slots, max_idx = 0)
  initial_state(slots, ts) = State(idx = 0, slots = slots, max_idx = 0)
  get_current_work_info(ts, state) = ts.work_info(producer, DEFAULT)
  advance(ts, state, p) = none
}
scheduler T {
  may_advance = false
  schedule = DEFAULT
  grid_dim(b, t) = (atomic_add(queue, 1), block_idx.x, 1)
  initial_state(slots, ts) = State(idx = 0, slots = slots, max_idx = 0)
  get_current_work_info(ts, state) = ts.work_info(state.idx, schedule)
  advance(ts, state, p) = none
  unsafe_seq_info(ts, state) = ts.seq_info(ts.work_info(state.idx, schedule))
}
"""
    msgs = "\n".join(errors_of(text))
    for expected in [
        "scheduler 'S' does not define 'schedule'",
        "rule 'grid_dim' takes 2 parameters (batch_size, max_num_prompt_tiles), got 1",
        "rule 'initial_state' is defined twice",
        "'producer' is only available in advance",
        "scheduler 'S' is missing rule 'unsafe_seq_info'",
        "'atomic_add' is not available in grid_dim",
        "'block_idx' is not available in host-side code",
    ]:
        assert expected in msgs


def test_several_errors_are_all_reported():
    msgs = errors_of("fn f() -> u32 { return true }\nfn g() -> bool { return 1 + false }\n")
    assert len(msgs) == 2
    assert msgs[0].startswith("bad.mha:1:24:") and msgs[1].startswith("bad.mha:2:25:")


def test_fn_recursion_and_redefinition_rejected():
    msgs = "\n".join(errors_of(
        "fn f(a: u32) -> u32 { return g(a) }\nfn g(a: u32) -> u32 { return f(a) }\n"
        "fn f(a: u32) -> u32 { return a }\n"))
    assert "may only call fns declared before it" in msgs
    assert "'f' is already declared" in msgs


def test_import_errors_point_at_the_import():
    (msg,) = errors_of('import "std/nope.mha"\n')
    assert "bad.mha:1:8: error: no standard library file 'std/nope.mha'" in msg
    (msg,) = errors_of('import "missing_file.mha"\n')
    assert "cannot import 'missing_file.mha'" in msg


SOURCES = [STD + "\n" + p.read_text().replace('import "std/schedulers.mha"', "")
           for p in EXAMPLES] + [(REPO / "mhadsl/std/schedulers.mha").read_text()]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_sources_only_ever_give_diagnostics(data):
    """Whatever the text, the front end answers with MhaError diagnostics or succeeds."""
    text = data.draw(st.sampled_from(SOURCES))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(text)))
        action = data.draw(st.sampled_from(["delete", "insert", "replace"]))
        piece = data.draw(st.text(alphabet=string.printable + "{}()[]", min_size=1, max_size=6))
        end = min(len(text), pos + data.draw(st.integers(1, 8)))
        if action == "delete":
            text = text[:pos] + text[end:]
        elif action == "insert":
            text = text[:pos] + piece + text[pos:]
        else:
            text = text[:pos] + piece + text[end:]
    try:
        front_end(text, "fuzz.mha", REPO)
    except MhaError as err:
        for d in err.diagnostics:
            rendered = d.render()
            assert rendered.startswith("fuzz.mha:") or rendered.startswith("std/"), rendered
            assert rendered.count("\n") == 2 and rendered.endswith("^")


@pytest.mark.parametrize("expr, value", [
    ("1.0 / sqrt(128.0)", 1.0 / math.sqrt(128.0)), ("exp(-2.0)", math.exp(-2.0)),
    ("log2(8.0) * 0.05", 0.15), ("tanh(0.5) + exp2(-3.0)", math.tanh(0.5) + 0.125)])
def test_a_constant_scale_folds_the_f32_math_functions_by_their_numpy_meaning(expr, value):
    kern = mhadsl.compile(f"{STD}\nattention a {{ dtype = bf16  head_dim = 64  scale = {expr} }}")
    assert kern["a"].options.scale == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize("expr", ["min(0.1, 0.2)", "f32(1)", "sqrt(1.0, 2.0)"])
def test_a_constant_scale_refuses_other_calls(expr):
    with pytest.raises(MhaError):
        mhadsl.compile(f"{STD}\nattention a {{ dtype = bf16  head_dim = 64  scale = {expr} }}")
