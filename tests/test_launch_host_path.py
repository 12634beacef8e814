"""The host work of a launch stays small (no GPU needed: the driver is replaced by recorders).

Back to back, a kernel that runs shorter than its launch's host work waits for the host:
choosing the kernel design again on every call, or building NumPy views of out, q, k and v
to prove they share no memory, makes a short sliding-window call take twice its kernel's
time.
"""
import ctypes
import struct
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

import mhadsl
from mhadsl import abi
from mhadsl.host import calls
from mhadsl.build import RequestError, plan
from mhadsl.codegen.backends import CacheLayout, KernelBuild
from mhadsl.runtime import driver, faults, tensormap, tensors
from helpers import fake_launcher
from test_hostile_tensors import D, SOURCE, FakeDevice, dense, qkv_and_out_interleaved, ragged


WORKSPACE = 1 << 20  # the stand-in stream workspace's address


def _fake_map(layout) -> ctypes.Array:
    """128 bytes that say what was asked of the encoder: address, box, dims (u64 each)."""
    words = [layout.address, *layout.box, *layout.dims]
    return (ctypes.c_ubyte * 128).from_buffer_copy(
        b"".join(w.to_bytes(8, "little") for w in words).ljust(128, b"\0"))


@pytest.fixture
def kernel(monkeypatch):
    yield from stand_in(monkeypatch, mhadsl.compile(SOURCE)["h64"])


def stand_in(monkeypatch, kern):
    """`kern` on a stand-in 9.0 device; `kernel.launches` counts launches,
    `kernel.calls` the builds (each chooses the design) and overlap checks the host ran,
    `kernel.targets` the targets of the builds it loaded, `kernel.encoded` the addresses of
    the tensor maps it encoded, `kernel.blocks` the parameter blocks launched (and
    `kernel.grids` their grids and threads, `kernel.dependent` whether each was launched
    grid-dependent). A build is the
    real build path's choice of design and config, with no code generated."""
    kern.launches, kern.calls, kern.targets, kern.encoded, kern.blocks = 0, Counter(), [], [], []
    kern.grids, kern.dependent = [], []

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            kern.calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    def launch(grid, threads, shared_bytes, stream, params):
        kern.launches += 1
        kern.grids.append((grid, threads))
        kern.blocks.append(ctypes.string_at(ctypes.cast(params, ctypes.POINTER(
            ctypes.c_void_p))[0], kern.abi.size))  # the parameter block as launched

    def build(layout, arch):
        kern.calls["build"] += 1
        try:
            resolved = plan(kern.program.checked, kern._request(layout, arch, kern.backend))
        except RequestError as err:
            raise RuntimeError(f"kernel '{kern.name}': {err}") from None
        kern.targets.append(arch)
        scheduled = resolved.backend.scheduled(resolved.configs[0])
        kern.abi = abi.with_operands(scheduled.abi, abi.operand_params(kern.options.operands))
        waits = "griddepcontrol.wait;" if arch == "sm_90a" else ""  # as sm_90a prefill's
        return KernelBuild(resolved.backend.name, arch, "", waits, None, resolved.configs[0])

    function = SimpleNamespace(max_active_blocks=lambda *a: 2, launcher=fake_launcher(launch, kern.dependent),
                               set_max_dynamic_shared=lambda nbytes: None)
    monkeypatch.setattr(driver.Module, "from_ptx", staticmethod(
        lambda ptx, device=None: SimpleNamespace(function=lambda name: function)))
    monkeypatch.setattr(np, "shares_memory", counted("shares_memory", np.shares_memory))
    monkeypatch.setattr(tensors, "pointer_device", lambda ptr: ptr >> 40)
    monkeypatch.setattr(driver, "device_info", lambda device: SimpleNamespace(
        compute_capability=(9, 0), multiprocessor_count=132))
    monkeypatch.setattr(driver, "workspace", lambda stream, device: SimpleNamespace(
        ptr=WORKSPACE))
    monkeypatch.setattr(driver, "ensure_context", lambda device=None: device)
    def encode(*args, device=None, **kwargs):  # host-side layout checks, no driver encoder
        kern.encoded.append(args[0])
        layout = tensormap.tiled_layout(*args, **kwargs)
        return SimpleNamespace(layout=layout, kernel_arg=lambda: _fake_map(layout))

    monkeypatch.setattr(tensormap, "encode_tiled", encode)
    monkeypatch.setattr(kern.launcher, "build", build)
    tensormap.launch_arg.cache_clear()  # no map from another test, none left for the next
    yield kern
    tensormap.launch_arg.cache_clear()


