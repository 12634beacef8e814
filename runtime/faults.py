"""The scheduler fault a kernel records when a scheduler would have hung it, as an error.

The record's layout in the per-stream workspace is the kernel ABI's (`mhadsl.abi`): the
first fault wins until the runtime reports it and clears it (`runtime.driver`).
"""
from __future__ import annotations

from mhadsl import abi
from mhadsl.abi import (
    DQ_ORDER_WAIT, DQ_ORDER_WAIT_NS, ENDLESS_WHILE, RULES, TOO_MANY_TILES, WHILE_MIN, WHILE_SLACK,
)

_names: dict[int, str] = {}


def scheduler_id(name: str) -> int:
    """The id a kernel records for scheduler `name` (remembered, so a fault can name it)."""
    sid = abi.scheduler_id(name)
    _names[sid] = name
    return sid


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
            DQ_ORDER_WAIT: "handed out a K/V tile of a deterministic backward before the "
                           "tiles whose gradients it adds after: its CTA waited "
                           f"{DQ_ORDER_WAIT_NS / 1e9:g} s for them (deterministic mode on "
                           "Hopper adds each head's K/V tiles in the order Queued hands "
                           "them out)",
        }.get(kind, f"stopped with fault kind {kind}")
        super().__init__(f"scheduler '{self.scheduler}': rule '{self.rule}' {what} (CTA {cta}); "
                         "the kernel stopped early and its output is incomplete")
