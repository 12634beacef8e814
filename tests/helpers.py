"""Small helpers shared by the tests."""
from pathlib import Path

from mhadsl.check import CheckedProgram
from mhadsl.pipeline import front_end

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.mha"))
STD = 'import "std/schedulers.mha"\n'


def checked(text: str, name: str = "test.mha") -> CheckedProgram:
    return front_end(text, name, REPO)[1]
