"""mhadsl.runtime parts that need no GPU: the compile cache, bfloat16 conversion, tensor
checks, a launch plan's parameters, stream handles and driver error reporting."""

import ctypes
import dataclasses
import enum
import os
import struct
from types import SimpleNamespace

import numpy as np
import pytest
from cuda.bindings import driver as cu

from mhadsl.abi import KIND_BYTES, CallValue, KernelABI, Param, Pointer, TensorMap
from mhadsl.runtime import cache, driver, tensormap
from mhadsl.runtime.cache import CompileCache, cache_dir, cache_key
from mhadsl.runtime.driver import CudaError, check, stream_handle
from mhadsl.runtime.launch import LaunchPlan, TensorShape
from mhadsl.runtime.tensors import (
    as_device_tensor,
    bf16_bits_to_float32,
    empty_like_kind,
    numpy_to_bf16_bits,
    to_device,
)
from helpers import fake_launcher

KEY = cache_key(source="attention a {}", arch="sm_90a")


# --- compile cache -----------------------------------------------------------------------------


def files_under(directory):
    return sorted(
        os.path.relpath(os.path.join(root, name), directory)
        for root, _, names in os.walk(directory)
        for name in names
    )


def test_cache_round_trip(tmp_path):
    store = CompileCache(tmp_path)
    artifacts = {"ptx": b".version 8.0\n", "cubin": bytes(range(256)) * 3, "meta.json": b"{}", "empty": b""}
    assert store.get(KEY) is None
    store.put(KEY, artifacts)
    assert store.get(KEY) == artifacts
    assert CompileCache(tmp_path).get(KEY) == artifacts  # a second process sees it too
    store.put(KEY, {"ptx": b"newer"})  # overwriting replaces the whole entry
    assert store.get(KEY) == {"ptx": b"newer"}


def test_cache_leaves_no_temp_files(tmp_path):
    store = CompileCache(tmp_path)
    store.put(KEY, {"ptx": b"x" * 100_000})
    assert files_under(tmp_path) == [os.path.join(KEY[:2], f"{KEY}.entry")]


def test_cache_failed_write_leaves_nothing_and_warns(tmp_path, monkeypatch):
    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(cache.os, "replace", failing_replace)
    store = CompileCache(tmp_path)
    with pytest.warns(RuntimeWarning, match="not writable"):
        store.put(KEY, {"ptx": b"abc"})
    assert [name for name in files_under(tmp_path) if name.endswith(".entry")] == []
    assert store.get(KEY) is None


def test_cache_unwritable_dir_warns_once_and_never_raises(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")  # a file where the cache directory should be: mkdir fails, even as root
    store = CompileCache(blocker / "cache")
    with pytest.warns(RuntimeWarning) as record:
        store.put(KEY, {"ptx": b"abc"})
        store.put(cache_key(other=1), {"ptx": b"def"})
        CompileCache(blocker / "cache").put(KEY, {"ptx": b"abc"})
    assert len(record) == 1
    assert store.get(KEY) is None


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[:-1],  # truncated
        lambda data: data[: len(data) // 2],
        lambda data: data[:-1] + bytes([data[-1] ^ 1]),  # one bit flipped in an artifact
        lambda data: b"",
        lambda data: b"garbage" * 10,
    ],
)
def test_cache_corrupt_entry_is_a_miss_and_removed(tmp_path, damage):
    store = CompileCache(tmp_path)
    store.put(KEY, {"ptx": b"abcdef", "meta.json": b'{"regs": 128}'})
    (entry,) = tmp_path.rglob("*.entry")
    entry.write_bytes(damage(entry.read_bytes()))
    assert store.get(KEY) is None
    assert not entry.exists()


def test_cache_rejects_keys_that_are_not_digests(tmp_path):
    with pytest.raises(ValueError, match="sha256"):
        CompileCache(tmp_path).get("../../etc/passwd")


