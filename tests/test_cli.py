"""The mhadsl command line, run as a user runs it."""
import json
import subprocess
import sys

import pytest

from helpers import EXAMPLES, REPO


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
    assert "std/schedulers.mha: ok (4 schedulers" in out.stdout


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


@pytest.mark.parametrize("name", ["Transient", "Persistent", "Queued", "LPT"])
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


@pytest.mark.parametrize("args, message", [
    (["check", "nope.mha"], "error: cannot read nope.mha"),
    (["simulate", "std/schedulers.mha", "--scheduler", "Nope", "--seqlen", "5"],
     "error: no scheduler 'Nope'"),
    (["simulate", "std/schedulers.mha", "--scheduler", "Queued"], "error: give --seqlen"),
    (["simulate", "std/schedulers.mha", "--scheduler", "Queued", "--seqlens", "1,x"],
     "error: --seqlens takes comma-separated integers"),
    (["simulate", "std/schedulers.mha", "--scheduler", "Queued", "--seqlen", "9",
      "--param", "bogus=1"], "has no parameter 'bogus'"),
])
def test_bad_command_lines(args, message):
    out = mhadsl(*args)
    assert out.returncode == 1 and message in out.stderr and "Traceback" not in out.stderr


def test_compile_attention_example_writes_one_file_per_unit(tmp_path):
    out = mhadsl("compile", "examples/causal.mha", "-o", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["causal_fwd.ptx",
                                                                    "schedulers.ptx"]
    assert ".entry mha_fwd" in (tmp_path / "out" / "causal_fwd.ptx").read_text()
    assert "causal_fwd (sm80, 128x64 tile, 128 threads" in out.stdout
    assert "0 bytes spilled" in out.stdout
    one = mhadsl("compile", "examples/causal.mha", "--kernel", "causal_fwd", "--emit", "llvm",
                 "-o", str(tmp_path / "k.ll"))
    assert one.returncode == 0 and "define ptx_kernel void @\"mha_fwd\"" in \
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
    assert "takes one of DEFAULT, PROMPT_ROTATE, got 'SIDEWAYS'" in out.stderr
