"""Tensor interop: see PyTorch, CuPy and __cuda_array_interface__ tensors as raw device
pointers without copying, and copy NumPy arrays to and from the device.

NumPy has no bfloat16. A NumPy float16/float32 array given to a bfloat16 kernel is rounded to
bfloat16 on the host (round to nearest even) by `to_device`, and bfloat16 results come back to
NumPy as float32 (exact: every bfloat16 is a float32).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np

from mhadsl.runtime.driver import DeviceBuffer, current_device, memcpy_dtoh, pointer_device, stream_handle

DTYPES = ("bfloat16", "float16", "float32", "int32", "float8_e4m3fn")
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4, "float8_e4m3fn": 1}
_NUMPY_DTYPES = {
    np.dtype(np.float16): "float16",
    np.dtype(np.float32): "float32",
    np.dtype(np.int32): "int32",
}
_CAI_DTYPES = {"<f2": "float16", "<f4": "float32", "<i4": "int32"}
HOST = -1  # DeviceTensor.device of a NumPy array that still has to be copied to the device


@dataclass(frozen=True)
class DeviceTensor:
    """A tensor as a kernel sees it. `kind` is what the user passed ("torch", "cupy", "numpy",
    "cai"), so results can be handed back as the same kind; `obj` is that object, kept alive."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements, not bytes
    dtype: str
    device: int  # CUDA ordinal, or HOST for a NumPy array not yet copied
    kind: str
    obj: object = field(repr=False, compare=False)

    @property
    def on_host(self) -> bool:
        return self.device == HOST

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """C-order strides, in elements."""
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def _element_strides(byte_strides: tuple[int, ...], itemsize: int, name: str) -> tuple[int, ...]:
    if any(s % itemsize for s in byte_strides):
        raise ValueError(f"argument {name!r}: strides {byte_strides} bytes are not whole elements")
    return tuple(s // itemsize for s in byte_strides)


def _is_torch_tensor(obj: object) -> bool:
    torch = sys.modules.get("torch")  # a torch tensor implies torch is imported: never import it
    return torch is not None and isinstance(obj, torch.Tensor)


def as_device_tensor(obj: object, name: str) -> DeviceTensor:
    """View `obj` as a DeviceTensor, without copying. A NumPy array comes back with
    `on_host` True (device HOST, ptr 0): the caller copies it with `to_device`."""
    if _is_torch_tensor(obj):
        return _from_torch(obj, name)
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_cuda_array_interface(obj, name)
    if isinstance(obj, np.ndarray):
        dtype = _numpy_dtype(obj, name)
        strides = _element_strides(obj.strides, obj.itemsize, name)
        return DeviceTensor(0, obj.shape, strides, dtype, HOST, "numpy", obj)
    raise TypeError(
        f"argument {name!r}: expected a CUDA tensor (PyTorch, CuPy, or any object with "
        f"__cuda_array_interface__) or a NumPy array, got {type(obj).__qualname__}"
    )


def _from_torch(tensor: object, name: str) -> DeviceTensor:
    if tensor.device.type != "cuda":
        raise ValueError(
            f"tensor {name!r} is on {tensor.device.type}; mhadsl kernels need CUDA tensors "
            "(or NumPy arrays, which are copied)"
        )
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}; supported: {', '.join(DTYPES)}")
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    return DeviceTensor(tensor.data_ptr(), shape, strides, dtype, tensor.device.index, "torch", tensor)


def _from_cuda_array_interface(obj: object, name: str) -> DeviceTensor:
    interface = obj.__cuda_array_interface__
    typestr = interface["typestr"]
    dtype = _CAI_DTYPES.get(typestr)
    if dtype is None:
        raise TypeError(
            f"argument {name!r}: dtype {typestr!r} is not supported; use float16 '<f2', "
            "float32 '<f4' or int32 '<i4' (bfloat16 has no __cuda_array_interface__ typestr: "
            "pass a torch tensor for bfloat16)"
        )
    if interface.get("mask") is not None:
        raise TypeError(f"argument {name!r}: masked arrays are not supported")
    ptr = interface["data"][0]
    shape = tuple(interface["shape"])
    byte_strides = interface.get("strides")
    if byte_strides is None:  # the interface's way of saying C-contiguous
        strides = contiguous_strides(shape)
    else:
        strides = _element_strides(tuple(byte_strides), ITEMSIZE[dtype], name)
    kind = "cupy" if type(obj).__module__.startswith("cupy") else "cai"
    if kind == "cupy":
        device = obj.device.id
    else:  # an empty array may have no pointer to ask the driver about
        device = pointer_device(ptr) if ptr else current_device()
    return DeviceTensor(ptr, shape, strides, dtype, device, kind, obj)


def _numpy_dtype(array: np.ndarray, name: str) -> str:
    dtype = _NUMPY_DTYPES.get(array.dtype)
    if dtype is None:
        raise TypeError(
            f"argument {name!r}: NumPy dtype {array.dtype} is not supported; use float16, "
            "float32 or int32 (float data is rounded to bfloat16 for bfloat16 kernels)"
        )
    return dtype


