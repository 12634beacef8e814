"""Every invalid call of an attention kernel raises a clear error before anything is copied or
launched, and a correct call right after it goes through.

The CPU table uses stand-in device tensors: objects that describe made-up device addresses
through __cuda_array_interface__ (device = the address's bits 40 and up). The argument
checks read only shapes, strides, dtypes and addresses, so they run without a GPU; the
copy and the launch are replaced by recorders. The `gpu` table repeats the cases a real
device can show with torch tensors.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import mhadsl
from mhadsl.host import forward
from mhadsl.runtime import driver, tensors

SOURCE = '''import "std/schedulers.mha"
attention h64 {
    dtype = fp16
    head_dim = 64
    scheduler = Queued()
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx
}
'''
D = 64
ITEM = 2  # fp16


class FakeDevice:
    """A device tensor at a made-up address, as __cuda_array_interface__ describes it."""

    next_address = {0: 1 << 32, 1: 1 << 32}

    def __init__(self, shape, typestr="<f2", *, strides=None, device=0, offset=0,
                 ptr=None):
        itemsize = int(typestr[-1])
        if strides is None:
            strides = tensors.contiguous_strides(tuple(shape))
        if ptr is None:
            ptr = (device << 40) + FakeDevice.next_address[device]
            FakeDevice.next_address[device] += 1 << 30  # tensors never share memory
        self.ptr, self.shape, self.strides, self.typestr = ptr + offset, tuple(shape), \
            tuple(strides), typestr
        self.__cuda_array_interface__ = {
            "shape": self.shape, "typestr": typestr, "data": (self.ptr, False),
            "strides": tuple(s * itemsize for s in strides), "version": 3}

    def view(self, shape, strides, offset_elements=0):
        """Another view of the same memory."""
        return FakeDevice(shape, self.typestr, strides=strides,
                          ptr=self.ptr + offset_elements * int(self.typestr[-1]))


def dense(batch=2, sq=8, sk=10, heads=4, kv_heads=2):
    q = FakeDevice((batch, sq, heads, D))
    k, v = FakeDevice((batch, sk, kv_heads, D)), FakeDevice((batch, sk, kv_heads, D))
    return dict(q=q, k=k, v=v, out=FakeDevice(q.shape))


def ragged(lengths_q=(5, 4), lengths_k=(7, 5), heads=4, kv_heads=2):
    cq = np.cumsum((0,) + lengths_q).astype(np.int32)
    ck = np.cumsum((0,) + lengths_k).astype(np.int32)
    q = FakeDevice((int(cq[-1]), heads, D))
    k, v = (FakeDevice((int(ck[-1]), kv_heads, D)) for _ in range(2))
    return dict(q=q, k=k, v=v, out=FakeDevice(q.shape), cu_seqlens_q=cq, cu_seqlens_k=ck)


def with_(base, **changes):
    def make():
        args = base()
        for name, change in changes.items():
            args[name] = change(args) if callable(change) else change
            if args[name] is None:
                del args[name]
        return args
    return make


def packed_qkv():
    """q, k and v side by side in one (B, S, 3, H, D) buffer, out separate: valid."""
    buf = FakeDevice((2, 8, 3, 4, D))
    s = buf.strides
    view = [buf.view((2, 8, 4, D), (s[0], s[1], s[3], s[4]), k * 4 * D) for k in range(3)]
    return dict(q=view[0], k=view[1], v=view[2], out=FakeDevice((2, 8, 4, D)))


def qkv_and_out_interleaved():
    """q, k, v and out side by side in one buffer: out shares no element with them."""
    buf = FakeDevice((2, 8, 4, 4, D))
    s = buf.strides
    view = [buf.view((2, 8, 4, D), (s[0], s[1], s[3], s[4]), k * 4 * D) for k in range(4)]
    return dict(q=view[0], k=view[1], v=view[2], out=view[3])


def shifted(name, elements):
    """The out tensor moved onto part of `name`'s memory."""
    def change(args):
        t = args[name]
        return t.view(args["q"].shape, tensors.contiguous_strides(args["q"].shape), elements)
    return change


