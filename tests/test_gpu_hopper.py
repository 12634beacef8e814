"""The Hopper building blocks on an H200: TMA + mbarrier, wgmma (shared and register A,
K-major and MN-major B), setmaxnreg with a producer/consumer ring. The kernels are the ones
tests/test_hopper_codegen.py assembles; each test prints what it measured (max error,
where a mismatch is) for benchmarks/log/HOPPER_NOTES.md. Skipped without a GPU; the kernels
need compute capability 9.0."""
from __future__ import annotations

import ctypes

import pytest

from mhadsl.abi import CallValue, KernelABI, Param
from mhadsl.runtime.driver import Module, device_info
from mhadsl.runtime.launch import ParamBlock
from mhadsl.runtime.tensormap import TENSOR_MAP_BYTES, encode_tiled

from test_hopper_codegen import (
    TMA_ROUNDTRIP_SMEM, WS_SMEM, WS_THREADS, build, build_pv, build_qk, build_tma_roundtrip,
    build_warp_specialized, pv_smem, qk_smem,
)

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(scope="module", autouse=True)
def hopper_device():
    torch.zeros(1, device="cuda")  # torch owns the primary context we share
    if device_info().compute_capability != (9, 0):
        pytest.skip("sm_90a kernels need compute capability 9.0")


def kernel_abi(*params: tuple[str, str]) -> KernelABI:
    """A test kernel's parameters, (name, kind) in order, each bound to `launch`'s argument
    of that name."""
    return KernelABI(*(Param(name, kind, CallValue(name), "") for name, kind in params))


def tma_roundtrip_abi(rank: int) -> KernelABI:
    return kernel_abi(("map_in", "tensor_map"), ("map_out", "tensor_map"), ("raw", "ptr"),
                      ("info", "ptr"), *((f"c{i}", "i32") for i in range(rank)))


QK_ABI = kernel_abi(("q_map", "tensor_map"), ("k_map", "tensor_map"), ("s", "ptr"))
PV_ABI = kernel_abi(("p", "ptr"), ("v_map", "tensor_map"), ("o", "ptr"))
WS_QK_ABI = kernel_abi(("q_map", "tensor_map"), ("k_map", "tensor_map"), ("s", "ptr"),
                       ("kv_tiles", "i32"))


def launch(module, name: str, threads: int, smem: int, abi: KernelABI, args: dict) -> None:
    """Run kernel `name` of `module` as one CTA, each parameter of `abi` taken from `args` by
    name: a tensor map (by value), an address or an i32."""
    built = build(module)
    fn = Module.from_cubin(built.cubin).function(name)
    print(f"{name}: {built.registers} registers, {smem} B shared")
    # A LaunchPlan's tensor maps are views of attention tensors, (batch, rows, heads,
    # head_dim); these kernels' maps have ranks and boxes of their own, so the block is
    # packed here.
    block = ParamBlock(abi)
    for p in abi:
        if p.kind == "tensor_map":
            ctypes.memmove(block.base + abi.offsets[p.name], args[p.name].kernel_arg(),
                           TENSOR_MAP_BYTES)
        else:
            block.pack(p.name, args[p.name])
    fn.set_max_dynamic_shared(smem)
    fn.launcher((1, 1, 1), threads, smem, block.address)(torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()


def tensor_map(t, box):
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}[t.dtype]
    return encode_tiled(t.data_ptr(), dtype, t.shape, t.stride(), box)


def compare(name: str, got, ref, atol: float) -> None:
    """Assert got ~ ref, printing the max error and where the first mismatches are."""
    err = (got.float() - ref.float()).abs()
    err[torch.isnan(got)] = float("inf")
    bad = (err > atol).nonzero().tolist()
    print(f"{name}: max |error| {err.max().item():.3g} (|ref| max {ref.abs().max().item():.3g}); "
          f"{len(bad)} of {err.numel()} above {atol}; first at {bad[:6]}")
    assert not bad


# ============================================================================ (a) TMA
ROUNDTRIP_CASES = {  # rank: (shape, box origin); the 2-D box hangs over both edges
    2: ((128, 192), (96, 160)),
    3: ((3, 100, 72), (2, 40, 8)),
    4: ((2, 3, 128, 64), (1, 2, 64, 0)),
}


