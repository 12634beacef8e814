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

A declaration's operands are the operator's last arguments, by name (`attn(q, k, v,
window=512)`): an i32 is an `int?`, an f32 a `float?`, None taking the declared default, a
tensor a `Tensor?` (every call passes it; no gradient flows to it). They are values of the
call: a new value runs the same build.
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
    _library.define(name + with_operands(SCHEMA, kernel))

    def attention(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                  max_seqlen_k=None, scale=None, deterministic=None, *operands):
        return kernel(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, scale=scale,
                      return_lse=True, **given(kernel, operands))

    def fake(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
             max_seqlen_k=None, scale=None, deterministic=None, *operands):
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


def with_operands(schema: str, kernel) -> str:
    """`schema` with the kernel's operands after its arguments (`int?`/`float?`, None)."""
    extra = "".join(f", {'Tensor' if o.axes else 'int' if o.type == 'i32' else 'float'}? "
                    f"{o.name}=None" for o in kernel.options.operands)
    return schema.replace(") -> ", extra + ") -> ", 1)


def given(kernel, operands: tuple) -> dict:
    """The operands an operator call passed (positional, after the fixed arguments), by
    name; None leaves an operand at its default."""
    return {o.name: value for o, value in zip(kernel.options.operands, operands)
            if value is not None}


def _register_autograd(kernel, name: str) -> None:
    """The backward operator of forward operator `name`, and the autograd that calls it."""
    import torch

    _library.define(name + "_backward" + with_operands(BACKWARD_SCHEMA, kernel))

    def gradients(q, k, v, out, lse, dout, cu_seqlens_q=None, cu_seqlens_k=None,
                  max_seqlen_q=None, max_seqlen_k=None, scale=None, deterministic=None,
                  *operands):
        return kernel.backward(q, k, v, out, lse, dout, cu_seqlens_q=cu_seqlens_q,
                               cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, scale=scale,
                               deterministic=deterministic, **given(kernel, operands))

    def fake(q, k, v, out, lse, dout, cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=None, max_seqlen_k=None, scale=None, deterministic=None,
             *operands):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    _library.impl(name + "_backward", gradients, "CUDA")
    torch.library.register_fake(f"mhadsl::{name}_backward", fake, lib=_library)
    backward_op = getattr(torch.ops.mhadsl, name + "_backward").default

    def setup_context(ctx, inputs, output):
        q, k, v, cu_q, cu_k, *options = inputs  # max_q, max_k, scale, deterministic, operands
        ctx.save_for_backward(q, k, v, *output, cu_q, cu_k)
        ctx.options = options

    def backward(ctx, grad_out, _grad_lse):
        inputs = 5 + len(ctx.options)  # (no gradient for any but q, k and v)
        if grad_out is None:  # only the LSE was used
            return (None,) * inputs
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = backward_op(q, k, v, out, lse, grad_out.contiguous(), cu_q, cu_k,
                                 *ctx.options)
        return (dq, dk, dv) + (None,) * (inputs - 3)

    torch.library.register_autograd(f"mhadsl::{name}", backward, setup_context=setup_context,
                                    lib=_library)
