"""An attention kernel as a PyTorch operator (`Kernel.torch_op()`).

    attn = mhadsl.compile("examples/causal.mha")["causal_fwd"].torch_op()
    out, lse = attn(q, k, v)                                   # lse float32 (B, Hq, Sq)
    out, lse = attn(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq,
                    max_seqlen_k=mk)                           # lse (Hq, total_q)
    out, lse = attn(q, k_cache, v_cache, cache_seqlens=lens,  # a decode step against a
                    page_table=pages, num_splits=2)            # paged KV cache

Each kernel is one operator of the `mhadsl` library (`mhadsl::<kernel>_<hash>`) with a fake
implementation that gives the outputs' shapes without running anything, so
`torch.compile(fullgraph=True)` traces through it without a graph break; under
`mode="reduce-overhead"` its launch is captured into CUDA graphs (the queue counter is reset by
the kernel itself, so replays need no host work), and a dynamic sequence length reuses the
kernel's build (builds depend on the layout, not the lengths).

A call with `cache_seqlens` is a call against a KV cache (`Kernel.__call__`'s decode: contiguous
or paged by `page_table`, dense or ragged query rows, `num_splits`), its lengths and page table
read on the device only, so a captured graph replays new lengths and page tables as they are
then. A decode call has no gradient (its backward raises).

The operator is differentiable (`torch.library.register_autograd`): `out.backward()` runs the
kernel's backward pass (`Kernel.backward`) through a second operator,
`mhadsl::<kernel>_<hash>_backward`, so the backward traces under torch.compile too. The LSE
output's gradient is not propagated (the LSE is the backward's input, not a loss term). The
backward is deterministic (bitwise the same gradients every run) under
`torch.use_deterministic_algorithms(True)`, or for one call with `deterministic=True`
(`attn(q, k, v, deterministic=True)`; False forces the faster atomic dQ).

A declaration's operands are the operator's last arguments, by name (`attn(q, k, v,
window=512)`): an i32 is an `int?`, an f32 a `float?`, None taking the declared default, a
tensor a `Tensor?` (every call passes it). They are values of the call: a new value runs the
same build. A gradient flows to one tensor operand: the one a sink rule reads as its whole
body, `sink(b, h) = t[h]` (t `f32[heads]`: the sink's gradient summed over the batch) or
`t[b][h]` (t `f32[batch, heads]`), as a learned sink per head is (`sink_operand`).
"""

import hashlib

from mhadsl.front import ast

SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
          "SymInt? max_seqlen_q=None, SymInt? max_seqlen_k=None, float? scale=None, "
          "bool? deterministic=None, Tensor? cache_seqlens=None, Tensor? page_table=None, "
          "int? num_splits=None) -> (Tensor, Tensor)")
# the forward's arguments before the operands: q, k, v, cu_seqlens_q/k, max_seqlen_q/k,
# scale, deterministic, cache_seqlens, page_table, num_splits
FIRST_OPERAND = 12
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
                  max_seqlen_k=None, scale=None, deterministic=None, cache_seqlens=None,
                  page_table=None, num_splits=None, *operands):
        return kernel(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, scale=scale,
                      cache_seqlens=cache_seqlens, page_table=page_table,
                      num_splits=num_splits, return_lse=True, **given(kernel, operands))

    def fake(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
             max_seqlen_k=None, scale=None, deterministic=None, cache_seqlens=None,
             page_table=None, num_splits=None, *operands):
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


def sink_operand(kernel) -> tuple[int, bool] | None:
    """Where autograd sends the sink's gradient: the f32 tensor operand that a sink rule
    reads as its whole body, `t[h]` (t `f32[heads]`) or `t[b][h]` (t `f32[batch, heads]`), as
    (its position among the operands, whether its gradient sums over the batch); else None
    (the operand of any other sink rule gets no gradient)."""
    rule = kernel.options.sink
    if rule is None or len(rule.body) != 1 or not isinstance(rule.body[0], ast.Return):
        return None
    indices, e = [], rule.body[0].value
    while isinstance(e, ast.Index):
        indices.insert(0, e.index.id if isinstance(e.index, ast.Name) else None)
        e = e.obj
    b, h = (p.name for p in rule.params)
    for i, o in enumerate(kernel.options.operands):
        if isinstance(e, ast.Name) and e.id == o.name and o.type == "f32":
            if o.axes == ("heads",) and indices == [h]:
                return i, True
            if o.axes == ("batch", "heads") and indices == [b, h]:
                return i, False
    return None


def _register_autograd(kernel, name: str) -> None:
    """The backward operator of forward operator `name`, and the autograd that calls it."""
    import torch

    sink = kernel.options.sink is not None  # (the backward's fourth result: the sink's)
    schema = with_operands(BACKWARD_SCHEMA, kernel)
    if sink:
        schema = schema.replace("-> (Tensor, Tensor, Tensor)",
                                "-> (Tensor, Tensor, Tensor, Tensor)")
    _library.define(name + "_backward" + schema)

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
        grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if not sink:
            return grads
        batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
        return grads + (q.new_empty((batch, q.shape[-2]), dtype=torch.float32),)

    _library.impl(name + "_backward", gradients, "CUDA")
    torch.library.register_fake(f"mhadsl::{name}_backward", fake, lib=_library)
    backward_op = getattr(torch.ops.mhadsl, name + "_backward").default

    def setup_context(ctx, inputs, output):
        q, k, v, cu_q, cu_k, max_q, max_k, scale, deterministic, cache_seqlens = inputs[:10]
        ctx.save_for_backward(q, k, v, *output, cu_q, cu_k)
        ctx.options = [max_q, max_k, scale, deterministic, *inputs[FIRST_OPERAND:]]
        ctx.inputs, ctx.decode = len(inputs), cache_seqlens is not None

    target = sink_operand(kernel)

    def backward(ctx, grad_out, _grad_lse):
        inputs = ctx.inputs  # (no gradient for any but q, k, v and a sink's)
        if grad_out is None:  # only the LSE was used
            return (None,) * inputs
        if ctx.decode:
            raise RuntimeError(f"kernel '{kernel.name}': a call against a KV cache "
                               "(cache_seqlens=...) has no backward pass")
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        grads = backward_op(q, k, v, out, lse, grad_out.contiguous(), cu_q, cu_k,
                            *ctx.options)
        result = [*grads[:3]] + [None] * (inputs - 3)
        if target is not None:
            position, over_batch = target
            result[FIRST_OPERAND + position] = grads[3].sum(0) if over_batch else grads[3]
        return tuple(result)

    torch.library.register_autograd(f"mhadsl::{name}", backward, setup_context=setup_context,
                                    lib=_library)
