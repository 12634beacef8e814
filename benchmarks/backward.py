"""Benchmark: the backward pass, side by side in one process with cuDNN and
flash through torch SDPA and, when installed, FlashAttention-4; score rules (softcap, ALiBi)
against FlexAttention's backward of the same `score_mod`.

    python benchmarks/backward.py                    # every row
    python benchmarks/backward.py --only wide,d256   # the rows of these groups (ROWS' first field)
    python benchmarks/backward.py --scores           # the score rules' rows only
    python benchmarks/backward.py --runs 3           # each row timed three times
    python benchmarks/backward.py --only ragged      # the ragged causal batch against
                                                     # FlashAttention-4's varlen backward

TFLOP/s = 2.5 x the forward's FLOPs (4 B H Sq Sk D, halved under a causal mask) / the median
backward time (`mhadsl.host.bench.time_side_by_side`: every column timed in turn over rounds).
mhadsl's gradients, atomic and deterministic (`deterministic=True`), are checked against
SDPA's (math backend, fp32) first; each peer's against mhadsl's. Each row ends with the main
kernel's build (its design, `backward_sm90` on the H200 for atomic dense calls, and query rows
per step: `BackwardConfig.block_m`; "split" where a GQA group is split over CTAs) of either
mode. The score rows check mhadsl's gradients
against the float64 reference's (`mhadsl.reference_backward`) and FlexAttention's against
mhadsl's; FlexAttention runs torch.compile'd with its causal block mask built before timing.
"""
import argparse
import datetime
import itertools

import mhadsl
from mhadsl.host.bench import require_gpu, time_side_by_side

SOURCE = """
import "std/schedulers.mha"
attention plain { dtype = bf16  head_dim = 128 }
attention causal { dtype = bf16  head_dim = 128  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention plain_d64 { dtype = bf16  head_dim = 64 }
attention causal_d64 { dtype = bf16  head_dim = 64  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention causal_d256 { dtype = bf16  head_dim = 256  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention softcap { dtype = bf16  head_dim = 128  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx
                    score(s, b, h, q_idx, kv_idx) = 30.0 * tanh(s / 30.0) }
attention alibi { dtype = bf16  head_dim = 128  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx
                  score(s, b, h, q_idx, kv_idx) = s - exp2(-1.0 - f32(h)) * f32(q_idx - kv_idx) }
"""
ROWS = [  # group, kernel, B, Hq, Hkv, S, D
    ("dense", "plain", 4, 16, 16, 4096, 128), ("dense", "causal", 4, 16, 16, 4096, 128),
    ("d64", "causal_d64", 4, 32, 32, 4096, 64), ("gqa", "causal", 4, 32, 8, 4096, 128),
    ("long", "causal", 1, 16, 16, 16384, 128),
    ("d256", "causal_d256", 2, 8, 8, 4096, 256), ("wide", "causal", 2, 48, 8, 4096, 128),
    ("long", "plain", 2, 16, 16, 8192, 128), ("short", "causal", 16, 16, 16, 1024, 128),
    ("d64", "plain_d64", 4, 32, 32, 4096, 64), ("gqa", "causal", 8, 32, 8, 2048, 128),
]
SCORE_ROWS = [("softcap", 4, 16, 16, 4096, 128), ("alibi", 4, 16, 16, 4096, 128)]
# a ragged causal batch (the benchmarks' skewed one: 32640 tokens), against FlashAttention-4's
# varlen backward: group, kernel, lengths, Hq, Hkv, D
RAGGED_ROWS = [("ragged", "causal", [8192, 4096, 2048, 1024, 512, 256, 128, 64] * 2, 16, 16,
                128)]
# each score rule as FlexAttention's score_mod
FLEX_SCORES = {
    "softcap": lambda s, b, h, q, kv: 30.0 * (s / 30.0).tanh(),
    "alibi": lambda s, b, h, q, kv: s - (2.0 ** (-1.0 - h)) * (q - kv),
}


def relative(torch, got, want) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def tflops(timings: dict, B, Hq, S, D, causal: bool) -> dict:
    """Each column's TFLOP/s (None: not timed): 2.5 x the forward's FLOPs over its time."""
    flops = 2.5 * 4 * B * Hq * S * S * D / (2 if causal else 1)
    return {n: None if x is None else flops / (x.ms * 1e-3) / 1e12 for n, x in timings.items()}


