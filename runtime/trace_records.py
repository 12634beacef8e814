"""The work-item record a traced kernel writes (`mhadsl trace`), and its decoding.

A traced build (`KernelRequest(trace=True)`) reaches its record buffer through the same
workspace pointer as the queue counter, so it takes no new kernel parameter and the untraced
kernel is unchanged; the layout is the kernel ABI's (`mhadsl.abi`).

One thread per CTA (the recording role's first) writes one record per work item it runs:
the tile, where it ran and when (%globaltimer, nanoseconds) it started and ended.
"""
from __future__ import annotations

import numpy as np

from mhadsl.abi import TRACE_CAPACITY_WORD as CAPACITY_WORD
from mhadsl.abi import TRACE_COUNT_WORD as COUNT_WORD
from mhadsl.abi import TRACE_FIELDS as RECORD_FIELDS
from mhadsl.abi import TRACE_HEADER_WORDS as HEADER_WORDS
from mhadsl.abi import TRACE_RECORD_WORDS as RECORD_WORDS


def workspace_words(capacity: int) -> int:
    return HEADER_WORDS + capacity * RECORD_WORDS


def decode(words: np.ndarray) -> tuple[dict[str, np.ndarray], int]:
    """The records of a traced launch's workspace (u32 words) as columns (int64; `start`
    and `end` in ns), and how many the kernel tried to write (more than were kept when
    the buffer overflowed)."""
    words = np.asarray(words, np.uint32)
    written = int(words[COUNT_WORD])
    kept = min(written, int(words[CAPACITY_WORD]))
    rows = words[HEADER_WORDS:HEADER_WORDS + kept * RECORD_WORDS].reshape(kept, RECORD_WORDS)
    cols = {name: rows[:, k].astype(np.int64) for k, name in enumerate(RECORD_FIELDS)}
    cols["start"] = cols.pop("start_lo") | (cols.pop("start_hi") << 32)
    cols["end"] = cols["start"] + cols["duration"]
    return cols, written