def test_cache_dir_env_vars(monkeypatch, tmp_path):
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "explicit"
    assert CompileCache().directory == tmp_path / "explicit"
    monkeypatch.delenv("MHADSL_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "mhadsl"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "mhadsl"


@dataclasses.dataclass(frozen=True)
class Options:
    arch: str = "sm_90a"
    stages: int = 2
    scale: float | None = None


class Sync(enum.Enum):
    NONE = 0
    ALL = 2


BASE = dict(source="attention a {}", options=Options(), arch="sm_90a", ptx="8.0", llvm="22.1", mhadsl="0.1.0")


@pytest.mark.parametrize(
    "change",
    [
        {"source": "attention a { }"},
        {"options": Options(stages=3)},
        {"options": Options(scale=0.125)},
        {"arch": "sm_80"},
        {"ptx": "8.3"},
        {"llvm": "22.2"},
        {"mhadsl": "0.1.1"},
        {"extra": Sync.ALL},
    ],
)
def test_cache_key_changes_with_every_part(change):
    assert cache_key(**BASE) != cache_key(**{**BASE, **change})


def test_cache_key_is_canonical():
    key = cache_key(**BASE)
    assert len(key) == 64 and int(key, 16) >= 0
    assert key == cache_key(**dict(reversed(list(BASE.items()))))
    assert cache_key(a={"x": 1, "y": 2}) == cache_key(a={"y": 2, "x": 1})
    assert cache_key(blob=b"\x00\x01") != cache_key(blob=b"\x00\x02")
    with pytest.raises(TypeError, match="object"):
        cache_key(bad=object())


# --- bfloat16 ----------------------------------------------------------------------------------


def f32(*bits):
    return np.array(bits, dtype=np.uint32).view(np.float32)


@pytest.mark.parametrize(
    ("float_bits", "bf16_bits"),
    [
        (0x3F800000, 0x3F80),  # 1.0
        (0xC0200000, 0xC020),  # -2.5
        (0x80000000, 0x8000),  # -0.0
        (0x3F808000, 0x3F80),  # 1 + 2^-8: a tie, rounds to the even 0x3F80
        (0x3F818000, 0x3F82),  # 1 + 3 * 2^-8: a tie, rounds to the even 0x3F82
        (0x3F808001, 0x3F81),  # just above the tie rounds up
        (0x3F807FFF, 0x3F80),  # just below the tie rounds down
        (0x00008000, 0x0000),  # subnormal tie to even
        (0x00018000, 0x0002),
        (0x7F800000, 0x7F80),  # +inf
        (0xFF800000, 0xFF80),  # -inf
        (0x7F7FFFFF, 0x7F80),  # the largest float32 overflows to inf
    ],
)
def test_bf16_rounding_hand_computed(float_bits, bf16_bits):
    assert numpy_to_bf16_bits(f32(float_bits))[0] == bf16_bits


def test_bf16_nan_stays_nan():
    bits = numpy_to_bf16_bits(f32(0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF))
    assert np.isnan(bf16_bits_to_float32(bits)).all()
    assert list(bits >> 15) == [0, 1, 0, 0]  # the sign survives


def test_bf16_round_trip_every_pattern():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = bf16_bits_to_float32(bits)
    assert values.dtype == np.float32
    assert (values.view(np.uint32) & 0xFFFF == 0).all()
    finite = ~np.isnan(values)
    assert (numpy_to_bf16_bits(values)[finite] == bits[finite]).all()
    assert np.isnan(bf16_bits_to_float32(numpy_to_bf16_bits(values[~finite]))).all()


def test_bf16_accepts_float16_and_keeps_shape():
    a = np.array([[1.5, -0.25], [65504.0, 0.0]], dtype=np.float16)
    bits = numpy_to_bf16_bits(a.T)
    assert bits.shape == (2, 2) and bits.dtype == np.uint16
    assert bits[0, 0] == 0x3FC0 and bits[0, 1] == 0x4780  # 65504 = 0x477FE000 as float32: rounds up
    with pytest.raises(TypeError, match="float64"):
        numpy_to_bf16_bits(np.zeros(2))
    with pytest.raises(TypeError, match="uint16"):
        bf16_bits_to_float32(np.zeros(2, np.int16))


# --- tensors -----------------------------------------------------------------------------------


def test_numpy_array_is_marked_for_copy():
    a = np.zeros((4, 6), np.float32)[:, ::2]
    t = as_device_tensor(a, "q")
    assert t.on_host and t.kind == "numpy" and t.ptr == 0
    assert (t.shape, t.strides, t.dtype, t.itemsize) == ((4, 3), (6, 2), "float32", 4)
    assert t.obj is a


@pytest.mark.parametrize("dtype", [np.int64, np.float64, np.uint8])
def test_numpy_unsupported_dtype(dtype):
    with pytest.raises(TypeError, match=r"'k'.*NumPy dtype"):
        as_device_tensor(np.zeros(3, dtype), "k")


@pytest.mark.parametrize("obj", [[1.0, 2.0], 3.0, "q", None])
def test_unsupported_objects(obj):
    with pytest.raises(TypeError, match="argument 'v'"):
        as_device_tensor(obj, "v")


class FakeCupyArray:
    """Just enough of a CuPy array to exercise the __cuda_array_interface__ path without a GPU."""

    def __init__(self, typestr, shape, strides=None):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (0xAB00, False),
            "strides": strides,
            "version": 3,
        }
        self.device = type("Device", (), {"id": 1})()


