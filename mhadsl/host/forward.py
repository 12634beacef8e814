"""Forward calls: attention of q against k and v, dense or ragged.

    o = kern(q, k, v)                                    # q (B,Sq,Hq,D), k/v (B,Sk,Hkv,D)
    o, lse = kern(q, k, v, return_lse=True)
    o = kern(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk)
    o = kern(q, k, v, window=512)                        # the declaration's operands by name

Every argument is checked before anything is copied or launched (`check_call`: those
`mhadsl.reference` runs too, then those of device memory). What a call signature fixes is
planned once through the kernel's launcher (`mhadsl.host.launcher`); a later torch call of a
planned signature checks only its addresses, patches them and launches.
"""
from __future__ import annotations

import operator
import sys
from dataclasses import dataclass

import numpy as np

from mhadsl.abi import OPERAND_PREFIX, CallSizes
from mhadsl.host.calls import (
    DTYPE_NAMES, AddressChecks, DeviceCopies, check_attention_call, check_flag, check_output,
    check_rows, operand_views, tensor_operands,
    host_values, index_view, share_memory, span, stream_handle, torch_signature,
    torch_stream, typed_key,
)
from mhadsl.codegen.backends import Layout
from mhadsl.host.launcher import ClassesPlan, launch


def forward(kernel, q, k, v, cu_q, cu_k, max_q, max_k, scale, out, return_lse, stream,
            operands: dict | None, classes: BlockClasses | None = None):
    """`kernel`'s attention of q against k and v (`Kernel.__call__`; positional, as each
    keyword costs the per-call host path); `operands`: the operands' values, checked
    (`operand_values`; None where the declaration has none); `classes`: tile classes the
    caller made (`block_classes`)."""
    tensor_ops = tensor_operands(kernel.options, operands)
    key = torch_signature(q, k, v, out, cu_q, cu_k, *tensor_ops.values())
    if key is not None:  # torch tensors: a signature seen before runs its plan
        key = typed_key(key, (max_q, max_k, scale, return_lse))
        if kernel.launcher.band_operands:  # (its values may select another build)
            key = (key, kernel.launcher.short_band(operands))
        planned = kernel.launcher.fast_plans.get(key)
        if planned is not None:
            return _run_torch(kernel, planned, q, k, v, out, cu_q, cu_k, stream, operands,
                              tensor_ops, classes)
    return _call(kernel, q, k, v, cu_q, cu_k, max_q, max_k, scale, out, return_lse, stream,
                 key, operands, classes)


