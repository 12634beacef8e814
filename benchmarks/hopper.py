"""Benchmark: the sm90 (TMA + wgmma) and sm80 (FlashAttention-2) kernel designs of the same
declarations side by side with torch SDPA's flash and cuDNN backends, in one process.

    python benchmarks/hopper.py          # needs an H100/H200 (compute capability 9.0)

Each row checks both designs against the float64 reference first (relative error), then
times them and torch's kernels in turn, round after round (`mhadsl.bench.time_side_by_side`:
the median of CUDA-event-timed runs), so every column of a row meets the same GPU.
"""
import datetime

import mhadsl
from mhadsl.bench import Problem, allowed_pairs, check, make_inputs, require_gpu, \
    time_side_by_side, torch_baseline_fns

SOURCE = """
import "std/schedulers.mha"
attention plain_d128 { dtype = bf16  head_dim = 128 }
attention causal_d128 { dtype = bf16  head_dim = 128  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention plain_d64 { dtype = bf16  head_dim = 64 }
attention causal_d64 { dtype = bf16  head_dim = 64  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention causal_lpt { dtype = bf16  head_dim = 128  scheduler = LPT()
                       mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention gqa_causal { dtype = bf16  head_dim = 128  gqa = 4
                       mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention plain_d256 { dtype = bf16  head_dim = 256 }
attention causal_d256 { dtype = bf16  head_dim = 256  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention window { dtype = bf16  head_dim = 128
                   mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx && q_idx - kv_idx < 256 }
"""
WORKLOADS = [
    ("plain_d128", Problem(4, 4096, 4096, 16, 16, 128)),
    ("causal_d128", Problem(4, 4096, 4096, 16, 16, 128)),
    ("causal_lpt", Problem(4, 4096, 4096, 16, 16, 128)),
    ("plain_d128", Problem(1, 16384, 16384, 16, 16, 128)),
    ("causal_d128", Problem(1, 16384, 16384, 16, 16, 128)),
    ("plain_d64", Problem(4, 4096, 4096, 32, 32, 64)),
    ("causal_d64", Problem(4, 4096, 4096, 32, 32, 64)),
    ("gqa_causal", Problem(4, 4096, 4096, 32, 8, 128)),
    ("plain_d256", Problem(2, 8192, 8192, 16, 16, 256)),
    ("causal_d256", Problem(2, 8192, 8192, 16, 16, 256)),
    ("window", Problem(4, 4096, 4096, 16, 16, 128)),
    ("causal_d128", Problem(0, 0, 0, 16, 16, 128, tuple([8192 >> i for i in range(8)] * 2))),
    ("causal_d128", Problem(0, 0, 0, 16, 16, 128, (2048,) * 16)),
    ("causal_d128", Problem(0, 0, 0, 16, 16, 128, (96,) * 1024)),
    ("causal_d128", Problem(0, 0, 0, 16, 16, 128, (128,) * 768)),
]
DESIGNS = ("sm80", "sm90")


def varlen_flash_fn(torch, args: dict, causal: bool):
    """torch's packed-varlen flash kernel on the same ragged batch (cum_seq_q/k)."""
    def run():
        return torch.ops.aten._flash_attention_forward(
            args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"],
            args["max_seqlen_q"], args["max_seqlen_k"], 0.0, causal, False)
    try:
        run()
        return run
    except (RuntimeError, TypeError) as err:
        print(f"(varlen flash unavailable: {err})")
        return None


def main() -> None:
    torch = require_gpu()
    programs = {d: mhadsl.compile(SOURCE, name=f"<hopper {d}>") for d in DESIGNS}
    print(f"{datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| kernel | shape | sm80 | sm90 | torch flash (ragged: varlen) | cuDNN "
          "| sm90 / cuDNN (rounds) | rel. error sm80, sm90 |")
    print("|---|---|---|---|---|---|---|---|")
    for name, problem in WORKLOADS:
        kernels = {}
        for design in DESIGNS:
            kernels[design] = programs[design][name]
            kernels[design].backend = design
        args = make_inputs(torch, kernels["sm90"], problem)
        flops = 4.0 * problem.head_dim * problem.heads * allowed_pairs(kernels["sm90"], problem)
        errors = [check(torch, kernels[d], Problem(1, 1000, 1000, problem.heads, problem.kv_heads,
                                                   problem.head_dim))[0] for d in DESIGNS]
        fns = {d: lambda k=kernels[d]: k(**args) for d in DESIGNS}
        fns.update(torch_baseline_fns(torch, kernels["sm90"], problem, args))
        if problem.seqlens:  # torch's packed-varlen flash kernel stands in for the flash column
            fns["flash"] = varlen_flash_fn(torch, args, causal=name.startswith("causal"))
        times = time_side_by_side(torch, fns)
        tflops = {d: None if t is None else flops / t.ms / 1e9 for d, t in times.items()}

        def f(x):
            return "—" if x is None else f"{x:.0f}"
        ratio = "—"
        if times["cudnn"] is not None:  # and the lowest and highest of the rounds' ratios
            rounds = [c / s for s, c in zip(times["sm90"].round_ms, times["cudnn"].round_ms)]
            ratio = (f"{tflops['sm90'] / tflops['cudnn']:.3f}x "
                     f"({min(rounds):.2f}–{max(rounds):.2f})")
        print(f"| {name} | {problem.describe()} | {f(tflops['sm80'])} | "
              f"{f(tflops['sm90'])} | {f(tflops['flash'])} | {f(tflops['cudnn'])} | {ratio} | "
              f"{errors[0]:.1e}, {errors[1]:.1e} |", flush=True)


if __name__ == "__main__":
    main()