FakeCupyArray.__module__ = "cupy._fake"


def test_cuda_array_interface_strides_become_elements():
    t = as_device_tensor(FakeCupyArray("<f2", (2, 3, 4), (48, 2, 12)), "k")
    assert (t.ptr, t.shape, t.strides, t.dtype, t.device, t.kind) == (
        0xAB00,
        (2, 3, 4),
        (24, 1, 6),
        "float16",
        1,
        "cupy",
    )
    dense = as_device_tensor(FakeCupyArray("<i4", (2, 3)), "k")
    assert dense.strides == (3, 1) and dense.dtype == "int32"


def test_cuda_array_interface_errors():
    with pytest.raises(TypeError, match=r"'k'.*bfloat16"):
        as_device_tensor(FakeCupyArray("<V2", (4,)), "k")
    with pytest.raises(TypeError, match=r"'k'.*'<f8'"):
        as_device_tensor(FakeCupyArray("<f8", (4,)), "k")
    with pytest.raises(ValueError, match=r"'k'.*whole elements"):
        as_device_tensor(FakeCupyArray("<f4", (4,), (6,)), "k")


def test_to_device_rejects_before_touching_the_gpu():
    with pytest.raises(TypeError, match="'k'"):
        to_device(np.zeros(3, np.int64), "k")
    with pytest.raises(TypeError, match=r"'k'.*int32 array as bfloat16"):
        to_device(np.zeros(3, np.int32), "k", dtype="bfloat16")
    with pytest.raises(TypeError, match=r"'k'.*unknown dtype"):
        to_device(np.zeros(3, np.float32), "k", dtype="float8")


def test_empty_like_kind_numpy():
    ref = np.zeros(3, np.float16)
    out = empty_like_kind(ref, (2, 5), "float16")
    assert isinstance(out, np.ndarray) and out.shape == (2, 5) and out.dtype == np.float16
    assert empty_like_kind(as_device_tensor(ref, "q"), (2,), "bfloat16").dtype == np.float32
    with pytest.raises(TypeError):
        empty_like_kind([1, 2], (2,), "float32")


def test_torch_cpu_tensor_is_a_clear_error():
    torch = pytest.importorskip("torch")
    with pytest.raises(
        ValueError, match=r"tensor 'q' is on cpu; mhadsl kernels need CUDA tensors \(or NumPy"
    ):
        as_device_tensor(torch.zeros(3), "q")


# --- driver, without a driver --------------------------------------------------------------------


def test_check_success_values():
    ok = cu.CUresult.CUDA_SUCCESS
    assert check((ok,)) is None
    assert check((ok, 5)) == 5
    assert check((ok, 1, 2)) == (1, 2)


def test_check_raises_readable_cuda_error():
    with pytest.raises(CudaError) as caught:
        check((cu.CUresult.CUDA_ERROR_INVALID_VALUE,), "cuMemAlloc", "while allocating q")
    error = caught.value
    assert isinstance(error, RuntimeError)
    assert str(error).startswith("cuMemAlloc failed: CUDA_ERROR_INVALID_VALUE (1)")
    assert "while allocating q" in str(error)
    assert error.call == "cuMemAlloc" and error.error_name == "CUDA_ERROR_INVALID_VALUE"
    assert error.code == cu.CUresult.CUDA_ERROR_INVALID_VALUE


@pytest.fixture
def no_libcuda(monkeypatch):
    """The state of a machine without the NVIDIA driver, also on machines that have one."""

    def missing(flags):
        raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found via system search.')

    monkeypatch.setattr(driver, "_initialised", False)
    monkeypatch.setattr(driver, "_primary", {})
    monkeypatch.setattr(driver.cu, "cuInit", missing)


def test_gpu_available_is_false_without_driver(no_libcuda):
    assert driver.gpu_available() is False


def test_driver_calls_raise_cuda_error_without_driver(no_libcuda):
    with pytest.raises(CudaError, match="cuInit failed: CUDA driver library not found"):
        driver.DeviceBuffer(16)


