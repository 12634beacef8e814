"""The CUDA driver side of mhadsl: errors, the primary context, modules, launches, memory.

Everything goes through `cuda.bindings.driver` but the two calls of every launch (libcuda's
cuCtxGetCurrent and cuLaunchKernel by ctypes: `_raw`), and every driver result goes through
`check`.
Importing this module never touches the driver: the first call that needs a GPU initialises
it, so CPU-only machines (no libcuda) can import mhadsl and run its CPU parts.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
from cuda.bindings import driver as cu

from mhadsl import abi
from mhadsl.runtime import faults

_SUCCESS = cu.CUresult.CUDA_SUCCESS
_DEFAULT_DYNAMIC_SHARED = 48 * 1024  # what every kernel may use without opting in
_JIT_LOG_BYTES = 1 << 16


class CudaError(RuntimeError):
    """A CUDA driver call failed. `call`, `code` (a CUresult, or None when libcuda is missing)
    and `error_name` say which call and how."""

    def __init__(
        self, call: str, code: cu.CUresult | None, error_name: str, description: str, detail: str = ""
    ) -> None:
        self.call = call
        self.code = code
        self.error_name = error_name
        number = f" ({int(code)})" if code is not None else ""
        text = f"{call} failed: {error_name}{number}" + (f": {description}" if description else "")
        super().__init__(text + (f"\n{detail}" if detail else ""))


class NoGpuError(CudaError):
    """No usable NVIDIA GPU: no driver library, no device, or a driver that cannot start.
    The API and the CLI say it in the same words."""

    def __init__(self, call: str, code: cu.CUresult | None, error_name: str, description: str,
                 detail: str = "") -> None:
        super().__init__(call, code, error_name, description, detail)
        self.args = (f"no NVIDIA GPU found ({self.args[0]})",)


def _describe(code: cu.CUresult) -> tuple[str, str]:
    """(error name, error string) from the driver, or the enum's own name without libcuda."""
    try:
        name_err, name = cu.cuGetErrorName(code)
        text_err, text = cu.cuGetErrorString(code)
        if name_err == _SUCCESS and text_err == _SUCCESS:
            return name.decode(), text.decode()
    except Exception:  # describing an error must never hide it (libcuda may be absent)
        pass
    return getattr(code, "name", f"CUresult {int(code)}"), ""


def check(result: tuple, call: str = "CUDA driver call", detail: str = "") -> Any:
    """The one choke point for driver results: raise CudaError on failure, else return the
    values after the status (None, the single value, or a tuple)."""
    code, *values = result
    if code != _SUCCESS:
        raise CudaError(call, code, *_describe(code), detail)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def call(fn: Callable[..., tuple], *args: Any) -> Any:
    """`fn(*args)` through `check`, named after the driver function."""
    return check(fn(*args), fn.__name__)


# --- initialisation and the primary context ---------------------------------------------------

_lock = threading.Lock()
_initialised = False
_primary: dict[int, cu.CUcontext] = {}
_primary_address: dict[int, int] = {}


def _init() -> None:
    global _initialised
    if _initialised:
        return
    with _lock:
        if _initialised:
            return
        try:
            result = cu.cuInit(0)
        except RuntimeError as exc:  # cuda-bindings raises (not returns) when libcuda is missing
            raise NoGpuError("cuInit", None, "CUDA driver library not found", "") from exc
        if result[0] != _SUCCESS:
            raise NoGpuError("cuInit", result[0], *_describe(result[0]))
        _initialised = True


def require_device() -> None:
    """Raise `NoGpuError` unless a CUDA driver and at least one device are present."""
    _init()
    if call(cu.cuDeviceGetCount) == 0:
        raise NoGpuError("cuDeviceGetCount", None, "no CUDA device", "")


def gpu_available() -> bool:
    """True when a CUDA driver and at least one device are present; never raises."""
    try:
        require_device()
        return True
    except Exception:
        return False


