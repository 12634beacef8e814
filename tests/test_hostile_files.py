"""Hostile files and paths around a compile: links, names too long for the system, output
paths that are inputs or FIFOs, a ptxas that is missing or never ends, and API arguments of
the wrong type. Each ends in one clear error, never a traceback, a hang or a wrong answer."""
import os
from pathlib import Path

import pytest

import mhadsl
from helpers import REPO, finishes_within
from mhadsl.cli import main
from mhadsl.codegen import assemble as assembler
from mhadsl.front.diagnostics import MhaError

SECRET = "SECRET-7f3a-do-not-print"
ONE_FN = "fn one() -> u32 { return 1 }\n"


def run_main(args: list[str], capsys) -> tuple[int, str, str]:
    """The CLI in this process: its exit status, stdout and stderr."""
    try:
        status = main(args)
    except SystemExit as exit:  # argparse's own errors
        status = exit.code
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.fixture
def linked(tmp_path, monkeypatch):
    """A folder with a text file holding a secret, `p.mha` linked to it, a real .mha file
    and `q.mha` linked to that."""
    (tmp_path / "notes.txt").write_text(f"{SECRET}\n")
    (tmp_path / "p.mha").symlink_to(tmp_path / "notes.txt")
    (tmp_path / "real.mha").write_text(ONE_FN)
    (tmp_path / "q.mha").symlink_to("real.mha")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_link_named_mha_to_another_file_is_refused_unquoted(linked, capsys):
    for command in (["check", "p.mha"], ["compile", "p.mha"],
                    ["simulate", "p.mha", "--scheduler", "S", "--seqlen", "9"]):
        status, out, err = run_main(command, capsys)
        assert status != 0 and err.count("\n") == 1, err
        assert err.startswith("error: cannot read p.mha: not a .mha file"), err
        assert SECRET not in out + err
    with pytest.raises(OSError) as info:
        mhadsl.compile("p.mha")
    assert "not a .mha file" in str(info.value) and SECRET not in str(info.value)
    with pytest.raises(OSError):
        mhadsl.compile(linked / "p.mha")


def test_a_link_named_mha_to_a_mha_file_is_read(linked, capsys):
    status, out, err = run_main(["check", "q.mha"], capsys)
    assert status == 0 and out.startswith("q.mha: ok (0 schedulers, 1 fns"), err
    assert mhadsl.compile("q.mha").attentions == []


LONG_NAME = "a" * 100_000 + ".mha"


@pytest.mark.parametrize("imported", [LONG_NAME, "std/" + LONG_NAME])
def test_an_import_of_a_name_too_long_is_a_located_diagnostic(imported, tmp_path, capsys,
                                                              monkeypatch):
    (tmp_path / "long.mha").write_text(f'import "{imported}"\n')
    monkeypatch.chdir(tmp_path)
    status, _, err = run_main(["check", "long.mha"], capsys)
    assert status == 1 and err.startswith("long.mha:1:8: error: "), err[:200]
    assert err.endswith("\n       ^\n") and "Traceback" not in err, err[-200:]
    assert len(err.splitlines()[0]) < 400 and " characters)" in err  # the name cut
    with pytest.raises(MhaError):
        mhadsl.compile("long.mha")


def test_a_source_named_with_a_name_too_long_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, _, err = run_main(["check", LONG_NAME], capsys)
    assert status == 2 and err.startswith("error: cannot read aaa") and err.count("\n") == 1
    assert err.endswith(": File name too long\n"), err[-100:]
    with pytest.raises(OSError, match="File name too long"):
        mhadsl.compile(LONG_NAME)


# ---------------------------------------------------------------- ptxas


def error_of(work) -> Exception | None:
    """What `work()` raised (None when it returned)."""
    try:
        work()
    except Exception as err:  # noqa: BLE001 -- the test looks at which one
        return err
    return None


@pytest.fixture
def fake_ptxas(tmp_path, monkeypatch):
    """Point $MHADSL_PTXAS at a script (its body given) and forget the ptxas found before."""
    def install(body: str | None, executable: bool = True) -> Path:
        script = tmp_path / "ptxas"
        if body is not None:
            script.write_text(f"#!/bin/sh\n{body}\n")
            script.chmod(0o755 if executable else 0o644)
        monkeypatch.setenv("MHADSL_PTXAS", str(script))
        assembler.find_ptxas.cache_clear()
        return script
    yield install
    monkeypatch.undo()
    assembler.find_ptxas.cache_clear()


@pytest.mark.parametrize("body, executable", [(None, True), ("exit 0", False)])
def test_a_ptxas_that_cannot_run_is_one_line_naming_mhadsl_ptxas(body, executable, fake_ptxas,
                                                                 capsys, monkeypatch):
    script = fake_ptxas(body, executable)
    monkeypatch.chdir(REPO)
    status, _, err = run_main(["compile", "std/schedulers.mha", "-q"], capsys)
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: MHADSL_PTXAS={script}: "), err
    with pytest.raises(assembler.AssemblerError, match="MHADSL_PTXAS"):
        assembler.assemble("", "sm_90a")


def test_a_ptxas_that_writes_no_cubin_is_an_assembler_error(fake_ptxas):
    fake_ptxas("exit 0")
    with pytest.raises(assembler.AssemblerError, match="wrote no cubin"):
        assembler.assemble("", "sm_90a")


