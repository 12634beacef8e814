"""The backward pass on the host: `Kernel.backward(q, k, v, out, lse, dout, ...)` ->
(dq, dk, dv), on the kernels of the one build path (`Kernel.backward_build`).

    dq, dk, dv = kern.backward(q, k, v, out, lse, dout)  # out, lse = kern(q, k, v, return_lse=True)

The three kernels of `codegen.backends.backward` run on the caller's torch stream: the
preprocess (delta = rowsum(dO * O), the fp32 dQ accumulator zeroed), the main kernel (the
declaration's scheduler hands out its K/V tiles; dK and dV summed over the GQA group, dQ
added atomically) and the postprocess (dQ in q's dtype). In deterministic mode the last
kernel computes dQ itself, one CTA per query tile, and nothing is added atomically: the
gradients are bitwise the same every run. Every argument is checked before anything runs;
a call signature's three launch plans are made once (`runtime.launch`), the main kernel's
grid by its scheduler's `grid_dim`.
"""
from __future__ import annotations

import sys
import weakref

from mhadsl.calls import DTYPE_NAMES, check_flag, check_rows, check_shape, torch_stream
from mhadsl.codegen.backends import select_target
from mhadsl.codegen.backends import backward as _sm80_design
from mhadsl.codegen.backends.backward import BACKEND, MAIN, BackwardConfig


def _design(config):
    """The module of the design a build's config belongs to: its kernels' names, launch
    shapes, grids and parameters (`kernel_abi`)."""
    from mhadsl.codegen.backends import backward_sm90
    return backward_sm90 if isinstance(config, backward_sm90.HopperBackwardConfig) \
        else _sm80_design


def backward_work(lengths: list[int], kv_heads: int, block_n: int = BackwardConfig.block_n,
                  ragged: bool = True):
    """The work space the main backward kernel hands its scheduler, as a simulator batch:
    per (sequence, K/V head) the K/V tiles of block_n rows of the sequence's keys
    (`codegen.backends.backward.scheduler_view`). Prompt tile t is K/V tile n - 1 - t, which
    a causal mask gives t + 1 query tiles of an equal-length sequence: the simulator's
    causal cost."""
    from mhadsl.simulate import Batch
    return Batch(list(lengths), kv_heads, block_n, ragged=ragged)


class _State:
    """Per kernel: the loaded builds (by device and layout) and the launch plans (by call
    signature)."""

    def __init__(self):
        self.modules: dict[tuple, tuple] = {}
        self.plans: dict[tuple, dict] = {}  # kernel name -> runtime.launch.LaunchPlan


_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _state(kernel) -> _State:
    if kernel not in _states:
        _states[kernel] = _State()
    return _states[kernel]


