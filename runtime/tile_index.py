"""The tile index of a ragged launch, built on the device just before the launch.

`prepare` queues the tile index kernel (`codegen.tile_index`) on the launch's stream: it
reads cu_seqlens on the device and writes the per-stream index buffer the attention
kernel's `tile_index` parameter points to. Nothing waits on the host, and a CUDA graph
captures the kernel with the launch, so a replay with new cu_seqlens values rebuilds the
index too. The kernel comes built (`mhadsl.build.build_tile_index`: its PTX, name, threads
per CTA and parameters); it is loaded once per device.

Buffers are per (device, stream), like the workspace (`driver.queue_workspace`), so two
streams never overwrite each other's index. A buffer grows (doubling) when a launch has
more sequences than it holds; the old one is kept, since a captured graph may still point
to it. Growing allocates, which a stream under capture must not: run a launch with at least
as many sequences once before capturing (the warm-up launch graphs need anyway).
"""
from __future__ import annotations

import functools
import threading

from mhadsl.abi import tile_index_words
from mhadsl.runtime import driver
from mhadsl.runtime.launch import LaunchPlan

_lock = threading.Lock()
_functions: dict[tuple[str, int], driver.Function] = {}  # by (PTX, device)


def _function(kernel, device: int) -> driver.Function:
    """`kernel` (a `TileIndexBuild`) loaded on `device`, once."""
    with _lock:
        key = (kernel.ptx, device)
        if key not in _functions:
            _functions[key] = driver.Module.from_ptx(kernel.ptx, device).function(kernel.name)
        return _functions[key]


def buffer(batch: int, stream: object = None, device: int | None = None) -> int:
    """Device pointer to the index buffer of (`device`, `stream`), holding at least
    `tile_index_words(batch)` words."""
    dev = driver.ensure_context(device)
    return driver.stream_buffer("tile_index", 4 * tile_index_words(batch),
                                driver.stream_handle(stream), dev,
                                f"a ragged launch of {batch} sequences")


class IndexPlan:
    """The tile index kernel's launch for `batch` sequences and tiles of `tile_m` rows on
    `device`; a `LaunchPlan` runs it first when it is the plan's `tile_index`."""

    def __init__(self, kernel, batch: int, tile_m: int, device: int):
        self.batch, self.device = batch, device
        self.launch_plan = LaunchPlan(
            _function(kernel, device), (-(-batch * 32 // kernel.threads), 1, 1), kernel.threads,
            0, kernel.abi, None, device, {}, {"batch": batch, "tile_m": tile_m},
            grid_dependent=kernel.grid_dependent)

    def prepare(self, cu_seqlens: int, stream: int) -> int:
        """Queue the kernel over `cu_seqlens` (device pointer to int32 row offsets, batch
        + 1) on `stream` (a raw handle); return the index's device pointer."""
        index = buffer(self.batch, stream, self.device)
        if self.batch:
            self.launch_plan.launch({"cu_seqlens_q": cu_seqlens, "tile_index": index}, stream)
        return index


@functools.lru_cache(maxsize=256)
def plan(kernel, batch: int, tile_m: int, device: int) -> IndexPlan:
    """The launch of `kernel` (a `TileIndexBuild`) for `batch` sequences and tiles of
    `tile_m` rows on `device`."""
    return IndexPlan(kernel, batch, tile_m, device)


def prepare(kernel, cu_seqlens: int, batch: int, tile_m: int, stream: object = None,
            device: int | None = None) -> int:
    """Queue `kernel` (a `TileIndexBuild`) for `batch` sequences (row offsets at device
    pointer `cu_seqlens`, int32, batch + 1) and tiles of `tile_m` rows on `stream`; return
    the index's device pointer, for the attention kernel queued next on the same stream."""
    dev = driver.ensure_context(device)
    return plan(kernel, batch, tile_m, dev).prepare(cu_seqlens, driver.stream_handle(stream))
