"""Hostile inputs against operands, sinks, fns, the references and the command line, each
once a Python traceback or a wrong value: every one is now a located diagnostic from
`check`, or a TypeError/ValueError naming the argument."""
from __future__ import annotations

import re

import numpy as np
import pytest

import mhadsl
from helpers import EXAMPLES, checked
from mhadsl.front.attention_spec import Operand
from mhadsl.front.diagnostics import MhaError

STD = 'import "std/schedulers.mha"\n'


def diagnostics(text: str) -> list[str]:
    """The rendered diagnostics `check` gives `text` (a test.mha after the std import)."""
    with pytest.raises(MhaError) as info:
        checked(STD + text, "bad.mha")
    rendered = [d.render() for d in info.value.diagnostics]
    assert all(re.match(r"bad\.mha:\d+:\d+: error: ", r) and "^" in r for r in rendered)
    return rendered


# ---------------------------------------------------------------- constants
@pytest.mark.parametrize("text, where, message", [
    # a float setting from a division of integer literals: was a ZeroDivisionError (1/0),
    # or silently 3.5 where the language's `7 / 2` is 3
    ("attention a { scale = 1/0 }", "2:23", "1 / 0 divides two integers, which gives 0"),
    ("attention a { scale = 1 / 8 }", "2:23", "write 1.0 / 8 for a float"),
    ("attention a(w: f32 = 1 / 0) { score(s, b, h, q_idx, kv_idx) = s * w }", "2:22",
     "1 / 0 divides two integers"),
    ("attention a(w: f32 = 2.0 * (7 / 2)) { score(s, b, h, q_idx, kv_idx) = s * w }",
     "2:29", "7 / 2 divides two integers, which gives 3"),
])
def test_a_float_constant_from_an_integer_division_is_a_diagnostic(text, where, message):
    errors = diagnostics(text)
    assert any(e.startswith(f"bad.mha:{where}: error: ") and message in e for e in errors), \
        errors


def test_an_i32_default_is_the_checkers_exact_integer():
    """An i32 default was computed in floats (`4611686018427387903 / 2147483648` gave
    2147483648, past i32, where the exact quotient is 2147483647) and `1 / 0` raised
    ZeroDivisionError; integer literals now fold as the language folds them."""
    program = mhadsl.compile(
        STD + "attention a(w: i32 = 4611686018427387903 / 2147483648, "
              "x: i32 = 4611686018427387903 / 2147483648 - 2147483647, y: i32 = 1 / 0, "
              "z: i32 = -7 / 2, c: f32 = 8 / 2) {\n"
              "  mask(b, h, q_idx, kv_idx) = kv_idx < w + x + y + z\n"
              "  score(s, b, h, q_idx, kv_idx) = s * c }")
    assert [o.default for o in program["a"].options.operands] == [2147483647, 0, 0, -3, 4.0]
    assert program["a"].options.operands[-1].default == 4.0
    exact = mhadsl.compile(STD + "attention a { scale = 8 / 2 }")["a"]
    assert exact.options.scale == 4.0


# ---------------------------------------------------------------- tensor operands
@pytest.mark.parametrize("body, where, message", [
    # each crashed the tile classification or the lowering (KeyError, AttributeError)
    ("mask(b, h, q_idx, kv_idx) { let x = t\n return x[b][h] > 0 }", "3:39",
     "'x' cannot hold a tensor (i32[batch, heads])"),
    ("mask(b, h, q_idx, kv_idx) { var x = t[b]\n return x[h] > 0 }", "3:39",
     "'x' cannot hold a tensor (i32[heads])"),
    ("mask(b, h, q_idx, kv_idx) = where(b > 0, t[b], t[0])[h] > 0", "3:44",
     "'where' cannot choose a tensor (i32[heads])"),
])
def test_a_tensor_operand_is_read_only_by_indexing_it(body, where, message):
    errors = diagnostics(f"attention a(t: i32[batch, heads]) {{ head_dim = 64\n  {body} }}")
    assert len(errors) == 1, errors  # no follow-on error at the index
    assert errors[0].startswith(f"bad.mha:{where}: error: ") and message in errors[0], errors


@pytest.mark.parametrize("name", ["self", "kernel", "cell", "operand_grads", "k_scale",
                                  "v_scale"])
def test_an_operand_may_not_take_a_parameter_name_of_the_calls(name):
    """`kern(q, k, v, self=1)`, `reference(kern, ..., kernel=1)`,
    `reference_block_classes(..., cell=...)`, `backward(..., operand_grads=...)` and a
    decode call's `k_scale=` would never reach such an operand."""
    errors = diagnostics(f"attention a({name}: f32[heads]) {{ head_dim = 64\n"
                         f"  score(s, b, h, q_idx, kv_idx) = s + {name}[h] }}")
    assert any(e.startswith("bad.mha:2:13: error: ") and f"'{name}' is a parameter of the "
               "calls that take operands by name" in e for e in errors), errors