def test_a_ptxas_that_never_ends_is_stopped_after_the_timeout(fake_ptxas, tmp_path,
                                                              capsys, monkeypatch):
    child = tmp_path / "child.pid"
    fake_ptxas(f"sleep 1000 & echo $! > {child}\nwait")  # a child of its own, too
    monkeypatch.setenv("MHADSL_PTXAS_TIMEOUT", "1")
    error = finishes_within(5, lambda: error_of(lambda: assembler.assemble("", "sm_90a")))
    assert isinstance(error, assembler.AssemblerError), error
    assert str(error).startswith("ptxas ran past 1 s (MHADSL_PTXAS_TIMEOUT)"), error
    pid = int(child.read_text())
    try:  # gone, or a zombie no one has reaped yet
        assert Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except FileNotFoundError:
        pass
    monkeypatch.chdir(REPO)
    status, _, err = run_main(["compile", "std/schedulers.mha", "-q"], capsys)
    assert status == 2 and err.startswith("error: ptxas ran past 1 s") and \
        err.count("\n") == 1, err


@pytest.mark.parametrize("value", ["0", "-1", "soon", "١", "nan", "inf", ""])
def test_a_bad_ptxas_timeout_is_named(value, fake_ptxas, monkeypatch):
    fake_ptxas("exit 1")
    monkeypatch.setenv("MHADSL_PTXAS_TIMEOUT", value)
    expected = "ptxas failed" if value == "" else "MHADSL_PTXAS_TIMEOUT"
    with pytest.raises(assembler.AssemblerError, match=expected):
        assembler.assemble("", "sm_90a")


# ---------------------------------------------------------------- output paths


def test_compile_output_that_is_a_fifo_is_refused_at_once(tmp_path, capsys, monkeypatch):
    os.mkfifo(tmp_path / "fifo.ptx")
    monkeypatch.chdir(REPO)
    status, _, err = finishes_within(5, lambda: run_main(
        ["compile", "std/schedulers.mha", "-o", str(tmp_path / "fifo.ptx")], capsys))
    assert status == 2 and err == f"error: cannot write {tmp_path / 'fifo.ptx'}: it is not a " \
                                  f"regular file (a FIFO, device or socket)\n", err


def test_compile_output_that_is_an_input_is_refused_before_compiling(tmp_path, capsys,
                                                                     monkeypatch):
    (tmp_path / "lib.mha").write_text(ONE_FN)
    (tmp_path / "s.mha").write_text('import "lib.mha"\nimport "std/schedulers.mha"\n')
    (tmp_path / "s_link.ptx").symlink_to("s.mha")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "schedulers.ptx").symlink_to("../lib.mha")
    monkeypatch.chdir(tmp_path)
    for output, source in (("s.mha", "s.mha"), ("s_link.ptx", "s.mha"), ("lib.mha", "lib.mha"),
                           ("out", "lib.mha")):
        status, _, err = run_main(["compile", "s.mha", "-o", output], capsys)
        assert status == 2 and err.count("\n") == 1, err
        assert ": it is the input " in err and err.endswith(f"{source}\n"), err
    assert (tmp_path / "s.mha").read_text().startswith("import")
    assert (tmp_path / "lib.mha").read_text() == ONE_FN


def test_compile_output_ending_in_a_slash_is_a_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    status, _, err = run_main(["compile", "std/schedulers.mha", "-q", "-o",
                               f"{tmp_path / 'new'}/"], capsys)
    assert status == 0, err
    assert ".entry trace_LPT" in (tmp_path / "new" / "schedulers.ptx").read_text()
    (tmp_path / "file").write_text("")
    status, _, err = run_main(["compile", "std/schedulers.mha", "-o", f"{tmp_path / 'file'}/"],
                              capsys)
    assert status == 2 and err == f"error: cannot write {tmp_path / 'file'}/: it is not a " \
                                  f"folder\n", err


# ---------------------------------------------------------------- mhadsl.compile's arguments


@pytest.mark.parametrize("arguments, error, message", [
    ({"include_dirs": None}, TypeError, r"include_dirs takes a list of folders, not NoneType"),
    ({"include_dirs": "examples"}, TypeError, r"include_dirs takes a list of folders, not str"),
    ({"include_dirs": Path("examples")}, TypeError, r"include_dirs takes a list of folders"),
    ({"include_dirs": [123]}, TypeError, r"include_dirs takes folders \(str or os\.PathLike\),"
                                         r" not int"),
    ({"include_dirs": ["/nonexistent"]}, FileNotFoundError,
     r"include_dirs: /nonexistent: no such folder"),
    ({"include_dirs": ["README.md"]}, NotADirectoryError,
     r"include_dirs: README.md: not a folder"),
    ({"name": 123}, TypeError, r"name takes a str, not int"),
    ({"name": b"x"}, TypeError, r"name takes a str, not bytes"),
])
def test_compile_arguments_of_the_wrong_kind_are_named(arguments, error, message, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(error, match=message):
        mhadsl.compile("examples/plain.mha", **arguments)


def test_compile_takes_include_dirs_as_any_sequence_of_folders(tmp_path):
    (tmp_path / "lib.mha").write_text(ONE_FN)
    for folders in ([tmp_path], (str(tmp_path),)):
        assert mhadsl.compile('import "lib.mha"\nfn two() -> u32 { return one() + 1 }\n',
                              include_dirs=folders).attentions == []
