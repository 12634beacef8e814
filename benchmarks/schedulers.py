"""Benchmark: the scheduler a declaration gets when it names none, against each standard
scheduler with its parameters' defaults, on every workload class of the forward pass
(dense, short sequences, many medium, a skewed ragged batch, one long sequence with many
short ones, many medium and many very short ragged ones), causal and unmasked.

    python benchmarks/schedulers.py [--runs 3] [--json OUT.json] [--only causal|plain]
    python benchmarks/schedulers.py --warm      # only build every kernel (parallel processes)

bf16, H16 D128 (short sequences: B8 S512 H32). TFLOP/s count the (query, key) pairs the
mask keeps. Each run times every scheduler of a row in turn over six interleaved rounds
(`time_side_by_side`); a row is run `--runs` times in one process and reports the median
of the runs and their range. Every kernel is checked against the float64 reference on a
small ragged batch first. `--json` writes the rows in benchmarks/results.json's format
(kind "schedulers"; peers are the standard schedulers).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import mhadsl
from mhadsl.host.bench import (Problem, allowed_pairs, check, make_inputs, require_gpu,
                               source_commit, time_side_by_side)

MASKS = {"causal": "mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx", "plain": ""}
SCHEDULERS = {"default": None, "Transient": "Transient()", "Persistent": "Persistent()",
              "Queued": "Queued()", "LPT": "LPT()"}
# --control: the default's declaration a second time, timed last in each round: how far two
# copies of one kernel differ in this harness
CONTROL = "again"
SKEWED = tuple(8192 >> i for i in range(8)) * 2
WORKLOADS = [
    ("dense", Problem(4, 4096, 4096, 16, 16, 128)),
    ("short sequences", Problem(8, 512, 512, 32, 32, 128)),
    ("many medium", Problem(16, 1024, 1024, 16, 16, 128)),
    ("ragged, skewed", Problem(0, 0, 0, 16, 16, 128, SKEWED)),
    ("ragged, one long + many short", Problem(0, 0, 0, 16, 16, 128, (16384,) + (128,) * 64)),
    ("ragged, many medium", Problem(0, 0, 0, 16, 16, 128, (2048,) * 16)),
    ("ragged, many very short", Problem(0, 0, 0, 16, 16, 128, (96,) * 1024)),
]
SMALL = {True: Problem(0, 0, 0, 4, 4, 128, (0, 1, 127, 129, 700)),
         False: Problem(1, 200, 200, 4, 4, 128)}


def kernel_name(mask: str, scheduler: str) -> str:
    return f"{mask}_{scheduler}"


SOURCE = 'import "std/schedulers.mha"\n' + "\n".join(
    f"attention {kernel_name(mask, name)} {{ dtype = bf16  head_dim = 128  {rule}"
    + (f"  scheduler = {binding}" if binding else "") + " }"
    for mask, rule in MASKS.items() for name, binding in {**SCHEDULERS, CONTROL: None}.items())


def program():
    return mhadsl.compile(SOURCE, name="schedulers.mha")


def warm(job: tuple[str, bool]) -> str:
    """Build (or load from the on-disk cache) one kernel for one layout."""
    name, ragged = job
    torch = require_gpu()
    kern = program()[name]
    kern(**make_inputs(torch, kern, SMALL[ragged]))
    torch.cuda.synchronize()
    return f"{name} {'ragged' if ragged else 'dense'}"


def adaptive_order(problem: Problem, tile_m: int, ctas: int) -> str:
    """The order `Adaptive` takes on `problem` (std/schedulers.mha's `longest_first_pays`)."""
    lengths = problem.seqlens or (problem.seqlen_q,) * problem.batch
    tiles = [-(-n // tile_m) for n in lengths]
    longest_first = problem.heads * sum(tiles) < max(tiles) * ctas
    return "LPT" if longest_first else "Queued"


def measure_row(torch, prog, mask: str, label: str, problem: Problem, runs: int,
                control: bool) -> dict:
    names = list(SCHEDULERS) + ([CONTROL] if control else [])
    kernels = {name: prog[kernel_name(mask, name)] for name in names}
    inputs = make_inputs(torch, kernels["default"], problem)
    flops = 4.0 * problem.head_dim * problem.heads * allowed_pairs(kernels["default"], problem)
    tflops = {name: [] for name in kernels}
    for _ in range(runs):
        times = time_side_by_side(torch, {name: (lambda k=k: k(**inputs))
                                          for name, k in kernels.items()}, rounds=6)
        for name, t in times.items():
            tflops[name].append(round(flops / (t.ms * 1e-3) / 1e12, 1))
    default = kernels["default"]
    chosen = default.options.scheduler
    if chosen == "Adaptive":
        ctas = torch.cuda.get_device_properties(0).multi_processor_count
        tile_m = default.build("sm_90a", ragged=problem.seqlens is not None).config.block_m
        chosen += f", {adaptive_order(problem, tile_m, ctas)}'s order"
    return {"mask": mask, "workload": label, "shape": problem.describe(), "tflops": tflops,
            "default_is": chosen}


def results_row(row: dict, gpu: str, software: str, runs: int) -> dict:
    tf = row["tflops"]
    return {"kind": "schedulers",
            "workload": f"{row['mask']}, {row['workload']}",
            "shape": row["shape"], "ours": tf["default"],
            "peers": {name: tf[name] for name in SCHEDULERS if name != "default"},
            "detail": f"the default: {row['default_is']}",
            "date": str(datetime.date.today()), "gpu": gpu, "software": software,
            "commit": source_commit(),
            "command": f"python3 benchmarks/schedulers.py --runs {runs}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", help="write the rows in benchmarks/results.json's format")
    parser.add_argument("--only", choices=tuple(MASKS))
    parser.add_argument("--warm", action="store_true")
    parser.add_argument("--control", action="store_true",
                        help="also time a second copy of the default's kernel (last column)")
    args = parser.parse_args()
    masks = [args.only] if args.only else list(MASKS)
    if args.warm:
        jobs = [(kernel_name(m, s), r) for m in masks for s in SCHEDULERS for r in (True, False)]
        with ProcessPoolExecutor(8, mp_context=get_context("spawn")) as pool:
            for done in pool.map(warm, jobs):
                print("built", done, flush=True)
        return 0
    torch = require_gpu()
    prog = program()
    gpu, software = torch.cuda.get_device_name(), f"torch {torch.__version__}"
    print(f"{datetime.date.today()}, {gpu}, {software}, commit {source_commit()}")
    for m in masks:
        for name in SCHEDULERS:
            error = check(torch, prog[kernel_name(m, name)], SMALL[True])[0]
            assert error < 2e-2, f"{kernel_name(m, name)}: relative error {error:.1e}"
    columns = list(SCHEDULERS) + ([CONTROL] if args.control else [])
    print("| mask | workload | shape | " + " | ".join(columns) + " | default / best |")
    print("|---|---|---|" + "---|" * (len(columns) + 1))
    rows = []
    for m in masks:
        for label, problem in WORKLOADS:
            row = measure_row(torch, prog, m, label, problem, args.runs, args.control)
            rows.append(row)
            med = {name: statistics.median(v) for name, v in row["tflops"].items()}
            best = max(v for name, v in med.items() if name not in ("default", CONTROL))
            print(f"| {m} | {label} | {row['shape']} | "
                  + " | ".join(f"{med[name]:.0f}" for name in columns)
                  + f" | {med['default'] / best:.3f} ({row['default_is']}) |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([results_row(r, gpu, software, args.runs) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
