"""An attention kernel as a PyTorch operator (`Kernel.torch_op()`).

    attn = mhadsl.compile("examples/causal.mha")["causal_fwd"].torch_op()
    out, lse = attn(q, k, v)                                   # lse float32 (B, Hq, Sq)
    out, lse = attn(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq,
                    max_seqlen_k=mk)                           # lse (Hq, total_q)
    out, lse = attn(q, k, v, out=o)                           # O written into o (o is out)
    step = kern.torch_decode_op()                             # against a KV cache:
    out, lse = step(q, k_cache, v_cache, lens, page_table=pages, k_new=k, v_new=v)

Each kernel is one operator of the `mhadsl` library (`mhadsl::<kernel>_<hash>`) with a fake
implementation that gives the outputs' shapes without running anything, so
`torch.compile(fullgraph=True)` traces through it without a graph break; under
`mode="reduce-overhead"` its launch is captured into CUDA graphs (the queue counter is reset by
the kernel itself, so replays need no host work), and a dynamic sequence length reuses the
kernel's build (builds depend on the layout, not the lengths).

A call against a KV cache is a second operator (`Kernel.torch_decode_op()`,
`mhadsl::<kernel>_<hash>_decode`): `Kernel.__call__`'s decode (contiguous or paged by
`page_table`, dense or ragged query rows, `num_splits`, the step's `k_new`/`v_new` written into
the cache first, which its schema marks as mutated, a float8_e4m3fn cache's `k_scale` and
`v_scale`). Its lengths and page table are read on
the device only, so a captured graph replays new lengths and page tables as they are then. It
has no gradient.

Both take `out=`, a preallocated output that the kernel writes (checked as `Kernel.__call__`
checks it) and the call returns as its O: `attn(q, k, v, out=o)` is `(o, lse)`. A custom
operator may not return a tensor aliasing an argument, so `torch_op()` and `torch_decode_op()`
return a function (torch.compile inlines it) that runs such a call through a second operator,
`mhadsl::<name>_out`: `out` its last, keyword-only argument, marked as written in its schema,
and the LSE its one result. Under `mode="reduce-overhead"` the graph is captured only where
`out` has a static address (`torch._dynamo.mark_static_address(out)`): Inductor skips CUDA
graphs for a graph that writes any other input. An `out=` call has no gradient: with inputs
that require one it raises (train without `out=`).

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
same build. Gradients flow to the f32 tensors the score rule reads (`score_operands`: the
backward operator computes them, `Kernel.backward`'s `operand_grads`, only where one of them
requires a gradient, and returns them after dq, dk, dv and a sink's) and to the tensor a
sink rule reads as its whole body, `sink(b, h) = t[h]` (t `f32[heads]`: the sink's gradient
summed over the batch) or `t[b][h]` (t `f32[batch, heads]`), as a learned sink per head is
(`sink_operand`).
"""

import hashlib
import string

from mhadsl.front import ast
from mhadsl.host.calls import check_operand_grads, score_read_floats

SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
          "SymInt? max_seqlen_q=None, SymInt? max_seqlen_k=None, float? scale=None, "
          "bool? deterministic=None) -> (Tensor, Tensor)")
# the forward's arguments before the operands: q, k, v, cu_seqlens_q/k, max_seqlen_q/k,
# scale, deterministic
FIRST_OPERAND = 9
DECODE_SCHEMA = ("(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, "
                 "Tensor? page_table=None, Tensor? cu_seqlens_q=None, SymInt? max_seqlen_q=None, "
                 "float? scale=None, int? num_splits=None, Tensor? k_new=None, "
                 "Tensor? v_new=None, float? k_scale=None, float? v_scale=None) "
                 "-> (Tensor, Tensor)")
BACKWARD_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout, "
                   "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
                   "SymInt? max_seqlen_q=None, SymInt? max_seqlen_k=None, float? scale=None, "
                   "bool? deterministic=None, int operand_grads=0) "
                   "-> (Tensor, Tensor, Tensor)")
_library = None
_calls_by_name: dict[str, object] = {}  # operator name -> the call `torch_op` returns


def _name(kernel, suffix: str = "") -> str:
    """The operator's name: the kernel's and a digest of its program (`suffix`: which)."""
    digest = hashlib.sha256(f"{kernel.program.text}\0{kernel.name}".encode()).hexdigest()[:12]
    return f"{kernel.name}_{digest}{suffix}"


