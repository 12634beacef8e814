"""An attention kernel as a PyTorch operator (`Kernel.torch_op()`).

    attn = mhadsl.compile("examples/causal.mha")["causal_fwd"].torch_op()
    out, lse = attn(q, k, v)                                   # lse float32 (B, Hq, Sq)
    out, lse = attn(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq,
                    max_seqlen_k=mk)                           # lse (Hq, total_q)

Each kernel is one `torch.library.custom_op` (`mhadsl::<kernel>_<hash>`) with a fake
implementation that gives the outputs' shapes without running anything, so
`torch.compile(fullgraph=True)` traces through it without a graph break; under
`mode="reduce-overhead"` its launch is captured into CUDA graphs (the queue counter is reset by
the kernel itself, so replays need no host work), and a dynamic sequence length reuses the
kernel's build (builds depend on the layout, not the lengths). The backward pass attaches its
autograd here.
"""

import hashlib

_ops: dict[str, object] = {}


def torch_op(kernel):
    """The operator for `kernel` (`mhadsl.api.Kernel`), registered once per process."""
    import torch
    from torch import Tensor

    digest = hashlib.sha256(f"{kernel.program.text}\0{kernel.name}".encode()).hexdigest()[:12]
    name = f"mhadsl::{kernel.name}_{digest}"
    if name in _ops:
        return _ops[name]

    @torch.library.custom_op(name, mutates_args=(), device_types="cuda")
    def attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None = None,
                  cu_seqlens_k: Tensor | None = None, max_seqlen_q: int | None = None,
                  max_seqlen_k: int | None = None,
                  scale: float | None = None) -> tuple[Tensor, Tensor]:
        return kernel(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, scale=scale,
                      return_lse=True)

    @attention.register_fake
    def _(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
          max_seqlen_k=None, scale=None):
        if cu_seqlens_q is None:
            lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
        else:
            lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
        return torch.empty_like(q, memory_format=torch.contiguous_format), lse

    _ops[name] = attention
    return attention
