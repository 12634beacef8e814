"""The work-item record a traced kernel writes (`mhadsl trace`), and its decoding.

A traced build (`KernelRequest(trace=True)`) reaches its record buffer through the same
workspace pointer as the queue counter (`runtime.faults`), so it takes no new kernel
parameter and the untraced kernel is unchanged. The traced launch's workspace is larger:

    words 0 .. WORKSPACE_WORDS-1    the usual workspace (queue counter, fault record)
    word  COUNT_WORD                 records written so far (atomic; may pass the capacity)
    word  CAPACITY_WORD              how many records fit
    words HEADER_WORDS + k * RECORD_WORDS ...   record k (RECORD_FIELDS, u32 each)

One thread per CTA (the recording role's first) writes one record per work item it runs:
the tile, where it ran and when (%globaltimer, nanoseconds) it started and ended.
"""
from __future__ import annotations

import numpy as np

from mhadsl.runtime import faults

COUNT_WORD = faults.WORKSPACE_WORDS
CAPACITY_WORD = COUNT_WORD + 1
HEADER_WORDS = -(-(CAPACITY_WORD + 1) // 8) * 8  # records start 32-byte aligned
RECORD_FIELDS = ("prompt_offset", "head", "batch", "cta", "sm", "duration", "start_lo",
                 "start_hi")
RECORD_WORDS = len(RECORD_FIELDS)


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