def test_gpu_available_never_raises():
    assert isinstance(driver.gpu_available(), bool)


def test_stream_handles():
    class TorchLike:
        cuda_stream = 0x1234

    class CupyLike:
        ptr = 0x5678

    assert stream_handle(None) == 0
    assert stream_handle(None, kind="numpy") == 0
    assert stream_handle(42) == 42
    assert stream_handle(TorchLike()) == 0x1234
    assert stream_handle(CupyLike()) == 0x5678
    assert stream_handle(cu.CUstream(7)) == 7
    for bad in (True, "0", 1.0):
        with pytest.raises(TypeError, match="stream"):
            stream_handle(bad)


def test_a_plan_passes_each_parameter_by_name_as_its_kind(monkeypatch):
    """Each entry of the `void*[]` a plan launches with points at its parameter's bytes as
    the kernel declares them, the value found by its binding's name: an address (null for a
    tensor the call lacks), signed integers, a float and a tensor map by value."""
    tensor_map = (ctypes.c_ubyte * 128)(*range(128))
    monkeypatch.setattr(tensormap, "launch_arg", lambda *args, **kwargs: tensor_map)
    monkeypatch.setattr(driver, "ensure_context", lambda device=None: device)
    kernel_abi = KernelABI(Param("data", "ptr", Pointer("q"), ""),
                           Param("n", "i32", CallValue("n"), ""),
                           Param("scale", "f32", CallValue("softmax_scale"), ""),
                           Param("q_map", "tensor_map", TensorMap("q", "block_m", 64), ""),
                           Param("offset", "i64", CallValue("offset"), ""),
                           Param("lse", "ptr", Pointer("lse"), ""))
    launched = []

    def launch(grid, threads, shared_bytes, stream, params):
        pointers = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        launched.append([ctypes.string_at(pointers[i], KIND_BYTES[p.kind])
                         for i, p in enumerate(kernel_abi)])

    def plan(values):
        function = SimpleNamespace(launcher=fake_launcher(launch),
                                   set_max_dynamic_shared=lambda nbytes: None)
        q = TensorShape((2, 8, 4, 64), (2048, 256, 64, 1), "bfloat16")
        return LaunchPlan(function, (1, 1, 1), 128, 0, kernel_abi, SimpleNamespace(block_m=64),
                          device=0, tensors={"q": q}, values=values)

    values = {"n": -3, "softmax_scale": 0.5, "offset": -(1 << 40)}
    plan(values).launch({"q": 0x7F0000001000}, stream=0)
    assert launched == [[
        (0x7F0000001000).to_bytes(8, "little"),
        (-3).to_bytes(4, "little", signed=True),
        struct.pack("<f", 0.5),
        bytes(range(128)),
        (-(1 << 40)).to_bytes(8, "little", signed=True),
        bytes(8),
    ]]
    with pytest.raises(struct.error):  # a value its kind cannot hold is refused, not cut short
        plan({**values, "n": 1 << 31})


def as_libcuda(restype, *argtypes):
    """Decorates a Python function as a C function of libcuda's: called as `driver._raw`'s
    are (a ctypes function pointer without argtypes), it gets the arguments as C passes
    them, so one passed as the wrong C type arrives wrong."""
    def wrap(fn):
        callback = ctypes.CFUNCTYPE(restype, *argtypes)(fn)
        raw = ctypes.CDLL(None)._FuncPtr(ctypes.cast(callback, ctypes.c_void_p).value)
        raw.restype, raw.callback = restype, callback  # (the callback must outlive the test)
        return raw
    return wrap


LAUNCH_ARGTYPES = (ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p)  # libcuda's cuLaunchKernel


@pytest.mark.parametrize("through", ["ctypes", "cuda-python"])
def test_a_launcher_passes_its_plans_arguments_and_each_calls_stream(monkeypatch, through):
    """`Function.launcher` makes all but the stream ctypes objects once; each call passes its
    own stream (libcuda's cuLaunchKernel by ctypes, or cuda-python's where libcuda cannot be
    loaded so). Handles use all 64 bits, which a C int would not carry."""
    calls = []

    @as_libcuda(ctypes.c_int, *LAUNCH_ARGTYPES)
    def raw_launch(*args):
        calls.append(list(args))
        return 0

    def wrapped_launch(*args):
        calls.append(list(args))
        return (driver._SUCCESS,)
    monkeypatch.setattr(driver, "_raw", lambda name: raw_launch if through == "ctypes" else None)
    monkeypatch.setattr(driver.cu, "cuLaunchKernel", wrapped_launch)
    function = driver.Function(None, 0x7F00_0000_0F00, "k")
    run = function.launcher((3, 2, 1), 384, 1024, 0x7F00_0000_BEEF)
    streams = (0x7F00_0000_5151, 0x7F00_0000_6262, 0)  # 0: the legacy default stream
    for stream in streams:
        run(stream)
    null = None if through == "ctypes" else 0  # a NULL as C passes it; cuda-python's 0
    assert calls == [[0x7F00_0000_0F00, 3, 2, 1, 384, 1, 1, 1024, stream or null,
                      0x7F00_0000_BEEF, null] for stream in streams]


