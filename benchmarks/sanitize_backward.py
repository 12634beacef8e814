"""compute-sanitizer's memcheck and racecheck over the backward pass: dense and ragged batches
(lengths 0 and 1 among them), causal, GQA, softcap, fp16 D64, D256, a learned bias table's
gradient (`operand_grads`), each in atomic and deterministic mode (on sm_90a, both modes
run the Hopper design but the operand gradients').
Needs an NVIDIA GPU, torch and compute-sanitizer on PATH.

    python3 benchmarks/sanitize_backward.py [--tools memcheck,racecheck]

The kernels are built first, outside the sanitizer; each tool then runs this script's
`--worker` mode, which launches every case and checks its gradients against
`mhadsl.reference_backward` (float64). Exit status 0 when every tool ran and found no error.
"""
from __future__ import annotations

import sys

import numpy as np

import mhadsl

sys.path.insert(0, "benchmarks")
from sanitize import relative_error, worker_main  # noqa: E402

KERNELS = "mha_"  # what compute-sanitizer watches
CASES = [  # example file or source, kernel, query heads, K/V heads, lengths (None: dense
    # B1 S130), the f32 tensor operands whose gradients it asks for (their shapes); atomic
    # calls on sm_90a run the Hopper design (dense or ragged), and deterministic
    # ones too where their scheduler hands out K/V tiles in order (the default, Queued: the
    # softcap and GQA D64 cases, whose dQ is added in that order)
    ("examples/causal.mha", "causal_fwd", 2, 2, None, {}),
    ("examples/gqa.mha", "gqa_causal", 8, 2, [70, 0, 129], {}),
    ("examples/softcap.mha", "softcap_causal", 2, 2, [1, 200], {}),
    ("examples/plain.mha", "plain_fp16_d64", 2, 2, None, {}),
    ("attention gqa_d64 { dtype = bf16  head_dim = 64\n"
     "  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }", "gqa_d64", 8, 2, [70, 0, 129, 1], {}),
    ("examples/plain.mha", "plain_fp16_d64", 2, 2, [1, 0, 127, 65], {}),
    ("attention causal_d256 { dtype = bf16  head_dim = 256\n"  # a 64-row K/V tile
     "  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }", "causal_d256", 4, 2, [1, 0, 150], {}),
    ("examples/relative_bias.mha", "relative_bias", 4, 2, [1, 0, 150], {"table": (4, 100)}),
]


def worker() -> int:
    import torch
    g = torch.Generator(device="cuda").manual_seed(0)
    worst = 0.0
    for file, name, hq, hkv, lengths, learned in CASES:
        kern = mhadsl.compile(file)[name]
        d = kern.options.head_dim
        dtype = torch.bfloat16 if kern.options.dtype == "bf16" else torch.float16

        def randn(*shape):
            return torch.randn(*shape, generator=g, device="cuda").to(dtype)
        if lengths is None:
            q, k, v = randn(1, 130, hq, d), randn(1, 130, hkv, d), randn(1, 130, hkv, d)
            ragged = {}
        else:
            cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32,
                              device="cuda")
            total = sum(lengths)
            q, k, v = randn(total, hq, d), randn(total, hkv, d), randn(total, hkv, d)
            ragged = dict(cu_seqlens_q=cu, cu_seqlens_k=cu)
        operands = {n: torch.randn(*shape, generator=g, device="cuda")
                    for n, shape in learned.items()}
        grads = tuple(learned)
        out, lse = kern(q, k, v, return_lse=True, **ragged, **operands)
        dout = randn(*out.shape)
        want = mhadsl.reference_backward(kern, q, k, v, dout, operand_grads=grads, **ragged,
                                         **operands)
        for deterministic in (False, True):
            got = kern.backward(q, k, v, out, lse, dout, deterministic=deterministic,
                                operand_grads=grads, **ragged, **operands)
            if grads:  # (the operands' gradients last, by name)
                got = (*got[:-1], *got[-1].values())
                want_all = (*want[:-1], *want[-1].values())
            else:
                want_all = want
            worst = max(worst, *map(relative_error, got, want_all))
    print(f"{len(CASES)} backward cases x 2 modes, worst relative error {worst:.2e}")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(worker_main(__file__, KERNELS, worker))
