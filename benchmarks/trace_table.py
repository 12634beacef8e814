"""Traced against predicted makespan efficiency for the standard schedulers (needs a GPU).

    python benchmarks/trace_table.py OUT_DIR [--jobs 16] [--backend sm80|sm90]
    python benchmarks/trace_table.py OUT_DIR --repredict RUN_DIR     # no GPU

Builds every kernel it needs first, in parallel (the on-disk cache then serves them),
calibrates the causal and the unmasked kernel on this GPU (`mhadsl trace --calibrate`),
then for six workloads (causal H16 D128: dense B4 S4096; ragged 8192..64 twice; one 16384
+ 64 x 128; 16 x 2048; 1024 x 96; and unmasked dense B4 S4096) traces each standard
scheduler, predicts it with the calibrated simulator, and writes OUT_DIR/trace_table.md and
.json (efficiencies, makespans, TFLOP/s, recording overhead, ranking agreement; then each
scheduler's and the declaration's default's TFLOP/s, untraced, the median of interleaved
rounds, with the default against the best) and the skewed batch's timelines under Transient
and LPT (trace_skewed_*.png). `--repredict` recomputes the predicted columns of an earlier
run's table with this simulator.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
SCHEDULERS = (("Transient", ()), ("Persistent", ()), ("Persistent", (("order", "PROMPT_ROTATE"),)),
              ("Queued", ()), ("LPT", ()))
SKEWED = (8192, 4096, 2048, 1024, 512, 256, 128, 64) * 2
CAUSAL = (str(REPO / "examples/causal.mha"), "causal_fwd")
PLAIN = (str(REPO / "examples/plain.mha"), "plain_fwd")
# (name, kernel, batch, seqlen, seqlens)
WORKLOADS = (
    ("dense B4 S4096", CAUSAL, 4, 4096, None),
    ("ragged 8192..64 x2", CAUSAL, 0, 0, SKEWED),
    ("ragged 16384 + 64x128", CAUSAL, 0, 0, (16384,) + (128,) * 64),
    ("ragged 16x2048", CAUSAL, 0, 0, (2048,) * 16),
    ("ragged 1024x96", CAUSAL, 0, 0, (96,) * 1024),
    ("dense B4 S4096 non-causal", PLAIN, 4, 4096, None),
)
HEADS = 16
ROUNDS = 5  # interleaved timing rounds of the untraced kernels per workload (`timing_rounds`)


def _build(job) -> str:
    """One kernel into the on-disk cache (a worker process)."""
    import mhadsl
    from mhadsl.build import KernelRequest, build_kernel
    from mhadsl.codegen.backends import Layout
    path, kernel, scheduler, ragged, trace, backend = job
    program = mhadsl.compile(path)
    start = time.perf_counter()
    build_kernel(program.checked, KernelRequest(kernel, "sm_90a", backend, Layout(1, ragged),
                                                scheduler=scheduler, trace=trace))
    return f"{kernel} {scheduler[0]} ragged={ragged} trace={trace} {backend}: " \
           f"{time.perf_counter() - start:.1f} s"


FORCED_BACKEND: str | None = None  # --backend


@functools.cache  # FORCED_BACKEND is set once, before the first call
def design(path: str, kernel: str) -> str:
    """The design the table measures: --backend, else the one an H200 runs the declaration
    with when nothing forces one."""
    import mhadsl
    from mhadsl.codegen import backends
    return backends.backend_for_arch("sm_90a", FORCED_BACKEND,
                                     mhadsl.compile(path)[kernel].options).name


def prebuild(jobs: int) -> None:
    from mhadsl.analysis.trace import CALIBRATION_SCHEDULERS
    todo = set()
    for _, (path, kernel), _, _, lens in WORKLOADS:
        for name, args in SCHEDULERS:
            for trace in (False, True):
                todo.add((path, kernel, (name, args), lens is not None, trace,
                          design(path, kernel)))
    for path, kernel in (CAUSAL, PLAIN):
        for name, args in CALIBRATION_SCHEDULERS:
            for ragged in (False, True):
                for trace in (False, True):
                    todo.add((path, kernel, (name, args), ragged, trace,
                              design(path, kernel)))
    start = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        for line in pool.imap_unordered(_build, sorted(todo)):
            print("  built", line, flush=True)
    print(f"prebuilt {len(todo)} kernels in {time.perf_counter() - start:.0f} s", flush=True)


def inversions(a: list[float], b: list[float]) -> int:
    """Pairs ordered differently by a and b (Kendall distance; 1 = one adjacent swap)."""
    n = len(a)
    return sum((a[i] - a[j]) * (b[i] - b[j]) < 0 for i in range(n) for j in range(i + 1, n))


def scheduler_label(name: str, args: tuple) -> str:
    return name + "".join(f"({k}={v})" for k, v in args)


def measure(out: Path, jobs: int) -> tuple[list[dict], dict, list[dict]]:
    """Calibrate, then trace and predict every (workload, scheduler) on this GPU."""
    prebuild(jobs)
    import mhadsl
    from mhadsl.analysis import trace
    programs = {path: mhadsl.compile(path) for path, _ in (CAUSAL, PLAIN)}
    calibrations = {}
    for path, kernel in (CAUSAL, PLAIN):
        costs, file, runs = trace.calibrate(programs[path], kernel, heads=HEADS,
                                            backend=design(path, kernel))
        calibrations[kernel] = {"costs": [vars(c) for c in costs], "file": file,
                                "runs": [(r.scheduler, r.workload.describe(), r.block_n)
                                         for r in runs]}
        for c in costs:
            print(f"calibrated {kernel}: " + ", ".join(f"{k} {v:.0f}" for k, v in
                                                      vars(c).items()), flush=True)
        Path(out / f"calibration_{kernel}.json").write_text(Path(file).read_text())

    rows, defaults = [], []
    for label, (path, kernel), batch, seqlen, lens in WORKLOADS:
        program = programs[path]
        for name, args in SCHEDULERS:
            workload = trace.Workload(HEADS, batch, seqlen, lens)
            run = trace.run_trace(program, kernel, workload, scheduler=name, args=args,
                                  backend=design(path, kernel))
            model = trace.cost_model(program, run)
            result = trace.predict(program, run, model)
            cmp = trace.compare(run, result)
            row = {"workload": label, "scheduler": scheduler_label(name, args),
                   "ms": run.ms_untraced,
                   "ms_traced": run.ms_traced, "tflops": run.tflops, "overhead": run.overhead,
                   "measured_eff": cmp.measured.efficiency,
                   "predicted_eff": cmp.predicted.efficiency,
                   "measured_makespan_us": cmp.measured.makespan / 1e3,
                   "predicted_makespan_us": cmp.predicted.makespan / 1e3,
                   "covered": not (run.missing or run.repeated or run.invalid)
                   and run.written == len(run.records["start"]) and result.covered_exactly_once,
                   "grid": list(run.grid), "ctas_per_sm": run.ctas_per_sm,
                   "num_sms": run.num_sms,
                   "tile": f"{run.backend} {run.block_m}x{run.block_n}",
                   "differences": cmp.differences}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "differences"}), flush=True)
            if lens == SKEWED and name in ("Transient", "LPT"):
                trace.plot(run, cmp, str(out / f"trace_skewed_{name.lower()}.png"))
        group = rows[-len(SCHEDULERS):]
        rounds = timing_rounds(program, path, kernel, workload, run.flops)
        for row, (name, args) in zip(group, SCHEDULERS):
            row["tflops_rounds"] = rounds[scheduler_label(name, args)]
        defaults.append({"workload": label, "scheduler": program[kernel].options.scheduler,
                         "tflops_rounds": rounds["default"]})
    return rows, calibrations, defaults


def timing_rounds(program, path: str, kernel: str, workload, flops: float
                  ) -> dict[str, list[float]]:
    """TFLOP/s of each standard scheduler's kernel and of the declaration's default, untraced,
    in ROUNDS rounds that take them in turn (the spread between two runs of one schedule is
    wider than the differences being ranked, so each gets the same moments of the GPU)."""
    import torch

    from mhadsl.analysis import trace
    from mhadsl.host.bench import Problem, make_inputs, time_side_by_side
    kernels = {scheduler_label(name, args): trace.scheduler_kernel(
        program, kernel, name, args, design(path, kernel)) for name, args in SCHEDULERS}
    kernels["default"] = trace.scheduler_kernel(program, kernel, backend=design(path, kernel))
    w = workload
    problem = Problem(w.batch, w.seqlen, w.seqlen, w.heads, w.heads,
                      kernels["default"].options.head_dim, w.seqlens)
    inputs = make_inputs(torch, kernels["default"], problem)
    times = time_side_by_side(torch, {label: (lambda k=k: k(**inputs))
                                      for label, k in kernels.items()}, rounds=ROUNDS)
    return {label: [flops / (ms * 1e-3) / 1e12 for ms in t.round_ms]
            for label, t in times.items()}


def repredict(source: Path) -> tuple[list[dict], dict, list[dict]]:
    """The traced columns of an earlier run (its trace_table.json), the predicted ones
    recomputed here, on the CPU, by this simulator from that run's calibration; a constant
    the calibration lacks (`empty_cta`) is fitted as `trace.fit_runs` does, to the traced
    efficiency of that run's rows for the calibration batches under Transient."""
    import mhadsl
    from mhadsl.analysis import costmodel, trace
    data = json.loads((source / "trace_table.json").read_text())
    calibrations = data["calibrations"]
    by_label = {label: (path, kernel, batch, seqlen, lens)
                for label, (path, kernel), batch, seqlen, lens in WORKLOADS}
    schedulers = {scheduler_label(name, args): (name, args) for name, args in SCHEDULERS}
    rows = data["rows"]

    def setting(row):
        path, kernel, batch, seqlen, lens = by_label[row["workload"]]
        name, args = schedulers[row["scheduler"]]
        block_m, block_n = map(int, row["tile"].split()[-1].split("x"))
        sets = [costmodel.Costs(**c) for c in calibrations[kernel]["costs"]]
        costs = next((c for c in sets if c.block_n == block_n), sets[0]).for_block_n(block_n)
        run = trace.TraceRun(kernel, name, args, trace.Workload(HEADS, batch, seqlen, lens),
                             "", row["tile"].split()[0], "sm_90a", block_m, block_n,
                             row.get("num_sms", 132), row["ctas_per_sm"],  # 132: the H200's
                             tuple(row["grid"]), {}, 0, 0.0, 0.0, 0.0)
        return mhadsl.compile(path), kernel, run, costs

    empty: dict[str, list[float]] = {}
    calibration_batches = {b for b in trace.CALIBRATION_BATCHES}
    for row in rows:
        program, kernel, run, costs = setting(row)
        w = run.workload
        if row["scheduler"] == "Transient" and (w.batch, w.seqlen, w.seqlens) in \
                calibration_batches and costs.empty_cta == 0:
            fitted = trace.fit_empty_cta(program, run, costs, row["measured_eff"])
            if fitted is not None:
                empty.setdefault(kernel, []).append(fitted)
    for kernel, values in empty.items():
        calibrations[kernel]["empty_cta_refitted"] = float(np.median(values))
    for row in rows:
        program, kernel, run, costs = setting(row)
        costs = dataclasses.replace(
            costs, empty_cta=calibrations[kernel].get("empty_cta_refitted", costs.empty_cta))
        model = trace.cost_model(program, run, costs)
        predicted = trace.Timeline.from_simulation(trace.predict(program, run, model))
        row["predicted_eff"] = predicted.efficiency
        row["predicted_makespan_us"] = predicted.makespan / 1e3
    return rows, calibrations, data.get("defaults", [])


