"""Benchmark: tile and stage variants of one kernel design against cuDNN, in one process.

    python benchmarks/tiles.py [--backend sm90]      # needs a GPU

Each row declares the variant (`tile = (128, N)`, `stages = S`) in `.mha`, so `check` and the
spill-free build search treat it as a user's declaration would; the build that actually ran
(its KV tile and stages) is printed with it. cuDNN is re-timed on every row: its spread
between rows of the same shape is the noise floor for reading the differences.
"""
import argparse

import mhadsl
from mhadsl.host.bench import Problem, allowed_pairs, make_inputs, require_gpu, time_ms, \
    torch_baselines

CAUSAL = "mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx"
D128, D64, D256 = (Problem(4, 4096, 4096, 16, 16, 128), Problem(4, 4096, 4096, 32, 32, 64),
                   Problem(2, 8192, 8192, 16, 16, 256))
VARIANTS = [  # (problem, causal, KV tile or (rows, KV tile) or None, stages or None)
    (D128, False, None, None), (D128, False, 128, 3), (D128, False, 160, 2), (D128, False, 176, 2),
    (D128, True, None, None), (D128, True, 128, 3),
    (D64, False, None, None), (D64, False, 128, 3), (D64, False, 192, 2),
    (D64, True, None, None), (D64, True, 192, 2),
    (D64, False, (128, 128), 2), (D64, True, (128, 128), 2),  # two consumer warpgroups
    (D64, True, (192, 128), 2),
    (D256, False, None, None), (D256, False, 64, 2), (D256, False, 48, 2),
    (D256, True, None, None), (D256, True, 48, 2),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="sm90", help="the kernel design (sm80, sm90)")
    opts = parser.parse_args()
    torch = require_gpu()
    print("| head dim | mask | declared | built | TFLOP/s | cuDNN | ratio |")
    print("|---|---|---|---|---|---|---|")
    for p, causal, block_n, stages in VARIANTS:
        tile = block_n if isinstance(block_n, tuple) else (128, block_n)
        declared = " ".join(filter(None, (block_n and f"tile = {tile}",
                                          stages and f"stages = {stages}")))
        kernel = mhadsl.compile(
            f'import "std/schedulers.mha"\nattention a {{ dtype = bf16  head_dim = '
            f'{p.head_dim}  {declared}  {CAUSAL if causal else ""} }}')["a"]
        kernel.backend = opts.backend
        args = make_inputs(torch, kernel, p)
        flops = 4.0 * p.head_dim * p.heads * allowed_pairs(kernel, p)
        ours = flops / time_ms(torch, lambda: kernel(**args), reps=50) / 1e9
        cudnn_ms = torch_baselines(torch, kernel, p, args)["cudnn"]
        cudnn = flops / cudnn_ms / 1e9 if cudnn_ms else None
        config = kernel.build("sm_90a", backend=opts.backend).config
        built = f"{config.block_m}x{config.block_n}, {getattr(config, 'stages', 2)} stages"
        ratio = f"{ours / cudnn:.2f}x" if cudnn else "—"
        print(f"| {p.head_dim} | {'causal' if causal else '—'} | {declared or 'default'} | "
              f"{built} | {ours:.0f} | {f'{cudnn:.0f}' if cudnn else '—'} | {ratio} |",
              flush=True)


if __name__ == "__main__":
    main()
