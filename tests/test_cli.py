"""The mhadsl command line, run as a user runs it."""
import json
import os
import subprocess
import sys

import pytest

import mhadsl as mhadsl_package
from helpers import EXAMPLES, REPO
from mhadsl.cli import main


def mhadsl(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mhadsl", *args], capture_output=True,
                          text=True, cwd=cwd)


@pytest.mark.parametrize("command", ["check", "compile", "simulate"])
def test_help(command):
    out = mhadsl(command, "--help")
    assert out.returncode == 0 and "usage: mhadsl" in out.stdout


def test_check_examples():
    out = mhadsl("check", "std/schedulers.mha", *map(str, EXAMPLES))
    assert out.returncode == 0, out.stderr
    assert "std/schedulers.mha: ok (5 schedulers" in out.stdout


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_compile_emits_ptx_and_summary(arch, tmp_path):
    out = mhadsl("compile", "std/schedulers.mha", "--arch", arch, "-o", str(tmp_path / "s.ptx"))
    assert out.returncode == 0, out.stderr
    assert f".target {arch}" in (tmp_path / "s.ptx").read_text()
    assert "trace_Queued:" in out.stdout and "0 bytes spilled" in out.stdout
    cubin = mhadsl("compile", "std/schedulers.mha", "--emit", "cubin", "-o",
                   str(tmp_path / "s.cubin"))
    assert cubin.returncode == 0 and (tmp_path / "s.cubin").read_bytes()[:4] == b"\x7fELF"
    llvm = mhadsl("compile", "std/schedulers.mha", "--emit", "llvm")
    assert llvm.returncode == 0 and "define ptx_kernel" in llvm.stdout


