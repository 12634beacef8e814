"""compute-sanitizer's four tools (memcheck, racecheck, initcheck, synccheck) over every kernel
design, on small shapes, as a table design x tool. Needs an NVIDIA GPU (the Hopper designs:
compute capability 9.0), torch and compute-sanitizer on PATH.

    python3 benchmarks/sanitize.py [--designs sm90,sm80,...] [--tools memcheck,...]
                                   [--jobs N] [--log-dir DIR] [--timeout SECONDS]

Designs (`DESIGNS`; each forces its registered design, `mhadsl.codegen.backends.REGISTRY`):
`sm90` and `sm80` (the forward: Transient, Persistent, Queued and LPT, the persistent ones
on 8 CTAs so each runs several work tiles, causal D64 over a dense batch of 1,000 rows, a
ragged one and a ragged one with one offsets tensor; causal D128 dense; packed documents,
a mask that reads data, ragged), `decode`
(contiguous and paged caches, KV splits, ragged query rows, packed rows), `backward_sm90`
and `backward` (atomic backward: causal D128, ragged GQA 8:2 with lengths 70, 0, 129, ragged
fp16 D64) and `backward_deterministic` (the same, deterministic). `--backend X` is
`--designs X` (benchmarks/gpu_check.sh).

Each design's cases first run outside the sanitizer (building and caching every kernel, and
checking every output against its float64 reference), then under each tool in a child
process, `--jobs` at a time (default: half the CPUs, at most 8):

    compute-sanitizer --tool TOOL --error-exitcode 1 --kernel-name kns=mha_
        --report-api-errors no python3 benchmarks/sanitize.py --worker DESIGN

(only this project's kernels, whose names start with `mha_`, but under initcheck, which
must watch torch's kernels too to see their writes; API errors are left out, as cuda-python
probes cuGetProcAddress for entry points the driver lacks). A cell reads `OK`
when the child exited 0, the tool's summary counted 0 errors and every case ran and
matched its reference; else the error count (or why it failed). Logs:
`DIR/DESIGN.TOOL.log` (default DIR: sanitize-logs). Exit status 0 when every cell is OK, 1
otherwise.

`relative_error`, `worker_main`, `run_under_tools` and `summary` serve
benchmarks/sanitize_backward.py and benchmarks/sanitize_decode.py (larger case lists of one
workload each).
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
KERNELS = "mha_"  # the kernels compute-sanitizer watches: every design's
DONE = "worker done"  # a worker's last line when all its cases ran and matched
TOLERANCE = 1e-2  # relative error against the float64 references

# ------------------------------------------------------------------ the forward's cases
SCHEDULERS = ("Transient()", "Persistent(num_ctas = 8)", "Queued(num_ctas = 8)",
              "LPT(num_ctas = 8)")
FORWARD_SOURCE = 'import "std/schedulers.mha"\n' + "\n".join(
    f"attention {s.split('(')[0].lower()} {{ dtype = bf16  head_dim = 64  scheduler = {s}\n"
    f"    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }}" for s in SCHEDULERS) + (
    "\nattention causal_d128 { dtype = bf16  head_dim = 128\n"
    "    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }\n"
    # a mask that reads data: each call classifies its tiles first (codegen.block_classes)
    "attention documents(doc: i32[queries], doc_k: i32[keys]) { dtype = bf16  head_dim = 64\n"
    "    mask(b, h, q_idx, kv_idx) = doc[q_idx] == doc_k[kv_idx] && kv_idx <= q_idx }\n")
RAGGED_Q, RAGGED_K = (0, 1, 130, 77), (5, 1, 130, 200)
DENSE_ROWS = 1000

DECODE_SOURCE = """
import "std/schedulers.mha"
attention decode { dtype = bf16  head_dim = 128  return_lse = true
    mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = kv_idx <= q_idx + seqlen_k - seqlen_q }