# (id, arguments, error type, what the message says)
INVALID = [
    # dtypes
    ("k float32", with_(dense, k=lambda a: FakeDevice(a["k"].shape, "<f4")), TypeError,
     "tensor 'k' has dtype float32, but kernel 'h64' is declared fp16"),
    ("q int32", with_(dense, q=lambda a: FakeDevice(a["q"].shape, "<i4")), TypeError,
     "tensor 'q' has dtype int32"),
    ("out float32", with_(dense, out=lambda a: FakeDevice(a["q"].shape, "<f4")), TypeError,
     "out has dtype float32, expected float16"),
    ("numpy float64", with_(dense, v=np.zeros((2, 10, 2, D))), TypeError,
     "NumPy dtype float64 is not supported"),
    ("q a list", with_(dense, q=[[0.0]]), TypeError, "expected a CUDA tensor"),
    # devices
    ("k on device 1", with_(dense, k=lambda a: FakeDevice(a["k"].shape, device=1)),
     ValueError, "q, k and v are on different devices: [0, 1]"),
    ("out on device 1", with_(dense, out=lambda a: FakeDevice(a["q"].shape, device=1)),
     ValueError, "out is on device 1, q/k/v on 0"),
    ("cu_seqlens_k on device 1",
     with_(ragged, cu_seqlens_k=FakeDevice((3,), "<i4", device=1), max_seqlen_k=7),
     ValueError, "cu_seqlens_k is on device 1, q/k/v on 0"),
    # rank and shape
    ("dense q of rank 3", with_(dense, q=FakeDevice((16, 4, D))), ValueError,
     "tensor 'q' has shape (16, 4, 64); expected rank 4"),
    ("ragged q of rank 4", with_(ragged, q=FakeDevice((1, 9, 4, D))), ValueError,
     "expected rank 3: (total, heads, head_dim) with cu_seqlens"),
    ("head dim 128", with_(dense, v=FakeDevice((2, 10, 2, 128))), ValueError,
     "tensor 'v' has head dim 128, but kernel 'h64' is declared head_dim = 64"),
    ("k and v differ", with_(dense, v=FakeDevice((2, 11, 2, D))), ValueError,
     "k and v must have the same shape"),
    ("3 heads over 2", with_(dense, q=FakeDevice((2, 8, 3, D)),
                             out=FakeDevice((2, 8, 3, D))), ValueError,
     "query heads (3) must be a multiple of key/value heads (2)"),
    ("no kv heads", with_(dense, k=FakeDevice((2, 10, 0, D)), v=FakeDevice((2, 10, 0, D))),
     ValueError, "must be a multiple of key/value heads (0)"),
    ("batch 2 vs 3", with_(dense, k=FakeDevice((3, 10, 2, D)), v=FakeDevice((3, 10, 2, D))),
     ValueError, "q has batch 2 but k/v have 3"),
    ("out shape", with_(dense, out=FakeDevice((2, 8, 4, 32))), ValueError,
     "out has shape (2, 8, 4, 32), expected (2, 8, 4, 64)"),
    ("2**31 query rows", with_(dense, q=FakeDevice((1, 2**31, 4, D)),
                               out=FakeDevice((1, 2**31, 4, D)),
                               k=FakeDevice((1, 8, 2, D)), v=FakeDevice((1, 8, 2, D))),
     ValueError, "sequence lengths must be below 2**31"),
    # memory layout
    ("last dim strided", with_(dense, q=FakeDevice((2, 8, 4, D), strides=(8192, 1024, 256, 2))),
     ValueError, "tensor 'q': the last dimension must be contiguous"),
    ("negative row stride",
     with_(dense, k=FakeDevice((2, 10, 2, D), strides=(1280, -128, 64, 1), offset=9 * 256)),
     ValueError, "tensor 'k' has negative strides (1280, -128, 64, 1)"),
    ("negative batch stride in out",
     with_(dense, out=FakeDevice((2, 8, 4, D), strides=(-2048, 256, 64, 1), offset=4096)),
     ValueError, "tensor 'out' has negative strides"),
    ("row not 16-byte aligned", with_(dense, q=FakeDevice((2, 8, 4, D), offset=2 * ITEM)),
     ValueError, "rows must be 16-byte aligned"),
    ("null q", with_(dense, q=lambda a: FakeDevice(a["q"].shape, ptr=0)), ValueError,
     "tensor 'q' has a null data pointer"),
    ("out is q", with_(dense, out=lambda a: a["q"]), ValueError, "out overlaps q"),
    ("out on v's second half", with_(dense, out=shifted("v", 10 * 2 * D)), ValueError,
     "out overlaps v"),
    ("out broadcast over batch",
     with_(dense, out=FakeDevice((2, 8, 4, D), strides=(0, 256, 64, 1))), ValueError,
     "out has strides (0, 256, 64, 1) for shape (2, 8, 4, 64): its elements overlap"),
    ("out heads overlap rows",
     with_(dense, out=FakeDevice((2, 8, 4, D), strides=(2048, 64, 64, 1))), ValueError,
     "its elements overlap"),
    # cu_seqlens
    ("cu_seqlens_q int64", with_(ragged, cu_seqlens_q=np.array([0, 5, 9], np.int64)),
     TypeError, "cu_seqlens_q must be int32, got int64"),
    ("cu_seqlens_k float32 on device",
     with_(ragged, cu_seqlens_k=FakeDevice((3,), "<f4"), max_seqlen_k=7), TypeError,
     "cu_seqlens_k must be int32, got float32"),
    ("cu_seqlens lengths differ", with_(ragged, cu_seqlens_k=np.array([0, 7, 9, 12], np.int32)),
     ValueError, "cu_seqlens_q and cu_seqlens_k must have the same length"),
    ("cu_seqlens empty", with_(ragged, cu_seqlens_q=np.zeros(0, np.int32)), ValueError,
     "cu_seqlens_q must be 1-D with batch + 1 entries"),
    ("cu_seqlens 2-D", with_(ragged, cu_seqlens_q=np.zeros((3, 1), np.int32)), ValueError,
     "must be 1-D with batch + 1 entries, got shape (3, 1)"),
    ("cu_seqlens strided on device",
     with_(ragged, cu_seqlens_q=FakeDevice((3,), "<i4", strides=(2,)), max_seqlen_q=5),
     ValueError, "cu_seqlens_q must be contiguous"),
    ("cu_seqlens out of order", with_(ragged, cu_seqlens_q=np.array([0, 6, 5], np.int32)),
     ValueError, "cu_seqlens_q must be non-decreasing, got [0, 6, 5]"),
    ("cu_seqlens below 0", with_(ragged, cu_seqlens_k=np.array([-1, 7, 12], np.int32)),
     ValueError, "cu_seqlens_k must start at 0 or above, got -1"),
    ("q lengths past the end", with_(ragged, cu_seqlens_q=np.array([0, 5, 12], np.int32)),
     ValueError, "cu_seqlens_q ends at 12, beyond the 9 rows of its tensor"),
    ("k lengths past the end", with_(ragged, cu_seqlens_k=np.array([0, 7, 13], np.int32)),
     ValueError, "cu_seqlens_k ends at 13, beyond the 12 rows of its tensor"),
    ("one cu_seqlens only", with_(ragged, cu_seqlens_k=None), ValueError,
     "ragged attention needs both cu_seqlens_q and cu_seqlens_k"),
    # max_seqlen
    ("max_seqlen_q below a length", with_(ragged, max_seqlen_q=4), ValueError,
     "max_seqlen_q = 4 is below the longest sequence (5)"),
    ("max_seqlen_k below a length", with_(ragged, max_seqlen_k=6), ValueError,
     "max_seqlen_k = 6 is below the longest sequence (7)"),
    ("max_seqlen negative", with_(ragged, max_seqlen_q=-1), ValueError,
     "max_seqlen_q must be in [0, 2**31), got -1"),
    ("max_seqlen 2**31", with_(ragged, max_seqlen_k=2**31), ValueError,
     "max_seqlen_k must be in [0, 2**31)"),
    ("max_seqlen a float", with_(ragged, max_seqlen_q=5.5), TypeError,
     "max_seqlen_q must be an integer, got 5.5"),
    ("max_seqlen in a dense call", with_(dense, max_seqlen_q=8), ValueError,
     "max_seqlen_q/max_seqlen_k belong to ragged calls"),
    # the rest of the call
    ("scale NaN", with_(dense, scale=math.nan), TypeError, "scale must be a finite number"),
    ("scale a string", with_(dense, scale="0.1"), TypeError, "scale must be a finite number"),
    ("stream a string", with_(dense, stream="s0"), TypeError,
     "cannot use str as a CUDA stream"),
]