def test_repeated_launches_choose_the_design_once_and_skip_numpy_for_separate_tensors(kernel):
    for _ in range(3):
        kernel(**dense())
    assert kernel.launches == 3
    assert kernel.calls == Counter(build=1)  # once per kernel and device, not per call


def test_launches_over_the_same_tensors_encode_their_tensor_maps_once(kernel):
    args = dense()
    for _ in range(3):
        kernel(**args)
    assert kernel.launches == 3
    assert sorted(kernel.encoded) == sorted(args[n].ptr for n in ("q", "k", "v", "out"))
    new_q = FakeDevice(args["q"].shape)
    kernel(**dict(args, q=new_q))  # only the new tensor's map is encoded
    assert kernel.launches == 4 and kernel.encoded[4:] == [new_q.ptr]


def test_out_beside_q_k_v_in_one_buffer_still_gets_the_exact_overlap_check(kernel):
    kernel(**qkv_and_out_interleaved())  # address ranges meet, elements do not: valid
    assert kernel.launches == 1 and kernel.calls["shares_memory"] == 3
    args = dense()
    args["out"] = args["q"]
    with pytest.raises(ValueError, match="out overlaps q"):
        kernel(**args)
    assert kernel.launches == 1


def test_the_design_is_chosen_again_for_another_device_or_a_forced_backend(kernel,
                                                                           monkeypatch):
    kernel(**dense())
    monkeypatch.setattr(driver, "device_info", lambda device: SimpleNamespace(
        compute_capability=(9, 0) if device == 0 else (8, 0), multiprocessor_count=108))
    kernel(**on_device_1(dense()))
    assert kernel.targets == ["sm_90a", "sm_80"]
    kernel.backend = "sm90"  # Hopper only: refused on this device, at every call
    for _ in range(2):
        with pytest.raises(RuntimeError, match="builds for sm_90a, not sm_80"):
            kernel(**on_device_1(dense()))
    assert kernel.launches == 2 and kernel.calls["build"] == 4


def test_a_plain_call_runs_the_kv_tile_its_keys_select(monkeypatch):
    """A dense call without a mask of few keys runs the sm90 build without the wide KV tile
    (`Layout.narrow_kv`), a long one the wide tile's: both loaded at the first call, and
    K's tensor map boxes as many rows as the tile that ran."""
    kern = next(stand_in(monkeypatch, mhadsl.compile(
        "attention p { dtype = fp16  head_dim = 128 }")["p"]))

    def key_rows(keys: int) -> int:
        q, k, v = (FakeDevice((1, keys, 2, 128)) for _ in range(3))
        kern(q=q, k=k, v=v, out=FakeDevice(q.shape))
        words = struct.unpack(f"<{len(kern.blocks[-1]) // 8}Q", kern.blocks[-1])
        # K's tensor map: its address, then its box (columns, heads, rows, batch) and dims
        at = next(i for i, w in enumerate(words) if w == k.ptr and 0 < words[i + 1] < 1 << 16)
        return words[at + 3]

    assert key_rows(512) == 128 and kern.calls["build"] == 2
    assert key_rows(4096) == 144 and key_rows(2559) == 128 and key_rows(2560) == 144
    assert kern.calls["build"] == 2 and kern.launches == 4


def on_device_1(args: dict) -> dict:
    return {n: FakeDevice(t.shape, device=1) if isinstance(t, FakeDevice) else t
            for n, t in args.items()}


class Tripwire:
    """A stand-in for cuda-python's driver module: any driver call it is asked for fails the
    test, except those named in `allowed`, which are recorded."""

    def __init__(self, allowed=()):
        self.allowed, self.called = allowed, []

    def __getattr__(self, name):
        if name not in self.allowed:
            raise AssertionError(f"a planned launch called the driver: {name}")
        return lambda *args: (self.called.append(name), (driver._SUCCESS, 0))[1]