@pytest.mark.parametrize("rank", sorted(ROUNDTRIP_CASES))
def test_tma_load_lands_swizzled_and_store_writes_back(rank):
    shape, origin = ROUNDTRIP_CASES[rank]
    box = (1,) * (rank - 2) + (64, 64)
    x = torch.randn(shape, device="cuda").to(torch.bfloat16)
    out = torch.full(shape, -7.0, device="cuda", dtype=torch.bfloat16)
    raw = torch.zeros(2048, device="cuda", dtype=torch.int32)
    info = torch.zeros(2, device="cuda", dtype=torch.int32)
    map_in, map_out = tensor_map(x, box), tensor_map(out, box)
    assert map_in.box_bytes == 8192
    launch(build_tma_roundtrip(rank), "tma_roundtrip", 128, TMA_ROUNDTRIP_SMEM,
           tma_roundtrip_abi(rank),
           {"map_in": map_in, "map_out": map_out, "raw": raw.data_ptr(), "info": info.data_ptr(),
            **{f"c{i}": c for i, c in enumerate(origin)}})
    aligned, unaligned = info.tolist()
    print(f"rank {rank}: dynamic shared memory at {unaligned:#x} "
          f"(mod 1024 = {unaligned % 1024}); tile at {aligned:#x}")

    # the box, zero where it hangs over the tensor's edge
    region = tuple(slice(o, o + b) for o, b in zip(origin, box))
    inside = x[region].reshape(-1, x[region].shape[-1])
    expected = torch.zeros(64, 64, dtype=torch.bfloat16, device="cuda")
    expected[: inside.shape[0], : inside.shape[1]] = inside
    tile = raw.view(torch.int16).view(64, 64).cpu()  # row r = 128 bytes
    want = expected.view(torch.int16).cpu()
    r = torch.arange(64).view(64, 1)
    c = torch.arange(64).view(1, 64)
    swizzled = tile[r, ((c // 8) ^ (r % 8)) * 8 + c % 8]
    print(f"rank {rank}: swizzled placement matches {(swizzled == want).sum().item()}/4096, "
          f"plain placement {(tile == want).sum().item()}/4096")
    assert torch.equal(swizzled, want)

    # the store wrote the in-bounds part of the box and nothing else
    expected_out = torch.full(shape, -7.0, device="cuda", dtype=torch.bfloat16)
    expected_out[region] = x[region]
    wrong = (out != expected_out).nonzero().tolist()
    print(f"rank {rank}: TMA store: {len(wrong)} wrong elements; first {wrong[:4]}")
    assert not wrong


# ============================================================================ (b) S = Q K^T
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_wgmma_qk_from_tma_tiles_matches_torch(dtype):
    q = torch.randn(64, 128, device="cuda").to(DTYPES[dtype])
    k = torch.randn(64, 128, device="cuda").to(DTYPES[dtype])
    s = torch.full((64, 64), float("nan"), device="cuda")
    launch(build_qk(dtype), "qk", 128, qk_smem(), QK_ABI,
           {"q_map": tensor_map(q, (64, 64)), "k_map": tensor_map(k, (64, 64)),
            "s": s.data_ptr()})
    compare(f"S = Q K^T ({dtype}, m64n64k16 x 8)", s, q.float() @ k.float().T, atol=1e-3)


# ============================================================================ (c) O = P V
def run_pv(dtype: str, head_dim: int, p, v, **descriptor):
    o = torch.full((64, head_dim), float("nan"), device="cuda")
    launch(build_pv(dtype, head_dim, **descriptor), "pv", 128, pv_smem(head_dim), PV_ABI,
           {"p": p.data_ptr(), "v_map": tensor_map(v, (64, 64)), "o": o.data_ptr()})
    return o


@pytest.mark.parametrize("dtype, head_dim", [("bf16", 64), ("bf16", 128), ("fp16", 128)])
def test_wgmma_pv_register_a_and_mn_major_v_matches_torch(dtype, head_dim):
    p = torch.rand(64, 64, device="cuda")  # softmax-like: non-negative
    v = torch.randn(64, head_dim, device="cuda").to(DTYPES[dtype])
    o = run_pv(dtype, head_dim, p, v)
    ref = p.to(DTYPES[dtype]).float() @ v.float()  # P rounded to dtype, as a_fragment does
    if not torch.allclose(o, ref, atol=1e-3, rtol=0):  # say which V encoding would work
        for leading, stride in [(1024, 8192), (8192, 8192), (1024, 1024), (16, 1024)]:
            other = run_pv(dtype, head_dim, p, v, leading_bytes=leading, stride_bytes=stride)
            print(f"  V descriptor leading {leading} stride {stride}: max |error| "
                  f"{(other - ref).abs().nan_to_num(float('inf')).max().item():.3g}")
    compare(f"O = P V ({dtype}, m64n{head_dim}k16 x 4, A in registers, trans-b)", o, ref,
            atol=1e-3)


# ============================================================================ (d) setmaxnreg
@pytest.mark.parametrize("kv_tiles", [1, 7])
def test_warp_specialized_producer_consumers(kv_tiles):
    q = torch.randn(128, 128, device="cuda").to(torch.bfloat16)
    k = torch.randn(64 * kv_tiles, 128, device="cuda").to(torch.bfloat16)
    s = torch.full((128, 64 * kv_tiles), float("nan"), device="cuda")
    launch(build_warp_specialized(), "ws_qk", WS_THREADS, WS_SMEM, WS_QK_ABI,
           {"q_map": tensor_map(q, (64, 64)), "k_map": tensor_map(k, (64, 64)),
            "s": s.data_ptr(), "kv_tiles": kv_tiles})
    compare(f"warp-specialised S = Q K^T, {kv_tiles} K tiles through 2 stages", s,
            q.float() @ k.float().T, atol=1e-3)