def backward(kernel, q, k, v, out, lse, dout, *, cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=None, max_seqlen_k=None, scale=None, deterministic=None):
    """(dq, dk, dv) of `kernel(q, k, v, ...)` for the output gradient `dout`, given the
    forward's `out` and `lse` (`Kernel.backward`); `deterministic` None follows torch's
    `torch.are_deterministic_algorithms_enabled()`."""
    check_flag(deterministic, "deterministic")
    from mhadsl.runtime import tensors
    call = kernel._validate(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            scale)
    if problems := BACKEND.problems(kernel.options, "sm_80"):  # (the same on either target)
        raise kernel.options.backend_error(problems)
    dtype = DTYPE_NAMES[kernel.options.dtype]
    for name, t in (("out", out), ("dout", dout)):
        view = tensors.as_device_tensor(t, name)
        check_shape(view, name, call.q.shape)
        if not view.on_host:  # (host arrays are refused below: the backward runs on torch's)
            if view.dtype != dtype:
                raise TypeError(f"{name} has dtype {view.dtype}, expected {dtype} (like q)")
            check_rows(view, name)
    lse_view = tensors.as_device_tensor(lse, "lse")
    if tuple(lse_view.shape) != call.lse_shape:
        raise ValueError(f"lse has shape {lse_view.shape}, expected {call.lse_shape} (the "
                         "forward's: (batch, heads, seqlen_q) dense, (heads, total_q) ragged)")
    if lse_view.dtype != "float32":
        raise TypeError(f"lse has dtype {lse_view.dtype}, expected float32")
    given = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout}
    if call.ragged:
        given.update(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    torch = sys.modules.get("torch")
    if torch is None or not all(isinstance(t, torch.Tensor) for t in given.values()):
        raise TypeError("Kernel.backward runs on torch CUDA tensors: q, k, v, out, lse, dout "
                        "(and cu_seqlens_q/k) must all be torch tensors")
    devices = {t.device for t in given.values()}
    if len(devices) > 1:
        raise ValueError(f"the backward's tensors are on different devices: "
                         f"{sorted(map(str, devices))}")
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    return _run(kernel, torch, call, q, k, v, out, lse.contiguous(), dout, cu_seqlens_q,
                cu_seqlens_k, call.scale, bool(deterministic))


def _run(kernel, torch, call, q, k, v, out, lse, dout, cu_q, cu_k, scale, deterministic):
    # (ragged: rows outside every sequence get no gradient from the kernels, so zeros)
    alloc = torch.zeros if call.ragged else torch.empty
    dq = alloc(q.shape, dtype=q.dtype, device=q.device)
    dk = alloc(k.shape, dtype=k.dtype, device=k.device)
    dv = alloc(v.shape, dtype=v.dtype, device=v.device)
    if not (call.batch and call.heads):  # no CTA to launch (empty sequences launch)
        return dq.zero_(), dk.zero_(), dv.zero_()
    tensors = {"q": q, "k": k, "v": v, "o": out, "dout": dout, "dq": dq, "dk": dk, "dv": dv}
    plans, block_n, scratch = _plans(kernel, call, tensors, scale, q.device.index,
                                     deterministic)
    addresses = {name: t.data_ptr() for name, t in tensors.items()}
    addresses["lse"] = lse.data_ptr()
    # held until the launches are queued: a freed buffer's memory would go to the next one
    buffers = {name: torch.empty(floats, dtype=torch.float32, device=q.device)
               for name, floats in scratch.items()}
    addresses.update((name, t.data_ptr()) for name, t in buffers.items())
    if call.ragged:
        addresses.update(cu_seqlens_q=cu_q.data_ptr(), cu_seqlens_k=cu_k.data_ptr())
    for name, t in addresses.items():
        if t % 16 and name not in ("lse", "delta", "cu_seqlens_q", "cu_seqlens_k"):
            raise ValueError(f"tensor {name!r}: rows must be 16-byte aligned, got a pointer "
                             f"at {t:#x}")
    stream = torch_stream(torch, q.device.index)
    if call.ragged:  # the main kernel's scheduler numbers the K/V tiles of the sequences
        from mhadsl.build import tile_index_kernel
        from mhadsl.runtime import tile_index
        addresses["tile_index"] = tile_index.prepare(tile_index_kernel(),
                                                     addresses["cu_seqlens_k"], call.batch,
                                                     block_n, stream, q.device.index)
    for plan in plans:
        plan.launch(addresses, stream)
    return dq, dk, dv


def _plans(kernel, call, tensors: dict, scale: float, device: int,
           deterministic: bool) -> tuple[list, int, dict[str, int]]:
    """The launch plans of a validated call's signature, in launch order (a main kernel
    without work is not launched), the main kernel's K/V tile and the floats of each
    scratch buffer, delta and the dQ accumulator (their layouts are the design's): made
    once, then reused."""
    from mhadsl.runtime import driver
    from mhadsl.runtime.launch import LaunchPlan, TensorShape
    from mhadsl.runtime.tensors import contiguous_strides
    shapes = {n: TensorShape(tuple(t.shape), tuple(t.stride()),
                             str(t.dtype).removeprefix("torch."))
              for n, t in tensors.items()}
    # the accumulator's strides, as fp32 in q's shape (the sm90 design keeps it in blocks
    # of its own and reads none of them)
    q_shape = tuple(tensors["q"].shape)
    shapes["dq_accum"] = TensorShape(q_shape, contiguous_strides(q_shape), "float32")
    key = (device, tuple(shapes.items()), call.batch, call.heads, call.kv_heads, call.seqlen_q,
           call.seqlen_k, call.max_seqlen_q, call.max_seqlen_k, call.total_q, call.ragged, scale,
           deterministic)
    state = _state(kernel)
    if key in state.plans:
        return state.plans[key]
    functions, config = _functions(kernel, device, call.heads // call.kv_heads, call.ragged,
                                   deterministic)
    design = _design(config)
    shape = design.launch_shapes(config)
    num_sms = driver.device_info(device).multiprocessor_count
    ctas_per_sm = functions[MAIN].max_active_blocks(shape[MAIN].threads,
                                                    shape[MAIN].shared_bytes)
    kv_tiles = -(-call.max_seqlen_k // config.block_n)
    grid = design.fixed_grids(config, call.batch, call.heads, call.max_seqlen_q)
    grid[MAIN] = kernel._host_scheduler(config, design.BACKEND).grid(
        call.batch, kv_tiles, call.max_seqlen_k, call.kv_heads, num_sms, ctas_per_sm)
    values = {"lse_stride_batch": 0 if call.ragged else call.heads * call.seqlen_q,
              "lse_stride_head": call.total_q if call.ragged else call.seqlen_q,
              "batch": call.batch, "num_heads": call.heads, "seqlen_q": call.seqlen_q,
              "seqlen_k": call.seqlen_k, "softmax_scale": scale, "kv_heads": call.kv_heads,
              "max_seqlen_k": call.max_seqlen_k, "num_sms": num_sms,
              "ctas_per_sm": ctas_per_sm}
    # (ragged: tensor maps over all rows; the tile index, over the K/V tiles, is built per
    # call in `_run`)
    driver.ensure_context(device)
    plans = [LaunchPlan(functions[name], grid[name], shape[name].threads,
                        shape[name].shared_bytes, design.kernel_abi(name), config, device,
                        shapes, values, call.ragged)
             for name in design.kernel_names(config) if 0 not in grid[name]]
    scratch = design.scratch_elements(config, call.total_q if call.ragged else
                                      call.batch * call.seqlen_q, call.heads, call.batch,
                                      call.seqlen_q)
    state.plans[key] = plans, config.block_n, scratch
    return state.plans[key]


def _functions(kernel, device: int, gqa_group: int, ragged: bool,
               deterministic: bool) -> tuple[dict, object]:
    """The loaded kernels for `device` and the layout, and their build's config."""
    from mhadsl.runtime import driver
    state = _state(kernel)
    key = (device, gqa_group, ragged, deterministic)
    if key not in state.modules:
        target = select_target(driver.device_info(device).compute_capability)
        build = kernel.backward_build(target.arch, gqa_group=gqa_group, ragged=ragged,
                                      deterministic=deterministic)
        module = (driver.Module.from_cubin(build.assembled.cubin, device)
                  if target.load == "cubin" and build.assembled else
                  driver.Module.from_ptx(build.ptx.encode(), device))
        state.modules[key] = ({name: module.function(name)
                               for name in _design(build.config).kernel_names(build.config)},
                              build.config, module)
    functions, config, _module = state.modules[key]
    return functions, config
