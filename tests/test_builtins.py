"""The builtin functions' registry (mhadsl.front.builtin_functions) as the checker sees it."""
import pytest

from helpers import checked
from mhadsl.front.diagnostics import MhaError


@pytest.mark.parametrize("call, message", [
    ("abs()", "'abs' takes 1 argument, got 0"),  # no argument at all: a message, not a crash
    ("exp(s, s)", "'exp' takes 1 argument, got 2"),
    ("where(s > 0.0, s)", "'where' takes 3 arguments, got 2"),
])
def test_wrong_argument_count_is_one_error(call, message):
    with pytest.raises(MhaError) as info:
        checked(f"attention a {{ dtype = bf16  head_dim = 64\n"
                f"    score(s, b, h, q_idx, kv_idx) = {call} }}")
    assert [d.message for d in info.value.diagnostics] == [message]