@pytest.mark.parametrize("name", ["Transient", "Persistent", "Queued", "LPT", "Adaptive"])
def test_simulate_must_show(name):
    out = mhadsl("simulate", "std/schedulers.mha", "--scheduler", name, "--seqlens",
                 "0,1,127,128,129,3000,8192", "--heads", "5", "--tile", "128", "--ctas", "7",
                 "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["covered_exactly_once"] is True
    assert {"makespan", "lower_bound", "efficiency"} <= set(result)


def test_simulate_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out = mhadsl("simulate", "std/schedulers.mha", "--scheduler", "Queued", "--batch", "2",
                 "--seqlen", "1000", "--heads", "4", "--ctas", "8", "--plot",
                 str(tmp_path / "t.png"))
    assert out.returncode == 0 and (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("text, where", [
    ("scheduler S {\n  may_advance = = true\n}\n", "bad.mha:2:17: error: syntax error"),
    ('import "std/schedulers.mha"\nfn f(a: u32) -> bool {\n  return a + 1\n}\n',
     "bad.mha:3:10: error: 'f' returns bool, not u32"),
])
def test_user_errors_exit_1_without_traceback(tmp_path, text, where):
    (tmp_path / "bad.mha").write_text(text)
    for command in (["check", "bad.mha"], ["compile", "bad.mha"]):
        out = mhadsl(*command, cwd=tmp_path)
        assert out.returncode == 1
        assert out.stderr.startswith(where), out.stderr
        lines = out.stderr.splitlines()
        assert lines[2].strip() == "^"
        assert "Traceback" not in out.stderr


def run_main(args: list[str], capsys) -> tuple[int, str]:
    """The CLI in this process (fast): its exit status and what it printed to stderr."""
    try:
        status = main(args)
    except SystemExit as exit:  # argparse's own errors, and --version
        status = exit.code
    return status, capsys.readouterr().err


SIM = ["simulate", "std/schedulers.mha", "--scheduler", "Queued"]
TRACE = ["trace", "examples/causal.mha", "--kernel", "causal_fwd", "--seqlen", "64"]


@pytest.mark.parametrize("args, message", [
    (["check", "nope.mha"], "error: cannot read nope.mha: No such file or directory"),
    (["check", "examples"], "error: cannot read examples: Is a directory"),
    ([*SIM[:3], "Nope", "--seqlen", "5"], "error: no scheduler 'Nope'"),
    (SIM, "error: give --seqlen"),
    ([*SIM, "--seqlens", "1,x"], "error: --seqlens takes comma-separated integers, got '1,x'"),
    ([*SIM, "--seqlens", "8,-1"], "error: sequence lengths must be between 0 and 2147483647"),
    ([*SIM, "--seqlen", "2147483648"], "error: --seqlen must be between 0 and 2147483647"),
    ([*SIM, "--seqlen", "4294967296"], "error: --seqlen must be between 0 and 2147483647"),
    ([*SIM, "--seqlen", "9", "--heads", "0"], "error: --heads must be between 1 and 65535, got 0"),
    ([*SIM, "--seqlen", "9", "--tile", "0"], "error: --tile must be between 16 and 256, got 0"),
    ([*SIM, "--seqlen", "9", "--tile", "100"], "error: --tile must be a multiple of 16"),
    ([*SIM, "--seqlen", "9", "--ctas", "0"], "error: --ctas must be between 1 and"),
    ([*SIM, "--seqlen", "9", "--gqa", "0"], "error: --gqa must be between 1 and 65536, got 0"),
    ([*SIM, "--seqlen", "9", "--gqa", "3"], "error: --gqa 3 must divide --heads 16"),
    ([*SIM, "--seqlen", "9", "--batch", "1000000"], "error: --batch must be between 1 and 65535"),
    ([*SIM, "--seqlens", ",".join(["1"] * 70_000)], "error: --seqlens takes 1 to 65535 lengths"),
    ([*SIM, "--seqlen", "2147483647"], "error: the batch has 268435456 tiles; the simulator"),
    ([*SIM, "--seqlen", "9", "--heads", "many"], "error: argument --heads: invalid int value"),
    ([*SIM, "--seqlen", "9", "--param", "order"], "error: --param takes NAME=VALUE"),
    ([*SIM, "--seqlen", "9", "--plot", "no/such/folder/t.png"],
     "error: cannot write --plot no/such/folder/t.png: folder no/such/folder does not exist"),
    ([*SIM, "--seqlen", "9", "--plot", "examples"], "error: cannot write --plot examples: it is"),
    (["compile", "std/schedulers.mha", "--arch", "sm_75"],
     "error: argument --arch: invalid choice: 'sm_75'"),
    (["compile", "std/schedulers.mha", "--tile", "0"], "error: --tile must be between 16 and 256"),
    (["run", "examples/causal.mha", "--kernel", "causal_fwd", "--seqlen", "64", "--heads", "0"],
     "error: --heads must be between 1 and 65535"),
    ([], "error: the following arguments are required: COMMAND"),
    ([*SIM, "--seqlens", "1,,2"], "error: --seqlens takes comma-separated integers, got '1,,2'"),
    ([*SIM, "--seqlens", "1,2,"], "error: --seqlens takes comma-separated integers, got '1,2,'"),
    ([*SIM, "--seqlens", "1_000"], "error: --seqlens takes comma-separated integers"),
    ([*SIM, "--seqlens", "\u0661\u0662"], "error: --seqlens takes comma-separated integers"),
    ([*SIM, "--seqlen", "1_000"], "error: argument --seqlen: invalid int value: '1_000'"),
    ([*SIM, "--seqlen", "\u0661\u0662\u0663"], "error: argument --seqlen: invalid int value"),
    ([*SIM, "--seqlen", "9", "--heads", " 8"], "error: argument --heads: invalid int value"),
    ([*SIM, "--seqlen", "9", "--param", "order=DEFAULT", "--param", "order=PROMPT_ROTATE"],
     "error: --param order is given twice"),
    (["run", "examples/causal.mha", "--kernel", "causal_fwd", "--seqlen", "64", "--heads", "8",
      "--kv-heads", "3", "--no-gpu-ok"], "error: --kv-heads 3 must divide --heads 8"),
    ([*SIM, "--seqlen", "9", "--plot", "t.txt"],
     "error: cannot write --plot t.txt: matplotlib writes only files named "),
    ([*SIM, "--seqlen", "9", "--plot", "timeline"],
     "error: cannot write --plot timeline: matplotlib writes only files named"),
    ([*SIM, "--seqlen", "9", "--plot", ""], "error: --plot takes a file name, got ''"),
    (["compile", "std/schedulers.mha", "-o", ""], "error: -o takes a file or folder name, got ''"),
    (["compile", "examples/plain.mha", "-o", "examples/plain.mha"],
     "error: cannot write examples/plain.mha: it is the input examples/plain.mha"),
    ([*SIM, "--seqlen", "1", "--batch", "2", "--heads", "65535", "--kv-splits", "128"],
     "error: the batch has 16776960 tiles; the simulator takes at most"),
    ([*TRACE, "--json", ""], "error: --json takes a file name, got ''"),
    ([*TRACE, "--out", ""], "error: --out takes a file name, got ''"),
    ([*TRACE, "--json", "examples/causal.mha"],
     "error: cannot write --json examples/causal.mha: it is the input examples/causal.mha"),
])
def test_bad_command_lines_are_one_line_and_exit_2(args, message, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    status, err = run_main(args, capsys)
    assert status == 2 and err.startswith(message) and err.count("\n") == 1, err


def test_scheduler_parameters_are_ascii_integers(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    for value in ("\u0661\u0662", "1_0", " 12"):  # Python's int() reads each as 12 or 10
        status, err = run_main([*SIM, "--seqlen", "9", "--param", f"num_ctas={value}"],
                               capsys)
        assert status == 1 and f"takes a u32, got {value!r}" in err, err
    status, err = run_main([*SIM, "--seqlen", "9", "--param", "num_ctas=0x10"], capsys)
    assert status == 0, err


def test_output_fifos_and_inputs_are_refused_before_any_work(tmp_path, capsys):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "s.mha").write_text("scheduler {")  # not even parsed
    source = str(tmp_path / "s.mha")
    for args in (["compile", source, "-o", str(tmp_path / "fifo")],
                 ["trace", source, "--kernel", "K", "--seqlen", "9", "--json",
                  str(tmp_path / "fifo")],
                 ["trace", source, "--kernel", "K", "--seqlen", "9", "--json", source]):
        status, err = run_main(args, capsys)
        assert status == 2 and err.count("\n") == 1, err
        assert "it is not a regular file" in err or "it is the input" in err, err


def test_bad_arguments_are_found_before_any_work(tmp_path, capsys):
    """The file is not even read: a bad --plot wins over a file that does not parse."""
    (tmp_path / "broken.mha").write_text("scheduler {")
    status, err = run_main(["simulate", str(tmp_path / "broken.mha"), "--scheduler", "S",
                            "--seqlen", "9", "--plot", str(tmp_path / "missing" / "t.png")],
                           capsys)
    assert status == 2 and "folder" in err and "syntax error" not in err
    status, err = run_main(["simulate", str(tmp_path / "broken.mha"), "--scheduler", "S",
                            "--seqlen", "9"], capsys)
    assert status == 1 and "syntax error" in err


def test_mha_errors_in_a_command_line_value_exit_1(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    status, err = run_main([*SIM, "--seqlen", "9", "--param", "bogus=1"], capsys)
    assert status == 1 and "has no parameter 'bogus'" in err


def test_version():
    out = mhadsl("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"mhadsl {mhadsl_package.__version__}"


def test_file_that_is_not_utf8(tmp_path):
    (tmp_path / "latin1.mha").write_bytes(b"// caf\xe9\nfn f() -> u32 { return 1 }\n")
    for command in (["check", "latin1.mha"], ["simulate", "latin1.mha", "--scheduler", "S",
                                               "--seqlen", "9"]):
        out = mhadsl(*command, cwd=tmp_path)
        assert out.returncode == 1 and "Traceback" not in out.stderr
        assert out.stderr.startswith("latin1.mha:1:7: error: this file is not UTF-8 text: byte "
                                     "0xe9 cannot be decoded"), out.stderr


def test_compile_attention_example_writes_one_file_per_unit(tmp_path):
    out = mhadsl("compile", "examples/causal.mha", "-o", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["causal_fwd.ptx",
                                                                    "schedulers.ptx"]
    assert ".entry mha_fwd" in (tmp_path / "out" / "causal_fwd.ptx").read_text()
    assert "causal_fwd (sm90, 128x128 tile, 384 threads" in out.stdout  # sm_90a's default
    assert "0 bytes spilled" in out.stdout
    one = mhadsl("compile", "examples/causal.mha", "--kernel", "causal_fwd", "--emit", "llvm",
                 "-o", str(tmp_path / "k.ll"))
    assert one.returncode == 0 and "define ptx_kernel void @\"mha_fwd_sm90\"" in \
        (tmp_path / "k.ll").read_text()


def test_run_without_gpu():
    out = mhadsl("run", "examples/causal.mha", "--kernel", "causal_fwd", "--seqlen", "64",
                 "--heads", "2")
    no_gpu = "no NVIDIA GPU found" in out.stderr
    if no_gpu:
        assert out.returncode == 2
        ok = mhadsl("run", "examples/causal.mha", "--kernel", "causal_fwd", "--seqlen", "64",
                    "--heads", "2", "--no-gpu-ok")
        assert ok.returncode == 0 and "skipped the run" in ok.stdout
    else:
        assert out.returncode == 0 and "relative error" in out.stdout


def test_scheduler_parameter_of_the_wrong_type():
    out = mhadsl("simulate", "std/schedulers.mha", "--scheduler", "Queued", "--seqlen", "9",
                 "--param", "num_ctas=many")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "parameter 'num_ctas' of scheduler 'Queued' takes a u32, got 'many'" in out.stderr
    out = mhadsl("simulate", "std/schedulers.mha", "--scheduler", "Queued", "--seqlen", "9",
                 "--param", "order=SIDEWAYS")
    assert "takes one of DEFAULT, PROMPT_ROTATE, LONGEST_FIRST, INTERLEAVED, got 'SIDEWAYS'" in out.stderr


# ---------------------------------------------------------------- runs, flags, progress
WRONG_ADVANCE = """import "std/schedulers.mha"
scheduler Forever {
    may_advance = true
    schedule = DEFAULT
    grid_dim(batch_size, max_num_prompt_tiles) = (4, 1, 1)
    initial_state(slots, ts) = State(idx = block_idx.x, slots = slots, max_idx = ts.num_work())
    get_current_work_info(ts, state) = ts.work_info(state.idx, schedule)
    advance(ts, state, pipeline_idx) {
        state.idx = (state.idx + grid_dim.x) % ts.num_work()
        return ts.seq_info(ts.work_info(state.idx, schedule))
    }
    unsafe_seq_info(ts, state) = ts.seq_info(ts.work_info(state.idx, schedule))
}
"""


def test_simulate_says_a_stopped_run_stopped(tmp_path, capsys):
    (tmp_path / "f.mha").write_text(WRONG_ADVANCE)
    args = ["simulate", str(tmp_path / "f.mha"), "--scheduler", "Forever", "--seqlen", "3000"]
    assert main(args) == 3
    text = capsys.readouterr().out
    assert "makespan stopped" in text and "makespan 0" not in text, text
    main([*args, "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert summary["terminated"] is False and summary["makespan"] is None


@pytest.mark.parametrize("extra, message", [
    (["--seqlens", "5,6", "--batch", "3"], "error: --seqlens gives the batch: drop --batch"),
    (["--seqlens", "5,6", "--seqlen", "9"], "error: give --seqlen or --seqlens, not both"),
])
def test_contradictory_batch_flags(extra, message, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    status, err = run_main([*SIM, *extra], capsys)
    assert status == 2 and err.startswith(message) and err.count("\n") == 1, err


GQA_SIM = ["simulate", "examples/gqa.mha", "--scheduler", "LPT", "--seqlen", "300",
           "--ctas", "4"]


def test_simulate_kernel_takes_the_kernels_gqa(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    status, err = run_main([*GQA_SIM, "--kernel", "gqa_causal"], capsys)
    assert status == 0 and "4 query heads per K/V head (declared gqa = 4)" in err, err
    status, err = run_main([*GQA_SIM, "--kernel", "gqa_causal", "--heads", "6"], capsys)
    assert status == 2 and err == "error: --heads 6 is not a multiple of kernel gqa_causal's " \
                                  "gqa = 4\n", err
    status, err = run_main([*GQA_SIM, "--kernel", "gqa_causal", "--gqa", "2"], capsys)
    assert status == 2 and err == "error: --gqa 2 contradicts kernel gqa_causal's gqa = 4\n", err
    status, err = run_main([*GQA_SIM, "--kernel", "mqa", "--heads", "8"], capsys)
    assert status == 0 and "8 query heads per K/V head (declared kv_heads = 1)" in err, err


def test_simulate_kernel_says_why_the_makespan_passes_the_largest_load(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    main([*GQA_SIM, "--kernel", "gqa_causal"])
    text = capsys.readouterr().out
    assert "per-CTA load counts tile time only; the makespan also holds the scheduler's " \
           "steps" in text, text


def test_check_goes_on_past_a_missing_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    status = main(["check", "examples/plain.mha", str(tmp_path / "missing.mha"),
                   "examples/causal.mha"])
    out = capsys.readouterr()
    assert status == 2  # as for a missing file alone
    assert f"error: cannot read {tmp_path / 'missing.mha'}: No such file or directory" in out.err
    assert "examples/plain.mha: ok" in out.out and "examples/causal.mha: ok" in out.out


def test_compile_of_many_schedulers_shows_progress(tmp_path, capsys, monkeypatch):
    from mhadsl import pipeline
    monkeypatch.setattr(pipeline, "MANY_SCHEDULERS", 4)
    assert main(["compile", "std/schedulers.mha", "--emit", "llvm", "-o",
                 str(tmp_path / "s.ll")]) == 0
    err = capsys.readouterr().err
    assert "std/schedulers.mha: llvm of 5 schedulers...\n" in err
    assert "std/schedulers.mha: ptx of 5 schedulers...\n" in err
