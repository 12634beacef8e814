"""The kernel ABI byte for byte, without a GPU: the parameter block a call launches, read back
by the types and offsets of the kernel's own PTX, holds the call's values; the tensor maps'
boxes are the tiles the kernel's copies fill; a plan is made once per call signature.

The launch is replaced by a recorder of the block (`test_launch_host_path.kernel`).
"""
import ctypes
import math
import re
import struct

import pytest

from mhadsl.abi import KIND_ALIGN, KIND_BYTES, CallValue, KernelABI, Param, Pointer
from mhadsl.codegen.backends import sm80, sm90
from mhadsl.runtime import launch
from test_hostile_tensors import D, FakeDevice, dense
from test_launch_host_path import WORKSPACE, kernel  # noqa: F401 (a fixture)

# PTX parameter declarations -> (struct format, size, alignment)
PTX_TYPES = {".u64": ("<Q", 8, 8), ".u32": ("<I", 4, 4), ".f32": ("<f", 4, 4),
             ".b8[128]": (None, 128, 64)}


def ptx_params(ptx: str, kernel_name: str) -> list[tuple[str, str | None, int, int]]:
    """(PTX type, format, size, alignment) of each parameter of `.entry kernel_name`."""
    body = ptx.split(f".entry {kernel_name}(")[1].split(")")[0]
    params = []
    for line in body.split(","):
        words = line.split()
        align = int(words[words.index(".align") + 1]) if ".align" in words else None
        if words[-1].endswith("[128]"):
            ptx_type = ".b8[128]"
        else:
            ptx_type = next(w for w in words if w in PTX_TYPES)
        fmt, size, natural = PTX_TYPES[ptx_type]
        params.append((ptx_type, fmt, size, align if ptx_type == ".b8[128]" else natural))
    return params