VALID = [("dense", dense), ("ragged", ragged), ("packed qkv", packed_qkv),
         ("interleaved out", qkv_and_out_interleaved),
         ("ragged, device offsets and max_seqlen",
          with_(ragged, cu_seqlens_q=FakeDevice((3,), "<i4"), cu_seqlens_k=FakeDevice((3,), "<i4"),
                max_seqlen_q=5, max_seqlen_k=7))]


@pytest.fixture
def kernel(monkeypatch):
    """The kernel, with copies and launches recorded instead of done."""
    kern = mhadsl.compile(SOURCE)["h64"]
    kern.touched = []
    monkeypatch.delenv("MHADSL_DEBUG", raising=False)  # it would read device offsets

    def fake_copy(array, name, *, dtype=None, device=None, stream=None):
        kern.touched.append(f"copy {name}")
        return FakeDevice(array.shape, "<i4" if dtype == "int32" else "<f2"), None

    monkeypatch.setattr(tensors, "pointer_device", lambda ptr: ptr >> 40)
    monkeypatch.setattr(driver, "ensure_context", lambda device=None: device or 0)
    monkeypatch.setattr(tensors, "to_device", lambda array, name, **kw: (
        tensors.as_device_tensor(fake_copy(array, name, **kw)[0], name), None))
    monkeypatch.setattr(forward, "_launch", lambda kernel, call, *a: kern.touched.append(
        ("launch", call.sizes.batch, call.sizes.heads, call.sizes.max_seqlen_q,
         call.sizes.max_seqlen_k)))
    return kern