@pytest.mark.parametrize("through", ["ctypes", "cuda-python"])
def test_a_grid_dependent_launch_allows_programmatic_stream_serialization(monkeypatch,
                                                                         through):
    """A grid-dependent kernel's launcher calls cuLaunchKernelEx with cuda.h's CUlaunchConfig
    (grid, block, shared bytes, each call's stream) and one attribute,
    CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (6) set to 1, read here byte for
    byte as C lays them out."""
    calls = []

    @as_libcuda(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                ctypes.c_void_p)
    def raw_launch(config, function, params, extra):
        *dims, stream, attrs, count = struct.unpack("<7I4xQQI4x", ctypes.string_at(config, 56))
        attribute = struct.unpack("<i4xi", ctypes.string_at(attrs, 12))
        calls.append([function, *dims, stream or 0, count, attribute, params, extra])
        return 0

    def wrapped_launch(config, function, params, extra):
        attribute = config.attrs[0]
        calls.append([int(function), config.gridDimX, config.gridDimY, config.gridDimZ,
                      config.blockDimX, config.blockDimY, config.blockDimZ,
                      config.sharedMemBytes, int(config.hStream), config.numAttrs,
                      (int(attribute.id), attribute.value.programmaticStreamSerializationAllowed),
                      params, extra or None])
        return (driver._SUCCESS,)
    monkeypatch.setattr(driver, "_raw", lambda name: raw_launch if through == "ctypes" else None)
    monkeypatch.setattr(driver.cu, "cuLaunchKernelEx", wrapped_launch)
    handle = 0x7F00_0000_0F00
    function = driver.Function(None, cu.CUfunction(handle) if through != "ctypes" else handle,
                               "k")
    run = function.launcher((3, 2, 1), 384, 1024, 0x7F00_0000_BEEF, grid_dependent=True)
    streams = (0x7F00_0000_5151, 0x7F00_0000_6262, 0)
    for stream in streams:
        run(stream)
    assert calls == [[handle, 3, 2, 1, 384, 1, 1, 1024, stream, 1, (6, 1), 0x7F00_0000_BEEF,
                      None] for stream in streams]


def test_a_failed_launch_raises_the_drivers_error(monkeypatch):
    failing = as_libcuda(ctypes.c_int, *LAUNCH_ARGTYPES)(lambda *args: 1)
    monkeypatch.setattr(driver, "_raw", lambda name: failing)
    with pytest.raises(CudaError, match="cuLaunchKernel failed") as error:
        driver.Function(None, 0xF00, "k").launcher((1, 1, 1), 32, 0, 0)(0)
    assert error.value.code == cu.CUresult.CUDA_ERROR_INVALID_VALUE  # the driver's 1


def test_the_primary_context_is_made_current_only_where_another_one_is(monkeypatch):
    """ensure_context asks the driver for this thread's current context (libcuda's
    cuCtxGetCurrent by ctypes) and sets the device's primary one only where it differs."""
    current, made_current = [None], []

    @as_libcuda(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))
    def get_current(out):
        out[0] = current[0]
        return 0
    monkeypatch.setattr(driver, "_raw_ctx_get_current", lambda: get_current)
    monkeypatch.setattr(driver, "_primary", {0: "primary 0"})
    monkeypatch.setattr(driver, "_primary_address", {0: 0x7F00_0000_00C0})
    monkeypatch.setattr(driver.cu, "cuCtxSetCurrent",
                        lambda ctx: (made_current.append(ctx), (driver._SUCCESS,))[1])
    for context in (None, 0x7F00_0000_00C0, 0x7F00_0000_00D0):  # none, the primary, another
        current[0] = context
        assert driver.ensure_context(0) == 0
    assert made_current == ["primary 0", "primary 0"]