"""
DECODE_CASES = [  # lengths, K/V heads, query heads, query rows (0: ragged), page size, splits
    ([1, 70, 300], 2, 8, 1, None, 3),
    ([5, 64, 65, 400], 2, 16, 2, 16, 1),
    ([3, 200, 33], 2, 8, 0, 16, 2),
    ([300, 1000, 17], 2, 8, 16, 64, 2),  # 128 packed rows (wgmma on sm_90a)
    # no splits given: each sequence's follow its length (the split index kernel first)
    ([1, 70, 9000, 300, 5000], 2, 8, 1, 64, None),
    ([3, 12000, 33, 1], 2, 8, 0, 16, None),
]

BACKWARD_CASES = [  # example file or source, kernel, query heads, K/V heads, lengths (None:
    # dense, B1 S300)
    ("examples/causal.mha", "causal_fwd", 2, 2, None),
    ("examples/gqa.mha", "gqa_causal", 8, 2, [70, 0, 129]),
    ("examples/plain.mha", "plain_fp16_d64", 2, 2, [1, 0, 127, 65]),
]


def _rand(torch, gen, *shape, dtype=None):
    return torch.randn(*shape, device="cuda", generator=gen).to(dtype or torch.bfloat16)


def _offsets(torch, lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")


def forward_cases(torch):
    """(kernel, layout, kwargs) of the forward launches: each scheduler dense, ragged and
    ragged with one offsets tensor for Q and K (K's rows taken from Q's); D128 dense."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return _rand(torch, gen, *shape)
    for s in SCHEDULERS:
        name = s.split("(")[0].lower()
        yield name, "dense", dict(q=rand(2, DENSE_ROWS, 2, 64), k=rand(2, DENSE_ROWS, 2, 64),
                                  v=rand(2, DENSE_ROWS, 2, 64))
        yield name, "ragged", dict(q=rand(sum(RAGGED_Q), 2, 64), k=rand(sum(RAGGED_K), 2, 64),
                                   v=rand(sum(RAGGED_K), 2, 64),
                                   cu_seqlens_q=_offsets(torch, RAGGED_Q),
                                   cu_seqlens_k=_offsets(torch, RAGGED_K))
        rows, total = _offsets(torch, RAGGED_Q), sum(RAGGED_Q)
        yield name, "ragged self", dict(q=rand(total, 2, 64), k=rand(total, 2, 64),
                                        v=rand(total, 2, 64), cu_seqlens_q=rows,
                                        cu_seqlens_k=rows)
    yield "causal_d128", "dense", dict(q=rand(1, DENSE_ROWS, 2, 128),
                                       k=rand(1, DENSE_ROWS, 2, 128),
                                       v=rand(1, DENSE_ROWS, 2, 128))
    total = sum(RAGGED_K)
    docs = torch.arange(total, device="cuda", dtype=torch.int32) // 97  # documents of 97 rows
    rows = _offsets(torch, RAGGED_K)
    yield "documents", "ragged self", dict(q=rand(total, 2, 64), k=rand(total, 2, 64),
                                           v=rand(total, 2, 64), cu_seqlens_q=rows,
                                           cu_seqlens_k=rows, doc=docs, doc_k=docs)


def relative_error(tensor, reference) -> float:
    """|tensor - reference| / |reference| (a torch tensor against a NumPy float64 array)."""
    import numpy as np
    return float(np.linalg.norm(tensor.float().cpu().numpy() - reference) /
                 max(np.linalg.norm(reference), 1e-30))


# ------------------------------------------------------------------ the workers
def run_forward(backend: str) -> int:
    import torch

    import mhadsl
    program = mhadsl.compile(FORWARD_SOURCE, name="sanitize.mha")
    worst = 0.0
    for name, layout, args in forward_cases(torch):
        kern = program[name]
        kern.backend = backend
        out = kern(**args)
        mhadsl.synchronize()
        err = relative_error(out, mhadsl.reference(kern, **args))
        worst = max(worst, err)
        print(f"case {name} {layout}: relative error {err:.2e}", flush=True)
    return _verdict(worst)


def run_decode(backend: str) -> int:
    import numpy as np
    import torch

    import mhadsl
    kern = mhadsl.compile(DECODE_SOURCE, name="sanitize_decode")["decode"]
    kern.backend = backend
    g = torch.Generator(device="cuda").manual_seed(0)
    worst = 0.0
    for lengths, hkv, hq, rows, page, splits in DECODE_CASES:
        b, d = len(lengths), 128
        cap = max(lengths)
        if page is None:
            k = _rand(torch, g, b, cap, hkv, d)
            table = None
        else:
            per = -(-cap // page)
            k = _rand(torch, g, b * per, page, hkv, d)
            table = torch.randperm(b * per, generator=g, device="cuda").reshape(b, per)
            table = table.to(torch.int32).contiguous()
        v = torch.randn_like(k)
        seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        extra = {}
        if rows:
            q = _rand(torch, g, b, rows, hq, d)
        else:
            lens_q = [min(n, 3) for n in lengths]
            extra = dict(cu_seqlens_q=torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]),
                                                   dtype=torch.int32, device="cuda"),
                         max_seqlen_q=max(lens_q))
            q = _rand(torch, g, sum(lens_q), hq, d)
        out, _ = kern(q, k, v, cache_seqlens=seqlens, page_table=table, num_splits=splits,
                      **extra)
        mhadsl.synchronize()
        ref = mhadsl.reference_decode(kern, q, k, v, cache_seqlens=seqlens, page_table=table,
                                      cu_seqlens_q=extra.get("cu_seqlens_q"))[0]
        err = relative_error(out, ref)
        worst = max(worst, err)
        print(f"case decode {lengths} page {page}: relative error {err:.2e}", flush=True)
    return _verdict(worst)