def current_device() -> int:
    """torch's current CUDA device once torch has initialised CUDA (so we share its device and
    primary context), else 0. torch stays optional: it is only looked at if already imported."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return 0


def ensure_context(device: int | None = None) -> int:
    """Make `device`'s primary context current on this thread (retaining it on first use);
    return the device ordinal. The primary context is the one PyTorch and CuPy use, so pointers
    and streams pass freely between them and mhadsl."""
    dev = current_device() if device is None else device
    ctx = _primary.get(dev)
    if ctx is None:
        _init()
        with _lock:
            ctx = _primary.get(dev)
            if ctx is None:
                # Retained for the life of the process, like the runtime API does.
                ctx = _primary[dev] = call(cu.cuDevicePrimaryCtxRetain, call(cu.cuDeviceGet, dev))
                _primary_address[dev] = int(ctx)
    if _current_context() != _primary_address[dev]:  # the current context is per thread
        call(cu.cuCtxSetCurrent, ctx)
    return dev


_thread = threading.local()  # each thread's out-parameter for libcuda's cuCtxGetCurrent


def _current_context() -> int | None:
    """The address of this thread's current context (None: none, or the driver failed)."""
    get = _raw_ctx_get_current()
    if get is None:
        code, current = cu.cuCtxGetCurrent()
        return int(current) if code == _SUCCESS else None
    try:
        out, out_ref = _thread.context
    except AttributeError:
        out = ctypes.c_void_p()
        out_ref = ctypes.byref(out)  # made once: a byref per call costs a third of the call
        _thread.context = out, out_ref
    return out.value if get(out_ref) == 0 else None


@dataclass(frozen=True)
class DeviceInfo:
    device: int
    name: str
    compute_capability: tuple[int, int]
    multiprocessor_count: int
    max_shared_memory_per_block_optin: int
    l2_cache_size: int


def device_info(device: int | None = None) -> DeviceInfo:
    """What the compiler and launcher need to know about a device (cached per device)."""
    return _device_info(current_device() if device is None else device)


