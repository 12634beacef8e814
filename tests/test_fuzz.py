"""Fuzzing the front end and the lowering: whatever the input, the answer is diagnostics
(`MhaError`, each `file:line:col` with its line and a caret) or a successful compile.

Three generators, each bounded and derandomized so CI is reproducible:
- typed programs from the grammar's productions (schedulers and fns whose expressions are
  mostly well typed, so many pass `check` and go on to LLVM IR),
- token soup: random sequences of the grammar's own tokens (well-formed-ish text),
- byte-level mutations of the shipped examples and the standard library.
The count of inputs each runs is printed at the end (`pytest -s`).
"""
import collections
import re
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import EXAMPLES, REPO
from mhadsl.front.diagnostics import MhaError
from mhadsl.front.sources import decode_source
from mhadsl.pipeline import CompileOptions, compile_stages, front_end

RUNS = collections.Counter()  # generator -> inputs run
OUTCOMES = collections.Counter()  # "diagnostics" or "compiled"
LOWER_SECONDS = 10  # one input's check and lowering to LLVM IR


def fuzz(runs: int):
    return settings(max_examples=runs, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


def assert_diagnostics_or_success(text: str, name: str = "fuzz.mha") -> None:
    """Check; a program that passes and declares no attention kernel is lowered to LLVM
    IR too. (An attention kernel's build runs LLVM and ptxas for seconds: the hostile
    attention settings are tests of their own in test_hostile_input.py.)"""
    start = time.perf_counter()
    try:
        _, program = front_end(text, name, REPO / "examples")
        if not program.attentions:
            compile_stages(text, name, CompileOptions(), until="llvm", base_dir=REPO / "examples")
    except MhaError as err:
        OUTCOMES["diagnostics"] += 1
        for d in err.diagnostics:
            rendered = d.render()
            assert re.match(r"[^\n]+:\d+:\d+: error: ", rendered), rendered
            assert rendered.count("\n") == 2 and rendered.endswith("^"), rendered
    else:
        OUTCOMES["compiled"] += 1
    assert time.perf_counter() - start < LOWER_SECONDS


# ------------------------------------------------------------ typed programs
U32_ATOMS = ["state.idx", "state.max_idx", "grid_dim.x", "block_idx.x", "num_heads", "tile_m",
             "ts.batch_size", "ts.max_num_prompt_tiles", "ts.num_work()", "pipeline_idx",
             "num_sms", "state.slots[pipeline_idx]", "x", "0", "1", "7", "4294967295", "40"]
BINARY = ["+", "-", "*", "/", "%", "<<", ">>", "&", "|", "^"]
COMPARE = ["==", "!=", "<", "<=", ">", ">="]


def u32_expr(depth: int = 3):
    atoms = st.sampled_from(U32_ATOMS)
    if depth == 0:
        return atoms
    sub = st.deferred(lambda: u32_expr(depth - 1))
    return st.one_of(
        atoms,
        st.tuples(sub, st.sampled_from(BINARY), sub).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(st.sampled_from(["min", "max", "cdiv"]), sub, sub).map(
            lambda t: f"{t[0]}({t[1]}, {t[2]})"),
        st.tuples(bool_expr(depth - 1), sub, sub).map(lambda t: f"where({t[0]}, {t[1]}, {t[2]})"),
        sub.map(lambda e: f"u32(i32({e}) - 3)"),
        sub.map(lambda e: f"~{e}"),
    )


def bool_expr(depth: int = 2):
    sub = st.deferred(lambda: u32_expr(max(depth - 1, 0)))
    compare = st.tuples(sub, st.sampled_from(COMPARE), sub).map(lambda t: " ".join(t))
    if depth == 0:
        return compare
    inner = st.deferred(lambda: bool_expr(depth - 1))
    return st.one_of(compare, st.just("producer"),
                     st.tuples(inner, st.sampled_from(["&&", "||"]), inner).map(
                         lambda t: f"({t[0]} {t[1]} {t[2]})"),
                     inner.map(lambda e: f"!({e})"))


def statements(depth: int = 2):
    assign = st.tuples(st.sampled_from(["x", "state.idx", "state.slots[pipeline_idx]"]),
                       st.sampled_from(["=", "+=", "^=", ">>=", "%="]), u32_expr(2)).map(
        lambda t: f"{t[0]} {t[1]} {t[2]}")
    simple = st.one_of(assign, st.just("barrier(sync)"), st.just("return none"),
                       u32_expr(2).map(lambda e: f"return ts.seq_info(ts.work_info({e}, "
                                                 f"schedule))"))
    if depth == 0:
        return st.lists(simple, max_size=3).map("\n".join)
    inner = st.deferred(lambda: statements(depth - 1))
    block = st.one_of(
        simple,
        st.tuples(bool_expr(1), inner, inner).map(
            lambda t: f"if {t[0]} {{\n{t[1]}\n}} else {{\n{t[2]}\n}}"),
        st.tuples(bool_expr(1), inner).map(
            lambda t: f"var n = 0\nwhile {t[0]} && n < 3 {{\nn += 1\n{t[1]}\n}}"),
    )
    return st.lists(block, max_size=4).map("\n".join)


@st.composite
def typed_programs(draw) -> str:
    helper = draw(u32_expr(2)).replace("pipeline_idx", "a").replace("state.", "").replace(
        "slots[a]", "a").replace("ts.", "")  # a fn sees only its parameter and builtins
    fn = f"fn helper(a: u32) -> u32 {{\n let x = a\n return {helper}\n}}\n" \
        if draw(st.booleans()) else ""
    advance = draw(statements())
    max_idx = draw(u32_expr(2).filter(lambda e: "state" not in e and "pipeline" not in e
                                      and e != "x"))
    return f"""{fn}scheduler Fuzz(order: Schedule = DEFAULT) {{
    may_advance = {draw(st.sampled_from(["true", "false"]))}
    schedule = order
    grid_dim(batch_size, max_num_prompt_tiles) = (max(min(num_sms, batch_size), 1), 1, 1)
    initial_state(slots, ts) = State(idx = block_idx.x, slots = slots, max_idx = {max_idx})
    get_current_work_info(ts, state) = ts.work_info(state.idx, schedule)
    advance(ts, state, pipeline_idx) {{
        var x = {draw(u32_expr(1))}
{advance}
        return none
    }}
    unsafe_seq_info(ts, state) = ts.seq_info(ts.work_info(state.idx, schedule))
}}
""".replace("x = x", "x = 1").replace("where(producer", "where(true")


@fuzz(120)
@given(typed_programs())
def test_typed_programs_check_and_lower_or_give_diagnostics(text):
    RUNS["typed programs"] += 1
    assert_diagnostics_or_success(text.replace("helper(", "helper(" if "fn helper" in text
                                               else "min(1, "))


# ------------------------------------------------------------ token soup
TOKENS = ["import", '"std/schedulers.mha"', "scheduler", "attention", "fn", "let", "var",
          "if", "else", "while", "return", "true", "false", "none", "{", "}", "(", ")", "[",
          "]", ",", ":", ";", ".", "=", "->", "+", "-", "*", "/", "%", "<<", ">>", "&", "|",
          "^", "~", "!", "&&", "||", "==", "!=", "<", "<=", ">", ">=", "+=", "<<=", "0", "1",
          "0x10", "1.5", "1e3", "99999999999999999999", "u32", "i32", "bool", "State",
          "WorkInfo", "SeqInfo", "ts", "state", "idx", "x", "S", "mask", "score", "advance",
          "grid_dim", "block_idx", "dtype", "bf16", "head_dim", "128", "tile", "LPT", "min",
          "where", "// c\n", "/* c */", "\n", "\t", "\ufeff", "\x00", "é"]


@fuzz(250)
@given(st.lists(st.sampled_from(TOKENS), max_size=60))
def test_token_soup_gives_diagnostics_or_compiles(tokens):
    RUNS["token soup"] += 1
    assert_diagnostics_or_success(" ".join(tokens))


@fuzz(80)
@given(st.lists(st.sampled_from(TOKENS), max_size=30), st.integers(0, 2000))
def test_token_soup_inside_a_real_program(tokens, where):
    RUNS["token soup in a program"] += 1
    text = (REPO / "examples/queued_rotate.mha").read_text()
    where = min(where, len(text))
    assert_diagnostics_or_success(text[:where] + " ".join(tokens) + text[where:])


# ------------------------------------------------------------ byte mutations
SOURCES = [p.read_bytes() for p in EXAMPLES] + [(REPO / "mhadsl/std/schedulers.mha").read_bytes()]


@st.composite
def mutated_bytes(draw) -> bytes:
    data = bytearray(draw(st.sampled_from(SOURCES)))
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(data)))
        end = min(len(data), at + draw(st.integers(1, 40)))
        action = draw(st.sampled_from(["delete", "insert", "replace", "duplicate", "flip"]))
        if action == "delete":
            del data[at:end]
        elif action == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif action == "replace":
            data[at:end] = draw(st.binary(min_size=1, max_size=8))
        elif action == "duplicate":
            data[at:at] = data[at:end]
        elif at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
    return bytes(data)


@fuzz(300)
@given(mutated_bytes())
def test_mutated_examples_give_diagnostics_or_compile(data):
    RUNS["byte mutations"] += 1
    try:
        text = decode_source("fuzz.mha", data).text
    except MhaError as err:
        OUTCOMES["diagnostics"] += 1
        assert "not UTF-8" in err.render()
        return
    assert_diagnostics_or_success(text)


def teardown_module():
    print(f"\nfuzzed inputs: {dict(RUNS)} = {sum(RUNS.values())}; outcomes: {dict(OUTCOMES)}")
