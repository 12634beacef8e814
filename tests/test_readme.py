"""README.md stays short, keeps the set-up commands `.ci/run` relies on, and its first
example is real: the `.mha` file it shows is the one in `examples/` and compiles, and on a GPU
its Python block runs as written and computes what `mhadsl.reference` says."""
import re

import numpy as np
import pytest

import mhadsl
from helpers import REPO

README = REPO / "README.md"
INSTALL = ("pip install . && mhadsl compile examples/causal.mha -q && mhadsl simulate "
           "examples/queued_rotate.mha --scheduler MyQueued --seqlens 0,1,127,128,129,3000,8192 "
           "--heads 5 --ctas 7 && mhadsl run examples/causal.mha --kernel causal_fwd --batch 2 "
           "--seqlen 2048 --heads 8 --no-gpu-ok")
TEST = 'pip install -e ".[test]" && python -m pytest -q'
EXAMPLE = REPO / "examples/causal.mha"


def blocks(language: str | None = None) -> list[str]:
    """The README's fenced code blocks (of one language), in order."""
    found = re.findall(r"^```(\w*)\n(.*?)^```$", README.read_text(encoding="utf-8"),
                       re.MULTILINE | re.DOTALL)
    return [body for lang, body in found if language is None or lang == language]


def code_lines(text: str) -> list[str]:
    """A `.mha` text's lines without comments and blank lines."""
    lines = (line.split("//")[0].rstrip() for line in text.splitlines())
    return [line for line in lines if line.strip()]


def test_readme_is_at_most_250_lines():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 250


def test_first_block_is_the_install_and_test_commands():
    first = blocks()[0].splitlines()
    assert first == [INSTALL, TEST]
    ci = (REPO / ".ci/run").read_text()
    assert "pip install -q -e \".[test]\" && python3 -m pytest -q" in ci  # .ci/run's copy


def test_the_example_mha_is_the_file_in_examples_and_compiles():
    (shown,) = blocks("mha")
    assert code_lines(shown) == code_lines(EXAMPLE.read_text())
    assert 'mhadsl.compile("examples/causal.mha")["causal_fwd"]' in python_example()
    kern = mhadsl.compile(EXAMPLE)["causal_fwd"]
    for arch in ("sm_90a", "sm_80"):  # the two targets a GPU of 8.0 or newer loads
        assert ".entry" in kern.ptx(arch)


def python_example() -> str:
    (code,) = blocks("python")
    return code


def test_the_example_checks_its_output():
    code = python_example()
    assert "mhadsl.reference(" in code and "assert err < 1e-2" in code


@pytest.mark.gpu
def test_the_python_example_runs_as_written(monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.chdir(REPO)  # the example names examples/causal.mha from the repo's root
    namespace: dict = {}
    exec(compile(python_example(), str(README), "exec"), namespace)  # noqa: S102
    kern, q, k, v, o = (namespace[n] for n in ("kern", "q", "k", "v", "o"))
    assert o.shape == q.shape and o.dtype == q.dtype and o.is_cuda
    ref = mhadsl.reference(kern, q, k, v)
    out = o.float().cpu().numpy()
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2
    assert namespace["err"] < 1e-2