@dataclass(frozen=True)
class BlockClasses:
    """The tile classes of a call of a declaration whose mask reads data
    (`Kernel.block_classes`), made once on the device and passed to many calls
    (`kern(q, k, v, ..., block_classes=c)`: every layer of a model reads the same document
    ids), which then run no classes kernel of their own. They are keyed by the kernel, the
    device, the call's sizes and tiles, and the addresses of its row offsets and tensor
    operands and the values of its scalar operands: a call that differs in any of them is
    refused (ValueError). What they cannot see is new contents at the same addresses: make
    them again after writing new documents into the same tensors (a CUDA graph that
    captures the calls without them classifies at each replay instead)."""

    kernel: str
    program: str  # the text of the kernel's program (with the name: its declaration)
    device: int
    sizes: tuple[int, ...]  # `ClassesPlan.sizes`
    lengths: tuple[int, ...]  # `ClassesPlan.lengths`
    inputs: tuple  # what the classes were made from (`_class_inputs`)
    buffer: object  # runtime.driver.DeviceBuffer

    @property
    def ptr(self) -> int:
        return self.buffer.ptr

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(sequences, heads the classes differ by, query tiles, KV tiles)."""
        batch, rows, cols, heads = self.sizes[:4]
        return batch, heads, rows, cols

    def numpy(self) -> np.ndarray:
        """The classes as uint8 (`shape`), bits as `mhadsl.abi` lays them out (what
        `mhadsl.reference_block_classes` gives for cells of the kernel's tiles)."""
        from mhadsl.runtime import driver
        out = np.empty(self.shape, np.uint8)
        driver.synchronize(self.device)  # (the kernel that made them ran on the call's stream)
        driver.memcpy_dtoh(out, self.ptr, device=self.device)
        return out


def _described(sizes: tuple[int, ...], lengths: tuple[int, ...]) -> str:
    """A call's `ClassesPlan.sizes` and `.lengths` in words."""
    batch, rows, cols, heads, cell_rows, cell_keys = sizes
    seqlen_q, seqlen_k, max_q, max_k = lengths
    rows_of = f"{max_q} query rows and {max_k} keys at most" if not seqlen_q and not \
        seqlen_k else f"{seqlen_q} query rows and {seqlen_k} keys"
    return (f"{batch} sequences of {rows_of}, {heads} head(s) of {rows} x {cols} tiles of "
            f"{cell_rows} query rows by {cell_keys} keys")


def _class_inputs(kernel, addresses: dict, shapes: dict, operands: dict | None) -> tuple:
    """What a call's tile classes depend on beyond its sizes: the addresses of its row
    offsets, the addresses, shapes and strides of its tensor operands (`shapes`: name ->
    (shape, strides)), and its scalar operands' values."""
    scalars = tuple((o.name, operands[o.name]) for o in kernel.options.operands if not o.axes)
    tensors = tuple((addresses.get(OPERAND_PREFIX + o.name) or 0,
                     shapes.get(OPERAND_PREFIX + o.name)) for o in kernel.options.operands
                    if o.axes)
    return (addresses.get("cu_seqlens_q") or 0, addresses.get("cu_seqlens_k") or 0) + \
        tensors + scalars


def _operand_shapes(views: dict) -> dict:
    """(shape, strides) of each tensor operand among a call's device views."""
    return {n: (tuple(t.shape), tuple(t.strides)) for n, t in views.items()
            if n.startswith(OPERAND_PREFIX) and t is not None}


def _given_classes(kernel, plans: list, classes, addresses: dict, shapes: dict,
                   operands) -> dict:
    """`addresses` with the caller's tile classes, checked against the call (`shapes`: its
    tensor operands', `_operand_shapes`)."""
    if not isinstance(classes, BlockClasses):
        raise TypeError(f"block_classes must be what Kernel.block_classes() returns, got "
                        f"{type(classes).__name__}")
    plan = next((p for p in plans if isinstance(p, ClassesPlan)), None)
    if plan is None:
        raise TypeError(f"kernel '{kernel.name}' classifies its tiles at compile time: "
                        f"block_classes= is for masks that read tensor operands per pair")
    if (classes.kernel, classes.program) != (kernel.name, kernel.program.text):
        raise ValueError(f"block_classes were made for another kernel (declaration "
                         f"'{classes.kernel}' of another program, or another declaration)")
    if (classes.device, classes.sizes, classes.lengths) != (plan.device, plan.sizes,
                                                            plan.lengths):
        raise ValueError(f"block_classes were made for a call on device {classes.device} "
                         f"with {_described(classes.sizes, classes.lengths)}; this call is "
                         f"on device {plan.device} with "
                         f"{_described(plan.sizes, plan.lengths)}")
    if classes.inputs != _class_inputs(kernel, addresses, shapes, operands):
        raise ValueError("block_classes were made from other row offsets or operands than "
                         "this call passes (other tensors, or other scalar values): make "
                         "them from this call's")
    return {**addresses, "block_classes": classes.ptr}


def block_classes(kernel, q, k, v, cu_q, cu_k, max_q, max_k, return_lse, stream,
                  operands: dict | None) -> BlockClasses:
    """The tile classes of the call `kernel(q, k, v, ...)` with these arguments
    (`Kernel.block_classes`), made on the device on `stream` (the call's default)."""
    from mhadsl.runtime import driver
    from mhadsl.runtime.launch import TensorShape
    if not kernel.options.mask_reads_data:
        raise TypeError(f"kernel '{kernel.name}' classifies its tiles at compile time: its "
                        f"mask reads no tensor operand per pair")
    check_flag(return_lse, "return_lse")
    want_lse = kernel.options.return_lse if return_lse is None else bool(return_lse)
    call = check_call(kernel, q, k, v, cu_q, cu_k, max_q, max_k)
    op_views = operand_views(kernel.options, operands, call.sizes.batch, call.sizes.heads,
                             call.q.device, *operand_rows(call))
    views = {"q": call.q, "k": call.k, "v": call.v, "cu_seqlens_q": call.cu_q,
             "cu_seqlens_k": call.cu_k, **op_views}
    host = [n for n, t in views.items() if t is not None and t.on_host]
    if host:
        raise ValueError(f"Kernel.block_classes() takes device tensors (the classes are "
                         f"keyed by their addresses); {', '.join(host)} on the host")
    sizes, device = call.sizes, call.q.device
    launcher = kernel.launcher
    loaded = launcher.load_call(call_layout(kernel, sizes, want_lse, operands), sizes, device)
    shapes = {n: TensorShape(tuple(t.shape), tuple(t.strides), t.dtype)
              for n, t in views.items() if t is not None}
    plan = launcher.classes_plan(loaded, sizes, shapes, launcher.values(loaded, sizes))
    addresses = {n: t.ptr for n, t in views.items() if t is not None}
    buffer = driver.DeviceBuffer(plan.nbytes, device)
    handle = driver.stream_handle(stream, kind=call.q.kind, device=device)
    plan.run(addresses, buffer.ptr, handle, operands)
    return BlockClasses(kernel.name, kernel.program.text, device, plan.sizes, plan.lengths,
                        _class_inputs(kernel, addresses, _operand_shapes(views), operands),
                        buffer)


@dataclass
class Call:
    """A validated call: device views of the tensors and the run-time sizes."""

    q: object
    k: object
    v: object
    cu_q: object | None
    cu_k: object | None
    sizes: CallSizes

    @property
    def lse_shape(self) -> tuple[int, ...]:
        """The LSE's: (batch, heads, seqlen_q) dense, (heads, total_q) ragged."""
        n = self.sizes
        return (n.heads, n.total_q) if n.ragged else (n.batch, n.heads, n.seqlen_q)


def _call(kernel, q, k, v, cu_q, cu_k, max_q, max_k, scale, out, return_lse, stream,
          torch_key, operands, classes):
    """Any call: every check, then the device (without a GPU, NoGpuError before any host
    array is copied or allocated), then the plan of its signature (made once)."""
    from mhadsl.runtime import driver, tensors
    check_flag(return_lse, "return_lse")
    want_lse = kernel.options.return_lse if return_lse is None else bool(return_lse)
    call = check_call(kernel, q, k, v, cu_q, cu_k, max_q, max_k, scale)
    dtype = DTYPE_NAMES[kernel.options.dtype]
    device = next((t.device for t in (call.q, call.k, call.v) if not t.on_host), None)
    op_views = operand_views(kernel.options, operands, call.sizes.batch, call.sizes.heads,
                             device, *operand_rows(call))
    od = None if out is None else _check_out(kernel, out, call, dtype, device)
    handle = driver.stream_handle(stream, kind=call.q.kind,
                                  device=device if call.q.on_host else call.q.device)
    on_device = DeviceCopies(driver.ensure_context(device))
    if od is None:
        od = tensors.as_device_tensor(
            tensors.empty_like_kind(call.q.obj, call.q.shape, dtype), "out")
    out_obj = od.obj
    qd, kd, vd = (on_device(t, n, dtype) for t, n in ((call.q, "q"), (call.k, "k"),
                                                      (call.v, "v")))
    cu_qd = on_device(call.cu_q, "cu_seqlens_q", "int32") if call.sizes.ragged else None
    cu_kd = on_device(call.cu_k, "cu_seqlens_k", "int32") if call.sizes.ragged else None
    out_dev = on_device(od, "out", dtype)
    lse_obj = tensors.empty_like_kind(call.q.obj, call.lse_shape, "float32") \
        if want_lse else None
    lse_dev = on_device(tensors.as_device_tensor(lse_obj, "lse"), "lse", "float32") \
        if want_lse else None

    views = {"q": qd, "k": kd, "v": vd, "o": out_dev, "lse": lse_dev,
             "cu_seqlens_q": cu_qd, "cu_seqlens_k": cu_kd,
             **{n: on_device(t, n, t.dtype) for n, t in op_views.items()}}
    if _launches(call):
        # a torch call's signature fixes all its checks but those of its addresses, unless
        # they read lengths on the device
        reusable = torch_key is not None and not kernel.trace and not (
            call.sizes.ragged and (max_q is None or driver.debug_mode()))
        _launch(kernel, call, views, want_lse, handle, torch_key if reusable else None,
                operands, classes)
    if od.on_host:
        tensors.from_device(out_dev, out_obj, stream=handle)
    if want_lse and lse_dev.kind == "numpy" and isinstance(lse_obj, np.ndarray) \
            and lse_dev.ptr:
        tensors.from_device(lse_dev, lse_obj, stream=handle)
    return (out_obj, lse_obj) if want_lse else out_obj

def _run_torch(kernel, planned: _Planned, q, k, v, out, cu_q, cu_k, stream, operands,
               tensor_ops: dict, classes):
    """A call whose signature has a plan: only what depends on its addresses is checked
    (alignment, and whether out overlaps q, k or v), then the plan launches."""
    torch = sys.modules["torch"]
    if out is None:
        # (empty_like keeps q's strides: where q is contiguous, so is the output planned)
        out = torch.empty_like(q) if planned.q_contiguous else q.new_empty(planned.out_shape)
    addresses = {"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(),
                 "o": out.data_ptr()}
    planned.check_addresses(addresses)
    lse = None
    if planned.want_lse:
        lse = q.new_empty(planned.lse_shape, dtype=torch.float32)
        addresses["lse"] = lse.data_ptr()
    if cu_q is not None:
        addresses["cu_seqlens_q"], addresses["cu_seqlens_k"] = cu_q.data_ptr(), \
            cu_k.data_ptr()
    addresses.update((n, t.data_ptr()) for n, t in tensor_ops.items())
    if classes is not None:
        shapes = {n: (tuple(t.shape), tuple(t.stride())) for n, t in tensor_ops.items()}
        addresses = _given_classes(kernel, planned.plans, classes, addresses, shapes,
                                   operands)
    handle = torch_stream(torch, q.get_device()) if stream is None else \
        stream_handle(stream)
    launch(planned.plans, addresses, handle, kernel.recording_workspace, operands)
    return (out, lse) if planned.want_lse else out


def _launch(kernel, call: Call, views: dict, want_lse: bool, stream: int,
            torch_key: tuple | None, operands: dict | None, classes) -> None:
    """Launch a validated call on device views of its tensors, by its signature's plan
    (remembered for `torch_key`'s calls)."""
    planned = _planned(kernel, call, views, want_lse, operands)
    if torch_key is not None:
        kernel.launcher.fast_plans[torch_key] = planned
    addresses = {n: t.ptr for n, t in views.items() if t}
    if classes is not None:
        addresses = _given_classes(kernel, planned.plans, classes, addresses,
                                   _operand_shapes(views), operands)
    launch(planned.plans, addresses, stream, kernel.recording_workspace, operands)

def call_layout(kernel, sizes: CallSizes, want_lse: bool, operands: dict | None) -> Layout:
    """The layout a forward call selects: its GQA group, raggedness and log-sum-exp, and
    whether its i32 operands make the mask a short band (`Launcher.short_band`)."""
    return Layout(sizes.heads // sizes.kv_heads, sizes.ragged, want_lse,
                  short_band=kernel.launcher.short_band(operands))


def _planned(kernel, call: Call, views: dict, want_lse: bool, operands: dict | None
             ) -> _Planned:
    """The plan of a validated call's signature: made on its first call, then reused."""
    from mhadsl.runtime.launch import TensorShape
    shapes = {n: TensorShape(tuple(t.shape), tuple(t.strides), t.dtype) if t else None
              for n, t in views.items()}
    device = views["q"].device
    layout = call_layout(kernel, call.sizes, want_lse, operands)
    key = ("prefill", device, tuple(shapes.items()), call.sizes, layout, kernel.backend,
           kernel.trace)
    launcher = kernel.launcher
    planned = launcher.plans.get(key)
    if planned is None:
        loaded = launcher.load_call(layout, call.sizes, device)
        planned = launcher.plans[key] = _Planned(launcher.plan(loaded, call.sizes, shapes), call,
                                                 want_lse, shapes, device)
    return planned

def operand_rows(call: Call) -> tuple[tuple[int, int], tuple[bool, bool]]:
    """The query rows and keys a tensor operand's `queries` and `keys` axes hold in `call`
    (per sequence dense, in all ragged), and whether they are ragged
    (`calls.check_tensor_operand`)."""
    n = call.sizes
    if n.ragged:
        return (n.total_q, call.k.shape[0]), (True, True)
    return (n.seqlen_q, n.seqlen_k), (False, False)


def check_call(kernel, q, k, v, cu_q, cu_k, max_q, max_k, scale=None) -> Call:
    """Every check of a call's arguments, before anything is copied or launched: those
    `mhadsl.reference` runs too (`check_attention_call`), then those of device memory."""
    from mhadsl.runtime import driver, tensors
    o = kernel.options
    dtype = DTYPE_NAMES[o.dtype]
    views = {}
    for name, t in (("q", q), ("k", k), ("v", v)):
        view = tensors.as_device_tensor(t, name)
        if view.on_host:
            if view.dtype == "int32":
                raise TypeError(f"tensor {name!r} has dtype int32; attention needs "
                                f"{dtype} (or float NumPy arrays, which are converted)")
        elif view.dtype != dtype:
            raise TypeError(f"tensor {name!r} has dtype {view.dtype}, but kernel "
                            f"'{kernel.name}' is declared {o.dtype} ({dtype})")
        views[name] = view
    devices = {t.device for t in views.values() if not t.on_host}
    if len(devices) > 1:
        raise ValueError(f"q, k and v are on different devices: {sorted(devices)}")
    offsets = {name: None if t is None else index_view(t, name)
               for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k))}

    def read(view, name: str, max_seqlen):
        """Device values are read (a host sync) only where max_seqlen is not given, or
        under MHADSL_DEBUG=1: a launch given it never synchronises."""
        if not view.on_host and view.strides != (1,):
            raise ValueError(f"{name} must be contiguous")
        if view.on_host or max_seqlen is None or driver.debug_mode():
            return host_values(view)
        return None

    c = check_attention_call(o, views["q"], views["k"], views["v"],
                             cu_seqlens_q=offsets["cu_seqlens_q"],
                             cu_seqlens_k=offsets["cu_seqlens_k"], max_seqlen_q=max_q,
                             max_seqlen_k=max_k, scale=scale, read=read)
    for name, view in views.items():
        if not view.on_host:
            check_rows(view, name)
    for name, view in offsets.items():
        if view is not None and not view.on_host and devices and view.device not in devices:
            raise ValueError(f"{name} is on device {view.device}, q/k/v on "
                             f"{devices.pop()}")
    return Call(views["q"], views["k"], views["v"], offsets["cu_seqlens_q"],
                offsets["cu_seqlens_k"], CallSizes(
                    c.batch, c.heads, c.kv_heads, c.seqlen_q, c.seqlen_k, c.max_seqlen_q,
                    c.max_seqlen_k, c.total_q, c.ragged, c.scale, total_k=c.total_k))

