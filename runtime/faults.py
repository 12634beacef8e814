"""The scheduler fault record: what a kernel writes when a scheduler would have hung it.

Every kernel's `queue` parameter points to a per-stream workspace of `WORKSPACE_WORDS` u32:

    word 0   the queue counter (zeroed on the launch's stream before every launch)
    word 1   fault code: kind << 8 | rule index (0: no fault)
    word 2   id of the scheduler (`scheduler_id`)
    word 3   the CTA (linear block index) that stopped

The record is not zeroed per launch: the first fault wins until the runtime reports it and
clears it. The code generator writes it (`codegen.scheduler`), the driver reads it; this
module, plain Python, is the one place both take the layout from.
"""
from __future__ import annotations

import zlib

WORKSPACE_WORDS = 4
RECORD_WORDS = 3  # words 1..3
TOO_MANY_TILES = 1  # advance kept returning work past all the work of the launch, plus one
ENDLESS_WHILE = 2  # a `while` ran past its bound
RULES = ("grid_dim", "initial_state", "get_current_work_info", "advance", "unsafe_seq_info")
# The `while` loops of one scheduler step (the first rules, or one advance) may run
# WHILE_SLACK * (ts.num_work() + CTAs) + WHILE_MIN iterations together: a correct rule
# (skipping tiles, scanning sequences or heads) stays far below it.
WHILE_SLACK, WHILE_MIN = 4, 1024

_names: dict[int, str] = {}


def scheduler_id(name: str) -> int:
    """The id a kernel records for scheduler `name` (remembered, so a fault can name it)."""
    sid = zlib.crc32(name.encode()) or 1
    _names[sid] = name
    return sid


def fault_code(kind: int, rule: str) -> int:
    return kind << 8 | RULES.index(rule)


class SchedulerError(RuntimeError):
    """A scheduler ran past a bound no correct scheduler reaches, so the kernel stopped it.

    `scheduler`, `rule` and `cta` say where. The launch that hit it left its output incomplete;
    the CUDA context stays usable and the record is cleared once reported."""

    def __init__(self, code: int, sid: int, cta: int) -> None:
        kind, rule = code >> 8, code & 0xFF
        self.scheduler = _names.get(sid, f"#{sid:08x}")
        self.rule = RULES[rule] if rule < len(RULES) else f"rule #{rule}"
        self.cta = cta
        what = {
            TOO_MANY_TILES: "never returned none: the CTA took more tiles than all the work "
                            "of the launch plus one",
            ENDLESS_WHILE: "ran a `while` loop far past what a correct rule needs "
                           f"({WHILE_SLACK} x (tiles + CTAs) + {WHILE_MIN} iterations per "
                           "scheduler step)",
        }.get(kind, f"stopped with fault kind {kind}")
        super().__init__(f"scheduler '{self.scheduler}': rule '{self.rule}' {what} (CTA {cta}); "
                         "the kernel stopped early and its output is incomplete")
