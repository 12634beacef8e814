"""Tiled tensor maps (CUtensorMap) for the Tensor Memory Accelerator.

`encode_tiled` describes a 2-D to 5-D bf16/fp16 tensor in device memory and the box one
`cp.async.bulk.tensor` copies (`mhadsl.codegen.hopper.tma_load`). Shapes, strides, boxes
and coordinates are outermost first, as torch writes them (strides in elements); the
driver wants innermost first, in bytes, which `tiled_layout` works out after checking the
driver's rules up front, so a bad request is a ValueError that names the rule instead of
CUDA_ERROR_INVALID_VALUE.

The map is 128 opaque bytes passed by value to a `grid_constant` kernel parameter:
`TensorMap.kernel_arg()` is the launch argument (the bytes at `CUtensorMap.getPtr()`);
`launch_arg` is the same, remembered for the next launch over the same tensors.
Out-of-bounds elements of a box load as zero and are not written by a store.
"""
from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from cuda.bindings import driver as cu

from mhadsl.runtime import driver

TENSOR_MAP_BYTES = 128
MAX_RANK = 5
MAX_BOX = 256  # elements along any box dimension
GLOBAL_ALIGN = 16  # bytes: the base address and every stride but the innermost
MAX_STRIDE = 1 << 40
MAX_DIM = 1 << 32

_DTYPES = {  # codegen and runtime spellings -> (driver type, bytes per element)
    "bf16": (cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2),
    "bfloat16": (cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2),
    "fp16": (cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2),
    "float16": (cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2),
}
_SWIZZLES = {
    0: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
    32: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_32B,
    64: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
    128: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
}


@dataclass(frozen=True)
class TiledLayout:
    """A checked request, in the driver's order (innermost dimension first, bytes)."""

    dtype: str
    address: int
    dims: tuple[int, ...]  # elements per dimension
    byte_strides: tuple[int, ...]  # of dimensions 1..rank-1 (dimension 0 is contiguous)
    box: tuple[int, ...]  # elements per box dimension
    swizzle: int  # bytes: 0, 32, 64 or 128

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def box_bytes(self) -> int:
        """Bytes one copy moves (and completes on its mbarrier), in bounds or not."""
        return math.prod(self.box) * _DTYPES[self.dtype][1]


def tiled_layout(address: int, dtype: str, shape: Sequence[int], strides: Sequence[int],
                 box: Sequence[int], swizzle: int = 128) -> TiledLayout:
    """Check a tensor-map request against the driver's rules; outermost-first `shape`,
    `strides` (elements) and `box` become the driver's innermost-first `TiledLayout`."""
    if dtype not in _DTYPES:
        raise ValueError(f"tensor map dtype {dtype!r}: expected one of {', '.join(_DTYPES)}")
    size = _DTYPES[dtype][1]
    rank = len(shape)
    if not 2 <= rank <= MAX_RANK:
        raise ValueError(f"tensor map rank {rank}: expected 2 to {MAX_RANK} dimensions")
    if len(strides) != rank or len(box) != rank:
        raise ValueError(f"shape {tuple(shape)}, strides {tuple(strides)} and box {tuple(box)} "
                         "must have one entry per dimension")
    if swizzle not in _SWIZZLES:
        raise ValueError(f"swizzle {swizzle}: expected one of {sorted(_SWIZZLES)} bytes")
    if address % GLOBAL_ALIGN:
        raise ValueError(f"tensor address {address:#x} is not {GLOBAL_ALIGN}-byte aligned")
    if strides[-1] != 1:
        raise ValueError(f"the innermost dimension must be contiguous (stride 1), not "
                         f"{strides[-1]}")
    for i, extent in enumerate(shape):
        if not 0 < extent <= MAX_DIM:
            raise ValueError(f"dimension {i} has extent {extent}: expected 1 to 2^32")
    for i, stride in enumerate(strides[:-1]):
        nbytes = stride * size
        if nbytes <= 0 or nbytes % GLOBAL_ALIGN or nbytes >= MAX_STRIDE:
            raise ValueError(f"dimension {i} has a stride of {nbytes} bytes: the driver needs a "
                             f"positive multiple of {GLOBAL_ALIGN} below 2^40")
    for i, extent in enumerate(box):
        if not 0 < extent <= MAX_BOX:
            raise ValueError(f"box dimension {i} is {extent} elements: expected 1 to {MAX_BOX}")
    inner_bytes = box[-1] * size
    if inner_bytes % 16:
        raise ValueError(f"the box's innermost dimension is {inner_bytes} bytes: the driver "
                         "needs a multiple of 16")
    if swizzle and inner_bytes > swizzle:
        raise ValueError(f"the box's innermost dimension is {inner_bytes} bytes: a {swizzle}-byte "
                         f"swizzle allows at most {swizzle} ({swizzle // size} elements)")
    return TiledLayout(dtype, address, tuple(reversed(shape)),
                       tuple(s * size for s in reversed(strides[:-1])), tuple(reversed(box)),
                       swizzle)


class TensorMap:
    """An encoded CUtensorMap and the layout it was made from (kept for `box_bytes`)."""

    def __init__(self, handle: cu.CUtensorMap, layout: TiledLayout) -> None:
        self.handle = handle
        self.layout = layout

    @property
    def box_bytes(self) -> int:
        return self.layout.box_bytes

    def kernel_arg(self) -> ctypes.Array:
        """The launch argument: a copy of the map's 128 bytes (read at `getPtr()`), which a
        launch (`runtime.launch.LaunchPlan`) passes by value into the grid_constant
        parameter. A copy, so the argument stays valid even if this TensorMap is dropped
        before the launch."""
        return (ctypes.c_ubyte * TENSOR_MAP_BYTES).from_buffer_copy(
            ctypes.string_at(self.handle.getPtr(), TENSOR_MAP_BYTES))


def encode_tiled(address: int, dtype: str, shape: Sequence[int], strides: Sequence[int],
                 box: Sequence[int], swizzle: int = 128, device: int | None = None) -> TensorMap:
    """A tiled tensor map over `address` (see `tiled_layout`), out-of-bounds fill zero."""
    layout = tiled_layout(address, dtype, shape, strides, box, swizzle)
    driver.ensure_context(device)
    handle = driver.check(
        cu.cuTensorMapEncodeTiled(
            _DTYPES[dtype][0],
            layout.rank,
            layout.address,
            [cu.cuuint64_t(d) for d in layout.dims],
            [cu.cuuint64_t(s) for s in layout.byte_strides],
            [cu.cuuint32_t(b) for b in layout.box],
            [cu.cuuint32_t(1)] * layout.rank,
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            _SWIZZLES[swizzle],
            cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        ),
        "cuTensorMapEncodeTiled",
        f"{layout}",
    )
    return TensorMap(handle, layout)


@functools.lru_cache(maxsize=256)
def launch_arg(address: int, dtype: str, shape: tuple[int, ...], strides: tuple[int, ...],
               box: tuple[int, ...], swizzle: int = 128, device: int | None = None
               ) -> ctypes.Array:
    """`encode_tiled(...).kernel_arg()`, remembered. A map is a function of these values
    alone (it holds the address, not the data), and encoding an sm90 launch's four maps is a
    large part of its host time, which a kernel shorter than its launch waits for. The
    driver copies the bytes at each launch and nothing writes them, so launches share one
    copy. A bad request raises every time: errors are not remembered."""
    return encode_tiled(address, dtype, shape, strides, box, swizzle, device=device).kernel_arg()