@pytest.fixture
def stream_workspace(kernel, monkeypatch):
    """The real `driver.workspace` lookup over one stand-in workspace of stream 0, device 0,
    whose host-side fault record the test can write (as a faulting kernel would)."""
    record = (ctypes.c_uint32 * abi.RECORD_WORDS)()
    monkeypatch.setitem(driver._workspaces, (0, 0), driver._Workspace(WORKSPACE, record))
    monkeypatch.setattr(driver, "workspace", WORKSPACE_LOOKUP)
    return record


WORKSPACE_LOOKUP = driver.workspace


def test_a_planned_launch_calls_the_driver_for_the_launch_alone(kernel, stream_workspace,
                                                                monkeypatch):
    args = dense()
    kernel(**args)  # the plan: design, build, grid, tensor maps
    monkeypatch.setattr(driver, "cu", Tripwire())
    for _ in range(3):  # no memset of the counter, no copy of the record, no event
        kernel(**args)
    assert kernel.launches == 4


def test_a_fault_the_kernel_wrote_is_raised_at_the_next_launch_and_cleared(
        kernel, stream_workspace, monkeypatch):
    kernel(**dense())
    stream_workspace[:] = [abi.fault_code(abi.TOO_MANY_TILES, "advance"),
                           faults.scheduler_id("Queued"), 7]
    tripwire = Tripwire(allowed=("cuStreamIsCapturing", "cuMemsetD32Async"))
    monkeypatch.setattr(driver, "cu", tripwire)
    monkeypatch.setattr(driver, "_capturing", lambda handle: False)
    with pytest.raises(mhadsl.SchedulerError, match="'Queued': rule 'advance' never returned"
                                                   r".*\(CTA 7\)"):
        kernel(**dense())
    assert kernel.launches == 1 and list(stream_workspace) == [0, 0, 0]
    assert tripwire.called == ["cuMemsetD32Async"]  # the device's record, on the stream
    kernel(**dense())
    assert kernel.launches == 2


def test_forcing_a_design_or_tracing_forgets_the_plans_of_torch_calls(kernel):
    """A torch call's plan is looked up by its tensors alone: a forced design or a traced
    build must not be served the plan made before it."""
    kernel(**dense())
    for setting, value in (("backend", "sm80"), ("trace", True)):
        kernel.launcher.fast_plans[("a torch signature",)] = next(iter(
            kernel.launcher.plans.values()))
        setattr(kernel, setting, value)
        assert kernel.launcher.fast_plans == {}, setting
    kernel.trace = False
    kernel(**dense())
    assert kernel.targets == ["sm_90a", "sm_90a"] and kernel.launches == 2


def test_a_hopper_calls_kernels_and_its_tile_index_kernel_launch_grid_dependent(kernel,
                                                                                 monkeypatch):
    """An sm_90a build's kernels wait for the grids before them themselves
    (`KernelBuild.grid_dependent`), and so does the tile index kernel built for the same
    arch that a ragged call runs first: their launches allow programmatic stream
    serialization."""
    from mhadsl.runtime import tile_index
    index_dependent, index_kernels = [], []
    fake = SimpleNamespace(launcher=fake_launcher(lambda *a: None, index_dependent),
                           set_max_dynamic_shared=lambda n: None)

    def function(kernel, device):
        index_kernels.append(kernel)
        return fake
    monkeypatch.setattr(tile_index, "_function", function)
    monkeypatch.setattr(tile_index, "buffer", lambda batch, stream, device: 0xABC000)
    tile_index.plan.cache_clear()
    kernel(**dense())
    args = ragged((5, 0, 9), (7, 1, 2))
    args["cu_seqlens_q"], args["cu_seqlens_k"] = (FakeDevice((4,), "<i4") for _ in range(2))
    kernel(**args, max_seqlen_q=9, max_seqlen_k=7)
    tile_index.plan.cache_clear()
    assert kernel.targets == ["sm_90a", "sm_90a"]
    assert kernel.dependent == [True, True] and index_dependent == [True]
    assert "griddepcontrol.wait;" in index_kernels[0].ptx


