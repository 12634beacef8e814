"""Benchmark: mhadsl attention kernels next to torch SDPA's flash and cuDNN backends.

    python benchmarks/attention.py            # `mhadsl bench`'s shapes + masked/ragged workloads

Same process, same inputs, median of timed runs after warm-up (CUDA events); TFLOP/s count
4*D*H per (query, key) pair the mask keeps. Prints a Markdown table (figures worth keeping go
into benchmarks/results.json, from which benchmarks/report.py writes BENCHMARKS.md).
"""
import datetime

import mhadsl
from mhadsl.host.bench import Problem, format_table, measure, require_gpu, run_suite

EXTRA = """
import "std/schedulers.mha"
attention causal { dtype = bf16  head_dim = 128  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention window { dtype = bf16  head_dim = 128
                   mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx && q_idx - kv_idx < 256 }
attention gqa_causal { dtype = bf16  head_dim = 128  gqa = 4
                       mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
"""


def main() -> None:
    torch = require_gpu()
    rows = run_suite(torch)
    extra = mhadsl.compile(EXTRA, name="<extra>")
    doc = [8192 >> i for i in range(8)] * 2
    for kernel, problem in (
        ("causal", Problem(0, 0, 0, 16, 16, 128, tuple(doc))),
        ("causal", Problem(0, 0, 0, 16, 16, 128, (2048,) * 16)),
        ("causal", Problem(0, 0, 0, 16, 16, 128, (96,) * 1024)),
        ("window", Problem(4, 4096, 4096, 16, 16, 128)),
        ("gqa_causal", Problem(4, 4096, 4096, 32, 8, 128)),
    ):
        rows.append(measure(torch, extra[kernel], problem))
    print(f"{datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(format_table(rows))


if __name__ == "__main__":
    main()
