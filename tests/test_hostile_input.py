"""Hostile .mha input: every case ends in diagnostics (file:line:col, the line, a caret)
or a successful compile to PTX -- never a Python exception, a hang or a memory blow-up."""
import os
import re
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

import mhadsl
from helpers import REPO
from mhadsl.front.check import check_program
from mhadsl.cli import main as cli_main
from mhadsl.codegen.backends import declaration_problems
from mhadsl.front.diagnostics import MAX_ERRORS, MhaError
from mhadsl.front.parse import MAX_EXPR_DEPTH, MAX_STMT_DEPTH, load_program
from mhadsl.pipeline import CompileOptions, compile_stages, front_end
from mhadsl.front.sources import MAX_SOURCE_BYTES, read_source_file

STD = 'import "std/schedulers.mha"\n'


def scheduler(advance: str = "", *, name: str = "S", max_idx: str = "ts.num_work()") -> str:
    """A complete scheduler whose `advance` runs `advance`'s statements, then ends."""
    return f"""scheduler {name} {{
 may_advance = true
 schedule = DEFAULT
 grid_dim(b, t) = (1, 1, 1)
 initial_state(slots, ts) = State(idx = block_idx.x, slots = slots, max_idx = {max_idx})
 get_current_work_info(ts, state) = ts.work_info(state.idx, schedule)
 advance(ts, state, p) {{
 {advance}
 return none }}
 unsafe_seq_info(ts, state) = ts.seq_info(ts.work_info(state.idx, schedule))
}}
"""


def attention(*lines: str) -> str:
    return STD + "attention A {\n " + "\n ".join(lines) + "\n}\n"


def outcome(text: str, tmp_path: Path, name: str = "h.mha") -> str:
    """Compile to PTX: "ok", or the rendered diagnostics, each checked for its shape."""
    (tmp_path / name).write_text(text)
    try:
        compile_stages(text, name, CompileOptions(), until="ptx", base_dir=tmp_path)
    except MhaError as err:
        for d in err.diagnostics:
            rendered = d.render()
            assert re.match(r"[^:\n]+:\d+:\d+: error: ", rendered), rendered
            assert rendered.count("\n") == 2 and rendered.endswith("^"), rendered
        return err.render()
    return "ok"


def error_of(text: str, tmp_path: Path, name: str = "h.mha") -> str:
    result = outcome(text, tmp_path, name)
    assert result != "ok", "expected a diagnostic"
    return result


def test_empty_file(tmp_path):
    assert outcome("", tmp_path) == "ok"


def test_only_comments(tmp_path):
    assert outcome("// a comment\n/* a block\n   comment */\n// last, no newline", tmp_path) == "ok"


def test_non_utf8_bytes_point_at_the_first_bad_byte(tmp_path):
    (tmp_path / "bad.mha").write_bytes(b"// ok\nfn f() -> u32 { return 1 } // caf\xe9\n")
    (tmp_path / "top.mha").write_text('import "bad.mha"\n')
    with pytest.raises(MhaError) as info:
        front_end('import "bad.mha"\n', "top.mha", tmp_path)
    (d,) = info.value.diagnostics
    assert d.render().startswith(f"{tmp_path / 'bad.mha'}:2:34: error: this file is not UTF-8 "
                                 f"text: byte 0xe9 cannot be decoded")
    with pytest.raises(MhaError, match="bad.mha:2:34: error: this file is not UTF-8"):
        mhadsl.compile(tmp_path / "bad.mha")  # the API reads files the same way


def test_nul_byte(tmp_path):
    message = error_of("fn f() -> u32 { return 1 }\x00\n", tmp_path)
    assert message.startswith("h.mha:1:27: error: syntax error: unexpected character '\\x00'")
    assert "\x00" not in message  # shown as '?', so the caret lines up on a terminal


def test_utf8_byte_order_mark_is_accepted(tmp_path):
    assert outcome("\ufeff" + STD + scheduler(), tmp_path) == "ok"
    (tmp_path / "bom.mha").write_bytes(b"\xef\xbb\xbf" + scheduler(name="B").encode())
    assert outcome('import "bom.mha"\n', tmp_path) == "ok"


def _repeat(make, size: int) -> str:
    parts, total = [], 0
    while total < size:
        parts.append(make(len(parts)))
        total += len(parts[-1])
    return "".join(parts)


def test_five_megabyte_file(tmp_path):
    text = _repeat(lambda i: f"// line {i}: a long comment, as a generated file might hold\n"
                             + (scheduler(name=f"S{i}") if i % 2000 == 0 else ""), 5_000_000)
    (tmp_path / "big.mha").write_text(text)
    start = time.perf_counter()
    _, program = front_end(text, "big.mha")
    assert len(program.schedulers) > 40  # within MAX_SCHEDULERS
    assert time.perf_counter() - start < 30  # a few seconds


def _check_seconds(text: str) -> float:
    start = time.perf_counter()
    try:
        front_end(text, "big.mha")
    except MhaError as err:
        err.render()
    return time.perf_counter() - start


def test_front_end_time_is_linear_in_the_input():
    """4x the schedulers (distinct, then all duplicates) take about 4x the time, not 16x."""
    for make in (lambda i: scheduler("state.idx += grid_dim.x", name=f"S{i}"),
                 lambda i: scheduler(name="Same")):
        # the best of three runs each, the sizes taken in turn so both meet the same load
        # (other processes on the machine only ever add time)
        texts = [_repeat(make, size) for size in (100_000, 400_000)]
        runs = [[_check_seconds(text) for text in texts] for _ in range(3)]
        small, large = (min(times) for times in zip(*runs))
        assert large < 8 * small, (small, large)


