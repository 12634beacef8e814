"""Small helpers shared by the tests."""
import threading
from pathlib import Path

import pytest

from mhadsl.front.check import CheckedProgram
from mhadsl.pipeline import front_end

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.mha"))
STD = 'import "std/schedulers.mha"\n'


def checked(text: str, name: str = "test.mha") -> CheckedProgram:
    return front_end(text, name, REPO)[1]


def finishes_within(seconds: float, work):
    """`work()`'s result, or a test failure when it has not returned after `seconds` (it
    is left running on a daemon thread: a read that blocks for good cannot be interrupted)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(work()), daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still running after {seconds} s")
    assert result, "it raised (see the thread's traceback above)"
    return result[0]


def fake_launcher(launch):
    """A fake `driver.Function.launcher` that calls `launch(grid, threads, shared_bytes,
    stream, params)` at each launch (when the plan's parameter block holds the call's)."""
    def launcher(grid, threads, shared_bytes, params):
        return lambda stream: launch(grid, threads, shared_bytes, stream, params)
    return launcher