@pytest.mark.parametrize("name", ["min", "tanh", "where", "exp2"])
def test_an_operand_may_not_take_a_builtin_functions_name(name):
    errors = diagnostics(f"attention a({name}: i32) {{ head_dim = 64\n"
                         f"  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx + {name} }}")
    assert any(e.startswith("bad.mha:2:13: error: ") and f"'{name}' is a builtin function"
               in e for e in errors), errors


# ---------------------------------------------------------------- records and grids
@pytest.mark.parametrize("text, where, what", [
    # the reference raised NotImplementedError; a grid in a let crashed the lowering
    ("fn f(x: i32) -> WorkInfo { return WorkInfo(prompt_offset = 0, head_idx = 0, "
     "prompt_idx = 0, is_valid = true) }\n"
     "attention a { head_dim = 64\n  mask(b, h, q_idx, kv_idx) = f(b).is_valid }",
     "4:31", "a WorkInfo value"),
    ("attention a { head_dim = 64\n  mask(b, h, q_idx, kv_idx) = SeqInfo(seq_len = 1, "
     "start_of_seq = 0, prompt_offset = 0, head_idx = 0, prompt_idx = 0).is_valid }",
     "3:31", "a SeqInfo value"),
    ("attention a { head_dim = 64\n  mask(b, h, q_idx, kv_idx) { let t = (1, 2, 3)\n"
     "  return true } }", "3:39", "value has no meaning in attention code"),
])
def test_records_and_grids_have_no_meaning_in_attention_code(text, where, what):
    errors = diagnostics(text)
    assert any(e.startswith(f"bad.mha:{where}: error: ") and what in e for e in errors), errors


SCHEDULER = '''scheduler S(num_ctas: u32 = num_sms) {
    may_advance = false
    schedule = DEFAULT
    grid_dim(batch_size, max_num_prompt_tiles) { GRID }
    initial_state(slots, ts) = State(idx = block_idx.x, slots = slots, max_idx = ts.num_work())
    get_current_work_info(ts, state) = ts.work_info(state.idx, schedule)
    advance(ts, state, pipeline_idx) = none
    unsafe_seq_info(ts, state) = ts.seq_info(ts.work_info(state.idx, schedule))
}
'''


@pytest.mark.parametrize("grid, where, message", [
    ("let g = (max_num_prompt_tiles, 1, batch_size)\n return g", "4:58",
     "'g' cannot hold a grid"),
    ("return where(batch_size > 1, (max_num_prompt_tiles, 1, batch_size), (1, 1, 1))",
     "4:79", "'where' cannot choose a grid"),
])
def test_a_grid_is_returned_where_it_is_built(grid, where, message, tmp_path, capsys):
    """Both passed `check` and then crashed `compile` and `simulate` with a traceback."""
    from mhadsl.cli import main
    path = tmp_path / "bad.mha"
    path.write_text(SCHEDULER.replace("GRID", grid))
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"bad.mha:{where}: error: {message}" in err and "Traceback" not in err
    assert main(["simulate", str(path), "--scheduler", "S", "--seqlens", "100,200"]) == 1
    assert "Traceback" not in capsys.readouterr().err


# ---------------------------------------------------------------- call values
@pytest.mark.parametrize("operand, value, error, message", [
    (Operand("c", "f32"), 10 ** 400, ValueError,
     "operand 'c' must be a finite f32, got an integer of 1329 bits"),  # was OverflowError
    (Operand("w", "i32"), 10 ** 5000, ValueError,  # was Python's int-to-str limit
     "operand 'w' is i32: an integer of 16610 bits is out of its range"),
    (Operand("w", "i32"), -2 ** 31 - 1, ValueError, "-2147483649 is out of its range"),
], ids=["f32-10**400", "i32-10**5000", "i32-min-1"])
def test_an_operand_value_past_any_range_is_a_value_error(operand, value, error, message):
    with pytest.raises(error, match=re.escape(message)):
        operand.value(value)


REL = STD + '''attention rel(table: f32[heads, _]) {
    head_dim = 64
    score(s, b, h, q_idx, kv_idx) = s + table[h][q_idx - kv_idx + 3]
}
attention docs(doc: i32[queries], doc_k: i32[keys]) {
    head_dim = 64
    mask(b, h, q_idx, kv_idx) = doc[q_idx] == doc_k[kv_idx] && kv_idx <= q_idx
}
'''


@pytest.fixture(scope="module")
def program():
    return mhadsl.compile(REL)