def run_backward(backend: str, deterministic: bool) -> int:
    import torch

    import mhadsl
    g = torch.Generator(device="cuda").manual_seed(0)
    worst = 0.0
    for file, name, hq, hkv, lengths in BACKWARD_CASES:
        kern = mhadsl.compile(file)[name]
        d = kern.options.head_dim
        dtype = torch.bfloat16 if kern.options.dtype == "bf16" else torch.float16
        if lengths is None:
            q, k, v = (_rand(torch, g, 1, 300, h, d, dtype=dtype) for h in (hq, hkv, hkv))
            ragged = {}
        else:
            cu = _offsets(torch, lengths)
            total = sum(lengths)
            q, k, v = (_rand(torch, g, total, h, d, dtype=dtype) for h in (hq, hkv, hkv))
            ragged = dict(cu_seqlens_q=cu, cu_seqlens_k=cu)
        out, lse = kern(q, k, v, return_lse=True, **ragged)  # the device's forward design
        dout = _rand(torch, g, *out.shape, dtype=dtype)
        kern.backend = backend  # (after the forward: a backward design makes no forward)
        got = kern.backward(q, k, v, out, lse, dout, deterministic=deterministic, **ragged)
        mhadsl.synchronize()
        want = mhadsl.reference_backward(kern, q, k, v, dout, **ragged)
        err = max(map(relative_error, got, want))
        worst = max(worst, err)
        print(f"case {name} {'dense' if lengths is None else lengths}: relative error "
              f"{err:.2e}", flush=True)
    return _verdict(worst)


def _verdict(worst: float) -> int:
    ok = worst < TOLERANCE
    print(f"worst relative error {worst:.2e}")
    if ok:
        print(DONE)
    return 0 if ok else 1


@dataclass(frozen=True)
class Design:
    """A column of cases: the registered design it forces (`backend`) and its worker."""

    backend: str
    run: Callable[[], int]


DESIGNS = {
    "sm90": Design("sm90", lambda: run_forward("sm90")),
    "sm80": Design("sm80", lambda: run_forward("sm80")),
    "decode": Design("decode", lambda: run_decode("decode")),
    "backward_sm90": Design("backward_sm90", lambda: run_backward("backward_sm90", False)),
    "backward": Design("backward", lambda: run_backward("backward", False)),
    "backward_deterministic": Design("backward", lambda: run_backward("backward", True)),
}


