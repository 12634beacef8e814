"""The simulator's calibrated cost model: what a work item of one kernel costs on one GPU.

A work item (one query tile of one head) costs

    per_item + full_tile * (full KV tiles) + partial_tile * (partial KV tiles)

where the KV tiles are classified exactly as the kernel classifies them (`mhadsl.analysis.classify`
over the DECLARED mask, with the sequence's tail tile partial): empty tiles are skipped by
the kernel and cost nothing. Between items a CTA pays `advance` for each scheduler step,
plus `queue_op` for each atomic on the work queue that step made; a CTA that starts on a
multiprocessor after another ended pays `cta_start`, or `empty_cta` when it has no tile
(a grid's CTAs past a ragged sequence's end). All constants are nanoseconds.

`mhadsl trace --calibrate` measures them for a kernel on a GPU (`fit`) and stores them under
the compile cache's folder (`store`), keyed by the kernel's declaration, backend, arch and
the GPU's name; the simulator (`mhadsl simulate --kernel`, `mhadsl trace`) loads them
(`load`), and falls back to `DEFAULT_COSTS` (measured on an H200, sm90 design, causal D128).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mhadsl.front import ast
from mhadsl.front.attention_spec import mask_reads_data, rule_reads
from mhadsl.front.check import CheckedProgram
from mhadsl.analysis.classify import operand_bounds, _python_classifier
from mhadsl.runtime import cache
from mhadsl.front.sources import read_regular_file


@dataclass(frozen=True)
class Costs:
    """The constants, in nanoseconds, for KV tiles `block_n` keys wide."""

    full_tile: float
    partial_tile: float
    per_item: float
    advance: float = 0.0
    queue_op: float = 0.0
    cta_start: float = 0.0
    empty_cta: float = 0.0
    block_n: int = 64

    def for_block_n(self, block_n: int) -> Costs:
        """The constants for another KV tile width: a tile's cost scales with its keys."""
        scale = block_n / self.block_n
        return dataclasses.replace(self, full_tile=self.full_tile * scale,
                                   partial_tile=self.partial_tile * scale, block_n=block_n)


# Measured with `mhadsl trace --calibrate` on an H200 (sm90 design with the producer a work
# tile ahead, causal bf16 D128, 128x128 tiles, one CTA per multiprocessor; docs/TRACE.md):
# the figures a machine without a calibration simulates with (scaled to the kernel's KV
# tile width).
DEFAULT_COSTS = Costs(full_tile=1618.0, partial_tile=2095.0, per_item=1729.0, advance=2688.0,
                      queue_op=0.0, cta_start=2400.0, empty_cta=842.0, block_n=128)
PARTIAL_RATIO = DEFAULT_COSTS.partial_tile / DEFAULT_COSTS.full_tile  # when a fit cannot tell


