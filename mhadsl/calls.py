"""What every kernel call shares (prefill, decode, backward): the torch signature a planned
call is looked up by, streams, and the checks of the tensors a kernel reads and writes
(those of a planned call's addresses skipped where the last passing call had them).

Imported by `mhadsl.api`, `mhadsl.serving` and `mhadsl.backward`; it imports none of them.
"""
from __future__ import annotations

import sys

import numpy as np

from mhadsl.attention_spec import scale_problem

DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}
NO_OPTIONS = (None, None, None, None)


def typed_key(signature: tuple, options: tuple) -> tuple:
    """A planned call's key: its tensors' signature, and its options typed where any is
    given (3.0 == 3 and True == 1, yet one of each is refused)."""
    if options == NO_OPTIONS:
        return signature
    return (signature, *((type(x), x) for x in options))


def check_output(out, shape, dtype: str, device: int | None, reads: dict):
    """The output's view, checked: q's shape, the kernel's dtype and device, aligned rows,
    no element written twice, and no element shared with a tensor the kernel `reads`
    (name -> view)."""
    from mhadsl.runtime import tensors
    view = tensors.as_device_tensor(out, "out")
    if tuple(view.shape) != tuple(shape):
        raise ValueError(f"out has shape {view.shape}, expected {tuple(shape)} (like q)")
    if not view.on_host:
        if view.dtype != dtype:
            raise TypeError(f"out has dtype {view.dtype}, expected {dtype}")
        if device is not None and view.device != device:
            raise ValueError(f"out is on device {view.device}, {'/'.join(reads)} on {device}")
        check_rows(view, "out")
        if self_overlapping(view):
            raise ValueError(f"out has strides {view.strides} for shape {view.shape}: "
                             "its elements overlap, so the kernel's writes would collide")
        for name, t in reads.items():
            if not t.on_host and share_memory(view, t):
                raise ValueError(f"out overlaps {name}: the kernel reads {name} while it "
                                 "writes out; pass a separate output")
    return view


def span(shape, strides, itemsize: int) -> int:
    """Bytes from a non-empty tensor's first element to its last (non-negative strides)."""
    return sum((n - 1) * s for n, s in zip(shape, strides)) * itemsize + itemsize - 1


def torch_signature(*tensors) -> tuple | None:
    """What a call's torch tensors fix of its checks and its launch (everything but their
    addresses); None unless every tensor given is a torch tensor."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    signature = []
    for t in tensors:
        if t is None:
            signature.append(None)
        elif isinstance(t, torch.Tensor):
            signature.append((t.dtype, t.shape, t.stride(), t.get_device()))  # -1: the CPU
        else:
            return None
    return tuple(signature)


_current_stream = None  # torch's accessor of a device's current raw stream, found once


def torch_stream(torch, device: int) -> int:
    """torch's current stream on `device`, as a raw handle (its C accessor is the cheap way;
    looked up on the first call, as a lookup per call costs host time)."""
    global _current_stream
    if _current_stream is None:
        _current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda device: torch.cuda.current_stream(device).cuda_stream)
    return _current_stream(device)


class AddressChecks:
    """What a planned call signature checks of a call's tensor addresses, skipped where the
    ones it checks (`checked_addresses`, an `operator.itemgetter` over the call's address
    dict) are the last passing call's: a serving loop's usually are. A subclass raises from
    `check_new_addresses` for addresses it refuses, so a refused call's are never
    remembered. (A base class, not a helper object: a call that skips costs one method
    call and a comparison, as if the subclass wrote it itself.)"""

    _passed: tuple = ()

    def check_addresses(self, addresses: dict) -> None:
        key = self.checked_addresses(addresses)
        if key != self._passed:
            self.check_new_addresses(addresses)
            self._passed = key


def stream_handle(stream) -> int:
    from mhadsl.runtime import driver
    return driver.stream_handle(stream)


def check_rows(t, name: str) -> None:
    """The kernel copies rows in 16-byte pieces: a contiguous last dimension, aligned rows."""
    if t.strides[-1] != 1:
        raise ValueError(f"tensor {name!r}: the last dimension must be contiguous (stride 1), "
                         f"got strides {t.strides}")
    if t.ptr == 0 and 0 not in t.shape:
        raise ValueError(f"tensor {name!r} has a null data pointer")
    if any(s < 0 for s in t.strides):
        raise ValueError(f"tensor {name!r} has negative strides {t.strides}; pass a copy "
                         "with non-negative strides")
    if t.ptr % 16 or any(s % 8 for s in t.strides[:-1]):
        raise ValueError(f"tensor {name!r}: rows must be 16-byte aligned (pointer and strides "
                         f"multiples of 8 elements), got strides {t.strides}")


def self_overlapping(t) -> bool:
    """Whether two elements of `t` may share memory: sorted by stride, each dimension of
    more than one element must step past the whole of the dimensions inside it."""
    dims = sorted((s, n) for s, n in zip(t.strides, t.shape) if n > 1)
    span = 1
    for stride, extent in dims:
        if stride < span:
            return True
        span = stride * extent
    return False


def share_memory(a, b) -> bool:
    """Whether device tensors `a` and `b` have an element in common (exact, by NumPy's
    solver over their addresses and strides: packed QKV views side by side do not)."""
    def alias(t):  # a NumPy view of t's addresses, never read
        holder = type("Alias", (), {})()
        holder.__array_interface__ = {
            "shape": tuple(t.shape), "typestr": f"|V{t.itemsize}", "data": (t.ptr, True),
            "strides": tuple(s * t.itemsize for s in t.strides), "version": 3}
        return np.asarray(holder)
    def extent(t):  # [first byte, last byte] (strides are non-negative: check_rows)
        return t.ptr, t.ptr + span(t.shape, t.strides, t.itemsize)
    if 0 in a.shape or 0 in b.shape:
        return False
    (a_lo, a_hi), (b_lo, b_hi) = extent(a), extent(b)
    if a_hi < b_lo or b_hi < a_lo:
        return False  # separate allocations, the usual case: no NumPy views to build (a
        # launch's host work bounds how fast short kernels run back to back)
    try:
        return bool(np.shares_memory(alias(a), alias(b), max_work=10**6))
    except np.exceptions.TooHardError:
        return True  # cannot tell: refuse rather than risk a kernel reading its own output


def check_scale(scale) -> float:
    if problem := scale_problem(scale):
        raise TypeError(problem)
    return float(scale)


def host_values(view) -> np.ndarray:
    from mhadsl.runtime import tensors
    if view.on_host:
        return np.asarray(view.obj, dtype=np.int64)
    return tensors.from_device(view).astype(np.int64)
