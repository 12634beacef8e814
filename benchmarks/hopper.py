"""Benchmark: the sm90 (TMA + wgmma) and sm80 (FlashAttention-2) kernel designs of the same
declarations side by side with torch SDPA's flash and cuDNN backends and FlexAttention, in
one process.

    python benchmarks/hopper.py          # needs an H100/H200 (compute capability 9.0)
    python benchmarks/hopper.py --no-flex  # without FlexAttention (its compiles take minutes)
    python benchmarks/hopper.py --only window,causal_d64  # the rows of these declarations
    python benchmarks/hopper.py --only causal_d64 --runs 3  # each row timed 3 times
    python benchmarks/hopper.py --only softcap --warm  # only build the rows' kernels, in parallel

Each row checks both designs against the float64 reference first (relative error), then
times them and torch's kernels in turn, round after round (`mhadsl.host.bench.time_side_by_side`:
the median of CUDA-event-timed runs), so every column of a row meets the same GPU.
FlexAttention (torch.compile'd, its block mask built before timing) gets each declaration's
mask written as a `mask_mod` here (`FLEX_MASKS`), a ragged batch as one sequence of
documents; its output is checked against the sm90 kernel's before it is timed. So is
FlashAttention-4's (its sm90 path, where installed: `../shared/tools/fa4/` prepares it for
the GPU machine; its varlen entry on ragged batches), each mask as its causal and window
arguments (`FA4_MASKS`).
"""
import argparse
import datetime
import warnings
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import mhadsl
from mhadsl.host.bench import Problem, allowed_pairs, check, make_inputs, require_gpu, \
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
attention gqa8_plain { dtype = bf16  head_dim = 128  gqa = 8 }
attention gqa8_causal { dtype = bf16  head_dim = 128  gqa = 8
                        mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention plain_d256 { dtype = bf16  head_dim = 256 }
attention causal_d256 { dtype = bf16  head_dim = 256  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention window { dtype = bf16  head_dim = 128
                   mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx && q_idx - kv_idx < 256 }
attention softcap { dtype = bf16  head_dim = 128  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx
                    score(s, b, h, q_idx, kv_idx) = 30.0 * tanh(s / 30.0) }
attention chunked_prefill { dtype = bf16  head_dim = 128  gqa = 4
    mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = kv_idx <= q_idx + seqlen_k - seqlen_q }
"""
# a chunk of 512 new rows per sequence over its cached keys (bottom-right causal)
CACHED = (1536, 2560, 3584, 1024, 3072, 2048, 4096, 2560)
WORKLOADS = [
    ("plain_d128", Problem(4, 4096, 4096, 16, 16, 128)),
    ("causal_d128", Problem(4, 4096, 4096, 16, 16, 128)),
    ("causal_lpt", Problem(4, 4096, 4096, 16, 16, 128)),
    ("plain_d128", Problem(1, 16384, 16384, 16, 16, 128)),
    ("causal_d128", Problem(1, 16384, 16384, 16, 16, 128)),
    ("plain_d64", Problem(4, 4096, 4096, 32, 32, 64)),
    ("causal_d64", Problem(4, 4096, 4096, 32, 32, 64)),
    ("gqa_causal", Problem(4, 4096, 4096, 32, 8, 128)),
    ("gqa8_plain", Problem(2, 4096, 4096, 64, 8, 128)),
    ("gqa8_causal", Problem(2, 4096, 4096, 64, 8, 128)),
    ("plain_d256", Problem(2, 8192, 8192, 16, 16, 256)),
    ("causal_d256", Problem(2, 8192, 8192, 16, 16, 256)),
    ("window", Problem(4, 4096, 4096, 16, 16, 128)),
    ("causal_d128", Problem(0, 0, 0, 16, 16, 128, tuple([8192 >> i for i in range(8)] * 2))),
    ("causal_d128", Problem(0, 0, 0, 16, 16, 128, (2048,) * 16)),
    ("causal_d128", Problem(0, 0, 0, 16, 16, 128, (96,) * 1024)),
    ("causal_d128", Problem(0, 0, 0, 16, 16, 128, (128,) * 768)),
    ("causal_d128", Problem(0, 0, 0, 16, 16, 128, (16384,) + (128,) * 64)),
    ("plain_d128", Problem(8, 512, 512, 32, 32, 128)),
    ("plain_d128", Problem(16, 1024, 1024, 16, 16, 128)),
    ("softcap", Problem(4, 4096, 4096, 16, 16, 128)),
    ("chunked_prefill", Problem(0, 0, 0, 32, 8, 128, (512,) * len(CACHED),
                                tuple(512 + n for n in CACHED))),
]
DESIGNS = ("sm80", "sm90")


def _causal(b, h, q, kv):
    return kv <= q


# Each declaration's mask as FlexAttention's mask_mod (None: no mask).
FLEX_MASKS = {
    "plain_d128": None, "plain_d64": None, "plain_d256": None,
    "causal_d128": _causal, "causal_d64": _causal, "causal_lpt": _causal,
    "causal_d256": _causal, "gqa_causal": _causal, "gqa8_plain": None, "gqa8_causal": _causal,
    "window": lambda b, h, q, kv: _causal(b, h, q, kv) & (q - kv < 256),
    "softcap": _causal,
}
# Each declaration's score as FlexAttention's score_mod (None: the plain score).
FLEX_SCORES = {"softcap": lambda s, b, h, q, kv: 30.0 * (s / 30.0).tanh()}


# Each declaration's mask as FlashAttention-4's (causal, window_size).
FA4_MASKS = {
    "plain_d128": (False, (None, None)), "plain_d64": (False, (None, None)),
    "plain_d256": (False, (None, None)), "causal_d128": (True, (None, None)),
    "causal_d64": (True, (None, None)), "causal_lpt": (True, (None, None)),
    "causal_d256": (True, (None, None)), "gqa_causal": (True, (None, None)),
    "gqa8_plain": (False, (None, None)), "gqa8_causal": (True, (None, None)),
    "window": (True, (255, 0)),  # q_idx - kv_idx < 256: 255 keys to the left
    "softcap": (True, (None, None)),
    "chunked_prefill": (True, (None, None)),  # its causal is bottom-right where Sq < Sk
}
FA4_SOFTCAP = {"softcap": 30.0}


def agrees(peer: str, name: str, out, expected) -> bool:
    """Whether a peer's output is sm90's (`expected`) within 2e-2; says so where not (the
    peer's column is then left out)."""
    error = float((out - expected.float()).norm() / expected.float().norm())
    if error > 2e-2:
        print(f"({peer} disagrees with sm90 on {name}: relative difference {error:.1e})")
    return error <= 2e-2


def fa4_fn(torch, name: str, problem: Problem, args: dict, expected):
    """FlashAttention-4 on the same inputs and mask; None where it is not installed, cannot
    run or disagrees with `expected` (the sm90 kernel's output)."""
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except ImportError:
        return None
    # (its CuTe DSL warns on every compile that an argument is no JitArgument: a table's worth)
    warnings.filterwarnings("ignore", message="Argument aux_data")
    causal, window = FA4_MASKS[name]
    softcap = FA4_SOFTCAP.get(name, 0.0)
    if problem.seqlens:
        def run():
            return flash_attn_varlen_func(
                args["q"], args["k"], args["v"], cu_seqlens_q=args["cu_seqlens_q"],
                cu_seqlens_k=args["cu_seqlens_k"], max_seqlen_q=args["max_seqlen_q"],
                max_seqlen_k=args["max_seqlen_k"], causal=causal, window_size=window,
                softcap=softcap)[0]
    else:
        def run():
            return flash_attn_func(args["q"], args["k"], args["v"], causal=causal,
                                   window_size=window, softcap=softcap)[0]
    try:
        out = run().float()
    except Exception as err:  # noqa: BLE001 - the CuTe DSL raises many types; optional column
        print(f"(FlashAttention-4 unavailable for {name} {problem.describe()}: "
              f"{type(err).__name__}: {str(err).splitlines()[0][:100] if str(err) else ''})")
        return None
    return run if agrees("FlashAttention-4", name, out, expected) else None


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


def flex_fn(torch, kernel, name: str, problem: Problem, args: dict, expected):
    """FlexAttention on the same inputs and mask (a ragged batch: one sequence of documents,
    the mask within a document); None where it cannot run or disagrees with `expected`
    (the sm90 kernel's output)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if name not in FLEX_MASKS or problem.seqlens_k is not None:
        return None  # (a mask of its own lengths: not written here)
    mask, score = FLEX_MASKS[name], FLEX_SCORES.get(name)
    if problem.seqlens:  # (total, H, D) -> (1, H, total, D); both sides share the offsets
        q, k, v = (args[n].unsqueeze(0).transpose(1, 2) for n in ("q", "k", "v"))
        lengths = torch.tensor(problem.seqlens, device="cuda")
        doc = torch.repeat_interleave(torch.arange(len(problem.seqlens), device="cuda"), lengths)
        within, mask = mask, lambda b, h, qi, kv: (doc[qi] == doc[kv]) & within(b, h, qi, kv)
    else:
        q, k, v = (args[n].transpose(1, 2) for n in ("q", "k", "v"))
    for limit in ("recompile_limit", "cache_size_limit"):  # one compile per row, never eager
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 256)
    try:  # create_block_mask compiled: it never materialises the (total x total) mask
        block_mask = None if mask is None else torch.compile(create_block_mask)(
            mask, None, None, q.shape[2], k.shape[2], device="cuda")
        compiled = torch.compile(flex_attention, dynamic=False)

        def run():
            return compiled(q, k, v, score_mod=score, block_mask=block_mask,
                            scale=kernel.options.softmax_scale(),
                            enable_gqa=problem.heads != problem.kv_heads)
        out = run().transpose(1, 2).reshape(expected.shape).float()
    except Exception as err:  # noqa: BLE001 - inductor raises many types; the column is optional
        print(f"(FlexAttention unavailable for {name} {problem.describe()}: "
              f"{type(err).__name__})")
        return None
    return run if agrees("FlexAttention", name, out, expected) else None


def build(job: tuple[str, str, bool]) -> str:
    """One row's kernel for one design and layout, into the on-disk cache (a worker)."""
    name, design, ragged = job
    kernel = mhadsl.compile(SOURCE, name=f"<hopper {design}>")[name]
    kernel.build("sm_90a", ragged=ragged, backend=design)
    return f"{name} {design} {'ragged' if ragged else 'dense'}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-flex", action="store_true", help="leave FlexAttention out")
    parser.add_argument("--only", help="comma-separated declarations: only their rows")
    parser.add_argument("--warm", action="store_true",
                        help="only build the rows' kernels (parallel processes), then exit")
    parser.add_argument("--runs", type=int, default=1, help=(
        "time each row this many times, one line each (a noisy row's range over runs)"))
    cli = parser.parse_args()
    if cli.runs < 1:
        parser.error(f"--runs {cli.runs}: at least 1")
    names = {name for name, _ in WORKLOADS}
    only = set(cli.only.split(",")) if cli.only else names
    if only - names:
        parser.error(f"--only: no rows for {', '.join(sorted(only - names))} "
                     f"(the declarations: {', '.join(sorted(names))})")
    if cli.warm:  # each row's layout, and the dense batch every row is checked on first
        jobs = sorted({(name, d, ragged) for name, problem in WORKLOADS if name in only
                       for d in DESIGNS for ragged in {problem.seqlens is not None, False}})
        with ProcessPoolExecutor(16, mp_context=get_context("spawn")) as pool:
            for done in pool.map(build, jobs):
                print("built", done, flush=True)
        return
    torch = require_gpu()
    programs = {d: mhadsl.compile(SOURCE, name=f"<hopper {d}>") for d in DESIGNS}
    print(f"{datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| kernel | shape | sm80 | sm90 | torch flash (ragged: varlen) | cuDNN | FlexAttention "
          "| FA4 | sm90 / cuDNN (rounds) | sm90 / FA4 (rounds) | rel. error sm80, sm90 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, problem in WORKLOADS:
        if name not in only:
            continue
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
        if problem.seqlens and kernels["sm90"].options.score is None:
            # torch's packed-varlen flash kernel stands in for the flash column (its causal
            # is bottom-right where a sequence has more keys than queries)
            fns["flash"] = varlen_flash_fn(torch, args, causal=FA4_MASKS[name][0])
        expected = fns["sm90"]()
        fns["flex"] = None if cli.no_flex else \
            flex_fn(torch, kernels["sm90"], name, problem, args, expected)
        fns["fa4"] = fa4_fn(torch, name, problem, args, expected)
        for run in range(cli.runs):
            label = name if cli.runs == 1 else f"{name} (run {run + 1}/{cli.runs})"
            print_row(label, problem, flops, time_side_by_side(torch, fns), errors)


def print_row(label: str, problem: Problem, flops: float, times: dict, errors: list) -> None:
    """One line of the table: TFLOP/s per column, sm90's ratios to cuDNN and FA4 by the
    medians and (lowest–highest) over the rounds."""
    tflops = {d: None if t is None else flops / t.ms / 1e9 for d, t in times.items()}

    def f(x):
        return "—" if x is None else f"{x:.0f}"

    def ratio(peer):
        if times[peer] is None:
            return "—"
        rounds = [c / s for s, c in zip(times["sm90"].round_ms, times[peer].round_ms)]
        return f"{tflops['sm90'] / tflops[peer]:.3f}x ({min(rounds):.2f}–{max(rounds):.2f})"
    print(f"| {label} | {problem.describe()} | {f(tflops['sm80'])} | "
          f"{f(tflops['sm90'])} | {f(tflops['flash'])} | {f(tflops['cudnn'])} | "
          f"{f(tflops['flex'])} | {f(tflops['fa4'])} | {ratio('cudnn')} | {ratio('fa4')} | "
          f"{errors[0]:.1e}, {errors[1]:.1e} |", flush=True)


if __name__ == "__main__":
    main()
