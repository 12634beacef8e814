"""The settings an `attention` declaration may fix, and their resolved, frozen form."""
from __future__ import annotations

from mhadsl.types import BOOL, DTYPE, F32, SCHEDULER

# name -> what the checker expects: a type, "int" (integer constant) or "int_pair".
ATTENTION_CONSTANTS: dict[str, object] = {
    "dtype": DTYPE,
    "head_dim": "int",
    "tile": "int_pair",
    "warps": "int",
    "stages": "int",
    "gqa": "int",
    "kv_heads": "int",
    "scheduler": SCHEDULER,
    "scale": F32,
    "return_lse": BOOL,
}