def test_a_ragged_launch_builds_its_tile_index_first_by_the_index_kernels_abi(kernel,
                                                                            monkeypatch):
    from mhadsl.codegen import tile_index as index_kernel
    from mhadsl.runtime import tile_index
    index_launches = []

    def launch_index(grid, threads, shared_bytes, stream, params):
        index_launches.append((grid, ctypes.string_at(ctypes.cast(params, ctypes.POINTER(
            ctypes.c_void_p))[0], index_kernel.ABI.size)))
    fake = SimpleNamespace(launcher=fake_launcher(launch_index), set_max_dynamic_shared=lambda n: None)
    monkeypatch.setattr(tile_index, "_function", lambda kernel, device: fake)
    monkeypatch.setattr(tile_index, "buffer", lambda batch, stream, device: 0xABC000)
    tile_index.plan.cache_clear()
    args = ragged((5, 0, 9), (7, 1, 2))
    args["cu_seqlens_q"], args["cu_seqlens_k"] = (FakeDevice((4,), "<i4") for _ in range(2))
    kernel(**args, max_seqlen_q=9, max_seqlen_k=7)
    tile_index.plan.cache_clear()
    (grid, block), = index_launches
    assert grid == (1, 1, 1)  # a warp per sequence
    cu, batch, tile_m, index = struct.unpack("<QiiQ", block)
    assert (cu, batch, index) == (args["cu_seqlens_q"].ptr, 3, 0xABC000)
    assert tile_m == kernel.config(gqa_group=2, ragged=True).block_m
    offset = kernel.abi.offsets["tile_index"]
    assert struct.unpack_from("<Q", kernel.blocks[-1], offset)[0] == 0xABC000


def test_a_planned_call_checks_only_new_addresses_and_never_passes_refused_ones(monkeypatch):
    """A torch call of a planned signature checks its addresses (alignment, out against q,
    k and v) unless they are the last passing call's; a refused call's are not remembered."""
    from mhadsl.host.forward import _Planned
    from mhadsl.runtime.launch import TensorShape
    t = TensorShape((2, 8, 4, 64), (2048, 256, 64, 1), "bfloat16")  # 8 KiB
    planned = _Planned([], SimpleNamespace(q=SimpleNamespace(shape=t.shape), lse_shape=None),
                       False, dict.fromkeys("qkvo", t), 0)
    checked = []
    check = planned.check_new_addresses
    monkeypatch.setattr(planned, "check_new_addresses",
                        lambda addresses: (checked.append(addresses["o"]), check(addresses)))
    separate = {"q": 0x10000, "k": 0x20000, "v": 0x30000, "o": 0x40000}
    for _ in range(2):
        planned.check_addresses(separate)
    assert checked == [0x40000]
    for _ in range(2):
        with pytest.raises(ValueError, match="out overlaps k"):
            planned.check_addresses({**separate, "o": 0x20000 + 4096})
    with pytest.raises(ValueError, match="16-byte aligned"):
        planned.check_addresses({**separate, "o": 0x40008})
    planned.check_addresses(separate)  # still the last passing call's
    assert checked == [0x40000, 0x21000, 0x21000, 0x40008]


class FakeTorchC:
    """torch._C with its raw-stream accessor (a handle per device); counts its lookups."""

    def __init__(self):
        self.lookups = 0

    @property
    def _cuda_getCurrentRawStream(self):
        self.lookups += 1
        return lambda device: 0x7F00_0000_0000 + device


def test_a_calls_stream_comes_from_torchs_raw_accessor_looked_up_once(monkeypatch):
    monkeypatch.setattr(calls, "_current_stream", None)  # as before the first call
    torch = SimpleNamespace(_C=FakeTorchC())
    assert [calls.torch_stream(torch, d) for d in (0, 1, 1)] == [
        0x7F00_0000_0000, 0x7F00_0000_0001, 0x7F00_0000_0001]
    assert torch._C.lookups == 1


def test_without_torchs_raw_accessor_a_calls_stream_is_its_current_streams(monkeypatch):
    monkeypatch.setattr(calls, "_current_stream", None)
    torch = SimpleNamespace(_C=SimpleNamespace(), cuda=SimpleNamespace(
        current_stream=lambda device: SimpleNamespace(cuda_stream=0x5000 + device)))
    assert [calls.torch_stream(torch, d) for d in (2, 3)] == [0x5002, 0x5003]


