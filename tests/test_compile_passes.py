"""`mhadsl compile --pass`: the forward, backward and decode builds of each declaration.

One example (causal.mha on sm_90a): its three builds are made once per run and shared
through the run's compile cache by every test here.
"""
import re

import pytest

import mhadsl
from helpers import REPO, STD
from mhadsl.cli import main
from mhadsl.codegen.backends import CacheLayout

CAUSAL = "examples/causal.mha"
ENTRIES = {"causal_fwd": ["mha_fwd_sm90"],
           "causal_fwd.backward": ["mha_bwd_preprocess", "mha_bwd", "mha_bwd_postprocess"],
           "causal_fwd.decode": ["mha_decode_append", "mha_decode"]}


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def compile_cli(capsys, *args: str) -> tuple[int, str, str]:
    try:
        status = main(["compile", *args])
    except SystemExit as exit:  # argparse's own errors
        status = exit.code
    out = capsys.readouterr()
    return status, out.out, out.err


def entries(ptx: str) -> list[str]:
    return re.findall(r"\.entry (\w+)\(", ptx)


def test_pass_all_writes_one_file_per_unit(tmp_path, capsys):
    status, out, err = compile_cli(capsys, CAUSAL, "--pass", "all", "-o", f"{tmp_path}/out/")
    assert status == 0, err
    files = {p.name: p.read_text() for p in (tmp_path / "out").iterdir()}
    assert sorted(files) == ["causal_fwd.backward.ptx", "causal_fwd.decode.ptx",
                             "causal_fwd.ptx", "schedulers.ptx"]
    for unit, names in ENTRIES.items():
        assert entries(files[f"{unit}.ptx"]) == names
    assert "compiled schedulers, causal_fwd, causal_fwd.backward, causal_fwd.decode " in out
    # every kernel of every unit, with its own launch shape; a backward build's in launch order
    reported = re.findall(r"^  (causal_fwd\S*(?: mha_\w+)?) \((\w+), (\d+x\d+) tile, "
                          r"(\d+) threads, \d+ B dynamic shared\): \d+ registers, 0 bytes "
                          r"spilled", out, re.M)
    assert [(name, design, tile) for name, design, tile, _ in reported] == [
        ("causal_fwd", "sm90", "128x128"),
        ("causal_fwd.backward mha_bwd_preprocess", "backward_sm90", "64x128"),
        ("causal_fwd.backward mha_bwd", "backward_sm90", "64x128"),
        ("causal_fwd.backward mha_bwd_postprocess", "backward_sm90", "64x128"),
        ("causal_fwd.decode mha_decode_append", "decode", "16x64"),
        ("causal_fwd.decode mha_decode", "decode", "16x64")], out
    # the builds the API makes for a backward call and a decode step that appends its row
    # to a 64-row paged cache, its splits by length (LPT's default)
    kernel = mhadsl.compile(CAUSAL)["causal_fwd"]
    assert kernel.backward_build().cached
    assert kernel.build(cache=CacheLayout(query_rows=1, page_size=64, block_n=64,
                                          appends=True, balanced=True)).cached


@pytest.mark.parametrize("pass_name", ["backward", "decode"])
def test_a_pass_emits_its_kernels(pass_name, tmp_path, capsys):
    unit = f"causal_fwd.{pass_name}"
    status, out, err = compile_cli(capsys, CAUSAL, "--pass", pass_name, "--kernel", "causal_fwd")
    assert status == 0, err
    assert entries(out) == ENTRIES[unit] and "// =====" not in out
    assert f"compiled {unit} for sm_90a" in err
    status, _, err = compile_cli(capsys, CAUSAL, "--pass", pass_name, "--kernel", "causal_fwd",
                                 "--emit", "llvm", "-o", str(tmp_path / "k.ll"))
    assert status == 0, err
    assert re.findall(r'define ptx_kernel void @"(\w+)"', (tmp_path / "k.ll").read_text()) \
        == ENTRIES[unit]