def _check_out(kernel, out, call: Call, dtype: str, device: int | None):
    return check_output(out, call.q.shape, dtype, device,
                        {"q": call.q, "k": call.k, "v": call.v})


class _Planned(AddressChecks):
    """A call signature's launch plan (`runtime.launch`) and the validated call it was made
    from; what its calls still check depends on their addresses alone."""

    checked_addresses = operator.itemgetter("q", "k", "v", "o")

    def __init__(self, plans: list, call: Call, want_lse: bool, shapes: dict, device: int):
        # sizes only: a plan must not keep a call's tensors alive (a CUDA-graph pool's, say)
        self.plans, self.want_lse, self.shapes, self.device = plans, want_lse, shapes, device
        self.out_shape, self.lse_shape = tuple(call.q.shape), call.lse_shape
        from mhadsl.runtime.tensors import ITEMSIZE, contiguous_strides
        self.q_contiguous = shapes["q"].strides == contiguous_strides(shapes["q"].shape)
        self.spans = {n: span(shapes[n].shape, shapes[n].strides, ITEMSIZE[shapes[n].dtype])
                      for n in "qkvo"}  # first to last byte, inclusive
        self.empty = {n: 0 in shapes[n].shape for n in "qkvo"}

    def check_new_addresses(self, addresses: dict) -> None:
        """The checks of `check_call` and `_check_out` that depend on the addresses."""
        for name in "qkvo":
            ptr = addresses[name]
            if ptr == 0 and not self.empty[name]:
                raise ValueError(f"tensor {name!r} has a null data pointer")
            if ptr % 16:
                raise ValueError(f"tensor {name!r}: rows must be 16-byte aligned (pointer and "
                                 f"strides multiples of 8 elements), got a pointer at "
                                 f"{ptr:#x}")
        o_lo = addresses["o"]
        o_hi = o_lo + self.spans["o"]
        for name in "qkv":
            lo = addresses[name]
            if lo <= o_hi and o_lo <= lo + self.spans[name] and not self.empty["o"] \
                    and share_memory(self._view("o", o_lo), self._view(name, lo)):
                raise ValueError(f"out overlaps {name}: the kernel reads {name} while it "
                                 "writes out; pass a separate output")

    def _view(self, name: str, ptr: int):
        from mhadsl.runtime.tensors import DeviceTensor
        t = self.shapes[name]
        return DeviceTensor(ptr, t.shape, t.strides, t.dtype, self.device, "torch", None)


def _launches(call: Call) -> bool:
    """Whether a call has any work (an empty batch, query or head count launches nothing)."""
    return bool(call.sizes.batch and call.sizes.max_seqlen_q and call.sizes.heads)
