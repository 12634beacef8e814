"""Run compute-sanitizer's memcheck, racecheck and synccheck over the attention kernel driven
by every standard scheduler, on a dense and a ragged batch (small shapes), and report what
each tool finds. Needs an NVIDIA GPU, torch and compute-sanitizer on PATH.

    python3 benchmarks/sanitize.py [--tools memcheck,racecheck,synccheck] [--log-dir DIR]
                                   [--backend sm80|sm90]   (default: the device's choice)

The kernels are built (and cached on disk) first, outside the sanitizer; then each tool runs
this script's `--worker` mode, which launches the 12 cases and checks each output against
torch's SDPA. Exit status 0 when every tool ran and found no error, 1 otherwise.
"""
from __future__ import annotations

import argparse
import itertools
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

SCHEDULERS = ("Transient()", "Persistent()", "Queued()", "LPT()")
SOURCE = 'import "std/schedulers.mha"\n' + "\n".join(
    f"attention {s.lower()[:-2]} {{ dtype = bf16  head_dim = 64  scheduler = {s}\n"
    f"    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }}" for s in SCHEDULERS)
RAGGED_Q, RAGGED_K = (0, 1, 130, 77), (5, 1, 130, 200)
TOOLS = ("memcheck", "racecheck", "synccheck")
CASES = 3 * len(SCHEDULERS)  # launches of `cases`


def cases(torch):
    """(name, kwargs) of the CASES launches: each scheduler, dense, ragged, and ragged with
    one offsets tensor for Q and K (self-attention: K's rows taken from Q's)."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    def offsets(lengths):
        return torch.tensor([0, *itertools.accumulate(lengths)],
                            dtype=torch.int32, device="cuda")

    for s in SCHEDULERS:
        name = s.lower()[:-2]
        yield name, "dense", dict(q=rand(2, 200, 2, 64), k=rand(2, 200, 2, 64),
                                  v=rand(2, 200, 2, 64))
        yield name, "ragged", dict(q=rand(sum(RAGGED_Q), 2, 64), k=rand(sum(RAGGED_K), 2, 64),
                                   v=rand(sum(RAGGED_K), 2, 64), cu_seqlens_q=offsets(RAGGED_Q),
                                   cu_seqlens_k=offsets(RAGGED_K))
        rows, total = offsets(RAGGED_Q), sum(RAGGED_Q)
        yield name, "ragged self", dict(q=rand(total, 2, 64), k=rand(total, 2, 64),
                                        v=rand(total, 2, 64), cu_seqlens_q=rows,
                                        cu_seqlens_k=rows)


def sdpa_error(torch, args, out) -> float:
    """Relative error against torch SDPA (float32, causal, top-left), sequence by sequence."""
    F = torch.nn.functional
    if "cu_seqlens_q" in args:
        cq, ck = args["cu_seqlens_q"].tolist(), args["cu_seqlens_k"].tolist()
        spans = [((cq[b], cq[b + 1]), (ck[b], ck[b + 1])) for b in range(len(cq) - 1)]
        pieces = [(args["q"][a:b], args["k"][c:d], args["v"][c:d], out[a:b])
                  for (a, b), (c, d) in spans if b > a]
    else:
        pieces = [(args["q"][i], args["k"][i], args["v"][i], out[i])
                  for i in range(args["q"].shape[0])]
    num = den = 0.0
    for q, k, v, o in pieces:
        q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)
        num += (o.float() - ref).norm().item() ** 2
        den += ref.norm().item() ** 2
    return (num / max(den, 1e-30)) ** 0.5


def kernels(backend: str | None):
    """The attention kernel of each scheduler, on `backend` when one is forced."""
    import mhadsl
    program = mhadsl.compile(SOURCE, name="sanitize.mha")
    if backend:
        for name in program.attentions:
            program[name].backend = backend
    return program


def worker(backend: str | None) -> int:
    import torch

    import mhadsl
    program = kernels(backend)
    worst = 0.0
    for name, layout, args in cases(torch):
        out = program[name](**args)
        mhadsl.synchronize()
        err = sdpa_error(torch, args, out)
        worst = max(worst, err)
        print(f"case {name} {layout}: relative error {err:.2e}", flush=True)
    print(f"worst relative error {worst:.2e}")
    return 0 if worst < 1e-2 else 1


def summary(tool: str, log: str) -> int | None:
    """The error count compute-sanitizer printed (None when it printed no summary)."""
    match = re.search(r"ERROR SUMMARY: (\d+) error", log)
    if tool == "racecheck":
        race = re.search(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?", log)
        if race:
            return int(race.group(2))
    return int(match.group(1)) if match else None


def run_under_tools(script: str, kernels: str, tools: list[str]) -> int:
    """`script --worker` under each of `tools`, compute-sanitizer limited to the kernels whose
    names start with `kernels`; prints each tool's count, returns 1 if any found an error."""
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        print("error: compute-sanitizer is not on PATH", file=sys.stderr)
        return 1
    failed = 0
    for tool in tools:
        # (cuda-python's driver probing fails API calls on purpose: not the kernel's errors)
        run = subprocess.run([sanitizer, "--tool", tool, "--kernel-name", f"kns={kernels}",
                              "--report-api-errors", "no", sys.executable, script,
                              "--worker"], capture_output=True, text=True)
        errors = summary(tool, run.stdout + run.stderr)
        print(f"{tool}: {'no summary' if errors is None else f'{errors} errors'}, "
              f"exit {run.returncode}")
        failed |= errors != 0 or run.returncode != 0
        if errors:
            print((run.stdout + run.stderr)[:3000])
    return int(failed)


