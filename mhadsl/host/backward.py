"""The backward pass on the host: `Kernel.backward(q, k, v, out, lse, dout, ...)` ->
(dq, dk, dv), on the kernels of the one build path (`Kernel.backward_build`).

    dq, dk, dv = kern.backward(q, k, v, out, lse, dout)  # out, lse = kern(q, k, v, return_lse=True)

The three kernels of `codegen.backends.backward` run on the caller's torch stream: the
preprocess (delta = rowsum(dO * O), the fp32 dQ accumulator zeroed), the main kernel (the
declaration's scheduler hands out its K/V tiles; dK and dV summed over the GQA group, dQ
added atomically) and the postprocess (dQ in q's dtype; where the Hopper design splits a
wide GQA group over CTAs, a last kernel turns dK's and dV's fp32 sums into dK and dV too:
`codegen.backends.backward_sm90`). In deterministic mode the
gradients are bitwise the same every run: the Hopper design adds each query tile's dQ in a
fixed order of K/V tiles (`codegen.backends.backward_sm90`), the sm80-style design's last
kernel computes dQ itself, one CTA per query tile, with nothing added atomically. With
`operand_grads`, a last kernel adds the gradients of the f32 tensors the score reads
(`mha_bwd_operand_grads`). Every argument is checked before anything runs; a call
signature's three launch plans are made once (`runtime.launch`), the main kernel's grid by
its scheduler's `grid_dim`.
"""
from __future__ import annotations

import functools
import sys

from mhadsl.abi import GRAD_PREFIX, OPERAND_PREFIX
from mhadsl.front.attention_spec import operand_values
from mhadsl.host.calls import (
    DTYPE_NAMES, check_flag, check_operand_grads, check_rows, check_shape, operand_views,
    score_read_floats, tensor_operands, torch_stream,
)
from mhadsl.codegen.backends import Layout
from mhadsl.codegen.backends.backward import BACKEND, BackwardConfig
from mhadsl.host.forward import check_call, operand_rows
from mhadsl.host.launcher import launch


def backward_work(lengths: list[int], kv_heads: int, block_n: int = BackwardConfig.block_n,
                  ragged: bool = True):
    """The work space the main backward kernel hands its scheduler, as a simulator batch:
    per (sequence, K/V head) the K/V tiles of block_n rows of the sequence's keys
    (`codegen.backends.backward.scheduler_view`). Prompt tile t is K/V tile n - 1 - t, which
    a causal mask gives t + 1 query tiles of an equal-length sequence: the simulator's
    causal cost."""
    from mhadsl.analysis.simulate import Batch
    return Batch(list(lengths), kv_heads, block_n, ragged=ragged)


