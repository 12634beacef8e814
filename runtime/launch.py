"""Launch plans: everything about a launch that a call's signature fixes, made once.

A `LaunchPlan` holds a kernel's parameter block laid out by its ABI (`mhadsl.abi`) with
every value the signature fixes already packed (strides, sizes, the scale, the device's
multiprocessors), and the grid. A call then only patches what depends on its pointers and
its stream (tensor addresses, the stream's workspace, tensor maps over the addresses) and
launches: one `cuLaunchKernel` on the prebuilt block.
"""
from __future__ import annotations

import ctypes
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from mhadsl.abi import Extent, KernelABI, Pointer, Scalar, Stride, TensorMap, Workspace
from mhadsl.runtime import driver, tensormap

_FORMATS = {"ptr": "<Q", "i64": "<q", "i32": "<i", "f32": "<f"}
_AXES = {"batch": 0, "row": -3, "head": -2}  # of a (B, S, H, D) or ragged (T, H, D) tensor


@dataclass(frozen=True)
class TensorShape:
    """What a plan knows of a call's tensor: everything but its address."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]  # elements
    dtype: str


class ParamBlock:
    """A kernel's parameters as one block of bytes at the ABI's offsets, and the `void*[]` of
    their addresses that cuLaunchKernel takes. `words` is the block as 64-bit words: a call
    stores its addresses there by index (`word`), cheaper than through ctypes objects."""

    def __init__(self, abi: KernelABI):
        self.abi = abi
        self.data = (ctypes.c_uint64 * max(-(-abi.size // 8), 1))()  # whole words
        self.base = ctypes.addressof(self.data)
        self.pointers = (ctypes.c_void_p * len(abi.params))(
            *(self.base + abi.offsets[p.name] for p in abi))
        self.address = ctypes.addressof(self.pointers)
        self.words = memoryview(self.data).cast("B").cast("Q")  # ctypes' "<Q" casts via bytes

    def pack(self, name: str, value: int | float) -> None:
        """Pack scalar or pointer parameter `name` as the kernel declares it."""
        struct.pack_into(_FORMATS[self.abi[name].kind], self.data, self.abi.offsets[name], value)

    def word(self, name: str) -> int:
        """The index in `words` of pointer parameter `name` (CUDA aligns pointers to 8)."""
        offset = self.abi.offsets[name]
        assert self.abi[name].kind == "ptr" and offset % 8 == 0, name
        return offset // 8


def ragged(t: TensorShape) -> bool:
    """Whether `t` holds the rows of all sequences, (T, H, D): it has no batch axis."""
    return len(t.shape) == 3


def signature_value(binding, tensors: Mapping[str, TensorShape | None], values: Mapping):
    """The value of a parameter the call's signature fixes (`Stride`, `Extent`,
    `CallValue`)."""
    if isinstance(binding, Extent):
        return tensors[binding.tensor].shape[binding.axis]
    if isinstance(binding, Stride):
        t = tensors[binding.tensor]
        if isinstance(binding.axis, int):
            return t.strides[binding.axis]
        return 0 if ragged(t) and binding.axis == "batch" else t.strides[_AXES[binding.axis]]
    return values[binding.name]


def map_request(binding: TensorMap, t: TensorShape, config) -> tuple:
    """(shape, strides, box) of the tensor map over `t`, outermost first, in elements: a
    ragged (T, H, D) tensor is seen as (1, T, H, D); empty extents count as 1 (the driver
    wants at least 1; such a map is never read)."""
    if ragged(t):
        shape = (1, *t.shape)
        strides = (max(t.shape[0], 1) * t.strides[0], *t.strides)
    else:
        shape, strides = t.shape, t.strides
    shape = tuple(max(int(n), 1) for n in shape)
    strides = tuple(int(s) if s else 1 for s in strides[:-1]) + (1,)
    return shape, strides, binding.box(config)


class LaunchPlan:
    """One kernel launch for one call signature (see the module's docstring).

    `launch(addresses, stream)` takes device addresses by name (of the call's tensors, and
    of workspaces other than the stream's queue; absent ones are null) and a raw stream
    handle; `workspace` replaces the stream's (a traced launch records into its own);
    `scalars`, the call's operand values by name (`Scalar` parameters).
    Ragged tensors (`ragged`) have batch stride 0 and are seen as (1, T, H, D) in tensor
    maps. With a `tile_index` (`runtime.tile_index.plan`) the launch builds its tile index
    first, on the device by a kernel of its own, over the row offsets `tile_offsets`.
    `grid_dependent`: the kernel waits for the grids before it itself
    (`KernelBuild.grid_dependent`), so it launches while the one before it drains."""

    def __init__(self, function, grid: tuple[int, int, int], threads: int,
                 shared_bytes: int, abi: KernelABI, config, device: int,
                 tensors: Mapping[str, TensorShape | None], values: Mapping,
                 tile_index=None, tile_offsets: str = "cu_seqlens_q",
                 grid_dependent: bool = False):
        self.function, self.grid, self.threads = function, grid, threads
        self.shared_bytes, self.device = shared_bytes, device
        self.ctas_per_sm = values.get("ctas_per_sm")  # what the grid was planned for
        self.block = ParamBlock(abi)
        self._tile_index, self._tile_offsets = tile_index, tile_offsets
        # (tensor or workspace name, the block's word of its address)
        self._pointers: list[tuple[str, int]] = []
        self._queue: int | None = None  # the word of the stream's workspace
        self._maps: list[tuple[str, int, str, tuple, tuple, tuple, int]] = []
        self._scalars: list[tuple[str, str]] = []  # (operand, its parameter's name)
        for p in abi:
            b = p.binding
            if isinstance(b, Workspace) and b.name == "queue":
                self._queue = self.block.word(p.name)
            elif isinstance(b, (Pointer, Workspace)):
                self._pointers.append((b.tensor if isinstance(b, Pointer) else b.name,
                                       self.block.word(p.name)))
            elif isinstance(b, Scalar):
                self._scalars.append((b.name, p.name))
            elif isinstance(b, TensorMap):
                shape, strides, box = map_request(b, tensors[b.tensor], config)
                self._maps.append((b.tensor, abi.offsets[p.name], tensors[b.tensor].dtype,
                                   shape, strides, box, b.swizzle))
            else:
                self.block.pack(p.name, signature_value(b, tensors, values))
        self.function.set_max_dynamic_shared(shared_bytes)
        self._launch = function.launcher(grid, threads, shared_bytes, self.block.address,
                                         grid_dependent)
        self._lock = threading.Lock()  # the block is shared: one patch-and-launch at a time
        self._last: tuple | None = None  # the addresses the block's maps were made for

    def launch(self, addresses: Mapping[str, int], stream: int,
               workspace: int | None = None, scalars: Mapping | None = None) -> None:
        driver.ensure_context(self.device)
        if self._queue is not None and workspace is None:
            # (raises a fault that a launch recorded in the stream's workspace)
            workspace = driver.workspace(stream, self.device).ptr
        if self._tile_index is not None:
            addresses = {**addresses, "tile_index": self._tile_index.prepare(
                addresses[self._tile_offsets], stream)}
        with self._lock:
            self._patch(addresses)
            for operand, param in self._scalars:
                self.block.pack(param, scalars[operand])
            if self._queue is not None:
                self.block.words[self._queue] = workspace
            self._launch(stream)
        if driver.debug_mode():
            driver.wait_for_fault(stream, self.device)

    def _patch(self, addresses: Mapping[str, int]) -> None:
        get, words = addresses.get, self.block.words
        for tensor, word in self._pointers:
            words[word] = get(tensor, 0)
        if not self._maps:  # no tensor maps (a decode launch's, say): no key to build
            return
        key = tuple([get(m[0], 0) for m in self._maps])
        if key == self._last:
            return
        for (tensor, offset, dtype, shape, strides, box, swizzle), address in zip(self._maps,
                                                                                  key):
            # an empty tensor may have no address; its map is never read then
            arg = tensormap.launch_arg(address or addresses["o"] or 128, dtype, shape, strides,
                                       box, swizzle, device=self.device)
            ctypes.memmove(self.block.base + offset, arg, ctypes.sizeof(arg))
        self._last = key