def relative_error(tensor, reference) -> float:
    """|tensor - reference| / |reference| (a torch tensor against a NumPy float64 array)."""
    import numpy as np
    return float(np.linalg.norm(tensor.float().cpu().numpy() - reference) /
                 np.linalg.norm(reference))


def worker_main(script: str, kernels: str, worker) -> int:
    """A sanitizer script's command line: `--worker` runs `worker()` (the cases, checked);
    otherwise the cases run once outside the sanitizer (building every kernel), then under
    each of `--tools`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--tools", default="memcheck,racecheck")
    args = parser.parse_args()
    if args.worker:
        return worker()
    if worker():
        return 1
    return run_under_tools(script, kernels, args.tools.split(","))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--log-dir", type=Path, default=Path("sanitize-logs"))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per tool")
    parser.add_argument("--backend", help="force an attention backend (sm80, sm90)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        return worker(opts.backend)
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        print("error: compute-sanitizer is not on PATH", file=sys.stderr)
        return 1
    import torch

    import mhadsl
    program = kernels(opts.backend)
    for name, _, args in cases(torch):  # build and cache every kernel outside the tools
        program[name](**args)
    mhadsl.synchronize()
    opts.log_dir.mkdir(parents=True, exist_ok=True)
    clean = True
    for tool in opts.tools.split(","):
        # Only the attention kernels; driver API errors are left out (cuda-python probes
        # cuGetProcAddress for entry points this driver lacks), the worker raises on ours.
        command = [sanitizer, "--tool", tool, "--kernel-name", "kns=mha_fwd",
                   "--report-api-errors", "no", sys.executable, __file__, "--worker"] + (
                       ["--backend", opts.backend] if opts.backend else [])
        start = time.perf_counter()
        try:
            run = subprocess.run(command, capture_output=True, text=True, timeout=opts.timeout)
            log, status = run.stdout + run.stderr, run.returncode
        except subprocess.TimeoutExpired as err:
            log, status = f"{err.stdout or ''}{err.stderr or ''}\ntimed out", None
        (opts.log_dir / f"{tool}.log").write_text(log)
        errors = summary(tool, log)
        cases_run = log.count("case ")
        ok = status == 0 and errors == 0 and cases_run == CASES
        clean &= ok
        print(f"{tool:10s} {'clean' if ok else 'FAILED'}: {errors} errors, "
              f"{cases_run}/{CASES} cases, "
              f"exit {status}, {time.perf_counter() - start:.0f} s "
              f"(log: {opts.log_dir / (tool + '.log')})")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
