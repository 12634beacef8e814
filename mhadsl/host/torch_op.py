"""An attention kernel as a PyTorch operator (`Kernel.torch_op()`).

    attn = mhadsl.compile("examples/causal.mha")["causal_fwd"].torch_op()
    out, lse = attn(q, k, v)                                   # lse float32 (B, Hq, Sq)
    out, lse = attn(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq,
                    max_seqlen_k=mk)                           # lse (Hq, total_q)

Each kernel is one operator of the `mhadsl` library (`mhadsl::<kernel>_<hash>`) with a fake
implementation that gives the outputs' shapes without running anything, so
`torch.compile(fullgraph=True)` traces through it without a graph break; under
`mode="reduce-overhead"` its launch is captured into CUDA graphs (the queue counter is reset by
the kernel itself, so replays need no host work), and a dynamic sequence length reuses the
kernel's build (builds depend on the layout, not the lengths).

The operator is differentiable (`torch.library.register_autograd`): `out.backward()` runs the
kernel's backward pass (`Kernel.backward`) through a second operator,
`mhadsl::<kernel>_<hash>_backward`, so the backward traces under torch.compile too. The LSE
output's gradient is not propagated (the LSE is the backward's input, not a loss term). The
backward is deterministic (bitwise the same gradients every run) under
`torch.use_deterministic_algorithms(True)`, or for one call with `deterministic=True`
(`attn(q, k, v, deterministic=True)`; False forces the faster atomic dQ).
"""

import hashlib

SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
          "SymInt? max_seqlen_q=None, SymInt? max_seqlen_k=None, float? scale=None, "
          "bool? deterministic=None) -> (Tensor, Tensor)")
BACKWARD_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout, "
                   "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
                   "SymInt? max_seqlen_q=None, SymInt? max_seqlen_k=None, float? scale=None, "
                   "bool? deterministic=None) -> (Tensor, Tensor, Tensor)")
_library = None
_ops: dict[str, object] = {}


def torch_op(kernel):
    """The operator for `kernel` (`mhadsl.host.api.Kernel`), registered once per process. Defined
    through `torch.library.Library` rather than the `custom_op` decorator, whose Python
    wrappers cost more host time a call than many kernels take."""
    global _library
    import torch

    digest = hashlib.sha256(f"{kernel.program.text}\0{kernel.name}".encode()).hexdigest()[:12]
    name = f"{kernel.name}_{digest}"
    if name in _ops:
        return _ops[name]
    if _library is None:
        _library = torch.library.Library("mhadsl", "FRAGMENT")
    _library.define(name + SCHEMA)

    def attention(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                  max_seqlen_k=None, scale=None, deterministic=None):
        return kernel(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, scale=scale,
                      return_lse=True)

    def fake(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
             max_seqlen_k=None, scale=None, deterministic=None):
        if cu_seqlens_q is None:
            lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
        else:
            lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
        return q.new_empty(q.shape), lse

    _library.impl(name, attention, "CUDA")
    torch.library.register_fake(f"mhadsl::{name}", fake, lib=_library)
    _ops[name] = getattr(torch.ops.mhadsl, name).default
    _register_autograd(kernel, name)
    return _ops[name]


def _register_autograd(kernel, name: str) -> None:
    """The backward operator of forward operator `name`, and the autograd that calls it."""
    import torch

    _library.define(name + "_backward" + BACKWARD_SCHEMA)

    def gradients(q, k, v, out, lse, dout, cu_seqlens_q=None, cu_seqlens_k=None,
                  max_seqlen_q=None, max_seqlen_k=None, scale=None, deterministic=None):
        return kernel.backward(q, k, v, out, lse, dout, cu_seqlens_q=cu_seqlens_q,
                               cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, scale=scale,
                               deterministic=deterministic)

    def fake(q, k, v, out, lse, dout, cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=None, max_seqlen_k=None, scale=None, deterministic=None):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    _library.impl(name + "_backward", gradients, "CUDA")
    torch.library.register_fake(f"mhadsl::{name}_backward", fake, lib=_library)
    backward_op = getattr(torch.ops.mhadsl, name + "_backward").default

    def setup_context(ctx, inputs, output):
        q, k, v, cu_q, cu_k, max_q, max_k, scale, deterministic = inputs
        ctx.save_for_backward(q, k, v, *output, cu_q, cu_k)
        ctx.options = (max_q, max_k, scale, deterministic)

    def backward(ctx, grad_out, _grad_lse):
        if grad_out is None:  # only the LSE was used
            return (None,) * 9
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = backward_op(q, k, v, out, lse, grad_out.contiguous(), cu_q, cu_k,
                                 *ctx.options)
        return dq, dk, dv, None, None, None, None, None, None

    torch.library.register_autograd(f"mhadsl::{name}", backward, setup_context=setup_context,
                                    lib=_library)