def backward(kernel, q, k, v, out, lse, dout, *, cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=None, max_seqlen_k=None, scale=None, deterministic=None,
             operand_grads=(), **operands):
    """(dq, dk, dv) of `kernel(q, k, v, ...)` for the output gradient `dout`, given the
    forward's `out` and `lse` (`Kernel.backward`), and with a sink rule the gradient of each
    sequence's and query head's sink logit, (batch, heads) float32 (`_sink_gradient`);
    `deterministic` None follows torch's
    `torch.are_deterministic_algorithms_enabled()`; the operands' values by name, as the
    forward call had them; `operand_grads`, names of f32 tensor operands: last, a dict of
    their float32 gradients (added by `mha_bwd_operand_grads` with atomics, so not bitwise
    repeatable even in deterministic mode)."""
    check_flag(deterministic, "deterministic")
    values = operand_values(kernel.options, operands)
    grad_names = check_operand_grads(kernel.options, kernel.program.checked, operand_grads)
    for name in grad_names:  # (the kernels' offsets into a gradient are 32-bit)
        if values[name].numel() >= 2**31:
            raise ValueError(f"operand_grads: operand {name!r} has {values[name].numel()} "
                             f"elements; a gradient holds fewer than 2**31")
    from mhadsl.runtime import tensors
    call = check_call(kernel, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            scale)
    if problems := _design_problems(kernel.options):
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
    given = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout,
             **tensor_operands(kernel.options, values)}
    if call.sizes.ragged:
        given.update(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    torch = sys.modules.get("torch")
    if torch is None or not all(isinstance(t, torch.Tensor) for t in given.values()):
        raise TypeError("Kernel.backward runs on torch CUDA tensors: q, k, v, out, lse, dout "
                        "(and cu_seqlens_q/k) must all be torch tensors")
    devices = {t.device for t in given.values()}
    if len(devices) > 1:
        raise ValueError(f"the backward's tensors are on different devices: "
                         f"{sorted(map(str, devices))}")
    operand_views(kernel.options, values, call.sizes.batch, call.sizes.heads, None,
                  *operand_rows(call))
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    return _run(kernel, torch, call, q, k, v, out, lse.contiguous(), dout, cu_seqlens_q,
                cu_seqlens_k, bool(deterministic), values, grad_names)


@functools.lru_cache(maxsize=256)
def _design_problems(options) -> tuple:
    """What the backward design cannot run of a declaration (the same on either target),
    worked out once per declaration, not at each call."""
    return tuple(BACKEND.problems(options, "sm_80"))


def _run(kernel, torch, call, q, k, v, out, lse, dout, cu_q, cu_k, deterministic, operands,
         grad_names):
    # (ragged: the preprocess zeroes the rows outside every sequence)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    sink = kernel.options.sink is not None
    # the gradients asked for, zeros until the kernels add into those the score reads (the
    # others' addresses stay null, and the kernels add nothing there)
    read = set(score_read_floats(kernel.options, kernel.program.checked)) & set(grad_names) \
        if grad_names else set()
    grads = {name: torch.zeros(tuple(operands[name].shape), dtype=torch.float32,
                               device=q.device) for name in grad_names}

    def result(*gradients):
        return gradients + ({n: grads[n] for n in grad_names},) if grad_names else gradients

    if not (call.sizes.batch and call.sizes.heads):  # no CTA to launch (empty ones launch)
        found = dq.zero_(), dk.zero_(), dv.zero_()
        return result(*found, torch.zeros(call.sizes.batch, call.sizes.heads,
                                          device=q.device)) if sink else result(*found)
    tensors = {"q": q, "k": k, "v": v, "o": out, "dout": dout, "dq": dq, "dk": dk, "dv": dv,
               **tensor_operands(kernel.options, operands)}
    tensors.update((GRAD_PREFIX + n, grads[n]) for n in read)
    plans, scratch = _plans(kernel, call, tensors, q.device.index, deterministic, bool(read))
    addresses = {name: t.data_ptr() for name, t in tensors.items()}
    addresses["lse"] = lse.data_ptr()
    # held until the launches are queued: a freed buffer's memory would go to the next one
    buffers = {name: torch.empty(nbytes, dtype=torch.uint8, device=q.device)
               for name, nbytes in scratch.items()}
    addresses.update((name, t.data_ptr()) for name, t in buffers.items())
    if sink and call.sizes.ragged:  # (rows outside every sequence get no term)
        buffers["sink_terms"].zero_()
    if call.sizes.ragged:
        addresses.update(cu_seqlens_q=cu_q.data_ptr(), cu_seqlens_k=cu_k.data_ptr())
    for name, t in addresses.items():
        if t % 16 and name not in ("lse", "delta", "cu_seqlens_q", "cu_seqlens_k") \
                and not name.startswith((OPERAND_PREFIX, GRAD_PREFIX)):
            raise ValueError(f"tensor {name!r}: rows must be 16-byte aligned, got a pointer "
                             f"at {t:#x}")
    launch(plans, addresses, torch_stream(torch, q.device.index), scalars=operands)
    if not sink:
        return result(dq, dk, dv)
    return result(dq, dk, dv, _sink_gradient(torch, call, buffers["sink_terms"], cu_q))


def _sink_gradient(torch, call, terms, cu_q):
    """The gradient of each sequence's and query head's sink logit, (batch, heads) float32:
    minus the sum over the sequence's rows of the preprocess's terms exp(sink - LSE) *
    delta (the LSE's layout). Summed by torch in a fixed order: the same every run."""
    sizes = call.sizes
    terms = terms.view(torch.float32)
    if not sizes.ragged:
        return terms.view(sizes.batch, sizes.heads, sizes.seqlen_q).sum(-1).neg_()
    rows = terms.view(sizes.heads, -1).double().cumsum(1)
    ends = torch.nn.functional.pad(rows, (1, 0))  # ends[:, i]: the sum of rows before i
    cu = cu_q.long()
    return (ends[:, cu[:-1]] - ends[:, cu[1:]]).t().float().contiguous()


def _plans(kernel, call, tensors: dict, device: int, deterministic: bool,
           operand_grads: bool = False) -> tuple[list, dict[str, int]]:
    """The launch plans of a validated call's signature, in launch order, and the bytes of
    each scratch buffer (delta and the dQ accumulator, in the design's layouts, and a split
    GQA group's dK and dV accumulators): made once, then reused."""
    from mhadsl.runtime.launch import TensorShape
    from mhadsl.runtime.tensors import contiguous_strides
    shapes = {n: TensorShape(tuple(t.shape), tuple(t.stride()),
                             str(t.dtype).removeprefix("torch."))
              for n, t in tensors.items()}
    # the accumulator's strides, as fp32 in q's shape (the sm90 design keeps it in blocks
    # of its own and reads none of them)
    q_shape = tuple(tensors["q"].shape)
    shapes["dq_accum"] = TensorShape(q_shape, contiguous_strides(q_shape), "float32")
    key = ("backward", device, tuple(shapes.items()), call.sizes, deterministic,
           operand_grads, kernel.backend, kernel.trace)
    launcher = kernel.launcher
    if key not in launcher.plans:
        sizes = call.sizes
        loaded = launcher.load(Layout(sizes.heads // sizes.kv_heads, sizes.ragged,
                                      backward=True, deterministic=deterministic,
                                      operand_grads=operand_grads), device)
        launcher.plans[key] = (launcher.plan(loaded, call.sizes, shapes),
                               loaded.design.scratch(loaded.config, call.sizes))
    return launcher.plans[key]