# ------------------------------------------------------------------ running the tools
def summary(tool: str, log: str) -> int | None:
    """The error count compute-sanitizer printed (None when it printed no summary)."""
    match = re.search(r"ERROR SUMMARY: (\d+) error", log)
    if tool == "racecheck":
        race = re.search(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?", log)
        if race:
            return int(race.group(2))
    return int(match.group(1)) if match else None


def sanitizer_command(sanitizer: str, tool: str, kernels: str, argv: list[str]) -> list[str]:
    """compute-sanitizer's command line for `tool` over `argv` (a Python script's), watching
    the kernels whose names start with `kernels`; initcheck watches every kernel, as it counts
    memory as written only by the kernels it watches (torch's among them)."""
    watch = [] if tool == "initcheck" else ["--kernel-name", f"kns={kernels}"]
    return [sanitizer, "--tool", tool, "--error-exitcode", "1", *watch,
            "--report-api-errors", "no", sys.executable, *argv]


def run_under_tools(script: str, kernels: str, tools: list[str]) -> int:
    """`script --worker` under each of `tools`, compute-sanitizer limited to the kernels whose
    names start with `kernels`; prints each tool's count, returns 1 if any found an error."""
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        print("error: compute-sanitizer is not on PATH", file=sys.stderr)
        return 1
    failed = 0
    for tool in tools:
        run = subprocess.run(sanitizer_command(sanitizer, tool, kernels, [script, "--worker"]),
                             capture_output=True, text=True)
        errors = summary(tool, run.stdout + run.stderr)
        print(f"{tool}: {'no summary' if errors is None else f'{errors} errors'}, "
              f"exit {run.returncode}")
        failed |= errors != 0 or run.returncode != 0
        if errors:
            print((run.stdout + run.stderr)[:3000])
    return int(failed)


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


def _child(command: list[str], log: Path, timeout: float) -> tuple[int | None, str, float]:
    """Run `command`, its output into `log`: (exit status or None on a timeout, output,
    seconds)."""
    start = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
        text, status = run.stdout + run.stderr, run.returncode
    except subprocess.TimeoutExpired as err:
        def text_of(part):
            return part.decode(errors="replace") if isinstance(part, bytes) else part or ""
        text, status = f"{text_of(err.stdout)}{text_of(err.stderr)}\ntimed out", None
    log.write_text(text)
    return status, text, time.perf_counter() - start


def cell(tool: str | None, status: int | None, text: str) -> str:
    """A table cell: OK, or the error count, or why the run failed."""
    errors = summary(tool, text) if tool else 0
    if status == 0 and errors == 0 and DONE in text:
        return "OK"
    if errors:
        return f"{errors} errors"
    if status is None:
        return "timeout"
    if errors is None:
        return f"no summary (exit {status})"
    return "wrong output" if DONE not in text and "worst relative error" in text \
        else f"FAIL (exit {status})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--designs", default=",".join(DESIGNS),
                        help=f"comma-separated, of: {', '.join(DESIGNS)}")
    parser.add_argument("--backend", help="one design only (the same as --designs)")
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--jobs", type=int, default=min(8, max(1, (os.cpu_count() or 2) // 2)))
    parser.add_argument("--log-dir", type=Path, default=Path("sanitize-logs"))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per child")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        return DESIGNS[opts.worker].run()
    designs = (opts.backend or opts.designs).split(",")
    tools = opts.tools.split(",")
    unknown = [d for d in designs if d not in DESIGNS] + [t for t in tools if t not in TOOLS]
    if unknown:
        parser.error(f"unknown design or tool: {', '.join(unknown)}")
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        print("error: compute-sanitizer is not on PATH", file=sys.stderr)
        return 1
    opts.log_dir.mkdir(parents=True, exist_ok=True)
    script = str(Path(__file__).resolve())
    results: dict[tuple[str, str], str] = {}
    with ThreadPoolExecutor(max_workers=max(1, opts.jobs)) as pool:
        # first outside the sanitizer: every kernel built (and cached) once, outputs checked
        plain = {d: pool.submit(_child, [sys.executable, script, "--worker", d],
                                opts.log_dir / f"{d}.plain.log", opts.timeout)
                 for d in designs}
        for d, future in plain.items():
            status, text, seconds = future.result()
            results[d, "plain"] = cell(None, status, text)
            print(f"{d:24s} {'plain':10s} {results[d, 'plain']} ({seconds:.0f} s)", flush=True)
        runs = {(d, t): pool.submit(_child,
                                    sanitizer_command(sanitizer, t, KERNELS,
                                                      [script, "--worker", d]),
                                    opts.log_dir / f"{d}.{t}.log", opts.timeout)
                for t in tools for d in designs if results[d, "plain"] == "OK"}
        for (d, t), future in runs.items():
            status, text, seconds = future.result()
            results[d, t] = cell(t, status, text)
            print(f"{d:24s} {t:10s} {results[d, t]} ({seconds:.0f} s)", flush=True)
    columns = ["plain", *tools]
    width = max(map(len, designs + ["design"])) + 2
    cells = {c: max(14, len(c) + 2) for c in columns}
    print()
    print("design".ljust(width) + "".join(c.ljust(cells[c]) for c in columns))
    for d in designs:
        print(d.ljust(width) + "".join(results.get((d, c), "not run").ljust(cells[c])
                                       for c in columns))
    clean = all(results.get((d, c)) == "OK" for d in designs for c in columns)
    print(f"\n{'all clean' if clean else 'FAILED'} (logs: {opts.log_dir})")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