def offsets(params) -> list[int]:
    """CUDA's parameter layout: each parameter at the next multiple of its alignment."""
    at, out = 0, []
    for _, _, size, align in params:
        at = -(-at // align) * align
        out.append(at)
        at += size
    return out


@pytest.mark.parametrize("design", ["sm80", "sm90"])
def test_the_launched_block_holds_the_call_in_the_kernels_own_types_and_offsets(kernel,
                                                                              design):
    kernel.backend = design
    build = kernel.build("sm_90a", gqa_group=2, backend=design)
    params = ptx_params(build.ptx, re.search(r"\.entry (\w+)\(", build.ptx).group(1))
    sk = 10
    args = dense(batch=2, sq=8, sk=sk, heads=4, kv_heads=2)
    for n, at in (("k", 1 << 39), ("v", 3 << 38)):  # batch strides that need 64 bits
        args[n] = FakeDevice((2, sk, 2, D), strides=(2**32 + 8 * D, 2 * D, D, 1), ptr=at)
    kernel(**args)
    abi = kernel.abi
    assert len(params) == len(abi.params)
    assert offsets(params) == [abi.offsets[p.name] for p in abi]
    block = kernel.blocks[-1]
    q, k, v, o = (args[n] for n in ("q", "k", "v", "out"))
    expected = {
        "q": q.ptr, "k": k.ptr, "v": v.ptr, "o": o.ptr, "lse": 0, "cu_seqlens_q": 0,
        "cu_seqlens_k": 0, "lse_stride_batch": 4 * 8, "lse_stride_head": 8, "batch": 2,
        "num_heads": 4, "max_seqlen_q": 8, "max_seqlen_k": sk, "seqlen_q": 8, "seqlen_k": sk,
        "softmax_scale": struct.unpack("<f", struct.pack("<f", 1 / math.sqrt(D)))[0],
        "queue": WORKSPACE, "num_sms": 132, "ctas_per_sm": 2, "tile_index": 0,
    }
    for t, name in ((q, "q"), (k, "k"), (v, "v"), (o, "o")):
        for axis, stride in zip(("batch", "row", "head"), t.strides[:3]):
            expected[f"{name}_stride_{axis}"] = stride
    config = kernel.config(gqa_group=2, backend=design)
    rows = {"q": config.block_m, "k": config.block_n, "v": config.block_n,
            "o": 64 if getattr(config, "o_store_per_group", False) else config.block_m}
    addresses = {n: expected[n] for n in "qkvo"}
    for (_, fmt, size, _), at, p in zip(params, offsets(params), abi):
        raw = block[at:at + size]
        if fmt is None:  # a tensor map: the stand-in encoder wrote address, box, dims
            address, *box = struct.unpack("<5Q", raw[:40])
            tensor = p.name.removesuffix("_map")
            assert address == addresses[tensor]
            assert box == [64, 1, rows[tensor], 1], p.name  # innermost first: D, H, rows, B
        else:
            assert struct.unpack(fmt, raw)[0] == expected.pop(p.name), p.name
    assert expected == {}  # every parameter of the call was found in the block


def test_the_kernels_copies_expect_the_boxes_the_host_encodes(kernel):
    """The bytes each TMA copy completes on its barrier (expect_tx, in the IR) are the
    host's boxes for that map, and fill exactly the kernel's tile for it (O's: each
    storer's rows, a warpgroup's where each stores its own)."""
    for config in sm90.declared_configs(kernel.options):
        storers = config.consumer_groups if config.o_store_per_group else 1
        tiles = {"q_map": config.q_bytes, "k_map": config.kv_tile_bytes,
                 "v_map": config.kv_tile_bytes, "o_map": config.q_bytes // storers}
        for p in (p for p in sm90.ABI if p.kind == "tensor_map"):
            box = p.binding.box(config)
            assert math.prod(box) * 2 * config.boxes == tiles[p.name], (config, p.name)
    build = kernel.build("sm_90a", gqa_group=2, backend="sm90")
    c = build.config
    expected = {c.q_bytes, c.kv_tile_bytes}
    found = {int(n) for n in re.findall(r'"mbarrier\.arrive\.expect_tx[^"]*", "[^"]*"\(i32 '
                                        r'%"[^"]+", i32 (\d+)\)', build.llvm)}
    assert found == expected


def test_a_plan_is_made_once_per_signature(kernel, monkeypatch):
    made = []
    init = launch.LaunchPlan.__init__
    monkeypatch.setattr(launch.LaunchPlan, "__init__",
                        lambda self, *a, **kw: (made.append(1), init(self, *a, **kw))[1])
    for _ in range(3):
        kernel(**dense())  # new tensors, same shapes and strides
    assert kernel.launches == 3 and len(made) == 1
    args = dense()
    q = args["q"]  # the same rows, heads stored apart: another stride
    wide = FakeDevice((2, 8, 8, D))
    args["q"] = wide.view(q.shape, (8 * 8 * D, 8 * D, D, 1))
    kernel(**args)
    assert len(made) == 2
    kernel(**{n: FakeDevice(t.shape, device=1) for n, t in dense().items()})
    assert len(made) == 3  # another device
    kernel(**dense(sq=9))  # another length
    assert len(made) == 4 and kernel.launches == 6


def test_an_abi_lays_parameters_out_as_cuda_does():
    abi = KernelABI(Param("a", "i32", CallValue("batch"), ""),
                    Param("b", "ptr", Pointer("q"), ""),
                    Param("c", "f32", CallValue("softmax_scale"), ""),
                    Param("m", "tensor_map", sm90.ABI["k_map"].binding, ""))
    assert abi.offsets == {"a": 0, "b": 8, "c": 16, "m": 64} and abi.size == 192
    assert KIND_BYTES["tensor_map"] == 128 and KIND_ALIGN["tensor_map"] == 64
    block = launch.ParamBlock(abi)
    block.pack("a", -3)
    block.words[block.word("b")] = 0xDEADBEEF0
    block.pack("c", 0.5)
    raw = bytes(block.data)
    assert struct.unpack_from("<i", raw, 0)[0] == -3
    assert struct.unpack_from("<Q", raw, 8)[0] == 0xDEADBEEF0
    assert struct.unpack_from("<f", raw, 16)[0] == 0.5
    pointers = ctypes.cast(block.address, ctypes.POINTER(ctypes.c_void_p))
    assert [pointers[i] - block.base for i in range(4)] == [0, 8, 16, 64]


def test_a_parameter_blocks_words_are_its_pointers_in_whole_words():
    """A call patches pointers by word index; a block whose last parameter ends mid-word
    is still whole words, and only pointers have a word."""
    abi = KernelABI(Param("b", "ptr", Pointer("q"), ""), Param("n", "i32", CallValue("batch"), ""))
    assert abi.size == 12
    block = launch.ParamBlock(abi)
    assert block.word("b") == 0 and len(block.words) == 2
    block.pack("n", 7)
    block.words[block.word("b")] = 0xFEED0000
    assert struct.unpack_from("<Qi", bytes(block.data)) == (0xFEED0000, 7)
    with pytest.raises(AssertionError, match="n"):
        block.word("n")


def test_designs_share_no_parameter_list_and_codegen_never_imports_runtime():
    import pathlib
    root = pathlib.Path(__file__).resolve().parent.parent / "codegen"
    for path in root.rglob("*.py"):
        assert not re.search(r"^\s*(from|import) mhadsl\.runtime", path.read_text(), re.M), path
    for design in ("sm80", "sm90"):
        text = (root / "backends" / f"{design}.py").read_text()
        assert re.search(r"backends\.sm\d+ import", text) is None, design
    assert sm80.ABI.params == sm90.ABI.params[:len(sm80.ABI.params)]  # FORWARD_PARAMS


def test_the_trace_kernel_declares_its_abi():
    """The scheduler trace kernel's PTX parameters are `TRACE_ABI`'s, in its types and at
    its offsets: what a `LaunchPlan` of it packs by name."""
    from helpers import STD, checked
    from mhadsl.codegen.scheduler import SchedulerSpec, lower_scheduler
    from mhadsl.codegen.target import emit_ptx, gpu_target, new_module, optimize
    from mhadsl.codegen.trace_kernel import TRACE_ABI, build_trace_kernel
    target = gpu_target("sm_80")
    module = new_module("trace", target)
    build_trace_kernel(module, lower_scheduler(module, checked(STD),
                                               SchedulerSpec("Persistent"), target))
    params = ptx_params(emit_ptx(optimize(module, target), target), "trace_Persistent")
    assert [ptx_type for ptx_type, *_ in params] == \
        [{"ptr": ".u64", "i32": ".u32"}[p.kind] for p in TRACE_ABI]
    assert offsets(params) == [TRACE_ABI.offsets[p.name] for p in TRACE_ABI]
