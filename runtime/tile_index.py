"""The tile index of a ragged launch, built on the device just before the launch.

`prepare` queues the tile index kernel (`codegen.tile_index`) on the launch's stream: it
reads cu_seqlens on the device and writes the per-stream index buffer the attention
kernel's `tile_index` parameter points to. Nothing waits on the host, and a CUDA graph
captures the kernel with the launch, so a replay with new cu_seqlens values rebuilds the
index too.

Buffers are per (device, stream), like the workspace (`driver.queue_workspace`), so two
streams never overwrite each other's index. A buffer grows (doubling) when a launch has
more sequences than it holds; the old one is kept, since a captured graph may still point
to it. Growing allocates, which a stream under capture must not: run a launch with at least
as many sequences once before capturing (the warm-up launch graphs need anyway).
"""
from __future__ import annotations

import functools
import threading

from mhadsl.builtins import tile_index_words
from mhadsl.codegen.target import emit_ptx, gpu_target, new_module, optimize
from mhadsl.codegen.tile_index import ABI, KERNEL_NAME, THREADS, build_tile_index_kernel
from mhadsl.runtime import driver, launch

_lock = threading.Lock()
_ptx: str | None = None
_kernels: dict[int, driver.Function] = {}
_buffers: dict[tuple[int, int], list[driver.DeviceBuffer]] = {}


def _kernel(device: int) -> driver.Function:
    """The tile index kernel, loaded once per device (PTX for sm_80: every later GPU JITs it)."""
    global _ptx
    with _lock:
        if device not in _kernels:
            if _ptx is None:
                target = gpu_target("sm_80")
                module = new_module("tile_index", target)
                build_tile_index_kernel(module)
                _ptx = emit_ptx(optimize(module, target), target)
            _kernels[device] = driver.Module.from_ptx(_ptx, device).function(KERNEL_NAME)
        return _kernels[device]


def buffer(batch: int, stream: object = None, device: int | None = None) -> int:
    """Device pointer to the index buffer of (`device`, `stream`), holding at least
    `tile_index_words(batch)` words."""
    dev = driver.ensure_context(device)
    handle = driver.stream_handle(stream)
    nbytes = 4 * tile_index_words(batch)
    with _lock:
        held = _buffers.setdefault((dev, handle), [])
        if not held or held[-1].nbytes < nbytes:
            if driver._capturing(handle):
                raise RuntimeError(
                    f"a ragged launch of {batch} sequences needs a larger tile index than this "
                    f"stream holds, and a stream under CUDA-graph capture cannot allocate "
                    f"one: run the kernel once with at least {batch} sequences before "
                    f"capturing")
            size = max(nbytes, 2 * held[-1].nbytes if held else 4096)
            held.append(driver.DeviceBuffer(size, dev))
        return held[-1].ptr


@functools.lru_cache(maxsize=256)
def plan(batch: int, tile_m: int, device: int) -> launch.LaunchPlan:
    """The tile index kernel's launch for `batch` sequences and tiles of `tile_m` rows."""
    return launch.LaunchPlan(_kernel(device), (-(-batch * 32 // THREADS), 1, 1), THREADS, 0,
                             ABI, None, device, {}, {"batch": batch, "tile_m": tile_m})


def prepare(cu_seqlens: int, batch: int, tile_m: int, stream: object = None,
            device: int | None = None) -> int:
    """Queue the tile index kernel for `batch` sequences (row offsets at device pointer
    `cu_seqlens`, int32, batch + 1) and tiles of `tile_m` rows on `stream`; return the
    index's device pointer, for the attention kernel queued next on the same stream."""
    dev = driver.ensure_context(device)
    index = buffer(batch, stream, dev)
    if batch:
        plan(batch, tile_m, dev).launch({"cu_seqlens_q": cu_seqlens, "tile_index": index},
                                        driver.stream_handle(stream))
    return index
