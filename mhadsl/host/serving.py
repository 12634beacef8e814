"""Decode calls: attention of a few query rows per sequence against a (paged) KV cache.

    o = kern(q, k_cache, v_cache, cache_seqlens=lens)                  # contiguous cache
    o = kern(q, k_cache, v_cache, cache_seqlens=lens, page_table=pt)   # paged cache
    o, lse = kern(q, k_cache, v_cache, cache_seqlens=lens, cu_seqlens_q=cq, max_seqlen_q=mq,
                  return_lse=True)                                     # chunked prefill
    o = kern(q, k8, v8, cache_seqlens=lens, page_table=pt, k_scale=ks, v_scale=vs)  # FP8 cache

Layouts and checks are `mhadsl.host.paged`'s (the float64 `mhadsl.reference_decode` shares them).
The kernel is the decode design (`codegen.backends.decode`), driven by the declaration's own
scheduler over decode's work space: (sequence, K/V head, query-row tile x KV split).

What a call signature fixes (shapes, strides, dtypes, devices) is planned once: the build,
the split count, the grid, the parameter block and the split workspace (one per stream, so
streams never share partial results). A later call of a planned torch signature checks only
its addresses, patches them and launches. Index values (`cache_seqlens`, `page_table`,
`cu_seqlens_q`) stay on the device and are read by the kernel, so a CUDA graph replays new
contents without recapture; MHADSL_DEBUG=1 reads and checks them before every launch.
"""
from __future__ import annotations

import math
import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mhadsl.host.calls import (
    DTYPE_NAMES, AddressChecks, DeviceCopies, check_flag, check_output, check_rows, host_values,
    index_view, operand_views, share_memory, span, stream_handle, tensor_operands,
    torch_signature, torch_stream, typed_key,
)
from mhadsl.abi import CallSizes
from mhadsl.codegen.backends import CacheLayout, Layout, select_target
from mhadsl.build import decode_splits_by_length
from mhadsl.codegen.backends.decode import MIN_SPLIT_TILES, packed_rows
from mhadsl.host.launcher import launch
from mhadsl.host.paged import MAX_KV_SPLITS as MAX_SPLITS
from mhadsl.host.paged import (
    FP8_CACHE, cache_capacity, check_decode_call, decode_operand_rows,
)

_READ_AND_WRITTEN = ("q", "k_cache", "v_cache", "o")
# Where the splits follow the lengths: chunks of the batch's work per multiprocessor. With
# two, longest-first scheduling of 64-128 heavy-tailed sequences (one in 16 30-60x the
# median) ends 4-6 % over the ideal at GQA 32:8, 12-14 % at MQA, in the list-scheduling
# model of tests/test_decode_balanced.py, against 5-22 % with one; not yet measured.
CHUNKS_PER_SM = 2
# Splits that follow the lengths only where a sequence may hold more keys than this: below,
# the splits kernel and the combines cost more than a long sequence's tail can (an H200, B32
# 32:8, 8 layers' calls in a CUDA graph: a capacity of 1,120 keys ran 5.9 µs a call slower by
# length than with the host's split count, 4,098 keys at B16 3.4 µs faster).
BALANCED_MIN_KEYS = 2048


def splits_follow_lengths(kernel, num_splits: int | None, capacity: int) -> bool:
    """Whether a decode call of `kernel` whose sequences hold up to `capacity` keys splits
    each sequence by its own length (`CacheLayout.balanced`): where it fixes no split count,
    the cache may hold more than `BALANCED_MIN_KEYS` and the declaration's scheduler allows
    it (`build.decode_splits_by_length`)."""
    return (not num_splits and capacity > BALANCED_MIN_KEYS
            and decode_splits_by_length(kernel.program.checked, kernel.options))


