"""Benchmark: the Hopper backward with a GQA group's query heads split over CTAs
(`backward_sm90`'s `split_group`) and without, on the same calls, in one process.

    python benchmarks/backward_split_group.py           # every row (needs an H100/H200)
    python benchmarks/backward_split_group.py --runs 3  # each row timed three times
    python benchmarks/backward_split_group.py --deterministic  # deterministic mode's builds

Each row builds its causal D128 declaration twice, `backward_sm90.SPLIT_GROUP_MIN` (and
`DETERMINISTIC_SPLIT_GROUP_MIN`) set so that the call's group splits and so that it does not, each in a compile cache of its own (the
cache's key does not hold the threshold), and asserts which build each call loaded. Both
builds' gradients are checked against the float64 reference (`mhadsl.reference_backward`)
on a small call of the row's heads and against each other on the row's call; then the whole
backward of both is timed side by side (`time_side_by_side`: CUDA events, every column in
turn), and each kernel by CUPTI (`kernel_times`): the main kernel `mha_bwd`, and the split
build's row kernels (preprocess, dQ's postprocess, `mha_bwd_kv_postprocess`) beside the
other's.
"""
import argparse
import datetime
import os
import tempfile

import numpy as np

import mhadsl
from mhadsl.codegen.backends import backward_sm90
from mhadsl.host.bench import kernel_times, require_gpu, source_commit, time_side_by_side

SOURCE = """
import "std/schedulers.mha"
attention causal { dtype = bf16  head_dim = 128  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
"""
ROWS = [  # B, Hq, Hkv, S
    (2, 48, 8, 4096), (4, 32, 8, 4096), (8, 32, 8, 2048),
]
# SPLIT_GROUP_MIN and DETERMINISTIC_SPLIT_GROUP_MIN for either build: any group splits, or
# none does
THRESHOLDS = {"split": 2, "whole": 2**31}
SETTINGS = ("SPLIT_GROUP_MIN", "DETERMINISTIC_SPLIT_GROUP_MIN")
ROW_KERNELS = ("mha_bwd_preprocess", "mha_bwd_postprocess", backward_sm90.KV_POSTPROCESS)


def relative(got, want) -> float:
    got, want = (np.asarray(x, dtype=np.float64) for x in (got, want))
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def loaded_kernel(setting: str, q, k, v, dout, deterministic: bool):
    """The declaration compiled afresh, its backward built and loaded with the setting's
    thresholds in a compile cache of its own: the kernel, its forward's (out, lse) and its
    gradients."""
    kern = mhadsl.compile(SOURCE, name=f"split_group_bench_{setting}")["causal"]
    defaults = {name: getattr(backward_sm90, name) for name in SETTINGS}
    cache = os.environ.get("MHADSL_CACHE_DIR")
    for name in SETTINGS:
        setattr(backward_sm90, name, THRESHOLDS[setting])
    os.environ["MHADSL_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"mhadsl-{setting}-")
    try:
        out, lse = kern(q, k, v, return_lse=True)
        grads = kern.backward(q, k, v, out, lse, dout, deterministic=deterministic)
    finally:
        for name, value in defaults.items():
            setattr(backward_sm90, name, value)
        if cache is None:
            del os.environ["MHADSL_CACHE_DIR"]
        else:
            os.environ["MHADSL_CACHE_DIR"] = cache
    builds = [loaded for loaded in kern.launcher.loaded.values() if loaded.layout.backward]
    assert [(loaded.config.split_group, loaded.config.deterministic) for loaded in builds] \
        == [(setting == "split", deterministic)], builds
    return kern, (out, lse), grads


def check_against_reference(torch, kernels: dict, Hq, Hkv, deterministic: bool):
    """Both builds' gradients of a small call of the row's heads within 1e-2 of float64's."""
    q, k, v, dout = (torch.randn(1, 512, h, 128, device="cuda", dtype=torch.bfloat16)
                     for h in (Hq, Hkv, Hkv, Hq))
    for setting, kern in kernels.items():
        want = mhadsl.reference_backward(kern, q, k, v, dout)
        out, lse = kern(q, k, v, return_lse=True)
        got = kern.backward(q, k, v, out, lse, dout, deterministic=deterministic)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            error = relative(g.float().cpu().numpy(), w)
            assert error < 1e-2, f"{setting} build: {name} {error:.1e} from float64"


def row(torch, B, Hq, Hkv, S, deterministic: bool):
    q = torch.randn(B, S, Hq, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, S, Hkv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    kernels, outputs, grads = {}, {}, {}
    for setting in THRESHOLDS:
        kernels[setting], outputs[setting], grads[setting] = loaded_kernel(
            setting, q, k, v, dout, deterministic)
    check_against_reference(torch, kernels, Hq, Hkv, deterministic)
    apart = max(relative(s.float().cpu().numpy(), w.float().cpu().numpy())
                for s, w in zip(grads["split"], grads["whole"]))

    def backward(setting):
        kern, (out, lse) = kernels[setting], outputs[setting]
        return lambda: kern.backward(q, k, v, out, lse, dout, deterministic=deterministic)

    timings = time_side_by_side(torch, {setting: backward(setting) for setting in kernels})
    times = {setting: kernel_times(torch, backward(setting)) for setting in kernels}
    rows = {setting: sum(times[setting].get(n, 0.0) for n in ROW_KERNELS) / 1e3
            for setting in kernels}
    main = {setting: times[setting]["mha_bwd"] / 1e3 for setting in kernels}
    mode = ", deterministic" if deterministic else ""
    print(f"| B{B} H{Hq}:{Hkv} S{S} D128 causal{mode} | {timings['whole'].ms:.3f} | "
          f"{timings['split'].ms:.3f} | {timings['whole'].ms / timings['split'].ms:.3f}x | "
          f"{main['whole']:.3f} | {main['split']:.3f} | {main['whole'] / main['split']:.3f}x | "
          f"{rows['whole']:.3f} | {rows['split']:.3f} | {apart:.1e} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="time each row this many times")
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic mode's builds (bitwise repeatable gradients)")
    cli = parser.parse_args()
    if cli.runs < 1:
        parser.error(f"--runs {cli.runs}: at least 1")
    torch = require_gpu()
    print(f"backward, a GQA group split over CTAs or not, {datetime.date.today()}, "
          f"{torch.cuda.get_device_name()}, bf16, commit {source_commit()}; times in ms")
    print("| shape | whole group | split | speedup | main kernel, whole | main kernel, split "
          "| speedup | row kernels, whole | row kernels, split | split vs whole (relative) |")
    for spec in ROWS:
        for _ in range(cli.runs):
            row(torch, *spec, cli.deterministic)


if __name__ == "__main__":
    main()
