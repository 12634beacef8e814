"""benchmarks/sanitize.py covers every registered kernel design with all four tools, and its
sources compile (on the CPU: no launch)."""
import importlib.util
import sys
from pathlib import Path

import mhadsl
from mhadsl.codegen.backends import REGISTRY

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "sanitize.py"
spec = importlib.util.spec_from_file_location("sanitize", SCRIPT)
sanitize = importlib.util.module_from_spec(spec)
sys.modules["sanitize"] = sanitize  # its dataclass looks its module up
spec.loader.exec_module(sanitize)


def test_every_registered_design_is_sanitized():
    assert set(REGISTRY) <= {d.backend for d in sanitize.DESIGNS.values()}


def test_all_four_tools():
    assert set(sanitize.TOOLS) == {"memcheck", "racecheck", "initcheck", "synccheck"}


def test_sources_and_examples_compile():
    program = mhadsl.compile(sanitize.FORWARD_SOURCE, name="sanitize.mha")
    assert {s.split("(")[0].lower() for s in sanitize.SCHEDULERS} < set(program.attentions)
    mhadsl.compile(sanitize.DECODE_SOURCE, name="sanitize_decode")["decode"]
    root = SCRIPT.parent.parent
    for file, name, *_ in sanitize.BACKWARD_CASES:
        mhadsl.compile(str(root / file))[name]


def test_cells():
    done = f"case x\n{sanitize.DONE}\n"
    assert sanitize.cell("memcheck", 0, done + "========= ERROR SUMMARY: 0 errors") == "OK"
    assert sanitize.cell("synccheck", 1, done + "========= ERROR SUMMARY: 928 errors") \
        == "928 errors"
    assert sanitize.cell("racecheck", 0, done + "RACECHECK SUMMARY: 0 hazards displayed "
                         "(0 errors, 0 warnings)\nERROR SUMMARY: 0 errors") == "OK"
    assert sanitize.cell(None, 0, done) == "OK"
    assert sanitize.cell(None, 1, "worst relative error 1.0e+00") == "wrong output"
    assert sanitize.cell("initcheck", None, "timed out") == "timeout"