@pytest.mark.parametrize("make, error, message", [c[1:] for c in INVALID],
                         ids=[c[0] for c in INVALID])
def test_invalid_call_fails_before_anything_runs_then_a_valid_call_works(kernel, make, error,
                                                                         message):
    args = make()
    with pytest.raises(error) as info:
        kernel(**args)
    assert message in str(info.value)
    assert kernel.touched == []
    kernel(**dense())
    assert kernel.touched == [("launch", 2, 4, 8, 10)]


@pytest.mark.parametrize("make", [v[1] for v in VALID], ids=[v[0] for v in VALID])
def test_valid_layouts_launch(kernel, make):
    kernel(**make())
    launches = [t for t in kernel.touched if t[0] == "launch"]
    assert len(launches) == 1


def test_ragged_call_reads_lengths_into_the_launch(kernel):
    kernel(**ragged((3, 0, 6), (1, 9, 2)))
    assert kernel.touched == ["copy cu_seqlens_q", "copy cu_seqlens_k", ("launch", 3, 4, 6, 9)]


# ------------------------------------------------------------------------------ on a GPU
@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


def _gpu_cases(torch):
    def t(*shape, dtype=torch.float16):
        return torch.randn(*shape, device="cuda", dtype=dtype)

    def base():
        q = t(2, 64, 4, D)
        return dict(q=q, k=t(2, 80, 2, D), v=t(2, 80, 2, D))

    def k_and_out_in_one_buffer():
        args, buf = base(), t(4 * 64 * 4 * D)
        args["k"] = buf[:2 * 80 * 2 * D].view(2, 80, 2, D)
        args["out"] = buf[2 * 80 * D:2 * 80 * D + 2 * 64 * 4 * D].view(2, 64, 4, D)
        return args

    def rag():
        return dict(q=t(9, 4, D), k=t(12, 2, D), v=t(12, 2, D),
                    cu_seqlens_q=torch.tensor([0, 5, 9], dtype=torch.int32, device="cuda"),
                    cu_seqlens_k=torch.tensor([0, 7, 12], dtype=torch.int32, device="cuda"))

    return [
        ("bf16 k", with_(base, k=lambda a: a["k"].bfloat16()), TypeError,
         "tensor 'k' has dtype bfloat16"),
        ("cpu v", with_(base, v=lambda a: a["v"].cpu()), ValueError, "tensor 'v' is on cpu"),
        ("transposed q", with_(base, q=lambda a: a["q"].transpose(-1, -2).contiguous()
                               .transpose(-1, -2)), ValueError, "must be contiguous"),
        ("out is q", with_(base, out=lambda a: a["q"]), ValueError, "out overlaps q"),
        ("out shares k's memory", k_and_out_in_one_buffer, ValueError, "out overlaps k"),
        ("cu_seqlens int64", with_(rag, cu_seqlens_q=lambda a: a["cu_seqlens_q"].long()),
         TypeError, "dtype torch.int64"),
        ("cu_seqlens out of order on the device",
         with_(rag, cu_seqlens_k=lambda a: a["cu_seqlens_k"].flip(0).contiguous()),
         ValueError, "non-decreasing"),
        ("device cu_seqlens past the end",
         with_(rag, cu_seqlens_q=lambda a: a["cu_seqlens_q"] + 1), ValueError,
         "beyond the 9 rows"),
    ]