def test_many_duplicates_list_a_bounded_number_of_errors():
    text = _repeat(lambda i: scheduler(name="Same"), 1_000_000)
    modules = load_program(text, "dup.mha", Path.cwd())
    tracemalloc.start()
    with pytest.raises(MhaError) as info:
        check_program(modules, declaration_problems)
    rendered = info.value.render()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    duplicates = text.count("scheduler Same") - 1
    assert len(info.value.diagnostics) == MAX_ERRORS
    assert rendered.endswith(f"... and {duplicates - MAX_ERRORS} more errors")
    assert rendered.count("error: 'Same' is already declared") == MAX_ERRORS
    # Rendering split the whole text into lines once per error: 1 GB for 5 MB.
    assert peak < 50_000_000


def test_two_thousand_deep_parentheses_are_one_expression(tmp_path):
    assert outcome(STD + scheduler("state.idx += " + "(" * 2000 + "1" + ")" * 2000),
                   tmp_path) == "ok"


def test_deeply_nested_calls_are_a_diagnostic(tmp_path):
    message = error_of(STD + scheduler("state.idx += " + "min(" * 2000 + "1" + ", 1)" * 2000),
                       tmp_path)
    # The 100th call: its name is the 101st level.
    assert f"h.mha:9:{15 + 4 * (MAX_EXPR_DEPTH - 1)}: error: expression nested too deeply" in message