def _packed(kernel, names) -> dict:
    """The values the last launch's parameter block holds for `names`."""
    fmt = {"ptr": "<Q", "i64": "<q", "i32": "<i", "f32": "<f"}
    return {n: struct.unpack_from(fmt[kernel.abi[n].kind], kernel.blocks[-1],
                                  kernel.abi.offsets[n])[0] for n in names}


DECODE_VALUES = ("q_stride_batch", "q_stride_row", "o_stride_batch", "k_stride_page",
                 "page_table_stride", "lse_stride_batch", "lse_stride_head", "num_heads",
                 "query_rows", "cache_capacity", "q_tiles", "num_splits", "kv_chunk",
                 "work_tiles", "ctas_per_sm")


def _decode_call(monkeypatch, layout: str, batch: int, heads: int, kv_heads: int,
                 capacity: int, total_q: int) -> tuple[dict, dict, list]:
    """A decode call's tensors (3 query rows a sequence, or ragged over `total_q` rows; a
    contiguous cache or pages of 16) on stand-in buffers: (the call's arguments, the bytes
    of each buffer the driver allocated, by address, the memsets queued)."""
    allocated, zeroed = {}, []

    class Buffer:
        def __init__(self, nbytes, device=None):
            self.nbytes, self.ptr = nbytes, (len(allocated) + 1) << 36
            allocated[self.ptr] = nbytes
    monkeypatch.setattr(driver, "DeviceBuffer", Buffer)
    monkeypatch.setattr(driver, "memset_d32_async", lambda ptr, value, words, device=None:
                        zeroed.append((ptr, value, words)))
    monkeypatch.setattr(driver, "synchronize", lambda device=None: None)
    call = {"cache_seqlens": FakeDevice((batch,), "<i4")}
    if layout == "paged":
        call["k"], call["v"] = (FakeDevice((batch * capacity // 16, 16, kv_heads, D))
                                for _ in range(2))
        call["page_table"] = FakeDevice((batch, capacity // 16), "<i4")
    else:
        call["k"], call["v"] = (FakeDevice((batch, capacity, kv_heads, D)) for _ in range(2))
    if layout == "ragged":
        call["q"] = FakeDevice((total_q, heads, D))
        call.update(cu_seqlens_q=FakeDevice((batch + 1,), "<i4"), max_seqlen_q=3)
    else:
        call["q"] = FakeDevice((batch, 3, heads, D))
    call["out"] = FakeDevice(call["q"].shape)
    return call, allocated, zeroed


@pytest.mark.parametrize("layout", ["dense", "paged", "ragged"])
def test_a_decode_launch_packs_the_call_through_the_launcher(kernel, monkeypatch, layout):
    """A call against a KV cache, planned by the one launcher on the decode design: strides
    from the tensors (a ragged q's batch stride 0), the cache's capacity and page-table
    stride, the split the call asks for in whole KV tiles with its stream's workspace of the
    design's sizes (counters zeroed), K/V heads as the scheduler's."""
    batch, heads, kv_heads, capacity = 2, 4, 2, 208  # 13 pages; halves of 104 rows
    call, allocated, zeroed = _decode_call(monkeypatch, layout, batch, heads, kv_heads,
                                           capacity, 5)
    k = call["k"]
    kernel(num_splits=2, return_lse=False, **call)
    got = _packed(kernel, DECODE_VALUES + ("partial_o", "partial_lse", "split_counters"))
    config = kernel.config(gqa_group=2, cache=CacheLayout(
        0 if layout == "ragged" else 3, 16 if layout == "paged" else 0, 64))
    assert config.block_n == 64 and config.rows == (64 if layout == "ragged" else 16)
    rows = 2 * batch * kv_heads * config.rows  # two splits of every group's rows
    assert {allocated[got.pop(n)] for n in ("partial_o", "partial_lse")} == {
        4 * rows * D, 4 * rows} and allocated[got["split_counters"]] == 4 * batch * kv_heads
    assert zeroed == [(got.pop("split_counters"), 0, batch * kv_heads)]
    assert got == {
        "q_stride_batch": 0 if layout == "ragged" else 3 * heads * D,
        "q_stride_row": heads * D,
        "o_stride_batch": 0 if layout == "ragged" else 3 * heads * D,
        "k_stride_page": k.strides[0],
        "page_table_stride": capacity // 16 if layout == "paged" else 0,
        "lse_stride_batch": 0 if layout == "ragged" else heads * 3,
        "lse_stride_head": 5 if layout == "ragged" else 3,
        "num_heads": kv_heads, "query_rows": 0 if layout == "ragged" else 3,
        "cache_capacity": capacity, "q_tiles": 1, "num_splits": 2, "kv_chunk": 128,  # (104 rounded to whole KV tiles)
        "work_tiles": 2, "ctas_per_sm": 2,
    }


@pytest.mark.parametrize("layout", ["dense", "paged", "ragged"])
def test_a_decode_launch_whose_splits_follow_the_lengths_builds_its_split_index_first(
        kernel, monkeypatch, layout):
    """Without `num_splits` (and a queue scheduler) a call's splits follow its lengths: the
    split index kernel runs first, a warp per sequence, into its stream's index buffer,
    which the decode kernel reads; at most one split per KV tile of the cache, up to
    MAX_KV_SPLITS, a sequence; partial states for the groups plus the chunks aimed at."""
    batch, heads, kv_heads, capacity = 40, 4, 2, 2112  # 33 KV tiles: over BALANCED_MIN_KEYS
    call, allocated, _ = _decode_call(monkeypatch, layout, batch, heads, kv_heads, capacity, 50)
    kernel(**call)
    from mhadsl.codegen.backends import decode
    config = kernel.config(gqa_group=2, cache=CacheLayout(
        0 if layout == "ragged" else 3, 16 if layout == "paged" else 0, 64, balanced=True))
    assert kernel.launches == 2 and kernel.grids[0] == ((5, 1, 1), decode.SPLITS_THREADS)
    names = ("split_index", "split_slots", "partial_o", "partial_lse", "split_counters")
    got = _packed(kernel, DECODE_VALUES + names)
    first = struct.unpack_from("<Q", kernel.blocks[0], kernel.abi.offsets["split_index"])[0]
    assert first == got["split_index"]  # the index the first kernel writes, the second reads
    groups = batch * kv_heads  # one query-row tile a sequence
    rows = min(groups * 33, groups + 2 * 132) * config.rows  # 2 chunks a multiprocessor
    assert allocated[got.pop("split_index")] == 4 * abi.tile_index_words(batch)
    assert allocated[got.pop("partial_o")] == 4 * rows * D
    assert allocated[got.pop("partial_lse")] == 4 * rows
    assert allocated[got.pop("split_counters")] == 4 * groups
    assert {n: got[n] for n in ("num_splits", "kv_chunk", "work_tiles", "split_slots",
                                "q_tiles")} == {
        "num_splits": 33, "kv_chunk": 0, "work_tiles": 33, "split_slots": 264, "q_tiles": 1}


@pytest.mark.parametrize("layout", ["dense", "paged", "ragged"])
def test_a_short_cache_takes_the_hosts_split_count_and_no_split_index(
        kernel, monkeypatch, layout):
    """A cache of at most BALANCED_MIN_KEYS keys a sequence: the decode kernel alone, on a
    build whose splits do not follow the lengths, with the host's split count (one here:
    the groups fill the multiprocessors), so no split index, partial states or counters."""
    from mhadsl.host.serving import BALANCED_MIN_KEYS
    capacity = 2048
    assert capacity <= BALANCED_MIN_KEYS
    call, allocated, zeroed = _decode_call(monkeypatch, layout, 160, 4, 2, capacity, 480)
    for _ in range(2):
        kernel(**call)
    assert kernel.launches == 2  # one kernel a call
    assert not any(getattr(b.config, "balanced", True) for b in kernel.launcher.loaded.values()
                   if getattr(b.config, "page_size", None) is not None)
    got = _packed(kernel, ("num_splits", "work_tiles"))
    assert got == {"num_splits": 1, "work_tiles": 1}
    assert allocated == {} and zeroed == []