def _define(name: str, schema: str, impl, fake):
    """Operator `mhadsl::<name>`: its schema, its CUDA implementation and its fake one.
    Defined through `torch.library.Library` rather than the `custom_op` decorator, whose
    Python wrappers cost more host time a call than many kernels take."""
    global _library
    import torch

    if _library is None:
        _library = torch.library.Library("mhadsl", "FRAGMENT")
    _library.define(name + schema)
    _library.impl(name, impl, "CUDA")
    torch.library.register_fake(f"mhadsl::{name}", fake, lib=_library)
    return getattr(torch.ops.mhadsl, name).default


def with_out(schema: str) -> str:
    """The out= variant of operator `schema` (its operands included): `out` last and
    keyword-only, as in aten's out variants, so positional operands keep their places;
    written, under an alias letter no other argument uses; the LSE its one result, since an
    operator may not return a tensor aliasing an argument."""
    letter = next(c for c in string.ascii_lowercase if f"Tensor({c}!)" not in schema)
    return schema[:schema.index(") -> ")] + f", *, Tensor({letter}!) out) -> Tensor"


def _calls(op, out_op, differentiable: bool):
    """A call of `op` that takes `out=`: `out_op` writes O into `out` and returns the LSE,
    and the call returns (out, lse) as `op` does."""
    import torch

    def call(*args, out=None, **kwargs):
        if out is None:
            return op(*args, **kwargs)
        # (autograd cannot be registered for an operator that writes an argument)
        if differentiable and torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad
                for a in (*args, *kwargs.values())):
            raise RuntimeError("out= writes the output in place, which autograd cannot "
                               "differentiate: call without out= for gradients, or under "
                               "torch.no_grad()")
        return out, out_op(*args, out=out, **kwargs)

    return call


def torch_op(kernel):
    """The operator for `kernel` (`mhadsl.host.api.Kernel`), registered once per process."""
    import torch

    name = _name(kernel)
    if name in _calls_by_name:
        return _calls_by_name[name]

    def attention(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                  max_seqlen_k=None, scale=None, deterministic=None, *operands, out=None):
        return kernel(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, scale=scale,
                      out=out, return_lse=True, **given(kernel, operands))

    def fake(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
             max_seqlen_k=None, scale=None, deterministic=None, *operands):
        return q.new_empty(q.shape), _lse(torch, q, cu_seqlens_q)

    def attention_out(*args, out):
        return attention(*args, out=out)[1]

    def fake_out(q, k, v, cu_seqlens_q=None, *rest, out):
        return _lse(torch, q, cu_seqlens_q)

    schema = with_operands(SCHEMA, kernel)
    op = _define(name, schema, attention, fake)
    _register_autograd(kernel, name)
    out_op = _define(name + "_out", with_out(schema), attention_out, fake_out)
    _calls_by_name[name] = _calls(op, out_op, differentiable=True)
    return _calls_by_name[name]


def _lse(torch, q, cu_seqlens_q):
    """An empty LSE of a call's shape: (B, Hq, Sq) dense or (Hq, total) ragged."""
    if cu_seqlens_q is None:
        return q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def torch_decode_op(kernel):
    """The operator of `kernel`'s calls against a KV cache, registered once per process;
    its schema marks k_cache and v_cache as written (the step's new rows)."""
    import torch

    name = _name(kernel, "_decode")
    if name in _calls_by_name:
        return _calls_by_name[name]

    def step(q, k_cache, v_cache, cache_seqlens, page_table=None, cu_seqlens_q=None,
             max_seqlen_q=None, scale=None, num_splits=None, k_new=None, v_new=None,
             k_scale=None, v_scale=None, *operands, out=None):
        return kernel(q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table,
                      cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, scale=scale,
                      num_splits=num_splits, k_new=k_new, v_new=v_new, k_scale=k_scale,
                      v_scale=v_scale, out=out, return_lse=True, **given(kernel, operands))

    def fake(q, k_cache, v_cache, cache_seqlens, page_table=None, cu_seqlens_q=None,
             max_seqlen_q=None, scale=None, num_splits=None, k_new=None, v_new=None,
             k_scale=None, v_scale=None, *operands):
        return q.new_empty(q.shape), _lse(torch, q, cu_seqlens_q)

    def step_out(*args, out):
        return step(*args, out=out)[1]

    def fake_out(q, k_cache, v_cache, cache_seqlens, page_table=None, cu_seqlens_q=None,
                 *rest, out):
        return _lse(torch, q, cu_seqlens_q)

    schema = with_operands(DECODE_SCHEMA, kernel)
    op = _define(name, schema, step, fake)
    out_op = _define(name + "_out", with_out(schema), step_out, fake_out)
    _calls_by_name[name] = _calls(op, out_op, differentiable=False)
    return _calls_by_name[name]


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