def test_operand_grads_reads_its_names_once(program):
    """A generator of names was read twice (checked, then consumed): the gradients were
    silently left out. A value that is no collection of names names the argument."""
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 5, 2, 64)) for _ in range(4))
    table = rng.standard_normal((2, 9)).astype(np.float32)
    want = mhadsl.reference_backward(program["rel"], q, k, v, do, table=table,
                                     operand_grads=("table",))
    got = mhadsl.reference_backward(program["rel"], q, k, v, do, table=table,
                                    operand_grads=(n for n in ["table"]))
    assert len(got) == 4 and np.array_equal(got[3]["table"], want[3]["table"])
    for bad in (None, 1):
        with pytest.raises(TypeError, match="operand_grads takes operand names"):
            mhadsl.reference_backward(program["rel"], q, k, v, do, table=table,
                                      operand_grads=bad)


@pytest.mark.parametrize("cell, error, message", [
    ((0, 4), ValueError, "cell must be two sizes from 1 to 2\\*\\*31 - 1"),  # ZeroDivisionError
    ((-4, 4), ValueError, "cell must be two sizes"),
    ((2 ** 40, 4), ValueError, "cell must be two sizes"),  # tried to allocate 8 TiB
    ((4,), TypeError, "cell takes \\(query rows, keys\\)"),
    (4, TypeError, "cell takes"),
    ((4.0, 4), TypeError, "cell takes"),
    ((True, 4), TypeError, "cell takes"),
])
def test_reference_block_classes_checks_its_cell(program, cell, error, message):
    q = np.zeros((2, 8, 2, 64))
    doc = np.zeros(8, np.int32)
    with pytest.raises(error, match=message):
        mhadsl.reference_block_classes(program["docs"], q, q, cell=cell, doc=doc, doc_k=doc)


def test_a_cell_larger_than_the_sequences_costs_no_memory(program):
    """A cell of 2**30 x 2**30 pairs over 8 x 8 was padded to its size (an exabyte)."""
    q = np.zeros((2, 8, 2, 64))
    doc = np.array([0, 0, 0, 0, 1, 1, 1, 1], np.int32)
    huge = mhadsl.reference_block_classes(program["docs"], q, q, cell=(2 ** 30, 2 ** 30),
                                          doc=doc, doc_k=doc)
    small = mhadsl.reference_block_classes(program["docs"], q, q, cell=(8, 8), doc=doc,
                                           doc_k=doc)
    assert huge.shape == small.shape == (2, 1, 1, 1) and np.array_equal(huge, small)


# ---------------------------------------------------------------- the command line
def test_the_simulator_checks_a_position_axis_against_the_lengths(tmp_path, capsys):
    """A `queries`/`keys` tensor of any length was taken (its reads past the end silently
    0 in the cost model); `--seqlens` fixes it: every sequence's rows one after another,
    or with a batch axis the longest sequence's."""
    from mhadsl.cli import main
    path = tmp_path / "docs.mha"
    path.write_text(REL + '''attention bq(t: i32[batch, queries]) {
    head_dim = 64
    mask(b, h, q_idx, kv_idx) = t[b][q_idx] == 0
}
''')
    base = ["simulate", str(path), "--scheduler", "LPT", "--seqlens", "100,200", "--heads", "2"]
    assert main(base + ["--kernel", "docs", "--operand", "doc=1,2"]) == 2
    assert ("--operand doc: tensor operand 'doc' (i32[queries]): axis 0 (queries) has 2 "
            "entries, but the call has 300 query rows") in capsys.readouterr().err
    np.save(tmp_path / "t.npy", np.zeros((2, 3), np.int32))
    assert main(base + ["--kernel", "bq", "--operand", f"t={tmp_path / 't.npy'}"]) == 2
    assert "axis 1 (queries) has 3 entries, but the call has 200 query rows" in \
        capsys.readouterr().err
    np.save(tmp_path / "docs.npy", np.repeat(np.arange(3, dtype=np.int32), 100))
    np.save(tmp_path / "t.npy", np.zeros((2, 200), np.int32))
    assert main(base + ["--kernel", "docs", "--operand", f"doc={tmp_path / 'docs.npy'}",
                        "--operand", f"doc_k={tmp_path / 'docs.npy'}"]) == 0
    assert main(base + ["--kernel", "bq", "--operand", f"t={tmp_path / 't.npy'}"]) == 0
    capsys.readouterr()


def test_the_simulator_refuses_a_float_no_f32_holds(tmp_path, capsys):
    """A float64 .npy element past f32's range became inf with a NumPy warning."""
    from mhadsl.cli import main
    path = str(next(p for p in EXAMPLES if p.name == "relative_bias.mha"))
    kern = mhadsl.compile(path)
    name = next(iter(kern.keys()))
    operand = next(o for o in kern[name].options.operands if o.type == "f32" and o.axes)
    np.save(tmp_path / "big.npy", np.full((2,) * len(operand.axes), 1e40))
    status = main(["simulate", path, "--scheduler", "LPT", "--kernel", name, "--seqlens",
                   "100,200", "--heads", "2", "--operand",
                   f"{operand.name}={tmp_path / 'big.npy'}"])
    err = capsys.readouterr().err
    assert status == 2 and f"--operand {operand.name}: an element is out of f32's range" in err
    assert "Warning" not in err
