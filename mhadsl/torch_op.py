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
kernel's build (builds depend on the layout, not the lengths). The backward pass attaches its
autograd here.
"""

import hashlib

SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
          "SymInt? max_seqlen_q=None, SymInt? max_seqlen_k=None, float? scale=None) "
          "-> (Tensor, Tensor)")
_library = None
_ops: dict[str, object] = {}


def torch_op(kernel):
    """The operator for `kernel` (`mhadsl.api.Kernel`), registered once per process. Defined
    through `torch.library.Library` rather than the `custom_op` decorator, whose Python
    wrappers cost 40 us a call on the H200 host."""
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
                  max_seqlen_k=None, scale=None):
        return kernel(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, scale=scale,
                      return_lse=True)

    def fake(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
             max_seqlen_k=None, scale=None):
        if cu_seqlens_q is None:
            lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
        else:
            lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
        return q.new_empty(q.shape), lse

    _library.impl(name, attention, "CUDA")
    torch.library.register_fake(f"mhadsl::{name}", fake, lib=_library)
    _ops[name] = getattr(torch.ops.mhadsl, name).default
    return _ops[name]