@pytest.mark.gpu
def test_invalid_torch_calls_fail_before_a_launch(torch, monkeypatch):
    kern = mhadsl.compile(SOURCE)["h64"]
    launches = []
    launch = forward._launch
    monkeypatch.setattr(forward, "_launch",
                        lambda kernel, *a: (launches.append(1), launch(kernel, *a)))
    cases = _gpu_cases(torch)
    for name, make, error, message in cases:
        with pytest.raises(error) as info:
            kern(**make())
        assert message in str(info.value), name
    assert launches == []
    q, k, v = (torch.randn(2, 64, 4, D, device="cuda", dtype=torch.float16) for _ in range(3))
    out = kern(q, k, v)
    assert launches == [1]
    ref = mhadsl.reference(kern, q.float().cpu().numpy(), k.float().cpu().numpy(),
                           v.float().cpu().numpy())
    assert np.abs(out.float().cpu().numpy() - ref).max() < 2e-2


@pytest.mark.gpu
def test_debug_mode_checks_device_offsets_against_max_seqlen(torch, monkeypatch):
    kern = mhadsl.compile(SOURCE)["h64"]
    args = dict(q=torch.randn(9, 4, D, device="cuda", dtype=torch.float16),
                k=torch.randn(12, 2, D, device="cuda", dtype=torch.float16),
                v=torch.randn(12, 2, D, device="cuda", dtype=torch.float16),
                cu_seqlens_q=torch.tensor([0, 5, 9], dtype=torch.int32, device="cuda"),
                cu_seqlens_k=torch.tensor([0, 7, 12], dtype=torch.int32, device="cuda"),
                max_seqlen_q=3, max_seqlen_k=7)
    monkeypatch.setenv("MHADSL_DEBUG", "1")
    with pytest.raises(ValueError, match="max_seqlen_q = 3 is below the longest sequence"):
        kern(**args)


@pytest.mark.parametrize("make_out, message", [
    (lambda q: FakeDevice(q.shape, strides=(0, *q.strides[1:])),
     "its elements overlap, so the kernel's writes would collide"),
    (lambda q: FakeDevice(q.shape, device=1), "out is on device 1, q/k_cache/v_cache on 0"),
    (lambda q: q, "out overlaps q"),
], ids=["out expanded", "out on device 1", "out is q"])
def test_bad_decode_outputs_fail_before_anything_runs(kernel, make_out, message):
    """A decode call's output gets the prefill call's checks (one `check_output`)."""
    q = FakeDevice((2, 1, 4, D))
    k, v = FakeDevice((2, 16, 2, D)), FakeDevice((2, 16, 2, D))
    with pytest.raises(ValueError) as info:
        kernel(q, k, v, cache_seqlens=np.array([3, 4], np.int32), out=make_out(q))
    assert message in str(info.value)
    assert kernel.touched == []