def default_against_best(rows: list[dict], defaults: list[dict]) -> list[str]:
    """The table of the interleaved timing rounds: each scheduler's median TFLOP/s, and the
    declaration's default against the best of them and against Transient."""
    if not defaults:
        return []
    names = [scheduler_label(name, args) for name, args in SCHEDULERS]
    lines = [f"\nUntraced TFLOP/s, median of {ROUNDS} interleaved rounds:\n",
             "| workload | " + " | ".join(names) + " | default | default / best | "
             "default / Transient |", "|---|" + "---|" * (len(names) + 3)]
    for d in defaults:
        group = {r["scheduler"]: float(np.median(r["tflops_rounds"])) for r in rows
                 if r["workload"] == d["workload"]}
        best = max(group.values())
        default = float(np.median(d["tflops_rounds"]))
        lines.append(f"| {d['workload']} | " + " | ".join(f"{group[n]:.0f}" for n in names)
                     + f" | {default:.0f} ({d['scheduler']}) | {default / best:.3f} | "
                     f"{default / group['Transient']:.3f} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--repredict", metavar="DIR",
                        help="no GPU: take DIR/trace_table.json's traced columns and "
                             "recompute the predicted ones with this simulator")
    parser.add_argument("--backend", help="force a kernel design (sm80, sm90)")
    opts = parser.parse_args()
    global FORCED_BACKEND
    FORCED_BACKEND = opts.backend
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    if opts.repredict:
        rows, calibrations, defaults = repredict(Path(opts.repredict))
    else:
        rows, calibrations, defaults = measure(out, opts.jobs)

    lines = ["| workload | scheduler | tile | ms | TFLOP/s | recording | traced eff | "
             "predicted eff | diff (pts) | traced makespan us | predicted makespan us | "
             "coverage |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['scheduler']} | {r['tile']} | {r['ms']:.3f} | "
                     f"{r['tflops']:.0f} "
                     f"| {r['overhead']:+.1%} | {r['measured_eff']:.1%} | "
                     f"{r['predicted_eff']:.1%} | "
                     f"{(r['predicted_eff'] - r['measured_eff']) * 100:+.1f} | "
                     f"{r['measured_makespan_us']:.0f} | {r['predicted_makespan_us']:.0f} | "
                     f"{'exactly once' if r['covered'] else 'FAILED'} |")
    lines.append("")
    worst = max(abs(r["predicted_eff"] - r["measured_eff"]) for r in rows) * 100
    lines.append(f"Largest efficiency difference: {worst:.1f} points.")
    for what, measured_key, predicted_key, best_first in (
            ("efficiency", "measured_eff", "predicted_eff", True),
            ("makespan", "measured_makespan_us", "predicted_makespan_us", False)):
        lines.append(f"\nRanking by {what} (inversions: pairs the simulator orders "
                     f"differently; 1 = one adjacent swap):")
        for label, *_ in WORKLOADS:
            group = [r for r in rows if r["workload"] == label]
            swaps = inversions([r[measured_key] for r in group],
                               [r[predicted_key] for r in group])

            def order(key):
                return " > ".join(r["scheduler"] for r in sorted(
                    group, key=lambda r: r[key], reverse=best_first))
            lines.append(f"- {label}: {swaps} inversions; traced {order(measured_key)}; "
                         f"predicted {order(predicted_key)}")
    lines += default_against_best(rows, defaults)
    (out / "trace_table.md").write_text("\n".join(lines) + "\n")
    (out / "trace_table.json").write_text(json.dumps({"rows": rows, "calibrations": calibrations,
                                                      "defaults": defaults}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