def row(torch, program, name, B, Hq, Hkv, S, D):
    kern = program[name]
    causal = not name.startswith("plain")
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
        fns["fa4"]()
    except ImportError:
        fns["fa4"] = None
    except Exception as err:  # noqa: BLE001 - a shape FlashAttention-4 does not take
        print(f"  (fa4 unavailable: {type(err).__name__}: {str(err).splitlines()[0][:100]})")
        fns["fa4"] = None
    tf = tflops(time_side_by_side(torch, fns), B, Hq, S, D, causal)
    builds = [kern.backward_build(gqa_group=Hq // Hkv, deterministic=d) for d in (False, True)]
    # (the builds the calls loaded, from the cache): design and query step of either mode
    steps = "/".join(f"{b.backend} m{b.config.block_m}"
                     + (" split" if getattr(b.config, "split_group", False) else "")
                     for b in builds)
    best = max(tf.get(n) or 0 for n in ("cudnn", "fa4", "flash"))
    vs_best = f"{tf['mhadsl'] / best:.3f}x" if best else "—"
    print(f"| B{B} H{Hq}:{Hkv} S{S} D{D} {'causal' if causal else 'plain'} | "
          f"**{tf['mhadsl']:.0f}** | {tf['deterministic']:.0f} | "
          + " | ".join(f"{tf[n]:.0f}" if tf.get(n) else "—" for n in ("cudnn", "fa4", "flash"))
          + f" | {vs_best} | {tf['deterministic'] / tf['mhadsl']:.2f} | {max(errors):.1e} | "
          f"{steps} |",
          flush=True)


def ragged_row(torch, program, name, lengths, Hq, Hkv, D):
    """A ragged causal batch's backward (packed (total, H, D) tensors, `cu_seqlens`) against
    FlashAttention-4's varlen backward; the gradients of the sequences up to 2048 rows are
    checked against SDPA's math backend (fp32), FlashAttention-4's against mhadsl's."""
    kern = program[name]
    total, longest = sum(lengths), max(lengths)
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32,
                      device="cuda")
    ragged = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
    q = torch.randn(total, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    out, lse = kern(q, k, v, return_lse=True, **ragged)
    ours = kern.backward(q, k, v, out, lse, dout, **ragged)
    exact = kern.backward(q, k, v, out, lse, dout, deterministic=True, **ragged)
    errors = []
    for start, n in zip(cu.tolist(), lengths):
        if n > 2048:
            continue
        qt, kt, vt = (x[start:start + n].transpose(0, 1).float().requires_grad_()
                      for x in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True,
                                                             enable_gqa=Hq != Hkv)
        reference = torch.autograd.grad(o, (qt, kt, vt), dout[start:start + n].transpose(0, 1)
                                        .float())
        errors += [relative(torch, g[start:start + n], r.transpose(0, 1))
                   for grads in (ours, exact) for g, r in zip(grads, reference)]
    fns = {"mhadsl": lambda: kern.backward(q, k, v, out, lse, dout, **ragged),
           "deterministic": lambda: kern.backward(q, k, v, out, lse, dout, deterministic=True,
                                                  **ragged)}
    try:
        from flash_attn.cute import flash_attn_varlen_func
        qf, kf, vf = (x.detach().requires_grad_() for x in (q, k, v))
        of = flash_attn_varlen_func(qf, kf, vf, causal=True, **ragged)[0]
        fa4 = torch.autograd.grad(of, (qf, kf, vf), dout, retain_graph=True)
        fns["fa4"] = (lambda: torch.autograd.grad(of, (qf, kf, vf), dout, retain_graph=True)) \
            if relative(torch, fa4[0], ours[0]) < 2e-2 else None
    except ImportError:
        fns["fa4"] = None
    except Exception as err:  # noqa: BLE001 - a shape FlashAttention-4 does not take
        print(f"  (fa4 unavailable: {type(err).__name__}: {str(err).splitlines()[0][:100]})")
        fns["fa4"] = None
    timings = time_side_by_side(torch, fns)
    flops = 2.5 * sum(4 * Hq * n * n * D / 2 for n in lengths)
    tf = {n: None if x is None else flops / (x.ms * 1e-3) / 1e12 for n, x in timings.items()}
    fa4 = f"{tf['fa4']:.0f} | {tf['mhadsl'] / tf['fa4']:.3f}x" if tf.get("fa4") else "— | —"
    print(f"| ragged causal {len(lengths)} seqs, {total} tokens, H{Hq}:{Hkv} D{D} | "
          f"**{tf['mhadsl']:.0f}** | {tf['deterministic']:.0f} | {fa4} | "
          f"{tf['deterministic'] / tf['mhadsl']:.2f} | {max(errors):.1e} |", flush=True)


def score_row(torch, program, name, B, Hq, Hkv, S, D):
    """A score rule's backward (causal) against FlexAttention's of the same score_mod."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    kern = program[name]
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    out, lse = kern(q, k, v, return_lse=True)
    ours = kern.backward(q, k, v, out, lse, dout)
    small = [x[:1, :512].contiguous() for x in (q, k, v, dout)]  # the float64 check's size
    o1, l1 = kern(*small[:3], return_lse=True)
    want = mhadsl.reference_backward(kern, *small)
    got = kern.backward(*small[:3], o1, l1, small[3])
    error = max(relative(torch, g, torch.as_tensor(w, device="cuda")) for g, w in zip(got, want))
    assert error < 1e-2, f"{name}: gradients {error:.1e} from float64"
    qf, kf, vf = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    block_mask = torch.compile(create_block_mask)(lambda b, h, qi, kv: kv <= qi, None, None, S,
                                                  S, device="cuda")
    of = torch.compile(flex_attention, dynamic=False)(
        qf, kf, vf, score_mod=FLEX_SCORES[name], block_mask=block_mask,
        scale=kern.options.softmax_scale(), enable_gqa=Hq != Hkv)
    flex_grads = torch.autograd.grad(of, (qf, kf, vf), dout.transpose(1, 2), retain_graph=True)
    agree = relative(torch, flex_grads[0].transpose(1, 2), ours[0]) < 2e-2
    fns = {"mhadsl": lambda: kern.backward(q, k, v, out, lse, dout),
           "flex": (lambda: torch.autograd.grad(of, (qf, kf, vf), dout.transpose(1, 2),
                                                retain_graph=True)) if agree else None}
    tf = tflops(time_side_by_side(torch, fns), B, Hq, S, D, causal=True)
    flex = f"{tf['flex']:.0f} | {tf['mhadsl'] / tf['flex']:.2f}x" if tf["flex"] else "— | —"
    print(f"| {name}, B{B} H{Hq}:{Hkv} S{S} D{D} causal | **{tf['mhadsl']:.0f}** | {flex} | "
          f"{error:.1e} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    groups = sorted({r[0] for r in ROWS + RAGGED_ROWS})
    parser.add_argument("--only", help=f"comma-separated row groups ({', '.join(groups)})")
    parser.add_argument("--scores", action="store_true", help="the score rules' rows only")
    parser.add_argument("--runs", type=int, default=1, help="time each row this many times")
    cli = parser.parse_args()
    only = set(cli.only.split(",")) if cli.only else set(groups)
    if only - set(groups):
        parser.error(f"--only: no group {', '.join(sorted(only - set(groups)))} "
                     f"(the groups: {', '.join(groups)})")
    if cli.runs < 1:
        parser.error(f"--runs {cli.runs}: at least 1")
    torch = require_gpu()
    program = mhadsl.compile(SOURCE, name="backward_bench")
    print(f"backward, {datetime.date.today()}, {torch.cuda.get_device_name()}, bf16; TFLOP/s "
          f"= 2.5 x forward FLOPs / time")
    if not cli.scores:
        print("| shape | mhadsl | mhadsl deterministic | cuDNN | FA4 | torch flash | vs best "
              "peer | deterministic / atomic | max relative error vs SDPA math | main "
              "kernel's design and query step |")
        for measure, rows in ((row, ROWS), (ragged_row, RAGGED_ROWS)):
            if measure is ragged_row and any(group in only for group, *_ in rows):
                print("| ragged batch | mhadsl | mhadsl deterministic | FA4 varlen | vs FA4 | "
                      "deterministic / atomic | max relative error vs SDPA math (sequences "
                      "up to 2048) |")
            for group, *spec in rows:
                for _ in range(cli.runs if group in only else 0):
                    measure(torch, program, *spec)
    if cli.scores or not cli.only:
        print("| score rule | mhadsl | FlexAttention | vs FlexAttention | max relative error "
              "vs float64 (B1 S512) |")
        for spec in SCORE_ROWS:
            for _ in range(cli.runs):
                score_row(torch, program, *spec)


if __name__ == "__main__":
    main()