def score_operands(kernel) -> tuple[int, ...]:
    """The positions among the operands of the f32 tensors the score rule reads whose
    gradients `Kernel.backward` gives (`operand_grads`, `check_operand_grads`): autograd
    sends them theirs."""
    options, program = kernel.options, kernel.program.checked
    found = []
    for i, o in enumerate(options.operands):
        if o.name in score_read_floats(options, program):
            try:
                check_operand_grads(options, program, (o.name,))
            except ValueError:
                continue
            found.append(i)
    return tuple(found)


def _register_autograd(kernel, name: str) -> None:
    """The backward operator of forward operator `name`, and the autograd that calls it."""
    import torch

    sink = kernel.options.sink is not None  # (the backward's fourth result: the sink's)
    # then one result per f32 tensor operand the score reads: its gradient where the call
    # asks for it (bit n of `operand_grads` for scored[n]), else empty
    scored = score_operands(kernel)
    read = score_read_floats(kernel.options, kernel.program.checked)
    schema = with_operands(BACKWARD_SCHEMA, kernel).replace(
        "-> (Tensor, Tensor, Tensor)",
        "-> (" + ", ".join(["Tensor"] * (3 + sink + len(scored))) + ")")

    def gradients(q, k, v, out, lse, dout, cu_seqlens_q=None, cu_seqlens_k=None,
                  max_seqlen_q=None, max_seqlen_k=None, scale=None, deterministic=None,
                  operand_grads=0, *operands):
        names = tuple(kernel.options.operands[i].name for n, i in enumerate(scored)
                      if operand_grads >> n & 1)
        grads = kernel.backward(q, k, v, out, lse, dout, cu_seqlens_q=cu_seqlens_q,
                                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                max_seqlen_k=max_seqlen_k, scale=scale,
                                deterministic=deterministic, operand_grads=names,
                                **given(kernel, operands))
        found = grads[-1] if names else {}
        grads = grads[:-1] if names else grads
        return grads + tuple(found.get(kernel.options.operands[i].name,
                                       q.new_empty(0, dtype=torch.float32)) for i in scored)

    def fake(q, k, v, out, lse, dout, cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=None, max_seqlen_k=None, scale=None, deterministic=None,
             operand_grads=0, *operands):
        grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if sink:
            batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
            grads += (q.new_empty((batch, q.shape[-2]), dtype=torch.float32),)
        return grads + tuple(q.new_empty(operands[i].shape if operand_grads >> n & 1 else 0,
                                         dtype=torch.float32) for n, i in enumerate(scored))

    backward_op = _define(name + "_backward", schema, gradients, fake)

    def setup_context(ctx, inputs, output):
        q, k, v, cu_q, cu_k, *options = inputs  # max_q, max_k, scale, deterministic, operands
        ctx.save_for_backward(q, k, v, *output, cu_q, cu_k)
        ctx.options = options
        ctx.learned = [isinstance(x, torch.Tensor) and x.requires_grad
                       for x in options[FIRST_OPERAND - 5:]]

    target = sink_operand(kernel)

    def backward(ctx, grad_out, _grad_lse):
        inputs = 5 + len(ctx.options)  # (no gradient for any but q, k, v and the operands')
        if grad_out is None:  # only the LSE was used
            return (None,) * inputs
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        needs = ctx.learned  # (per operand: a tensor that requires a gradient)
        refused = [o.name for i, o in enumerate(kernel.options.operands)
                   if needs[i] and o.name in read and i not in scored]
        if refused:  # (its error says why)
            check_operand_grads(kernel.options, kernel.program.checked, refused)
        wanted = sum(1 << n for n, i in enumerate(scored) if needs[i])
        fixed, operands = ctx.options[:FIRST_OPERAND - 5], ctx.options[FIRST_OPERAND - 5:]
        grads = backward_op(q, k, v, out, lse, grad_out.contiguous(), cu_q, cu_k, *fixed,
                            wanted, *operands)
        result = [*grads[:3]] + [None] * (inputs - 3)
        if target is not None:
            position, over_batch = target
            result[FIRST_OPERAND + position] = grads[3].sum(0) if over_batch else grads[3]
        for n, i in enumerate(scored):
            if wanted >> n & 1:
                result[FIRST_OPERAND + i] = grads[3 + sink + n]
        return tuple(result)

    torch.library.register_autograd(f"mhadsl::{name}", backward, setup_context=setup_context,
                                    lib=_library)