def test_every_pass_assembles_to_a_cubin_per_unit(tmp_path, capsys):
    status, _, err = compile_cli(capsys, CAUSAL, "--pass", "all", "--kernel", "causal_fwd",
                                 "--emit", "cubin", "-o", f"{tmp_path}/")
    assert status == 0, err
    cubins = sorted(tmp_path.iterdir())
    assert [p.name for p in cubins] == sorted(f"{unit}.cubin" for unit in ENTRIES)
    assert all(p.read_bytes()[:4] == b"\x7fELF" for p in cubins)


def test_the_default_pass_is_forward(capsys):
    status, default, err = compile_cli(capsys, CAUSAL)
    assert status == 0, err
    status, forward, err = compile_cli(capsys, CAUSAL, "--pass", "forward")
    assert status == 0 and forward == default, err
    assert entries(default) == ["trace_Transient", "trace_Persistent", "trace_Queued",
                                "trace_LPT", "trace_Adaptive", "mha_fwd_sm90"]


def test_a_bad_pass_is_one_line(capsys):
    status, _, err = compile_cli(capsys, CAUSAL, "--pass", "sideways")
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith("error: argument --pass: invalid choice: 'sideways'"), err


def test_a_pass_the_declaration_cannot_build_is_one_line(tmp_path, capsys):
    source = tmp_path / "capped.mha"
    source.write_text(STD + "fn cap(x: f32) -> f32 {\n    return 30.0 * tanh(x / 30.0)\n}\n"
                            "attention capped {\n    score(s, b, h, q_idx, kv_idx) = cap(s)\n}\n")
    status, _, err = compile_cli(capsys, str(source), "--pass", "backward", "--emit", "llvm")
    assert status == 1 and "Traceback" not in err
    assert err == f"{source}:6:37: error: no backward build of attention 'capped' for sm_90a: " \
                  f"cannot differentiate the score through fn 'cap' (not supported yet)\n", err


def test_a_mask_that_reads_data_shows_its_classes_kernel(tmp_path, capsys):
    """The classes kernel a forward or backward call of such a declaration runs first is a
    unit of its own, with its registers; a decode pass has none."""
    status, out, err = compile_cli(capsys, "examples/document_mask.mha", "--pass", "forward",
                                   "-o", f"{tmp_path}/out/")
    assert status == 0, err
    files = {p.name: p.read_text() for p in (tmp_path / "out").iterdir()}
    assert entries(files["document_mask.classes.ptx"]) == ["mha_block_classes"]
    assert re.search(r"^  document_mask.classes \(mha_block_classes, a warp per tile, 128 "
                     r"threads\): \d+ registers, 0 bytes spilled", out, re.M), out
    status, out, err = compile_cli(capsys, "examples/document_mask.mha", "--pass", "decode",
                                   "-o", f"{tmp_path}/decode/")
    assert status == 0, err
    assert "document_mask.classes" not in out
    assert not (tmp_path / "decode" / "document_mask.classes.ptx").exists()


@pytest.mark.parametrize("name, entry_points, ordered", [
    # no scheduler named: Queued, which hands out each head's K/V tiles in order, so the
    # Hopper design adds dQ in that order
    ("plain_fwd", ["mha_bwd_preprocess", "mha_bwd", "mha_bwd_postprocess"], True),
    # LPT does not: the sm80-style design's own dQ kernel
    ("causal_fwd", ["mha_bwd_preprocess", "mha_bwd", "mha_bwd_dq"], False)])
def test_deterministic_emits_the_backward_a_deterministic_call_runs(name, entry_points,
                                                                    ordered, capsys):
    path = "examples/plain.mha" if name == "plain_fwd" else CAUSAL
    status, out, err = compile_cli(capsys, path, "--pass", "backward", "--deterministic",
                                   "--kernel", name)
    assert status == 0, err
    assert entries(out) == entry_points
    assert ("red.release.gpu.global.add.u32" in out) == ordered
    assert not re.search(r"(red|atom)\.global\.add(\.v\d)?\.f32", out)  # no dQ atomics
    # the build the API makes for the call, from the same compile cache
    build = mhadsl.compile(path)[name].backward_build(deterministic=True)
    assert build.cached and build.ptx.strip() == out.strip()


def test_deterministic_without_the_backward_pass_is_a_usage_error(capsys):
    status, out, err = compile_cli(capsys, CAUSAL, "--deterministic")
    assert status == 2 and not out
    assert "--deterministic selects the backward pass's kernels" in err