def default_splits(groups: int, slots: int, capacity: int, block_n: int) -> int:
    """KV splits per (sequence, K/V head, query-row tile) group over `slots` (the
    multiprocessors: one split streaming per multiprocessor measured best): none when the
    groups alone fill 80 % of them; else as many as fill them in one wave, unless that wave
    is emptier than FA3's rule allows: the fewest splits whose wave efficiency is within 85 %
    of the best. Each split covers at least MIN_SPLIT_TILES KV tiles."""
    most = max(1, min(MAX_SPLITS, capacity // (MIN_SPLIT_TILES * block_n)))
    if groups >= 0.8 * slots or most == 1:
        return 1

    def efficiency(splits: int) -> float:
        items = groups * splits
        return items / (math.ceil(items / slots) * slots)

    best = max(efficiency(s) for s in range(1, most + 1))
    one_wave = min(most, slots // groups)
    if efficiency(one_wave) >= 0.85 * best:
        return one_wave
    return next(s for s in range(1, most + 1) if efficiency(s) >= 0.85 * best)


def kv_tile(rows: int, groups: int, num_sms: int, page_size: int = 0,
            wgmma: bool = False, fp8: bool = False) -> int:
    """The KV tile for a call's shape: 32 rows (small CTAs, four per multiprocessor) where
    16-row work tiles are many enough to give most multiprocessors two and pages hold 64
    rows or more; else 64 (two CTAs per multiprocessor, each with more bytes in flight).
    `wgmma` (sm_90a, whose 64-row work tiles compute by wgmma): 64-row work tiles take the
    32-row KV tile under the same rule (three CTAs per multiprocessor). An FP8 cache
    (`fp8`): 64 rows, 128 for 32-row work tiles. All fastest measured on the H200
    (benchmarks/log/BENCHMARKS_LOG.md, decode)."""
    if fp8:
        return 128 if rows == 32 else 64
    small_pages = 0 < page_size < 64
    small_work = rows == 16 or (wgmma and rows == 64)
    return 32 if small_work and groups >= 1.5 * num_sms and not small_pages else 64


def decode_work(batch: int, kv_heads: int, work_tiles: int):
    """The work space a decode launch hands its scheduler, as a simulator batch: per
    (sequence, K/V head) `work_tiles` prompt tiles of height 1 (query-row tile x KV split)."""
    from mhadsl.analysis.simulate import Batch
    return Batch([work_tiles] * batch, kv_heads, 1, ragged=False)


def splits_used(cache_len: int, kv_chunk: int, num_splits: int) -> int:
    """The splits of a group that run on a cache of `cache_len` positions (the kernel's
    rule: the chunks it spans, at least one); the others exit at once. With more than one,
    each writes its partial state and the last to finish combines them."""
    return max(1, min(-(-max(cache_len, 0) // kv_chunk), num_splits))


@dataclass
class _DecodePlan(AddressChecks):
    """A decode signature's launch plan and what its calls need beyond it."""

    plans: list  # runtime.launch.LaunchPlan
    out_shape: tuple
    lse_shape: tuple | None
    scratch: dict[str, int]  # bytes of the split workspace's buffers (none: no split)
    device: int
    workspaces: dict  # stream -> {name: buffer} of the split workspace
    num_splits: int
    q_tiles: int  # packed-row tiles per sequence (the work space: q_tiles x num_splits)
    kv_chunk: int  # cache positions per split
    empty: bool  # nothing to launch
    shapes: dict  # name -> TensorShape of the call's tensors
    spans: dict  # name -> bytes from the first element of q, the cache and out to the last
    q_contiguous: bool  # then a call's output is torch.empty_like(q), cheaper than new_empty
    # runtime's driver.debug_mode, held so that a planned call imports nothing: under
    # MHADSL_DEBUG=1 every call takes the full path (it checks device-side values)
    debug_mode: Callable[[], bool]
    appends: bool  # the call's new rows (k_new, v_new) are copied 16 bytes at a time too

    def __post_init__(self):
        self.aligned = _READ_AND_WRITTEN + (("k_new", "v_new") if self.appends else ())
        self.checked_addresses = operator.itemgetter(*self.aligned)

    def check_new_addresses(self, addresses: dict) -> None:
        """The checks of a first call that depend on the tensors' addresses: 16-byte
        aligned rows, and an output that shares no element with q or the cache (exact,
        where their byte ranges meet)."""
        if any(a & 15 for a in self.checked_addresses(addresses)):
            name = next(n for n in self.aligned if addresses[n] & 15)
            raise ValueError(f"tensor {name!r}: rows must be 16-byte aligned (pointer and "
                             f"strides multiples of 16 bytes), got a pointer at "
                             f"{addresses[name]:#x}")
        q, k, v, o = (addresses[n] for n in _READ_AND_WRITTEN)
        o_end = o + self.spans["o"]
        for name, lo in (("q", q), ("k_cache", k), ("v_cache", v)):
            if lo <= o_end and o <= lo + self.spans[name] and self._overlap(addresses, name):
                raise ValueError(f"out overlaps {name}: the kernel reads {name} while it "
                                 "writes out; pass a separate output")

    def _overlap(self, addresses: dict, name: str) -> bool:
        from mhadsl.runtime.tensors import DeviceTensor

        def view(n):
            t = self.shapes[n]
            return DeviceTensor(addresses[n], t.shape, t.strides, t.dtype, self.device,
                                "torch", None)
        return share_memory(view("o"), view(name))

    def split_workspace(self, stream: int) -> dict[str, int]:
        """The stream's partial outputs and split counters (made on its first launch)."""
        if not self.scratch:
            return {}
        buffers = self.workspaces.get(stream)
        if buffers is None:
            buffers = self.workspaces[stream] = _split_buffers(self.scratch, self.device)
        return {name: _address(x) for name, x in buffers.items()}


def _split_buffers(nbytes: dict[str, int], device: int) -> dict:
    """Partial O, partial LSE and zeroed split counters (each launch leaves them at 0: the
    last split of a group resets its counter). Made by the driver, outside torch's memory
    pools: torch.compile's CUDA graphs warm up in their graph's pool and refuse tensors left
    there that no output holds. A first launch inside CUDA-graph capture (which may not
    synchronise) takes them from torch's allocator, the graph's pool, and the graph zeroes
    the counters it replays with."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_current_stream_capturing():
        return {name: (torch.zeros if name == "split_counters" else torch.empty)(
            n, dtype=torch.uint8, device=f"cuda:{device}") for name, n in nbytes.items()}
    from mhadsl.runtime import driver
    buffers = {name: driver.DeviceBuffer(n, device) for name, n in nbytes.items()}
    counters = buffers.get("split_counters")  # (none where no group splits: the index alone)
    if counters is not None:
        driver.memset_d32_async(counters.ptr, 0, counters.nbytes // 4, device=device)
        driver.synchronize(device)
    return buffers


def _address(buffer) -> int:
    return buffer.data_ptr() if hasattr(buffer, "data_ptr") else buffer.ptr


def decode(kernel, q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, max_seqlen_q,
           scale, out, return_lse, stream, num_splits, operands, k_new=None, v_new=None,
           k_scale=None, v_scale=None):
    """`kernel`'s attention of q against its cache (`Kernel.__call__` with `cache_seqlens`;
    positional, as each keyword costs the per-call host path); `operands`: the operands'
    checked values (None where the declaration has none); `k_new`/`v_new`: the step's rows,
    written into the cache first; `k_scale`/`v_scale`: a float8_e4m3fn cache's scales
    (`mhadsl.host.paged`)."""
    tensor_ops = tensor_operands(kernel.options, operands)
    key = torch_signature(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, out,
                          k_new, v_new, *tensor_ops.values())
    if key is not None:  # torch tensors: a signature seen before runs its plan
        key = typed_key(key, (max_seqlen_q, scale, return_lse, num_splits, k_scale, v_scale))
        key = ("decode", *key)
        planned = kernel.launcher.fast_plans.get(key)
        if planned is not None and not planned.debug_mode():
            return _run_torch(planned, q, k_cache, v_cache, cache_seqlens, page_table,
                              cu_seqlens_q, out, stream, kernel.recording_workspace, operands,
                              tensor_ops, k_new, v_new)
    check_flag(return_lse, "return_lse")
    want_lse = kernel.options.return_lse if return_lse is None else bool(return_lse)
    return _call(kernel, q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q,
                 max_seqlen_q, scale, out, want_lse, stream, num_splits, key, operands,
                 {"k_new": k_new, "v_new": v_new} if k_new is not None or v_new is not None
                 else {}, (k_scale, v_scale))


def _call(kernel, q, k_cache, v_cache, cache_seqlens, page_table, cu_q, max_q, scale, out,
          want_lse, stream, num_splits, key, operands, new_rows, kv_scales):
    """Every check, then the device (without a GPU, NoGpuError before any host array is
    copied or allocated), then the signature's plan (made once) and the launch."""
    from mhadsl.runtime import driver, tensors
    dtype = DTYPE_NAMES[kernel.options.dtype]
    views = {}
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), *new_rows.items()):
        if t is None and name in new_rows:  # (a lone k_new or v_new: check_decode_call
            continue                          # says so)
        view = tensors.as_device_tensor(t, name)
        if not view.on_host and view.dtype != dtype and not (
                name in ("k_cache", "v_cache") and view.dtype == FP8_CACHE):
            raise TypeError(f"tensor {name!r} has dtype {view.dtype}, but kernel "
                            f"'{kernel.name}' is declared {kernel.options.dtype} ({dtype})")
        views[name] = view
    for name, t in (("cache_seqlens", cache_seqlens), ("page_table", page_table),
                    ("cu_seqlens_q", cu_q)):
        if t is not None:
            views[name] = index_view(t, name)
    device = next((t.device for t in views.values() if not t.on_host), None)
    devices = {t.device for t in views.values() if not t.on_host}
    if len(devices) > 1:
        raise ValueError(f"the decode call's tensors are on different devices: "
                         f"{sorted(devices)}")

    def read(view):  # index values: the host's always, the device's under MHADSL_DEBUG=1
        return host_values(view) if view.on_host or driver.debug_mode() else None

    call = check_decode_call(kernel.options, views["q"], views["k_cache"], views["v_cache"],
                             cache_seqlens=views.get("cache_seqlens"),
                             page_table=views.get("page_table"),
                             cu_seqlens_q=views.get("cu_seqlens_q"), max_seqlen_q=max_q,
                             scale=scale, num_splits=num_splits, k_new=views.get("k_new"),
                             v_new=views.get("v_new"), k_scale=kv_scales[0],
                             v_scale=kv_scales[1], read=read)
    for name in ("q", "k_cache", "v_cache", *new_rows):
        if not views[name].on_host:
            check_rows(views[name], name)
    op_views = operand_views(kernel.options, operands, call.batch, views["q"].shape[-2],
                             device, *decode_operand_rows(
                                 call, views["q"].shape, views["k_cache"].shape,
                                 views["page_table"].shape if call.page_size else None))
    for name in ("cache_seqlens", "page_table", "cu_seqlens_q"):
        view = views.get(name)
        if view is not None and not view.on_host and view.strides[-1] != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    ragged = cu_q is not None
    qv = views["q"]
    reads = {n: views[n] for n in ("q", "k_cache", "v_cache")}
    out_view = None if out is None else check_output(out, qv.shape, dtype, device, reads)
    handle = driver.stream_handle(stream, kind=qv.kind, device=device if qv.on_host else
                                  qv.device)
    on_device = DeviceCopies(driver.ensure_context(device))
    if out_view is None:
        out_view = tensors.as_device_tensor(tensors.empty_like_kind(qv.obj, qv.shape, dtype),
                                            "out")
    out_obj = out_view.obj
    dev = {"q": on_device(qv, "q", dtype),
           "k_cache": on_device(views["k_cache"], "k_cache", views["k_cache"].dtype),
           "v_cache": on_device(views["v_cache"], "v_cache", views["v_cache"].dtype),
           "o": on_device(out_view, "out", dtype)}
    dev.update((name, on_device(views[name], name, dtype)) for name in new_rows)
    for name in ("cache_seqlens", "page_table", "cu_seqlens_q"):
        if name in views:
            dev[name] = on_device(views[name], name, "int32")
    dev.update((n, on_device(t, n, t.dtype)) for n, t in op_views.items())
    lse_obj = None
    if want_lse:
        shape = (qv.shape[1], qv.shape[0]) if ragged else (qv.shape[0], qv.shape[2],
                                                           qv.shape[1])
        lse_obj = tensors.empty_like_kind(qv.obj, shape, "float32")
        dev["lse"] = on_device(tensors.as_device_tensor(lse_obj, "lse"), "lse", "float32")

    planned = _plan(kernel, call, dev, ragged, want_lse, num_splits)
    if key is not None and not driver.debug_mode():
        kernel.launcher.fast_plans[key] = planned
    if not planned.empty:
        addresses = {n: t.ptr for n, t in dev.items()}
        launch(planned.plans, {**addresses, **planned.split_workspace(handle)}, handle,
               kernel.recording_workspace, operands)
    if out_view.on_host:
        tensors.from_device(dev["o"], out_obj, stream=handle)
    if new_rows:  # the cache the call appended to, back to host arrays
        for name in ("k_cache", "v_cache"):
            if views[name].on_host:
                tensors.from_device(dev[name], views[name].obj, stream=handle)
    if want_lse and isinstance(lse_obj, np.ndarray):
        tensors.from_device(dev["lse"], lse_obj, stream=handle)
    return (out_obj, lse_obj) if want_lse else out_obj


def _plan(kernel, call, dev: dict, ragged: bool, want_lse: bool,
          num_splits: int | None) -> _DecodePlan:
    """The decode design's build for the call's shape (its KV tile chosen here), the split
    of the cache (the scheduler's `kv_splits` rule, else `default_splits`), then the
    launcher's plan."""
    from mhadsl.runtime import driver
    from mhadsl.runtime.launch import TensorShape
    q, k_cache = dev["q"], dev["k_cache"]
    heads, kv_heads = q.shape[-2], k_cache.shape[-2]
    group = heads // kv_heads
    rows_per_seq = 0 if ragged else q.shape[1]
    device = q.device
    info = driver.device_info(device)
    num_sms = info.multiprocessor_count
    q_rows = call.max_seqlen_q if ragged else rows_per_seq
    rows = packed_rows(rows_per_seq, group)
    groups = call.batch * kv_heads * max(1, -(-q_rows * group // rows))
    launcher = kernel.launcher
    wgmma = select_target(info.compute_capability).arch == "sm_90a"
    fp8 = call.kv_scales is not None
    capacity = cache_capacity(call, k_cache.shape,
                              dev["page_table"].shape if call.page_size else None)
    balanced = splits_follow_lengths(kernel, num_splits, capacity)
    layout = Layout(group, False, want_lse, CacheLayout(
        rows_per_seq, call.page_size or 0,
        kv_tile(rows, groups, num_sms, call.page_size or 0, wgmma=wgmma, fp8=fp8),
        call.appends, fp8, balanced))
    loaded = launcher.load(layout, device)
    config, design = loaded.config, loaded.design
    _, ctas_per_sm = launcher.occupancy(loaded)
    if balanced:  # at most this many a sequence; the device splits each by the lengths
        splits = MAX_SPLITS
    else:
        host = launcher.host_scheduler(config, design)
        splits = (num_splits or host.kv_splits(call.batch, capacity, kv_heads, num_sms,
                                               ctas_per_sm)
                  or default_splits(groups, num_sms, capacity, config.block_n))
    sizes = CallSizes(call.batch, heads, kv_heads, rows_per_seq, capacity, q_rows, capacity,
                      q.shape[0] if ragged else call.batch * rows_per_seq, ragged, call.scale,
                      query_rows=rows_per_seq, cache_capacity=capacity,
                      page_table_stride=dev["page_table"].strides[0] if call.page_size else 0,
                      num_splits=splits, kv_scales=call.kv_scales or (1.0, 1.0),
                      kv_slots=CHUNKS_PER_SM * num_sms)
    shapes = {n: TensorShape(tuple(t.shape), tuple(t.strides), t.dtype) for n, t in dev.items()}
    values = design.call_values(config, sizes)
    lse_shape = tuple(dev["lse"].shape) if want_lse else None
    empty = not (call.batch and heads and q_rows)
    from mhadsl.runtime.tensors import ITEMSIZE, contiguous_strides
    spans = {n: span(t.shape, t.strides, ITEMSIZE[t.dtype]) if 0 not in t.shape else -1
             for n, t in shapes.items() if n in _READ_AND_WRITTEN}
    scratch = design.scratch(config, sizes)
    workspaces = launcher.scratch.setdefault((device, tuple(sorted(scratch.items()))), {})
    return _DecodePlan(launcher.plan(loaded, sizes, shapes), tuple(q.shape), lse_shape,
                       scratch, device, workspaces, values["num_splits"],
                       values["q_tiles"], values["kv_chunk"], empty, shapes, spans,
                       shapes["q"].strides == contiguous_strides(shapes["q"].shape),
                       driver.debug_mode, call.appends)


# ---------------------------------------------------------------------- torch fast path
def _run_torch(planned: _DecodePlan, q, k_cache, v_cache, cache_seqlens, page_table, cu_q,
               out, stream, workspace: int | None, operands: dict | None, tensor_ops: dict,
               k_new, v_new):
    """A call of a planned torch signature: only what its addresses decide is checked
    (alignment, and out overlapping what the kernel reads), then the plan launches."""
    torch = sys.modules["torch"]
    if out is None:
        out = torch.empty_like(q) if planned.q_contiguous else q.new_empty(planned.out_shape)
    addresses = {"q": q.data_ptr(), "k_cache": k_cache.data_ptr(),
                 "v_cache": v_cache.data_ptr(), "o": out.data_ptr(),
                 "cache_seqlens": cache_seqlens.data_ptr()}
    if page_table is not None:
        addresses["page_table"] = page_table.data_ptr()
    if cu_q is not None:
        addresses["cu_seqlens_q"] = cu_q.data_ptr()
    if k_new is not None:
        addresses.update(k_new=k_new.data_ptr(), v_new=v_new.data_ptr())
    addresses.update((n, t.data_ptr()) for n, t in tensor_ops.items())
    planned.check_addresses(addresses)
    lse = None
    if planned.lse_shape is not None:
        lse = q.new_empty(planned.lse_shape, dtype=torch.float32)
        addresses["lse"] = lse.data_ptr()
    handle = torch_stream(torch, q.get_device()) if stream is None else stream_handle(stream)
    addresses.update(planned.split_workspace(handle))
    if not planned.empty:
        launch(planned.plans, addresses, handle, workspace, operands)
    return (out, lse) if planned.lse_shape is not None else out
