"""mhadsl.runtime on a real GPU: module load, launch plans on torch/NumPy/CuPy data, memset,
queue workspaces and CUDA-graph capture. Skipped (by conftest) without a GPU."""

import shutil
import subprocess
import uuid

import numpy as np
import pytest

from mhadsl.abi import CallValue, KernelABI, Param, Pointer
from mhadsl.runtime.driver import (
    CudaError,
    DeviceBuffer,
    Module,
    device_info,
    memset_d32_async,
    queue_workspace,
    stream_handle,
)
from mhadsl.runtime.launch import LaunchPlan
from mhadsl.runtime.tensors import as_device_tensor, empty_like_kind, from_device, to_device

pytestmark = pytest.mark.gpu

# Hand-written PTX: add_one(int* data, u32 n); axpb(int* data, int a, int b, u32 n):
# data = data * a + b.
PTX = r"""
.version 8.0
.target sm_80
.address_size 64

.visible .entry add_one(.param .u64 add_one_data, .param .u32 add_one_n)
{
    .reg .pred %p<2>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<5>;
    ld.param.u64 %rd1, [add_one_data];
    ld.param.u32 %r1, [add_one_n];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    setp.ge.u32 %p1, %r5, %r1;
    @%p1 bra $ADD_DONE;
    cvta.to.global.u64 %rd2, %rd1;
    mul.wide.u32 %rd3, %r5, 4;
    add.s64 %rd4, %rd2, %rd3;
    ld.global.u32 %r6, [%rd4];
    add.s32 %r7, %r6, 1;
    st.global.u32 [%rd4], %r7;
$ADD_DONE:
    ret;
}

.visible .entry axpb(.param .u64 axpb_data, .param .u32 axpb_a, .param .u32 axpb_b, .param .u32 axpb_n)
{
    .reg .pred %p<2>;
    .reg .b32 %r<10>;
    .reg .b64 %rd<5>;
    ld.param.u64 %rd1, [axpb_data];
    ld.param.u32 %r8, [axpb_a];
    ld.param.u32 %r9, [axpb_b];
    ld.param.u32 %r1, [axpb_n];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    setp.ge.u32 %p1, %r5, %r1;
    @%p1 bra $AXPB_DONE;
    cvta.to.global.u64 %rd2, %rd1;
    mul.wide.u32 %rd3, %r5, 4;
    add.s64 %rd4, %rd2, %rd3;
    ld.global.u32 %r6, [%rd4];
    mad.lo.s32 %r7, %r6, %r8, %r9;
    st.global.u32 [%rd4], %r7;
$AXPB_DONE:
    ret;
}
"""

BROKEN_PTX = r"""
.version 8.0
.target sm_80
.address_size 64

.visible .entry broken()
{
    .reg .b32 %r<2>;
    mov.u32 %r1, %no_such_register;
    ret;
}
"""

N = 1000
THREADS = 128
GRID = ((N + THREADS - 1) // THREADS, 1, 1)

ADD_ONE_ABI = KernelABI(Param("data", "ptr", Pointer("data"), "the ints to add one to"),
                        Param("n", "i32", CallValue("n"), "how many"))
AXPB_ABI = KernelABI(Param("data", "ptr", Pointer("data"), "the ints to scale and shift"),
                     Param("a", "i32", CallValue("a"), "the factor"),
                     Param("b", "i32", CallValue("b"), "the shift"),
                     Param("n", "i32", CallValue("n"), "how many"))


@pytest.fixture(scope="module")
def module():
    return Module.from_ptx(PTX)


def plan(function, abi=ADD_ONE_ABI, shared_bytes=0, **values) -> LaunchPlan:
    """A launch of `function` over the N ints at address "data", with `values` by name."""
    return LaunchPlan(function, GRID, THREADS, shared_bytes, abi, config=None,
                      device=function.module.device, tensors={}, values={"n": N, **values})


def test_device_info():
    info = device_info()
    assert info.name and info.compute_capability >= (8, 0)
    assert info.multiprocessor_count > 0 and info.l2_cache_size > 0
    assert info.max_shared_memory_per_block_optin > 48 * 1024


def test_module_load_and_function_attributes(module):
    add_one = module.function("add_one")
    assert add_one.num_regs > 0
    # The verbose JIT log (spill checks). PTX the driver's JIT cache already holds (another
    # test process loaded it) compiles silently, so this load's text is new.
    fresh = Module.from_ptx(PTX + f"// {uuid.uuid4()}\n")
    assert "registers" in fresh.info_log, fresh.info_log
    with pytest.raises(CudaError, match=r"(?s)CUDA_ERROR_NOT_FOUND.*no kernel named 'missing'"):
        module.function("missing")


def test_bad_ptx_shows_the_jit_log():
    with pytest.raises(CudaError) as caught:
        Module.from_ptx(BROKEN_PTX)
    message = str(caught.value)
    assert message.startswith("cuModuleLoadDataEx failed: CUDA_ERROR_INVALID_PTX")
    assert "JIT error log" in message, message


def test_dynamic_shared_memory_opt_in(module):
    add_one = module.function("add_one")
    data = DeviceBuffer.from_numpy(np.zeros(N, np.int32))
    plan(add_one, shared_bytes=100 * 1024).launch({"data": data.ptr}, 0)  # opts in by itself
    assert (data.copy_to_numpy(np.empty(N, np.int32)) == 1).all()
    too_much = device_info().max_shared_memory_per_block_optin + 1
    with pytest.raises(ValueError, match="dynamic shared memory"):
        add_one.set_max_dynamic_shared(too_much)


def test_launch_on_numpy_array(module):
    a = np.arange(N, dtype=np.int32)
    tensor, _buffer = to_device(a, "a")
    plan(module.function("add_one")).launch({"data": tensor.ptr}, 0)
    assert (from_device(tensor) == np.arange(1, N + 1)).all()
    assert (a == np.arange(N)).all()  # the input was copied, not written


def test_plans_of_one_kernel_pass_their_own_signed_values(module):
    tensor, _buffer = to_device(np.arange(N, dtype=np.int32), "a")
    axpb = module.function("axpb")
    first, second = (plan(axpb, AXPB_ABI, a=a, b=b) for a, b in ((3, -5), (2, 1)))
    first.launch({"data": tensor.ptr}, 0)
    second.launch({"data": tensor.ptr}, 0)
    assert (from_device(tensor) == (np.arange(N) * 3 - 5) * 2 + 1).all()


def test_bf16_round_trip_through_device():
    values = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, np.inf], np.float32)
    tensor, _buffer = to_device(values, "v", dtype="bfloat16")
    assert tensor.dtype == "bfloat16" and tensor.kind == "numpy"
    out = np.zeros(4, np.float32)
    assert from_device(tensor, out) is out
    assert out.tolist() == [1.0, 1.015625, -2.5, np.inf]