@cache
def _device_info(dev: int) -> DeviceInfo:
    _init()
    handle = call(cu.cuDeviceGet, dev)

    def attr(name: str) -> int:
        return call(cu.cuDeviceGetAttribute, getattr(cu.CUdevice_attribute, name), handle)

    return DeviceInfo(
        device=dev,
        name=call(cu.cuDeviceGetName, 256, handle).split(b"\0", 1)[0].decode(),
        compute_capability=(
            attr("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"),
            attr("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR"),
        ),
        multiprocessor_count=attr("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"),
        max_shared_memory_per_block_optin=attr("CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
        l2_cache_size=attr("CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE"),
    )


def pointer_device(ptr: int) -> int:
    """The device ordinal that owns device pointer `ptr`."""
    _init()
    attribute = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    return int(call(cu.cuPointerGetAttribute, attribute, ptr))


# --- streams -----------------------------------------------------------------------------------


def stream_handle(stream: object = None, *, kind: str | None = None, device: int | None = None) -> int:
    """The raw CUstream handle of `stream`: an int, a torch.cuda.Stream (`.cuda_stream`), a CuPy
    stream (`.ptr`) or a cuda-bindings CUstream. None means the stream the caller's tensors are
    ordered on: torch's current stream for kind "torch", CuPy's for "cupy", else the legacy
    default stream 0."""
    if stream is None:
        if kind == "torch":
            return sys.modules["torch"].cuda.current_stream(device).cuda_stream
        if kind == "cupy":
            return sys.modules["cupy"].cuda.get_current_stream().ptr
        return 0
    if isinstance(stream, cu.CUstream):
        return int(stream)
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    for attribute in ("cuda_stream", "ptr"):
        handle = getattr(stream, attribute, None)
        if isinstance(handle, int):
            return handle
    raise TypeError(
        f"cannot use {type(stream).__qualname__} as a CUDA stream; pass an int handle, "
        "a torch.cuda.Stream, a CuPy stream or None"
    )


# --- memory ------------------------------------------------------------------------------------


def _free(ptr: int, device: int) -> None:
    ensure_context(device)  # the collecting thread may have no current context
    call(cu.cuMemFree, ptr)


class DeviceBuffer:
    """Device memory from cuMemAlloc, freed by `free()` or when the object is collected."""

    def __init__(self, nbytes: int, device: int | None = None) -> None:
        self.device = ensure_context(device)
        self.nbytes = nbytes
        self.ptr = int(call(cu.cuMemAlloc, max(nbytes, 1)))  # cuMemAlloc rejects 0 bytes
        self._finalizer = weakref.finalize(self, _free, self.ptr, self.device)
        self._finalizer.atexit = False  # process teardown frees device memory; the driver may be gone

    @classmethod
    def from_numpy(cls, array: np.ndarray, stream: object = None, device: int | None = None) -> DeviceBuffer:
        """A new buffer holding a copy of `array` (made C-contiguous first)."""
        host = np.ascontiguousarray(array)
        buffer = cls(host.nbytes, device)
        memcpy_htod(buffer.ptr, host, stream, buffer.device)
        return buffer

    def copy_to_numpy(self, out: np.ndarray, stream: object = None) -> np.ndarray:
        """Fill the C-contiguous array `out` from the start of this buffer; return `out`."""
        if out.nbytes > self.nbytes:
            raise ValueError(f"cannot copy {out.nbytes} bytes out of a {self.nbytes}-byte buffer")
        memcpy_dtoh(out, self.ptr, stream, self.device)
        return out

    def free(self) -> None:
        self._finalizer()


def _require_contiguous(array: np.ndarray) -> None:
    if not array.flags.c_contiguous:
        raise ValueError("host array for a device copy must be C-contiguous")


def memcpy_htod(ptr: int, array: np.ndarray, stream: object = None, device: int | None = None) -> None:
    """Copy the C-contiguous `array` to device pointer `ptr`, ordered on `stream`, and wait."""
    _require_contiguous(array)
    ensure_context(device)
    handle = stream_handle(stream)
    call(cu.cuMemcpyHtoDAsync, ptr, array.ctypes.data, array.nbytes, handle)
    call(cu.cuStreamSynchronize, handle)  # the host array may be freed as soon as we return


def memcpy_dtoh(out: np.ndarray, ptr: int, stream: object = None, device: int | None = None) -> None:
    """Copy `out.nbytes` bytes from device pointer `ptr` into the C-contiguous `out`, ordered on
    `stream` (so after the kernels queued there), and wait."""
    _require_contiguous(out)
    ensure_context(device)
    handle = stream_handle(stream)
    call(cu.cuMemcpyDtoHAsync, out.ctypes.data, ptr, out.nbytes, handle)
    call(cu.cuStreamSynchronize, handle)


def memset_d32_async(
    ptr: int, value: int, count: int, stream: object = None, device: int | None = None
) -> None:
    """Set `count` 32-bit words at `ptr` to `value`, ordered on `stream`. Resetting the queue
    counter this way on the launch's own stream is what makes CUDA-graph replay correct."""
    ensure_context(device)
    call(cu.cuMemsetD32Async, ptr, value, count, stream_handle(stream))


class _PinnedBuffer:
    """Page-locked host memory (cuMemHostAlloc) that kernels can write too (mapped)."""

    def __init__(self, nbytes: int, device: int) -> None:
        ensure_context(device)
        self.ptr = int(call(cu.cuMemHostAlloc, nbytes, cu.CU_MEMHOSTALLOC_DEVICEMAP))
        self.device_ptr = int(call(cu.cuMemHostGetDevicePointer, self.ptr, 0))
        ctypes.memset(self.ptr, 0, nbytes)
        weakref.finalize(self, _free_host, self.ptr, device).atexit = False


def _free_host(ptr: int, device: int) -> None:
    ensure_context(device)
    call(cu.cuMemFreeHost, ptr)


class _Workspace:
    """One stream's workspace (`mhadsl.abi`): the device words, and the host's copy of the
    fault record, which the faulting kernel writes itself."""

    def __init__(self, ptr: int, record: ctypes.Array) -> None:
        self.ptr, self.record = ptr, record


_workspace_lock = threading.Lock()
_slabs: dict[int, list[tuple[DeviceBuffer, _PinnedBuffer]]] = {}
_workspaces: dict[tuple[int, int], _Workspace] = {}
_WORKSPACE_BYTES = 4 * abi.WORKSPACE_WORDS
_RECORD_BYTES = 16  # the host's copy of one record (abi.RECORD_WORDS words, padded)
_SLAB_SLOTS = 1024  # workspaces per slab


def workspace(stream: int, device: int) -> _Workspace:
    """The workspace of (`device`, raw `stream` handle), after raising a scheduler fault that
    a launch there recorded (it need not have finished: its kernel wrote the host's copy).

    Streams never share one, so queued kernels running on two streams at once cannot steal
    each other's work. Workspaces are carved from pre-allocated slabs (device memory and its
    pinned twin), so a stream first seen during CUDA-graph capture (where allocation is
    illegal) still gets one, provided the device has handed one out before the capture (a
    warm-up launch does that)."""
    ws = _workspaces.get((device, stream))
    if ws is None:
        ws = _new_workspace(stream, device)
    if ws.record[0]:
        _take_fault(ws, stream)
    return ws


def _new_workspace(stream: int, device: int) -> _Workspace:
    with _workspace_lock:
        key = (device, stream)
        if key in _workspaces:
            return _workspaces[key]
        ensure_context(device)
        used = sum(1 for d, _ in _workspaces if d == device)
        slabs = _slabs.setdefault(device, [])
        if used == len(slabs) * _SLAB_SLOTS:  # a new slab, each workspace's words set up
            pinned = _PinnedBuffer(_RECORD_BYTES * _SLAB_SLOTS, device)
            init = np.zeros((_SLAB_SLOTS, abi.WORKSPACE_WORDS), np.uint32)
            init[:, abi.HOST_RECORD_WORD:abi.HOST_RECORD_WORD + 2] = np.arange(
                pinned.device_ptr, pinned.device_ptr + _RECORD_BYTES * _SLAB_SLOTS,
                _RECORD_BYTES, dtype=np.uint64).view(np.uint32).reshape(-1, 2)
            slabs.append((DeviceBuffer.from_numpy(init, device=device), pinned))
        words, pinned = slabs[-1]
        slot = used % _SLAB_SLOTS
        ptr = words.ptr + _WORKSPACE_BYTES * slot
        record = (ctypes.c_uint32 * abi.RECORD_WORDS).from_address(
            pinned.ptr + _RECORD_BYTES * slot)
        ws = _workspaces[key] = _Workspace(ptr, record)
        return ws


_stream_buffers: dict[tuple[str, int, int], list[DeviceBuffer]] = {}
_stream_buffers_lock = threading.Lock()


def stream_buffer(name: str, nbytes: int, handle: int, device: int, what: str) -> int:
    """Device pointer to buffer `name` of (`device`, raw stream `handle`), holding at least
    `nbytes` (zeroed when it is allocated): two streams never overwrite each other's. It
    grows (doubling) when a call needs more; the old one is kept, since a captured graph may
    still point to it. A stream under CUDA-graph capture cannot allocate: a call that would
    grow it there raises, naming `what` needs it (run such a call once on that stream before
    capturing, as graphs' warm-up does)."""
    with _stream_buffers_lock:
        held = _stream_buffers.setdefault((name, device, handle), [])
        if not held or held[-1].nbytes < nbytes:
            if _capturing(handle):
                raise RuntimeError(
                    f"{what} needs a larger buffer ({nbytes} bytes) than this stream holds, "
                    f"and a stream under CUDA-graph capture cannot allocate one: run the "
                    f"kernel once on a call at least this large before capturing")
            size = max(nbytes, 2 * held[-1].nbytes if held else 4096)
            buffer = DeviceBuffer(size, device)
            # zeroed once on its stream (before any launch there), so a byte a kernel may
            # read before a launch wrote it is defined
            call(cu.cuMemsetD8Async, buffer.ptr, 0, size, handle)
            held.append(buffer)
        return held[-1].ptr


def queue_workspace(stream: object = None, device: int | None = None) -> int:
    """Device pointer to the workspace of (`device`, `stream`): the u32 words a kernel's
    `queue` parameter points to (`mhadsl.abi`)."""
    dev = ensure_context(device)
    return workspace(stream_handle(stream), dev).ptr


def _capturing(handle: int) -> bool:
    """True while `handle` is being captured into a CUDA graph (or its status is unknown):
    then nothing may be queried or copied, only captured."""
    code, status = cu.cuStreamIsCapturing(handle)
    return code != _SUCCESS or status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


def _take_fault(ws: _Workspace, handle: int) -> None:
    """Raise the fault the host's copy holds, clearing it on the host and (ordered on stream
    `handle`, after the launch that recorded it) on the device first, so the launches after
    it start clean. Under capture the fault waits for the next launch outside it."""
    if _capturing(handle):
        return
    with _workspace_lock:
        code, sid, cta = tuple(ws.record)
        if not code:
            return  # another thread reported it
        ctypes.memset(ctypes.addressof(ws.record), 0, ctypes.sizeof(ws.record))
        call(cu.cuMemsetD32Async, ws.ptr + 4 * abi.RECORD_WORD, 0, abi.RECORD_WORDS, handle)
    raise faults.SchedulerError(code, sid, cta)


def wait_for_fault(stream: int, device: int) -> None:
    """MHADSL_DEBUG=1 after a launch: wait for it and raise its scheduler fault now."""
    if not _capturing(stream):
        call(cu.cuStreamSynchronize, stream)
        workspace(stream, device)


# os.environ's own bytes mapping (POSIX): a lookup through os.environ encodes the name first,
# a measurable part of every launch's host time
_ENVIRON_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None


def debug_mode() -> bool:
    """MHADSL_DEBUG=1: every launch waits and reports its scheduler fault at once, and ragged
    offsets on the device are read and checked even when max_seqlen is given."""
    if _ENVIRON_BYTES is not None:
        return _ENVIRON_BYTES.get(b"MHADSL_DEBUG") == b"1"
    return os.environ.get("MHADSL_DEBUG") == "1"


def synchronize(device: int | None = None) -> None:
    """Wait for all work on `device` (default: the current one), then raise SchedulerError
    for a scheduler fault any launch there recorded (clearing it)."""
    dev = ensure_context(device)
    call(cu.cuCtxSynchronize)
    for (d, _), ws in list(_workspaces.items()):
        if d == dev and ws.record[0]:
            _take_fault(ws, 0)  # everything has finished: the legacy stream clears it


# --- modules and launches ----------------------------------------------------------------------


def _c_string(buffer: bytearray) -> str:
    return bytes(buffer).split(b"\0", 1)[0].decode(errors="replace").strip()


def _unload(handle: cu.CUmodule, device: int) -> None:
    ensure_context(device)
    call(cu.cuModuleUnload, handle)


class Module:
    """A CUDA module loaded into a device's primary context. `info_log` keeps the JIT's
    verbose log (registers, spills) when the module came from PTX."""

    def __init__(self, image: bytes, device: int | None = None) -> None:
        """Load a cubin, fatbin or NUL-terminated PTX image; prefer `from_ptx`/`from_cubin`."""
        self.device = ensure_context(device)
        info, error = bytearray(_JIT_LOG_BYTES), bytearray(_JIT_LOG_BYTES)
        jit = cu.CUjit_option
        options = [
            jit.CU_JIT_INFO_LOG_BUFFER,
            jit.CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
            jit.CU_JIT_ERROR_LOG_BUFFER,
            jit.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
            jit.CU_JIT_LOG_VERBOSE,
        ]
        values = [info, _JIT_LOG_BYTES, error, _JIT_LOG_BYTES, 1]
        result = cu.cuModuleLoadDataEx(image, len(options), options, values)
        self.info_log = _c_string(info)
        error_log = _c_string(error)
        detail = f"JIT error log:\n{error_log}" if error_log else ""
        if self.info_log and result[0] != _SUCCESS:
            detail += f"\nJIT info log:\n{self.info_log}"
        self._handle = check(result, "cuModuleLoadDataEx", detail.strip())
        weakref.finalize(self, _unload, self._handle, self.device).atexit = False

    @classmethod
    def from_ptx(cls, ptx: str | bytes, device: int | None = None) -> Module:
        text = ptx.encode() if isinstance(ptx, str) else bytes(ptx)
        return cls(text + b"\0", device)  # the driver reads PTX as a C string

    @classmethod
    def from_cubin(cls, cubin: bytes, device: int | None = None) -> Module:
        return cls(bytes(cubin), device)

    def function(self, name: str) -> Function:
        ensure_context(self.device)
        result = cu.cuModuleGetFunction(self._handle, name.encode())
        handle = check(result, "cuModuleGetFunction", f"no kernel named {name!r} in this module")
        return Function(self, handle, name)


class Function:
    """A kernel in a loaded Module."""

    def __init__(self, module: Module, handle: cu.CUfunction, name: str) -> None:
        self.module = module  # keeps the module loaded while the function is in use
        self.name = name
        self._handle = handle
        self._dynamic_shared_limit: int | None = None  # known after the first launch
        self._occupancy: dict[tuple[int, int], int] = {}

    @property
    def num_regs(self) -> int:
        ensure_context(self.module.device)
        attribute = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS
        return call(cu.cuFuncGetAttribute, attribute, self._handle)

    def max_active_blocks(self, threads: int, shared_bytes: int) -> int:
        """How many CTAs of this kernel fit on one multiprocessor at once (at least 1)."""
        self.set_max_dynamic_shared(shared_bytes)
        key = (threads, shared_bytes)
        if key not in self._occupancy:
            self._occupancy[key] = call(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor,
                                        self._handle, threads, shared_bytes)
        return max(1, self._occupancy[key])

    def set_max_dynamic_shared(self, nbytes: int) -> None:
        """Opt the kernel in to `nbytes` of dynamic shared memory (only needed when it and the
        kernel's static shared memory pass 48 KiB together)."""
        ensure_context(self.module.device)
        if self._dynamic_shared_limit is None:
            attribute = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
            self._static_shared = call(cu.cuFuncGetAttribute, attribute, self._handle)
            self._dynamic_shared_limit = _DEFAULT_DYNAMIC_SHARED - self._static_shared
        if nbytes <= self._dynamic_shared_limit:
            return
        info = device_info(self.module.device)
        if nbytes + self._static_shared > info.max_shared_memory_per_block_optin:
            raise ValueError(
                f"kernel {self.name!r} needs {nbytes} bytes of dynamic shared memory; "
                f"(and {self._static_shared} static); {info.name} allows at most "
                f"{info.max_shared_memory_per_block_optin} per block"
            )
        attribute = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        call(cu.cuFuncSetAttribute, self._handle, attribute, nbytes)
        self._dynamic_shared_limit = nbytes

    def launcher(self, grid: tuple[int, int, int], threads: int, shared_bytes: int,
                 params: int, grid_dependent: bool = False) -> Callable[[int], None]:
        """A launch on a raw stream handle with `params`, the address of a `void*[]` of the
        kernel's parameters (`runtime.launch.ParamBlock`): one driver call, every argument
        but the stream a ctypes object made once, here. `grid_dependent`: the kernel waits
        for the grids before it itself (`KernelBuild.grid_dependent`), so it is launched
        with programmatic stream serialization (cuLaunchKernelEx) and may start while the
        grid before it drains."""
        if grid_dependent:
            return self._dependent_launcher(grid, threads, shared_bytes, params)
        launch = _raw("cuLaunchKernel")
        if launch is None:
            def run(stream: int) -> None:
                check(cu.cuLaunchKernel(self._handle, *grid, threads, 1, 1, shared_bytes, stream,
                                        params, 0), "cuLaunchKernel")
            return run
        function, params_arg = ctypes.c_void_p(int(self._handle)), ctypes.c_void_p(params)
        grid_x, grid_y, grid_z, block_x, block_y, block_z, shared = map(
            ctypes.c_uint, (*grid, threads, 1, 1, shared_bytes))
        # c_void_p's own conversion of an int: the pointer argument without a c_void_p
        # object (half the cost)
        stream_arg = ctypes.c_void_p.from_param

        def run(stream: int) -> None:
            code = launch(function, grid_x, grid_y, grid_z, block_x, block_y, block_z, shared,
                          stream_arg(stream), params_arg, None)
            if code:
                check((cu.CUresult(code),), "cuLaunchKernel")
        return run

    def _dependent_launcher(self, grid: tuple[int, int, int], threads: int, shared_bytes: int,
                            params: int) -> Callable[[int], None]:
        """`launcher`'s launch with programmatic stream serialization allowed: the
        configuration a ctypes struct made once, its stream written at each launch (the
        caller holds its plan's lock across a launch)."""
        launch = _raw("cuLaunchKernelEx")
        if launch is None:
            attribute = cu.CUlaunchAttribute()
            attribute.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attribute.value.programmaticStreamSerializationAllowed = 1

            def run(stream: int) -> None:
                config = cu.CUlaunchConfig()
                config.gridDimX, config.gridDimY, config.gridDimZ = grid
                config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
                config.sharedMemBytes, config.hStream = shared_bytes, stream
                config.attrs, config.numAttrs = [attribute], 1
                check(cu.cuLaunchKernelEx(config, self._handle, params, 0), "cuLaunchKernelEx")
            return run
        attribute = _LaunchAttribute(_PROGRAMMATIC_STREAM_SERIALIZATION)
        attribute.value[0] = 1  # programmaticStreamSerializationAllowed
        config = _LaunchConfig(*grid, threads, 1, 1, shared_bytes, None,
                               ctypes.pointer(attribute), 1)
        # (the config's pointer field keeps the attribute alive; byref keeps the config)
        config_arg = ctypes.byref(config)
        function, params_arg = ctypes.c_void_p(int(self._handle)), ctypes.c_void_p(params)

        def run(stream: int) -> None:
            config.stream = stream
            code = launch(config_arg, function, params_arg, None)
            if code:
                check((cu.CUresult(code),), "cuLaunchKernelEx")
        return run


# cuda.h's CUlaunchAttribute and CUlaunchConfig, for cuLaunchKernelEx through ctypes
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_int * 16)]  # the 64-byte CUlaunchAttributeValue union


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint),
                ("grid_z", ctypes.c_uint), ("block_x", ctypes.c_uint),
                ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("attr_count", ctypes.c_uint)]


@cache
def _raw_ctx_get_current() -> Callable | None:
    return _raw("cuCtxGetCurrent")


@cache
def _raw(name: str) -> Callable | None:
    """libcuda's own `name` through ctypes (None where it cannot be loaded so), for the calls
    of every launch: the cuda-python wrappers convert each argument and result on every call,
    a large part of a launch's host time. It has no argtypes, which ctypes would apply to
    every argument of every call: callers pass ctypes objects (a plain int would go as a
    C int)."""
    try:
        function = getattr(ctypes.CDLL("nvcuda.dll" if os.name == "nt" else "libcuda.so.1"), name)
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_int
    return function