def test_flat_five_thousand_term_chains_go_through_every_stage(tmp_path, monkeypatch):
    """A flat chain is not nesting: check, LLVM IR, the host simulator, the
    mask's classification and the reference all loop over it. (A kernel's mask and score
    are capped in size for LLVM's sake, a separate rule: lifted here, tested below.)"""
    import numpy as np
    from mhadsl.front import check
    monkeypatch.setattr(check, "MAX_KERNEL_RULE_NODES", check.MAX_INLINED_NODES)
    from mhadsl.analysis.classify import classify_tile
    from mhadsl.codegen.scheduler import SchedulerSpec
    from mhadsl.analysis.reference import attention_reference
    from mhadsl.analysis.simulate import Batch, simulate
    terms = 5_000
    # Each adds 0 (or nothing) to a correct rule; the bodies stay under MAX_INLINED_NODES.
    sched = STD + scheduler("state.idx += grid_dim.x" + " + p - p" * (terms // 2))
    compiled = compile_stages(sched, "h.mha", CompileOptions(), until="llvm")
    assert compiled.artifacts["llvm"].count(" = sub i32 ") >= terms // 2
    result = simulate(compiled.checked, SchedulerSpec("S", (), 128),
                      Batch([300], 2, 128, False), ctas=1)
    assert result.terminated and len(result.missing) == result.tiles - 1  # one tile per CTA
    mask = f"kv_idx * {terms} <= " + " + ".join(["q_idx"] * terms) + " && (" + \
        " && ".join(["kv_idx <= q_idx"] * 1000) + ")"
    score = " + ".join(["s"] * terms) + f" - {terms - 1}.0 * s"
    _, program = front_end(attention(f"mask(b, h, q_idx, kv_idx) = {mask}",
                                     f"score(s, b, h, q_idx, kv_idx) = {score}"), "h.mha")
    rules = {r.name: r for r in program.attentions["A"].rules}
    assert classify_tile(rules["mask"], program, b=0, h=0, q_lo=0, q_hi=127, kv_lo=128,
                         kv_hi=191, seqlen_q=512, seqlen_k=512) == "empty"
    q = np.random.default_rng(0).standard_normal((1, 8, 1, 64))
    out = attention_reference(q, q, q, mask_rule=rules["mask"], score_rule=rules["score"],
                              program=program)
    assert np.allclose(out, attention_reference(q, q, q, mask_rule=rules["mask"],
                                                program=program))


def test_a_kernels_mask_past_its_size_limit_is_a_located_diagnostic(tmp_path):
    """LLVM's optimiser grows faster than a mask (15 s at 300 terms, 95 s at 900, minutes and
    once a crash at 5,000); the kernel evaluates it for every element of its register tiles."""
    mask = "kv_idx <= " + " + ".join(["q_idx"] * 400)
    message = error_of(attention(f"mask(b, h, q_idx, kv_idx) = {mask}"), tmp_path)
    assert re.search(r":\d+:\d+: error: 'mask' is too big: \d+ expressions and statements "
                     r"once the fns it calls are inlined \(limit 600: the kernel", message)
    front_end(attention("mask(b, h, q_idx, kv_idx) = kv_idx <= "
                        + " + ".join(["q_idx"] * 250)), "h.mha")  # checks


def test_deep_nesting_is_still_limited(tmp_path):
    message = error_of(STD + scheduler("state.idx += " + "1 + (" * 200 + "1" + ")" * 200), tmp_path)
    assert "error: expression nested too deeply (limit 100" in message


def test_integer_literal_past_64_bits(tmp_path):
    for literal in ("18446744073709551616", "0x10000000000000000", "9" * 5000):
        message = error_of(STD + scheduler(max_idx=literal), tmp_path)
        assert message.startswith("h.mha:6:79: error: integer constant does not fit in 64 bits")
    # Leading zeros are not digits of the value.
    assert outcome(STD + scheduler(max_idx="0" * 5000 + "7"), tmp_path) == "ok"


def test_shift_by_40(tmp_path):
    """A shift by 32 or more gives 0: each statement compiles to PTX, and the host JIT (what
    the simulator runs) computes 0 where a count taken modulo 32 would not."""
    import ctypes
    from mhadsl.codegen.scheduler import SchedulerSpec
    from mhadsl.analysis.simulate import HostScheduler, _Env, _TileSummary
    start, step = 0xFFFFFFFF, 7
    for advance, want in (("state.idx += grid_dim.x << 40", start),
                          ("state.idx = state.idx >> 40", 0),
                          ("let k = 40\n state.idx <<= k", 0)):
        # The same statement in grid_dim, on locals, with the result as the grid's x.
        on_host = advance.replace("state.idx", "idx").replace("grid_dim.x", "step")
        text = STD + scheduler(advance).replace(
            "grid_dim(b, t) = (1, 1, 1)",
            f"grid_dim(b, t) {{\n var idx = b\n let step = t\n {on_host}\n return (idx, 1, 1) }}")
        assert outcome(text, tmp_path) == "ok"
        host = HostScheduler(front_end(text, "h.mha")[1], SchedulerSpec("S"))
        env, grid = _Env(None, 1), (ctypes.c_uint32 * 3)()
        env.fuel = 1000
        host.grid_dim(ctypes.byref(env), ctypes.byref(_TileSummary()), start, step, grid)
        assert grid[0] == want, (advance, grid[0])


def test_recursion_between_fns(tmp_path):
    message = error_of("fn f(a: u32) -> u32 { return g(a) }\n"
                       "fn g(a: u32) -> u32 { return f(a) }\n", tmp_path)
    assert "h.mha:1:30: error: fn 'f' may only call fns declared before it" in message


def test_fn_chains_that_inline_too_deep_or_too_big(tmp_path):
    # (named g0, g1, ...: `f32` is the builtin cast)
    deep = "fn g0(a: u32) -> u32 { return a }\n" + "".join(
        f"fn g{i}(a: u32) -> u32 {{ return g{i - 1}(a) + 1 }}\n" for i in range(1, 300))
    message = error_of(deep, tmp_path)
    assert "error: fn 'g53' nests 161 levels deep once the fns it calls are inlined (limit 160)" \
        in message
    assert message.count("error:") == 1  # the callers are not reported again
    doubling = "fn g0(a: u32) -> u32 { return a }\n" + "".join(
        f"fn g{i}(a: u32) -> u32 {{ return g{i - 1}(a) + g{i - 1}(a + 1) }}\n"
        for i in range(1, 60))
    message = error_of(doubling, tmp_path)
    assert "is too big:" in message and message.count("error:") == 1


def test_nesting_at_the_limits_compiles_through_every_stage(tmp_path):
    """The limits leave room: the deepest accepted code still compiles and simulates."""
    from mhadsl.codegen.scheduler import SchedulerSpec
    from mhadsl.analysis.simulate import Batch, simulate
    # grid_dim.x is two levels: an attribute of a name.
    calls = "min(" * (MAX_EXPR_DEPTH - 2) + "grid_dim.x" + ", 9)" * (MAX_EXPR_DEPTH - 2)
    blocks = MAX_STMT_DEPTH - 1
    text = STD + scheduler("if state.idx < 5 {" * blocks + f"state.idx += {calls}" + "}" * blocks)
    assert outcome(text, tmp_path) == "ok"
    _, program = front_end(text, "h.mha")
    result = simulate(program, SchedulerSpec("S", (), 128), Batch([300], 2, 128, ragged=False),
                      ctas=2)
    assert result.covered_exactly_once is not None
    mask = "min(" * (MAX_EXPR_DEPTH - 3) + "q" + ", 1 + q)" * (MAX_EXPR_DEPTH - 3) + " >= k"
    assert outcome(attention(f"mask(b, h, q, k) = {mask}"), tmp_path) == "ok"
    deeper = STD + scheduler("if true {" * (blocks + 1) + "state.idx += 1" + "}" * (blocks + 1))
    assert "statements nested too deeply" in error_of(deeper, tmp_path)


def test_import_cycle_names_the_chain(tmp_path):
    (tmp_path / "a.mha").write_text('import "b.mha"\nfn fa() -> u32 { return 1 }\n')
    (tmp_path / "b.mha").write_text('import "c.mha"\nfn fb() -> u32 { return 2 }\n')
    (tmp_path / "c.mha").write_text('import "a.mha"\nfn fc() -> u32 { return 3 }\n')
    message = error_of((tmp_path / "a.mha").read_text(), tmp_path, "a.mha")
    c = tmp_path / "c.mha"
    assert message.startswith(f"{c}:1:8: error: import cycle: a.mha -> {tmp_path / 'b.mha'} "
                              f"-> {c} -> a.mha")
    assert "already declared" not in message
    (tmp_path / "self.mha").write_text('import "self.mha"\n')
    assert "import cycle: self.mha -> self.mha" in error_of('import "self.mha"\n', tmp_path,
                                                            "self.mha")


def test_an_import_shared_by_two_files_is_not_a_cycle(tmp_path):
    (tmp_path / "common.mha").write_text("fn one() -> u32 { return 1 }\n")
    (tmp_path / "left.mha").write_text('import "common.mha"\n')
    (tmp_path / "right.mha").write_text('import "common.mha"\n')
    assert outcome('import "left.mha"\nimport "right.mha"\n', tmp_path) == "ok"


def test_missing_import(tmp_path):
    message = error_of('import "nowhere.mha"\n', tmp_path)
    assert message.startswith("h.mha:1:8: error: cannot import 'nowhere.mha': No such file")


def test_import_of_a_folder(tmp_path):
    (tmp_path / "folder.mha").mkdir()
    message = error_of('import "folder.mha"\n', tmp_path)
    assert message.startswith("h.mha:1:8: error: cannot import 'folder.mha': Is a directory")


def test_unreadable_import(tmp_path, monkeypatch):
    locked = tmp_path / "locked.mha"
    locked.write_text("fn f() -> u32 { return 1 }\n")
    locked.chmod(0)
    if os.access(locked, os.R_OK):  # root reads anything: refuse it the way the OS would
        real = os.open

        def open_file(path, *args, **kwargs):
            if Path(path) == locked:
                raise PermissionError(13, "Permission denied", str(path))
            return real(path, *args, **kwargs)
        monkeypatch.setattr(os, "open", open_file)
    message = error_of('import "locked.mha"\n', tmp_path)
    assert message.startswith("h.mha:1:8: error: cannot import 'locked.mha': Permission denied")


def test_duplicate_rule(tmp_path):
    text = STD + scheduler().replace(" get_current", " advance(ts, state, p) = none\n get_current")
    assert "rule 'advance' is defined twice" in error_of(text, tmp_path)


def test_missing_rule(tmp_path):
    text = STD + re.sub(r" unsafe_seq_info.*\n", "", scheduler())
    assert "scheduler 'S' is missing rule 'unsafe_seq_info'" in error_of(text, tmp_path)


def test_unknown_scheduler(tmp_path):
    message = error_of(attention("scheduler = Nope()"), tmp_path)
    assert message.startswith("h.mha:3:14: error: scheduler must name a declared scheduler")


@pytest.mark.parametrize("setting, message", [
    ("head_dim = 96", "head_dim must be one of 64, 128, 256"),
    ("dtype = fp8", "dtype must be one of bf16, fp16"),
    ("tile = (0, 0)", "tile sizes must be"),
    ("tile = (7, 13)", "tile sizes must be"),
])
def test_bad_attention_settings(tmp_path, setting, message):
    assert message in error_of(attention(setting), tmp_path)


def test_mask_that_returns_i32(tmp_path):
    assert "'mask' returns bool, not i32" in error_of(attention("mask(b, h, q, k) = q - k"),
                                                       tmp_path)


def test_score_that_uses_an_undefined_name(tmp_path):
    message = error_of(attention("score(s, b, h, q, k) = s * nowhere"), tmp_path)
    assert message.startswith("h.mha:3:29: error: unknown name 'nowhere'")


def test_name_that_shadows_a_builtin(tmp_path):
    message = error_of("fn f(num_sms: u32) -> u32 { return num_sms }\n", tmp_path)
    assert "'num_sms' is a builtin name and cannot be redefined" in message
    message = error_of(STD + scheduler("let block_idx = 3"), tmp_path)
    assert "'block_idx' is a builtin name" in message


@pytest.mark.parametrize("text, where", [
    ("fn while(a: u32) -> u32 { return a }\n", "h.mha:1:4:"),
    ("fn f(if: u32) -> u32 { return 1 }\n", "h.mha:1:6:"),
    (STD + scheduler("let true = 1"), "h.mha:9:6:"),
    ("scheduler return {}\n", "h.mha:1:11:"),
])
def test_keyword_used_as_a_name(tmp_path, text, where):
    assert error_of(text, tmp_path).startswith(f"{where} error: '")
    assert "is a keyword and cannot be used as a name" in error_of(text, tmp_path)


def test_five_hundred_nested_ifs(tmp_path):
    message = error_of(STD + scheduler("if true {" * 500 + "}" * 500), tmp_path)
    column = 2 + len("if true {") * MAX_STMT_DEPTH
    assert message.startswith(f"h.mha:9:{column}: error: statements nested too deeply")


def test_else_if_chains_nest(tmp_path):
    chain = " else ".join(f"if state.idx == {i} {{ state.idx += 1 }}" for i in range(300))
    assert "statements nested too deeply" in error_of(STD + scheduler(chain), tmp_path)
    short = " else ".join(f"if state.idx == {i} {{ state.idx += 1 }}" for i in range(40))
    assert outcome(STD + scheduler(short), tmp_path) == "ok"


def test_a_very_long_line_is_shown_as_a_window_around_the_error(tmp_path):
    message = error_of("fn f() -> u32 { return 1 }" + " " * 100_000 + "$", tmp_path)
    _, line, caret = message.splitlines()
    assert len(line) < 200 and line.startswith("...") and caret.endswith("^")
    assert line[len(caret) - 1] == "$"


# --- Untrusted files. A source is read only from a regular .mha file of at most
# 16 MB; an import stays inside the importing file's folder, the standard library and the
# include folders; the compile cache reads the same way (tests/test_build.py).

def run_bounded(args: list[str], cwd: Path) -> tuple[str, float, float]:
    """`mhadsl ARGS` in a child process limited to 1 GB of address space (so a read without
    bound fails there instead of taking the machine down): its stderr, seconds and peak
    resident memory in MB. A child still running after 20 s fails the test."""
    # The child limits itself and reports its own peak (VmHWM) as it exits: the kernel's
    # ru_maxrss of a child counts the copy of this (large) test process it started as.
    limited = ("import atexit, resource, runpy, sys; "
               "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30)); "
               "atexit.register(lambda: print(open('/proc/self/status').read()"
               ".split('VmHWM:')[1].split()[0])); "
               "sys.argv[0] = 'mhadsl'; runpy.run_module('mhadsl', run_name='__main__')")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")  # each thread reserves address space
    start = time.monotonic()
    child = subprocess.Popen([sys.executable, "-c", limited, *args], cwd=cwd, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = child.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        pytest.fail(f"mhadsl {' '.join(args)} still running after 20 s")
    return err, time.monotonic() - start, int(out.split()[-1]) / 1024


@pytest.fixture(scope="module")
def startup_seconds(tmp_path_factory) -> float:
    """How long `mhadsl check` of a one-line file takes: Python's and the compiler's start."""
    folder = tmp_path_factory.mktemp("startup")
    (folder / "one.mha").write_text("fn one() -> u32 { return 1 }\n")
    return run_bounded(["check", "one.mha"], folder)[1]


@pytest.mark.parametrize("args, first_line", [
    (["check", "/dev/zero"],
     "error: cannot read /dev/zero: not a regular file (a device, FIFO or socket)"),
    (["check", "fifo.mha"],
     "error: cannot read fifo.mha: not a regular file (a device, FIFO or socket)"),
    (["check", "zero.mha"],
     "zero.mha:1:8: error: cannot import '/dev/zero': it is outside the importing file's "
     "folder and the include folders"),
    (["check", "-I", "/dev", "urandom.mha"],
     "urandom.mha:1:8: error: cannot import '/dev/urandom': not a regular file"),
    (["check", "imports_fifo.mha"],
     "imports_fifo.mha:1:8: error: cannot import 'fifo.mha': not a regular file"),
])
def test_special_files_end_in_one_diagnostic_fast_in_bounded_memory(tmp_path, startup_seconds,
                                                                   args, first_line):
    os.mkfifo(tmp_path / "fifo.mha")
    (tmp_path / "zero.mha").write_text('import "/dev/zero"\n')
    (tmp_path / "urandom.mha").write_text('import "/dev/urandom"\n')
    (tmp_path / "imports_fifo.mha").write_text('import "fifo.mha"\n')
    stderr, seconds, megabytes = run_bounded(args, tmp_path)
    assert "Traceback" not in stderr
    lines = stderr.splitlines()
    assert lines[0].startswith(first_line), stderr
    assert len(lines) == (1 if first_line.startswith("error:") else 3), stderr  # line, caret
    assert seconds < startup_seconds + 1, (seconds, startup_seconds)
    assert megabytes < 200, megabytes


def test_a_source_past_16_megabytes_is_refused_unread(tmp_path):
    with open(tmp_path / "big.mha", "wb") as big:
        big.truncate(MAX_SOURCE_BYTES + 1)  # sparse: no disk space taken
    message = error_of('import "big.mha"\n', tmp_path)
    assert message.startswith("h.mha:1:8: error: cannot import 'big.mha': larger than 16 MB")


def test_imports_outside_the_allowed_folders_are_refused(tmp_path):
    project, outside = tmp_path / "project", tmp_path / "outside"
    project.mkdir(), outside.mkdir()
    (outside / "secret.mha").write_text("fn secret() -> u32 { return 1 }\n")
    (project / "link.mha").symlink_to(outside / "secret.mha")
    escaping = '../../../../../../../../etc/shadow', '/etc/passwd', '../outside/secret.mha', \
        'link.mha', str(outside / "secret.mha")
    for path in escaping:
        message = error_of(f'import "{path}"\n', project)
        assert message.startswith(f"h.mha:1:8: error: cannot import '{path}': it is outside "
                                  f"the importing file's folder and the include folders"), \
            message
        assert message.endswith("\n       ^") and "root:" not in message
    message = error_of('import "std/../../mhadsl/cli.py"\n', project)
    assert message.startswith("h.mha:1:8: error: no standard library file "
                              "'std/../../mhadsl/cli.py'")


def test_include_dirs_are_where_imports_may_also_come_from(tmp_path, capsys):
    project, lib = tmp_path / "project", tmp_path / "lib"
    project.mkdir(), lib.mkdir()
    (lib / "common.mha").write_text("fn common() -> u32 { return 1 }\n")
    for text in ('import "common.mha"\n', 'import "../lib/common.mha"\n',
                 f'import "{lib / "common.mha"}"\n'):
        (project / "main.mha").write_text(text)
        with pytest.raises(MhaError, match="outside the importing file's folder|No such file"):
            mhadsl.compile(project / "main.mha")
        assert mhadsl.compile(project / "main.mha", include_dirs=[lib]).checked.fns
        assert cli_main(["check", "-I", str(lib), str(project / "main.mha")]) == 0
    assert "main.mha: ok (0 schedulers, 1 fns" in capsys.readouterr().out
    assert cli_main(["check", "-I", str(tmp_path / "nope"), str(project / "main.mha")]) == 2
    assert capsys.readouterr().err == f"error: -I {tmp_path / 'nope'}: no such folder\n"


def test_a_file_that_is_not_mha_source_is_never_quoted(tmp_path, capsys, monkeypatch):
    (tmp_path / "notes.txt").write_text("secret words\n")
    (tmp_path / "binary.mha").write_bytes(b"secret \xff\xfe\x00 words\n")
    message = error_of('import "notes.txt"\n', tmp_path)
    assert message.startswith("h.mha:1:8: error: cannot import 'notes.txt': not a .mha file")
    with pytest.raises(MhaError) as info:
        front_end('import "binary.mha"\n', "h.mha", tmp_path)
    assert info.value.render() == (f"{tmp_path / 'binary.mha'}:1:8: error: this file is not "
                                   f"UTF-8 text: byte 0xff cannot be decoded")  # no line
    monkeypatch.chdir(tmp_path)
    for name in ("notes.txt", "binary.mha"):
        assert cli_main(["check", name]) in (1, 2)
        err = capsys.readouterr().err
        assert "secret" not in err and err.count("\n") == 1, err


@pytest.mark.parametrize("source, error, message", [
    (None, TypeError, r"compile\(\) takes \.mha source text \(str\) or a path \(str or "
                      r"os\.PathLike\), not NoneType"),
    (123, TypeError, r"takes \.mha source text .* not int"),
    (b"attention a {}", TypeError, r"not bytes: decode them \(data\.decode\(\)\) or pass the "
                                   r"file's path"),
    ("examples", IsADirectoryError, "cannot read examples: Is a directory"),
    ("examples/", IsADirectoryError, "cannot read examples: Is a directory"),
    ("x.txt", FileNotFoundError, "cannot read x.txt: No such file or directory"),
    ("README.md", OSError, "cannot read README.md: not a .mha file"),
    ("", ValueError, r"empty \.mha source"),
    (" \n\t", ValueError, r"empty \.mha source"),
])
def test_compile_takes_source_text_or_the_path_of_a_mha_file(source, error, message,
                                                            monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(error, match=message):
        mhadsl.compile(source)


@pytest.mark.parametrize("init", ["no driver library", "no device"])
def test_no_gpu_is_one_error_with_one_wording_in_the_api_and_the_cli(init, monkeypatch, capsys):
    from mhadsl.runtime import driver

    def no_library(flags):
        raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found via '
                           'system search.')
    monkeypatch.setattr(driver, "_initialised", False)
    monkeypatch.setattr(driver, "_primary", {})
    monkeypatch.setattr(driver.cu, "cuInit", no_library if init == "no driver library" else
                        lambda flags: (driver.cu.CUresult.CUDA_ERROR_NO_DEVICE,))
    with pytest.raises(mhadsl.NoGpuError, match=r"^no NVIDIA GPU found \(cuInit failed: ") \
            as caught:
        mhadsl.synchronize()
    assert isinstance(caught.value, mhadsl.CudaError) and "\n" not in str(caught.value)
    monkeypatch.chdir(REPO)
    assert cli_main(["run", "examples/causal.mha", "--kernel", "causal_fwd", "--seqlen",
                     "64"]) == 2
    assert capsys.readouterr().err == f"error: {caught.value}\n"


@pytest.mark.parametrize("target, message", [
    ("/proc/x.png", "error: cannot write --plot /proc/x.png: "),
    ("fifo.png", "error: cannot write --plot fifo.png: it is not a regular file"),
])
def test_plot_to_a_path_that_takes_no_image_is_one_line(target, message, tmp_path):
    pytest.importorskip("matplotlib")
    os.mkfifo(tmp_path / "fifo.png")
    (tmp_path / "s.mha").write_text(STD)
    stderr = run_bounded(["simulate", "s.mha", "--scheduler", "Queued", "--seqlen", "9",
                          "--plot", target], tmp_path)[0]
    assert stderr.startswith(message) and stderr.count("\n") == 1, stderr

# ---------------------------------------------------------------- constants that are not finite
@pytest.mark.parametrize("line, where, message", [
    ("score(s, b, h, q, k) = s * 1e400", "h.mha:3:29:", "float constant 1e400 is not a finite f32"),
    ("score(s, b, h, q, k) = s * 1e39", "h.mha:3:29:", "float constant 1e39 is not a finite f32"),
    ("score(s, b, h, q, k) = s / 0.0", "h.mha:3:25:", "division by zero"),
    ("score(s, b, h, q, k) = s / (1.0 - 1.0)", "h.mha:3:25:", "division by zero"),
    ("score(s, b, h, q, k) = s + 0.0 / 0.0", "h.mha:3:29:", "division by zero"),
    ("score(s, b, h, q, k) = s + 3e38 * 10.0", "h.mha:3:29:",
     "constant expression is not a finite f32 value"),
    ("scale = -1e400", "h.mha:3:11:", "float constant 1e400 is not a finite f32"),
    ("scale = 0.0 / 0.0", "h.mha:3:10:", "division by zero"),
])
def test_float_constants_that_are_not_finite(tmp_path, line, where, message):
    assert error_of(attention(line), tmp_path).startswith(f"{where} error: {message}")


def test_declared_and_call_time_scale_follow_one_rule(tmp_path):
    from mhadsl.host.calls import check_scale
    declared = error_of(attention("scale = sqrt(-1.0)"), tmp_path)
    # Any constant, a declared scale included, must fold to a finite value: one error.
    assert declared.startswith("h.mha:3:10: error: constant expression is not a finite f32 "
                               "value (nan)") and declared.count("error:") == 1, declared
    with pytest.raises(TypeError, match="^scale must be a finite number, got nan$"):
        check_scale(float("nan"))
    assert outcome(attention("scale = 0.5 * 0.25", "score(s, b, h, q, k) = s / 2.0"),
                   tmp_path) == "ok"


def test_a_constant_grid_with_a_zero_dimension(tmp_path):
    """CUDA refuses a launch with a zero grid dimension."""
    text = STD + scheduler().replace("grid_dim(b, t) = (1, 1, 1)", "grid_dim(b, t) = (0, 1, 1)")
    assert error_of(text, tmp_path).startswith(
        "h.mha:5:20: error: grid dimension 0: CUDA launches at least one CTA along each axis")


# ---------------------------------------------------------------- loops in per-element rules
LOOP_RULE = "`while` loops are not allowed in a mask or score rule, nor in a fn one calls"
COUNTDOWN = "fn countdown(q: i32) -> i32 {\n var x = q\n while x > 0 { x = x - 1 }\n return x\n}\n"


def test_a_while_in_a_score_is_a_diagnostic_at_the_while(tmp_path):
    text = STD + ("attention K { dtype = bf16 head_dim = 128\n"
                  "    score(s, b, h, q_idx, kv_idx) { var x = s  while true { x = x + 1.0 }  "
                  "return x } }\n")
    column = text.splitlines()[2].index("while") + 1
    message = error_of(text, tmp_path)
    assert message.startswith(f"h.mha:3:{column}: error: {LOOP_RULE} (in attention 'K''s "
                              f"score): these rules run once per (query, key) pair"), message
    assert message.count("error:") == 1


def test_a_mask_that_calls_a_fn_with_a_while_is_a_diagnostic_at_the_while(tmp_path):
    message = error_of(COUNTDOWN + attention("mask(b, h, q_idx, kv_idx) = countdown(q_idx) <= "
                                             "kv_idx"), tmp_path)
    assert message.startswith(f"h.mha:3:2: error: {LOOP_RULE} (fn 'countdown' is called by "
                              f"attention 'A''s mask)"), message


def test_a_while_reached_through_other_fns_names_the_chain(tmp_path):
    fns = COUNTDOWN + "fn shifted(q: i32) -> i32 { return countdown(q) + 1 }\n" + \
        "fn twice(q: i32) -> i32 { return shifted(q) * 2 }\n"
    message = error_of(fns + attention("score(s, b, h, q_idx, kv_idx) = s + f32(shifted(q_idx))"),
                       tmp_path)
    assert message.startswith(f"h.mha:3:2: error: {LOOP_RULE} (fn 'countdown' is called by "
                              f"attention 'A''s score through fn 'shifted')"), message
    assert message.count("error:") == 1
    message = error_of(fns + attention("mask(b, h, q_idx, kv_idx) = twice(q_idx) <= kv_idx"),
                       tmp_path)
    assert f"(fn 'countdown' is called by attention 'A''s mask through fns 'twice', " \
           f"'shifted')" in message


def test_a_scheduler_may_call_a_fn_with_a_while(tmp_path):
    text = "fn ahead(i: u32, n: u32) -> u32 {\n var x = i\n while x < n { x += 1 }\n return x\n}\n"
    assert outcome(text + STD + scheduler("state.idx = ahead(state.idx, 3) + grid_dim.x"),
                   tmp_path) == "ok"


# ---------------------------------------------------------------- builtin names
SHADOW_MIN = "fn min(a: u32, b: u32) -> u32 { return 1000000 }\n"


@pytest.mark.parametrize("main", ['import "lib.mha"\n' + STD, STD + 'import "lib.mha"\n'])
def test_a_fn_named_like_a_builtin_is_refused_in_its_own_file(tmp_path, main):
    """Whatever the import order: it neither changes the standard library's `min` nor gets
    the standard library blamed for calling it."""
    (tmp_path / "lib.mha").write_text(SHADOW_MIN)
    message = error_of(main, tmp_path)
    assert message == (f"{tmp_path / 'lib.mha'}:1:4: error: 'min' is a builtin function and "
                       f"cannot be redefined\n{SHADOW_MIN.rstrip()}\n   ^")


@pytest.mark.parametrize("text, what", [
    ("fn barrier(a: u32) -> u32 { return a }\n", "'barrier' is a builtin function"),
    ("fn atomic_add(a: u32) -> u32 { return a }\n", "'atomic_add' is a builtin function"),
    ("fn tanh(a: f32) -> f32 { return a }\n", "'tanh' is a builtin function"),
    ("fn u32(a: u32) -> u32 { return a }\n", "'u32' is a builtin function"),
    ("fn num_sms() -> u32 { return 1 }\n", "'num_sms' is a builtin name"),
    ("fn State() -> u32 { return 1 }\n", "'State' is a builtin type"),
    (scheduler(name="where"), "'where' is a builtin function"),
])
def test_a_declaration_named_like_a_builtin_is_a_diagnostic_at_its_name(tmp_path, text, what):
    assert error_of(text, tmp_path).startswith(f"h.mha:1:{text.index(' ') + 2}: error: {what} "
                                               f"and cannot be redefined")


# ---------------------------------------------------------------- constants of builtin calls
@pytest.mark.parametrize("score, where, value", [
    ("s + sqrt(-1.0)", "h.mha:3:29:", "nan"),
    ("s + log(0.0)", "h.mha:3:29:", "-inf"),
    ("s + exp(1000.0)", "h.mha:3:29:", "inf"),
    ("s + exp(50.0) * exp(50.0)", "h.mha:3:29:", "2.68812e+43"),
    ("s / sqrt(0.0)", "h.mha:3:25:", None),
])
def test_a_builtin_call_that_folds_to_a_non_finite_value(tmp_path, score, where, value):
    """The rule arithmetic of constants follows (`s * 1e999`): a constant is a finite f32."""
    message = error_of(attention(f"score(s, b, h, q, k) = {score}"), tmp_path)
    want = "division by zero" if value is None else \
        f"constant expression is not a finite f32 value ({value})"
    assert message.startswith(f"{where} error: {want}"), message


def test_a_builtin_call_of_constants_that_stays_finite_is_accepted(tmp_path):
    assert outcome(attention("score(s, b, h, q, k) = s + sqrt(4.0) * exp(-1000.0) + "
                             "log(1.0) + tanh(1.0e30) + max(1.0, 2.0)"), tmp_path) == "ok"


# ---------------------------------------------------------------- line endings
@pytest.mark.parametrize("newline", ["\r", "\r\n"])
def test_other_line_endings_compile_to_the_same_kernels(tmp_path, newline):
    original = (REPO / "examples" / "causal.mha").read_text()
    (tmp_path / "causal.mha").write_bytes(original.replace("\n", newline).encode())
    with_lf, other = (
        compile_stages(read_source_file(folder / "causal.mha", "causal.mha").text, "causal.mha",
                       CompileOptions(), until="ptx", base_dir=folder)
        for folder in (REPO / "examples", tmp_path))
    assert list(other.kernels) == list(with_lf.kernels) == ["causal_fwd"]
    assert other.kernels["causal_fwd"].ptx == with_lf.kernels["causal_fwd"].ptx
    assert other.artifacts["ptx"] == with_lf.artifacts["ptx"]  # the schedulers' trace kernels


@pytest.mark.parametrize("newline", ["\r", "\r\n"])
def test_a_mistake_in_a_file_of_other_line_endings_is_reported_at_its_line(tmp_path, newline):
    lines = ["// first", "fn f() -> u32 {", "  return 1", "}", "fn g() -> u32 { return nope }"]
    message = error_of(newline.join(lines) + newline, tmp_path)
    assert message == "h.mha:5:24: error: unknown name 'nope'\n" + lines[4] + "\n" + " " * 23 + "^"
    message = error_of(newline.join(lines[:4] + ["fn g() -> u32 { return 1 + }"]), tmp_path)
    assert message.startswith("h.mha:5:28: error: syntax error: unexpected '}'"), message


# ---------------------------------------------------------------- many declarations
def test_schedulers_past_the_limit_are_a_diagnostic_at_the_first_too_many(tmp_path):
    """`compile` builds a kernel of each (2,000 schedulers took 1.8 GB): std's and as many more as
    check; one more is refused at its name."""
    from mhadsl.front.check import MAX_SCHEDULERS
    own = MAX_SCHEDULERS - len(front_end(STD, "std.mha")[1].schedulers)
    allowed = STD + "".join(scheduler(name=f"S{i}") for i in range(own))
    assert len(front_end(allowed, "h.mha")[1].schedulers) == MAX_SCHEDULERS
    text = STD + "".join(scheduler(name=f"S{i}") for i in range(own + 3))
    message = error_of(text, tmp_path)
    line = text.count("\n", 0, text.index(f"scheduler S{own} ")) + 1
    assert message == (f"h.mha:{line}:11: error: too many schedulers: a program declares at "
                       f"most {MAX_SCHEDULERS}, imports included (each is compiled to a kernel "
                       f"of its own)\nscheduler S{own} {{\n          ^")


def test_attention_kernels_past_the_limit_are_a_diagnostic(tmp_path):
    from mhadsl.front.check import MAX_ATTENTIONS
    text = STD + "".join(f"attention A{i} {{ mask(b, h, q, k) = k <= q + {i} }}\n"
                         for i in range(MAX_ATTENTIONS + 1))
    message = error_of(text, tmp_path)
    assert message.startswith(f"h.mha:{MAX_ATTENTIONS + 2}:11: error: too many attention "
                              f"kernels: a program declares at most {MAX_ATTENTIONS}"), message
    assert message.count("error:") == 1
    front_end(text.rsplit("attention", 1)[0], "h.mha")  # one fewer checks


def test_schedulers_too_big_together_are_a_diagnostic(tmp_path):
    """Each rule is under its own limit, but their LLVM IR together would not be."""
    from mhadsl.front.check import MAX_INLINED_NODES, MAX_SCHEDULER_NODES
    terms = MAX_INLINED_NODES // 11  # each adds 10 nodes to advance
    fat = [scheduler("state.idx += grid_dim.x" + " + p * state.idx - state.idx * p" * terms,
                     name=f"Fat{i}") for i in range(MAX_SCHEDULER_NODES // (10 * terms) + 1)]
    message = error_of("".join(fat), tmp_path)
    assert re.match(rf"h.mha:{1 + 11 * (len(fat) - 1)}:11: error: the schedulers up to "
                    rf"'Fat{len(fat) - 1}' are too big together: \d+ expressions and statements "
                    rf"once the fns they call are inlined \(limit {MAX_SCHEDULER_NODES} in a "
                    rf"program, imports included\)", message), message
    assert message.count("error:") == 1
    front_end("".join(fat[:-1]), "h.mha")  # one fewer checks


def test_a_program_past_the_token_limit_is_refused_while_it_is_read(tmp_path, monkeypatch):
    """The parser holds ~750 bytes a token until the AST is built (16 MB of schedulers took
    3.3 GB): reading stops at the first token past the limit, imports included."""
    from mhadsl.front import parse
    monkeypatch.setattr(parse, "MAX_TOKENS", 1000)
    # 8 tokens, then 250 pairs `1 +`, then `1 }`: 510 tokens.
    (tmp_path / "lib.mha").write_text("fn f() -> u32 { return " + "1 + " * 250 + "1 }\n")

    def top(pairs: int) -> str:  # 12 + 2 * pairs tokens, read before lib.mha
        return 'import "lib.mha"\nfn g() -> u32 { return ' + "1 + " * pairs + "1 }\n"
    assert len(load_program(top(239), "h.mha", tmp_path)) == 2  # 1,000 tokens in all
    with pytest.raises(MhaError) as info:
        load_program(top(240), "h.mha", tmp_path)
    # lib.mha's 509th token, its last `1`, is the 1,001st.
    assert info.value.render().startswith(
        f"{tmp_path / 'lib.mha'}:1:1024: error: too much source: a program holds at most 1000 "
        f"tokens (names, numbers, operators), imports included")