def test_memset_d32_async_then_read_back():
    buffer = DeviceBuffer(16 * 4)
    memset_d32_async(buffer.ptr, 0, 16, 0)
    memset_d32_async(buffer.ptr, 0xDEADBEEF, 10, 0)
    host = buffer.copy_to_numpy(np.empty(16, np.uint32))
    assert (host[:10] == 0xDEADBEEF).all() and (host[10:] == 0).all()


def test_launch_on_torch_tensor(module):
    torch = pytest.importorskip("torch")
    x = torch.arange(N, dtype=torch.int32, device="cuda")
    tensor = as_device_tensor(x, "x")
    assert (tensor.ptr, tensor.shape, tensor.strides, tensor.dtype, tensor.kind) == (
        x.data_ptr(),
        (N,),
        (1,),
        "int32",
        "torch",
    )
    add_one = plan(module.function("add_one"))
    add_one.launch({"data": tensor.ptr}, stream_handle(None, kind="torch"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    add_one.launch({"data": tensor.ptr}, stream_handle(side))  # a torch stream object
    side.synchronize()
    assert torch.equal(x.cpu(), torch.arange(2, N + 2, dtype=torch.int32))


def test_torch_dtypes_kinds_and_errors():
    torch = pytest.importorskip("torch")
    q = torch.zeros(2, 3, 4, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    tensor = as_device_tensor(q, "q")
    assert (tensor.dtype, tensor.shape, tensor.strides) == ("bfloat16", (2, 4, 3), (12, 1, 4))
    with pytest.raises(TypeError, match=r"'k'.*torch.int64"):
        as_device_tensor(torch.zeros(3, dtype=torch.int64, device="cuda"), "k")
    out = empty_like_kind(q, (5, 6), "bfloat16")
    assert out.dtype == torch.bfloat16 and out.device == q.device and out.shape == (5, 6)


def test_cuda_array_interface_object():
    torch = pytest.importorskip("torch")
    x = torch.zeros(6, 4, dtype=torch.float32, device="cuda")[:, 1:]

    class Wrapper:
        __cuda_array_interface__ = x.__cuda_array_interface__

    tensor = as_device_tensor(Wrapper(), "w")
    assert (tensor.kind, tensor.ptr, tensor.strides, tensor.device) == (
        "cai",
        x.data_ptr(),
        (4, 1),
        x.device.index,
    )


def test_launch_on_cupy_array(module):
    cupy = pytest.importorskip("cupy")
    x = cupy.arange(N, dtype=cupy.int32)
    tensor = as_device_tensor(x, "x")
    assert tensor.kind == "cupy"
    stream = stream_handle(None, kind="cupy")
    plan(module.function("add_one")).launch({"data": tensor.ptr}, stream)
    cupy.cuda.get_current_stream().synchronize()
    assert (cupy.asnumpy(x) == np.arange(1, N + 1)).all()
    assert isinstance(empty_like_kind(x, (3,), "float16"), cupy.ndarray)


def test_queue_workspace_one_per_stream():
    torch = pytest.importorskip("torch")
    side = torch.cuda.Stream()
    default = queue_workspace(0)
    other = queue_workspace(side)
    assert abs(default - other) >= 16 and abs(default - other) % 16 == 0
    assert queue_workspace(0) == default and queue_workspace(side.cuda_stream) == other


def test_load_cubin(tmp_path):
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("ptxas not on PATH")
    major, minor = device_info().compute_capability
    (tmp_path / "k.ptx").write_text(PTX)
    subprocess.run(
        [ptxas, f"-arch=sm_{major}{minor}", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
        check=True,
    )
    add_one = Module.from_cubin((tmp_path / "k.cubin").read_bytes()).function("add_one")
    data = DeviceBuffer.from_numpy(np.full(N, 41, np.int32))
    plan(add_one).launch({"data": data.ptr}, 0)
    assert (data.copy_to_numpy(np.empty(N, np.int32)) == 42).all()