def _host_copy(array: np.ndarray, name: str, dtype: str | None) -> tuple[np.ndarray, str]:
    """`array` as a C-contiguous host array holding the bits of `dtype` (default: its own)."""
    if dtype == "bfloat16" and array.dtype == np.uint16:  # already bfloat16 bit patterns
        return np.ascontiguousarray(array), dtype
    source = _numpy_dtype(array, name)
    target = dtype or source
    if target not in DTYPES:
        raise TypeError(f"argument {name!r}: unknown dtype {target!r}; supported: {', '.join(DTYPES)}")
    if (source == "int32") != (target == "int32"):
        raise TypeError(f"argument {name!r}: cannot pass a NumPy {source} array as {target}")
    if target == "bfloat16":
        return np.ascontiguousarray(numpy_to_bf16_bits(array)), target
    return np.ascontiguousarray(array, dtype=target), target


def to_device(
    array: np.ndarray,
    name: str = "array",
    *,
    dtype: str | None = None,
    stream: object = None,
    device: int | None = None,
) -> tuple[DeviceTensor, DeviceBuffer]:
    """Copy a NumPy array to a new device buffer, converting it to `dtype` (default: its own)
    on the host; uint16 input with dtype "bfloat16" is taken as bfloat16 bits. The tensor is
    C-contiguous and of kind "numpy"; keep the buffer alive while the tensor is in use."""
    host, dtype = _host_copy(array, name, dtype)
    buffer = DeviceBuffer.from_numpy(host, stream, device)
    tensor = DeviceTensor(
        buffer.ptr, host.shape, contiguous_strides(host.shape), dtype, buffer.device, "numpy", array
    )
    return tensor, buffer


def from_device(tensor: DeviceTensor, out: np.ndarray | None = None, *, stream: object = None) -> np.ndarray:
    """Copy a C-contiguous device tensor to NumPy, ordered on `stream`, after waiting for it.
    bfloat16 comes back as float32. With `out`, the values are stored into it (cast as NumPy
    does) and `out` is returned."""
    if tensor.strides != contiguous_strides(tensor.shape):
        raise ValueError(f"cannot copy a non-contiguous tensor (strides {tensor.strides}) to NumPy")
    raw = np.empty(tensor.shape, np.uint16 if tensor.dtype == "bfloat16" else tensor.dtype)
    memcpy_dtoh(raw, tensor.ptr, stream_handle(stream, kind=tensor.kind, device=tensor.device), tensor.device)
    values = bf16_bits_to_float32(raw) if tensor.dtype == "bfloat16" else raw
    if out is None:
        return values
    np.copyto(out, values, casting="same_kind")
    return out


def empty_like_kind(reference: object, shape: tuple[int, ...], dtype: str) -> object:
    """An uninitialised array of the same kind (and device) as `reference`, so results come back
    as the user's own kind. NumPy has no bfloat16: a NumPy result for it is float32."""
    if isinstance(reference, DeviceTensor):
        reference = reference.obj
    if dtype not in DTYPES:
        raise TypeError(f"unknown dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    if _is_torch_tensor(reference):
        torch = sys.modules["torch"]
        return torch.empty(shape, dtype=getattr(torch, dtype), device=reference.device)
    if type(reference).__module__.startswith("cupy"):
        if dtype == "bfloat16":
            raise TypeError("CuPy has no bfloat16; pass torch tensors for bfloat16 kernels")
        cupy = sys.modules["cupy"]
        with reference.device:
            return cupy.empty(shape, dtype=dtype)
    if isinstance(reference, np.ndarray):
        return np.empty(shape, np.float32 if dtype == "bfloat16" else dtype)
    raise TypeError(
        f"cannot allocate an output like a {type(reference).__qualname__}; pass the output explicitly"
    )


def numpy_to_bf16_bits(array: np.ndarray) -> np.ndarray:
    """Round float16/float32 values to bfloat16 (nearest, ties to even) and return the bit
    patterns as uint16. NaN stays NaN (quietened, sign kept); overflow rounds to infinity."""
    array = np.asarray(array)
    if array.dtype not in (np.float16, np.float32):
        raise TypeError(f"bfloat16 conversion needs float16 or float32 data, got {array.dtype}")
    values = array.astype(np.float32)
    bits = values.view(np.uint32)
    # Adding 0x7FFF plus the kept part's lowest bit rounds to nearest with ties to even.
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16
    quiet_nan = (bits >> 16) | 0x0040  # rounding could carry a NaN's payload into infinity
    return np.where(np.isnan(values), quiet_nan, rounded).astype(np.uint16)


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) to float32 values, exactly."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"bfloat16 bits must be uint16, got {bits.dtype}")
    return (bits.astype(np.uint32) << 16).view(np.float32)
