"""The valid work of a launch: which (query tile, head, sequence) items exist, in which
order, and the tile index a ragged launch reads.

`ts.num_valid_work()` and `ts.valid_work_info(idx, order, heads_per_section)` number only
the valid (query tile, head, sequence) work items, so a scheduler never spends an index
(or a queue atomic) on a tile past a sequence's end. Their meaning, written once here
(`valid_work_order` enumerates it; the lowering computes the same by index arithmetic):

- Heads run in sections of `heads_per_section` consecutive heads (0, or at least
  num_heads: one section of all heads; the last may be shorter), one section after the
  other, so the K/V of a section's heads stay in L2 while its tiles run.
- Within a section, DEFAULT: sequences in batch order, then heads, the query tile fastest
  from the first; PROMPT_ROTATE: as DEFAULT with the query tiles of odd heads from the
  last; LONGEST_FIRST: query-tile levels from the highest down (the last tiles of the
  longest sequences first: under a causal mask, the costliest work first), at each level
  the sequences that reach it by tile count, most tiles first (ties by batch index), then
  heads fastest; INTERLEAVED: as LONGEST_FIRST from the lowest level up, so each (sequence,
  head) pair's tiles come in order, a level's worth of other pairs' tiles apart.

On a dense launch every sequence has max_num_prompt_tiles tiles, so with one section
DEFAULT and PROMPT_ROTATE are `ts.work_info`'s orders and LONGEST_FIRST is
`ts.work_info(idx, LONGEST_FIRST)`: query tile slowest from the last, then batch, head
fastest (INTERLEAVED: from the first). A ragged launch reads the tile index:
TILE_INDEX_WORDS(B) u32 words that a small kernel builds on the device from cu_seqlens
before each launch (`tile_index`; its size: `mhadsl.abi.tile_index_words`).
"""
from __future__ import annotations

import numpy as np

from mhadsl.front.semantics import U32_MAX


def tile_counts(seqlens, tile: int) -> np.ndarray:
    """Query tiles per sequence (a negative length counts 0)."""
    return -(-np.maximum(np.asarray(seqlens, np.int64), 0) // tile)


def tile_index(counts) -> np.ndarray:
    """The tile index of sequences with `counts` query tiles (uint32):

    - prefix[b], b = 0..B: the tiles of the sequences before b (prefix[B]: all of them);
    - ranked[r], r < B: the sequence of rank r, most tiles first, ties by batch index;
    - level[r], r = 0..B: where LONGEST_FIRST's block of rank r starts (per head): the
      levels that exactly the r+1 longest sequences reach, counted from the top, come after
      level[r] = (tiles of ranks < r) - r * tiles(rank r); level[B] = all tiles.
    """
    counts = np.asarray(counts, np.int64)
    batch = len(counts)
    ranked = np.lexsort((np.arange(batch), -counts)).astype(np.int64)
    sorted_counts = counts[ranked]
    before = np.concatenate(([0], np.cumsum(sorted_counts)))
    level = before.copy()
    level[:batch] -= np.arange(batch) * sorted_counts
    prefix = np.concatenate(([0], np.cumsum(counts)))
    return (np.concatenate((prefix, ranked, level)) & U32_MAX).astype(np.uint32)


def valid_work_order(counts, heads: int, order: str, heads_per_section: int = 0
                     ) -> list[tuple[int, int, int]]:
    """Every valid work item as (query tile, head, batch), in `ts.valid_work_info`'s order."""
    counts = [int(n) for n in counts]
    section = heads_per_section if 0 < heads_per_section < heads else heads
    ranked = sorted(range(len(counts)), key=lambda b: (-counts[b], b))
    out = []
    for first in range(0, heads, max(section, 1)):
        section_heads = range(first, min(first + section, heads))
        if order in ("LONGEST_FIRST", "INTERLEAVED"):
            levels = range(max(counts, default=0))
            for level in reversed(levels) if order == "LONGEST_FIRST" else levels:
                out += [(level, h, b) for b in ranked if counts[b] > level
                        for h in section_heads]
            continue
        for b, n in enumerate(counts):
            for h in section_heads:
                out += [(n - 1 - q if order == "PROMPT_ROTATE" and h % 2 else q, h, b)
                        for q in range(n)]
    return out


def balanced_splits(cache_lens, query_rows, *, gqa_group: int, rows: int, block_n: int,
                    capacity: int, appends: bool, kv_heads: int, slots: int, max_splits: int,
                    min_tiles: int, max_q_tiles: int, max_chunk: int = 1 << 30
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(query-row tiles, KV splits) of each sequence of a decode call whose splits follow
    its lengths (the decode design's split index kernel computes the same on the device):

    - a sequence's keys are its cache length (plus its query rows where the call appends
      them), clamped to [0, capacity]: n KV tiles of `block_n`; its query-row tiles hold
      query_rows x gqa_group packed rows, `rows` a tile (at most `max_q_tiles`);
    - the chunk aims at one chunk per multiprocessor (`slots`) over the whole batch's work
      (KV tiles x query-row tiles x K/V heads), `min_tiles` KV tiles at least, and never
      fewer tiles than spread a sequence over `max_splits`;
    - a sequence takes its tiles / chunk splits rounded to the nearest (1 to max_splits),
      as few as give every split the same whole KV tiles but one (none left empty).
    """
    lens = np.asarray(cache_lens, np.int64)
    q_rows = np.maximum(np.broadcast_to(np.asarray(query_rows, np.int64), lens.shape), 0)
    q_tiles = np.minimum(-(-q_rows * gqa_group // rows), max_q_tiles)
    keys = np.clip(lens + (q_rows if appends else 0), 0, capacity)
    n = -(-keys // block_n)
    work = int((q_tiles * n).sum()) * kv_heads
    chunk = min(max(min_tiles, -(-work // max(slots, 1))), max_chunk)
    most = max(max_splits, 1)
    per = np.maximum(chunk, -(-n // most))
    splits = np.clip((2 * n + per) // (2 * per), 1, most)
    splits = np.where(n > 0, -(-n // np.maximum(-(-n // splits), 1)), 1)
    return q_tiles, splits


def split_tiles(n: int, per: int, split: int) -> int:
    """The KV tiles split `split` of a sequence of `n` reads, `per` a split from the first:
    the last takes what is left, one past the sequence none."""
    return max(min(per, n - split * per), 0)
