"""Benchmark: LPT's head sections against the other dynamic orders, causal D128.

    python benchmarks/lpt_sections.py [--backend sm90] [--only GQA]     # needs a GPU

Times `LPT()` (the default sections), `LPT(heads_per_section = 16, 4, 2)`, Queued and
Persistent with PROMPT_ROTATE on the same inputs (H16, and GQA 32:8), in five rounds that
take the kernels in turn (`time_side_by_side`), and prints each one's median TFLOP/s and
LPT's against the best: the measurement behind `section_heads` in std/schedulers.mha.
"""
import argparse

import mhadsl
from mhadsl.host.bench import Problem, allowed_pairs, make_inputs, require_gpu, time_side_by_side

SCHEDULERS = {"Queued": "Queued()", "LPT": "LPT()", "LPT16": "LPT(heads_per_section = 16)",
              "LPT4": "LPT(heads_per_section = 4)", "LPT2": "LPT(heads_per_section = 2)",
              "PROMPT_ROTATE": "Persistent(order = PROMPT_ROTATE)"}
WORKLOADS = [
    ("dense B4 S4096", Problem(4, 4096, 4096, 16, 16, 128)),
    ("ragged 8192..64 x2", Problem(0, 0, 0, 16, 16, 128, tuple(8192 >> i for i in range(8)) * 2)),
    ("ragged 16384 + 64x128", Problem(0, 0, 0, 16, 16, 128, (16384,) + (128,) * 64)),
    ("ragged 16x2048", Problem(0, 0, 0, 16, 16, 128, (2048,) * 16)),
    ("ragged 4x8192", Problem(0, 0, 0, 16, 16, 128, (8192,) * 4)),
    ("ragged 1024x96", Problem(0, 0, 0, 16, 16, 128, (96,) * 1024)),
    ("ragged 768x128", Problem(0, 0, 0, 16, 16, 128, (128,) * 768)),
    ("ragged 256x384", Problem(0, 0, 0, 16, 16, 128, (384,) * 256)),
    ("GQA 32:8 dense B4 S4096", Problem(4, 4096, 4096, 32, 8, 128)),
    ("GQA 32:8 dense B1 S16384", Problem(1, 16384, 16384, 32, 8, 128)),
    ("GQA 32:8 ragged 8192..64 x2",
     Problem(0, 0, 0, 32, 8, 128, tuple(8192 >> i for i in range(8)) * 2)),
]
ROUNDS = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", help="force a kernel design (sm80, sm90)")
    parser.add_argument("--only", default="", help="the workloads whose name has this text")
    opts = parser.parse_args()
    torch = require_gpu()
    source = 'import "std/schedulers.mha"\n' + "\n".join(
        f"attention k_{label} {{ dtype = bf16  head_dim = 128  scheduler = {decl}\n"
        "    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }" for label, decl in SCHEDULERS.items())
    program = mhadsl.compile(source, name="<lpt_sections>")
    kernels = {label: program[f"k_{label}"] for label in SCHEDULERS}
    if opts.backend:
        for k in kernels.values():
            k.backend = opts.backend
    print("| workload | " + " | ".join(SCHEDULERS) + " | LPT / best |")
    print("|---|" + "---|" * (len(SCHEDULERS) + 1))
    for name, p in WORKLOADS:
        if opts.only not in name:
            continue
        args = make_inputs(torch, kernels["LPT"], p)
        flops = 4.0 * p.head_dim * p.heads * allowed_pairs(kernels["LPT"], p)
        times = time_side_by_side(torch, {label: (lambda k=k: k(**args))
                                          for label, k in kernels.items()}, rounds=ROUNDS)
        median = {label: flops / t.ms / 1e9 for label, t in times.items()}
        print(f"| {name} | " + " | ".join(f"{median[label]:.0f}" for label in SCHEDULERS)
              + f" | {median['LPT'] / max(median.values()):.3f} |", flush=True)


if __name__ == "__main__":
    main()