@dataclass
class KernelCostModel:
    """Costs of one kernel: its constants and the declared mask that classifies its tiles.

    `block_m`/`block_n` are the kernel's tile (BM, BN); `source` says where the constants
    came from (a calibration file, or "defaults"); `producer_ahead`: the kernel design's
    producer takes each work index a tile ahead (`Backend.producer_ahead`), so where the
    scheduler's roles run apart a queue atomic costs the consumers nothing; `operands`: the
    values of the declaration's operands the mask reads (one not given is unknown, and
    classifies no tile)."""

    costs: Costs
    program: CheckedProgram | None
    mask: ast.Rule | None
    block_m: int
    block_n: int
    source: str = "defaults"
    producer_ahead: bool = False
    operands: dict = field(default_factory=dict)
    declared: tuple = ()  # the declaration's `Operand`s (a mask that reads data: exact)

    def classes(self, seqlens: list[int], offset: np.ndarray, head: np.ndarray,
                b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(full, partial) KV tiles of each tile (offset, head, b), as the kernel counts
        them (query and key lengths equal: self-attention)."""
        return tile_classes(self.program, self.mask, seqlens, offset, head, b, self.block_m,
                            self.block_n, self.operands, self.declared)

    def item_costs(self, seqlens: list[int], offset: np.ndarray, head: np.ndarray,
                   b: np.ndarray) -> np.ndarray:
        full, partial = self.classes(seqlens, offset, head, b)
        c = self.costs
        return c.per_item + c.full_tile * full + c.partial_tile * partial


def _names_used(rule: ast.Rule) -> set[str]:
    names, todo = set(), list(rule.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Name):
            names.add(node.id)
        todo.extend(ast.children(node))
    return names


def tile_classes(program: CheckedProgram | None, mask: ast.Rule | None, seqlens: list[int],
                 offset: np.ndarray, head: np.ndarray, b: np.ndarray, block_m: int,
                 block_n: int, operands: dict | None = None,
                 declared: tuple = ()) -> tuple[np.ndarray, np.ndarray]:
    """Full and partial KV-tile counts of each query tile, from the kernel's own static
    classification of the declared mask: a KV tile is skipped when the mask may keep no
    pair of it, full when it keeps every pair and lies inside the sequence, else partial.
    Memoised per distinct (length, query tile), and per batch and head only when the mask
    reads them. A mask that reads data (`declared`: the declaration's operands) given its
    tensors is classified as a call classifies it, from its pairs (`_data_classes`)."""
    lens = np.asarray(seqlens, np.int64)[np.asarray(b, np.int64)] if len(b) else \
        np.zeros(0, np.int64)
    offset = np.asarray(offset, np.int64)
    full, partial = np.zeros(len(offset)), np.zeros(len(offset))
    if mask is None:  # every KV tile is kept: full ones, and the tail tile partial
        full[:] = lens // block_n
        partial[:] = (lens % block_n) > 0
        return full, partial
    if mask_reads_data(mask, declared) and all(
            isinstance((operands or {}).get(o.name), np.ndarray) for o in declared if o.axes):
        counts = _data_classes(program, mask, seqlens, block_m, block_n, operands, declared)
        per_head = rule_reads(mask, "h")
        for k, (q_lo, bb, hh) in enumerate(zip(offset.tolist(), np.asarray(b).tolist(),
                                               np.asarray(head).tolist())):
            full[k], partial[k] = counts(bb, hh if per_head else 0, q_lo // block_m)
        return full, partial
    classify = _python_classifier(mask, program)
    extra = operand_bounds(classify, operands)
    params = [p.name for p in mask.params]
    used = _names_used(mask)
    reads_b, reads_h = params[0] in used, params[1] in used
    memo: dict[tuple, tuple[int, int]] = {}
    for k, (n, q_lo, bb, hh) in enumerate(zip(lens.tolist(), offset.tolist(),
                                              np.asarray(b).tolist(),
                                              np.asarray(head).tolist())):
        key = (n, q_lo, bb if reads_b else None, hh if reads_h else None)
        counts = memo.get(key)
        if counts is None:
            counts = memo[key] = _classify_row(classify, key[2], key[3], n, q_lo, block_m,
                                               block_n, extra)
        full[k], partial[k] = counts
    return full, partial


def _data_classes(program: CheckedProgram, mask: ast.Rule, seqlens: list[int], block_m: int,
                  block_n: int, operands: dict, declared: tuple):
    """counts(b, h, query tile) -> (full, partial) KV tiles, from the mask's pairs (what the
    classes kernel finds, `codegen.block_classes`; a KV tile past the sequence's end is
    partial). Tensor operands along `queries`/`keys` hold every sequence's rows one after
    another, as a ragged call's do, unless they have a `batch` axis."""
    from mhadsl.analysis.reference import _Positions, cell_classes, evaluate_rule
    values = {}
    for o in declared:
        value = operands.get(o.name)
        if o.axes:
            value = np.asarray(value).astype(np.int64 if o.type == "i32" else np.float64)
            if set(o.axes) & {"queries", "keys"}:
                ragged = "batch" not in o.axes
                value = _Positions(value, o.axes, (ragged, ragged))
        values[o.name] = value
    starts = np.concatenate(([0], np.cumsum(seqlens))).tolist()
    memo: dict[tuple, tuple[int, int]] = {}

    def tiles(b: int, h: int, q_tile: int) -> tuple[int, int]:
        if (b, h, q_tile) not in memo:  # (one query tile's rows at a time: long sequences)
            n, rows = seqlens[b], slice(starts[b], starts[b + 1])
            seq = {k: v.of_sequence(rows, rows) if isinstance(v, _Positions) else v
                   for k, v in values.items()}
            q = np.arange(q_tile * block_m, min(n, (q_tile + 1) * block_m))
            keep = np.broadcast_to(evaluate_rule(
                mask, program, seq, b=b, h=h, q_idx=q[:, None],
                kv_idx=np.arange(n)[None, :], seqlen_q=n, seqlen_k=n), (len(q), n))
            kv_tiles = -(-n // block_n)
            some, every = cell_classes(keep, (block_m, block_n), 1, kv_tiles)
            # a tile past the sequence's end is never full
            every = every[0] & ((np.arange(kv_tiles) + 1) * block_n <= n)
            some = some[0]
            memo[b, h, q_tile] = (int((some & every).sum()), int((some & ~every).sum()))
        return memo[b, h, q_tile]
    return tiles


def _classify_row(classify, b: int | None, h: int | None, n: int, q_lo: int, block_m: int,
                  block_n: int, extra: list[int]) -> tuple[int, int]:
    q_hi = min(q_lo + block_m, n) - 1
    if q_hi < q_lo:
        return 0, 0
    lo32, hi32 = -2**31, 2**31 - 1
    b_lo, b_hi = (lo32, hi32) if b is None else (b, b)
    h_lo, h_hi = (lo32, hi32) if h is None else (h, h)
    full = partial = 0
    for kv_lo in range(0, n, block_n):
        kv_end = kv_lo + block_n
        may, must = classify(b_lo, b_hi, h_lo, h_hi, q_lo, q_hi, kv_lo, min(kv_end, n) - 1,
                             n, n, *extra)
        if may:
            if must and kv_end <= n:
                full += 1
            else:
                partial += 1
    return full, partial


# ------------------------------------------------------------------ calibration
def fit(full: np.ndarray, partial: np.ndarray, duration: np.ndarray,
        step_gaps: np.ndarray | None = None, queue_gaps: np.ndarray | None = None,
        cta_gaps: np.ndarray | None = None, block_n: int = 64) -> Costs:
    """Constants from measured work items: least squares of duration over (full, partial,
    1), non-negative; when the partial counts cannot be told from the constant (a causal
    mask gives every query tile the same diagonal), a partial tile is taken to cost
    PARTIAL_RATIO full ones. `step_gaps` are the gaps between a CTA's items under a
    scheduler without a queue, `queue_gaps` under one that takes one index from the queue
    per step, `cta_gaps` between CTAs on one multiprocessor (medians: robust to stalls).
    All items must come from builds with KV tiles `block_n` wide."""
    full, partial, duration = (np.asarray(x, np.float64) for x in (full, partial, duration))
    if len(duration) == 0:
        raise ValueError("calibration needs at least one traced work item")
    design = np.stack([full, partial, np.ones_like(full)], axis=1)
    if _explained(partial, design[:, [0, 2]]):
        merged = np.stack([full + PARTIAL_RATIO * partial, np.ones_like(full)], axis=1)
        f, c = _nonneg_lstsq(merged, duration)
        p = PARTIAL_RATIO * f
    else:
        f, p, c = _nonneg_lstsq(design, duration)
    advance = _median(step_gaps, DEFAULT_COSTS.advance)
    queue = max(_median(queue_gaps, advance + DEFAULT_COSTS.queue_op) - advance, 0.0)
    return Costs(float(f), float(p), float(c), advance, queue,
                 _median(cta_gaps, DEFAULT_COSTS.cta_start), block_n=block_n)


def _explained(column: np.ndarray, others: np.ndarray) -> bool:
    """Whether `column` is (within a tenth of a tile, RMS) a linear mix of `others`."""
    x, *_ = np.linalg.lstsq(others, column, rcond=None)
    return float(np.sqrt(np.mean((others @ x - column) ** 2))) < 0.1


def _median(values, default: float) -> float:
    values = np.asarray([] if values is None else values, np.float64)
    return float(np.median(values)) if len(values) else float(default)


def _nonneg_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin |a x - y| over x >= 0, by trying every set of free columns (a has <= 3)."""
    best, best_err = np.zeros(a.shape[1]), float(np.sum(y * y))
    n = a.shape[1]
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        x, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
        if np.all(x >= 0):
            full_x = np.zeros(n)
            full_x[cols] = x
            err = float(np.sum((a @ full_x - y) ** 2))
            if err < best_err:
                best, best_err = full_x, err
    return best


# ------------------------------------------------------------------ storage
MAX_CALIBRATION_BYTES = 1 << 20  # a few constants per tile width: a kilobyte


def calibration_dir() -> Path:
    return cache.cache_dir() / "costs"


def kernel_key(program: CheckedProgram, kernel: str, backend: str, arch: str) -> str:
    """What the constants depend on besides the GPU: the kernel's declaration (every loaded
    file's text), its design and arch. Not the scheduler (an item costs the same under any)
    nor the compiler's own hash (an unrelated edit keeps a calibration)."""
    return cache.cache_key(what="cost calibration", sources=[s.text for s in program.sources],
                           kernel=kernel, backend=backend, arch=arch)


def _slug(gpu: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", gpu).strip("-") or "gpu"


def store(costs: list[Costs], key: str, gpu: str, meta: dict | None = None) -> Path:
    """Write the constants for (kernel `key`, `gpu`), one set per KV tile width the
    calibration's builds used; returns the file."""
    folder = calibration_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key}--{_slug(gpu)}.json"
    temp = path.with_suffix(".tmp")
    temp.write_text(json.dumps({"gpu": gpu, "costs": [dataclasses.asdict(c) for c in costs],
                                **(meta or {})}, indent=1))
    os.replace(temp, path)
    return path


def load(key: str, gpu: str | None = None, block_n: int | None = None) -> tuple[Costs, str]:
    """The constants for kernel `key` on `gpu` (None: the newest calibration of the kernel
    on any GPU) for KV tiles `block_n` wide (scaled from another width when the calibration
    has none; None: the first it has) and where they came from; DEFAULT_COSTS and
    "defaults" when none is stored or it cannot be read."""
    folder = calibration_dir()
    pattern = f"{key}--{_slug(gpu)}.json" if gpu else f"{key}--*.json"
    try:
        files = sorted(folder.glob(pattern), key=lambda f: f.stat().st_mtime, reverse=True)
    except OSError:
        files = []
    for file in files:
        try:
            # a FIFO or a device in the cache folder is skipped, not waited on
            data = json.loads(read_regular_file(file, MAX_CALIBRATION_BYTES))
            sets = [Costs(**c) for c in data["costs"]]
            exact = [c for c in sets if c.block_n == block_n]
            chosen = exact[0] if exact else sets[0]
            return (chosen if block_n is None else chosen.for_block_n(block_n)), str(file)
        except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError):
            continue
    default = DEFAULT_COSTS if block_n is None else DEFAULT_COSTS.for_block_n(block_n)
    return default, "defaults"
