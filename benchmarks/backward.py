"""Benchmark: the backward pass, side by side in one process with cuDNN and
flash through torch SDPA and, when installed, FlashAttention-4.

    python benchmarks/backward.py

TFLOP/s = 2.5 x the forward's FLOPs (4 B H Sq Sk D, halved under a causal mask) / the median
backward time (`mhadsl.host.bench.time_side_by_side`: every column timed in turn over rounds).
mhadsl's gradients, atomic and deterministic (`deterministic=True`), are checked against
SDPA's (math backend, fp32) first; each peer's against mhadsl's. Each row ends with the main
kernel's build (its design, `backward_sm90` on the H200 for atomic dense calls, and query rows
per step: `BackwardConfig.block_m`) of either mode.
"""
import datetime

import mhadsl
from mhadsl.host.bench import require_gpu, time_side_by_side

SOURCE = """
import "std/schedulers.mha"
attention plain { dtype = bf16  head_dim = 128 }
attention causal { dtype = bf16  head_dim = 128  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention causal_d64 { dtype = bf16  head_dim = 64  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
"""
ROWS = [  # kernel, B, Hq, Hkv, S, D
    ("plain", 4, 16, 16, 4096, 128), ("causal", 4, 16, 16, 4096, 128),
    ("causal_d64", 4, 32, 32, 4096, 64), ("causal", 4, 32, 8, 4096, 128),
    ("causal", 1, 16, 16, 16384, 128),
]


def relative(torch, got, want) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def row(torch, program, name, B, Hq, Hkv, S, D):
    kern = program[name]
    causal = name != "plain"
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    out, lse = kern(q, k, v, return_lse=True)
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))

    def sdpa_backward(backend):
        from torch.nn.attention import sdpa_kernel
        with sdpa_kernel(backend):
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                 enable_gqa=Hq != Hkv)
        grads = torch.autograd.grad(o, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True)
        return lambda: torch.autograd.grad(o, (qt, kt, vt), dout.transpose(1, 2),
                                           retain_graph=True), grads

    from torch.nn.attention import SDPBackend
    ours = kern.backward(q, k, v, out, lse, dout)
    exact = kern.backward(q, k, v, out, lse, dout, deterministic=True)
    _, reference = sdpa_backward(SDPBackend.MATH)
    errors = [relative(torch, g, r.transpose(1, 2))
              for grads in (ours, exact) for g, r in zip(grads, reference)]
    fns = {"mhadsl": lambda: kern.backward(q, k, v, out, lse, dout),
           "deterministic": lambda: kern.backward(q, k, v, out, lse, dout, deterministic=True)}
    for label, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                           ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            fn, grads = sdpa_backward(backend)
            fns[label] = fn if relative(torch, grads[0].transpose(1, 2), ours[0]) < 2e-2 \
                else None
        except RuntimeError as err:
            print(f"  ({label} unavailable: {str(err).splitlines()[0][:100]})")
            fns[label] = None
    try:
        from flash_attn.cute import flash_attn_func
        qf, kf, vf = (x.detach().requires_grad_() for x in (q, k, v))
        of = flash_attn_func(qf, kf, vf, causal=causal)[0]
        fns["fa4"] = lambda: torch.autograd.grad(of, (qf, kf, vf), dout, retain_graph=True)
    except ImportError:
        fns["fa4"] = None
    t = time_side_by_side(torch, fns)
    flops = 2.5 * 4 * B * Hq * S * S * D / (2 if causal else 1)
    tf = {n: None if x is None else flops / (x.ms * 1e-3) / 1e12 for n, x in t.items()}
    builds = [kern.backward_build(gqa_group=Hq // Hkv, deterministic=d) for d in (False, True)]
    # (the builds the calls loaded, from the cache): design and query step of either mode
    steps = "/".join(f"{b.backend} m{b.config.block_m}" for b in builds)
    print(f"| B{B} H{Hq}:{Hkv} S{S} D{D} {'causal' if causal else 'plain'} | "
          f"**{tf['mhadsl']:.0f}** | {tf['deterministic']:.0f} | "
          + " | ".join(f"{tf[n]:.0f}" if tf.get(n) else "—" for n in ("cudnn", "fa4", "flash"))
          + f" | {max(errors):.1e} | {steps} |", flush=True)


def main():
    torch = require_gpu()
    program = mhadsl.compile(SOURCE, name="backward_bench")
    print(f"backward, {datetime.date.today()}, {torch.cuda.get_device_name()}, bf16; TFLOP/s "
          f"= 2.5 x forward FLOPs / time")
    print("| shape | mhadsl | mhadsl deterministic | cuDNN | FA4 | torch flash | max relative "
          "error vs SDPA math | main kernel's design and query step |")
    for spec in ROWS:
        row(torch, program, *spec)


if __name__ == "__main__":
    main()
