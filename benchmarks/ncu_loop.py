"""Where does a kernel's KV loop spend its time? ncu's per-instruction counters, ours against
FlashAttention-4's, one kernel beside the other.

    # on the GPU machine (FA4 installed as `../shared/tools/fa4/` says; --rows from hopper.py)
    ncu --set full -k 'regex:mha_fwd|[Ff]lash' -f -o /tmp/r \\
        python3 benchmarks/ncu_loop.py run --rows plain_d64,causal_d64
    ncu -i /tmp/r.ncu-rep --page source --print-source sass --csv > sass.csv
    # anywhere
    python3 benchmarks/ncu_loop.py summarize sass.csv

`run` calls each row's sm90 kernel and FA4 on the same inputs, twice each (the first call
compiles). `summarize` reads the source page (one block per profiled kernel: its name, a
header, one row per SASS instruction with its executions and warp-stall samples) and prints,
per kernel, the hot loop (the instructions run most often, weighted by their count) with its
instructions per trip by opcode, then the instructions that gathered the most stall samples
and their leading reasons. It shows, for instance, whether ptxas has hoisted P V's wait above
the softmax (benchmarks/log/BENCHMARKS_LOG.md).
"""
from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class Kernel:
    name: str
    rows: list[dict[str, str]] = field(default_factory=list)

    def executions(self, row: dict[str, str]) -> int:
        return int(row.get(EXECUTED) or 0)

    def samples(self, row: dict[str, str]) -> int:
        return int(row.get(SAMPLES) or 0)

    @property
    def loop_trips(self) -> int:
        """The execution count of the hot loop's body: the count whose instructions executed
        most in all (count times how many instructions share it)."""
        counts = Counter(self.executions(r) for r in self.rows if self.executions(r) > 0)
        return max(counts, key=lambda c: (c * counts[c], c)) if counts else 0

    def loop_opcodes(self) -> Counter:
        """The loop body's instructions per trip, by opcode (a predicate guard skipped)."""
        trips = self.loop_trips
        return Counter(opcode(r["Source"]) for r in self.rows
                       if trips and self.executions(r) == trips)

    def stall_sites(self, count: int) -> list[tuple[int, dict[str, str], list[tuple[str, int]]]]:
        """The `count` instructions with the most stall samples, in program order: (index,
        row, the three leading reasons)."""
        ranked = sorted(range(len(self.rows)), key=lambda i: -self.samples(self.rows[i]))
        return [(i, self.rows[i], reasons(self.rows[i])[:3])
                for i in sorted(ranked[:count]) if self.samples(self.rows[i]) > 0]


def opcode(source: str) -> str:
    """`@!P0 BRA 0x10` -> `BRA`; `HGMMA.64x128x16.F32.BF16 R24, ...` -> `HGMMA`."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def reasons(row: dict[str, str]) -> list[tuple[str, int]]:
    """The row's stall samples by reason (ncu's `stall_*` columns, issued or not), most
    first."""
    found = [(name[len("stall_"):], int(value or 0)) for name, value in row.items()
             if name.startswith("stall_") and "Not Issued" not in name and int(value or 0)]
    return sorted(found, key=lambda item: -item[1])


def read_source_page(path: Path) -> list[Kernel]:
    """The kernels of an exported source page (`--page source --print-source sass --csv`)."""
    kernels: list[Kernel] = []
    header = None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                kernels.append(Kernel(row[1]))
                header = None
            elif header is None:
                header = row
            elif kernels:
                kernels[-1].rows.append(dict(zip(header, row)))
    return kernels


def summarize(path: Path, sites: int) -> None:
    for index, kernel in enumerate(read_source_page(path)):
        opcodes = kernel.loop_opcodes()
        total = sum(kernel.samples(r) for r in kernel.rows) or 1
        print(f"[{index}] {kernel.name[:60]}: loop trips {kernel.loop_trips}, "
              f"{sum(opcodes.values())} instructions a trip")
        print("    " + ", ".join(f"{op} {n}" for op, n in opcodes.most_common()))
        for i, row, top in kernel.stall_sites(sites):
            print(f"    {i:5d} {100 * kernel.samples(row) / total:5.1f}% "
                  f"x{kernel.executions(row):<9d} {row['Source'].strip()[:56]:56s} "
                  + ", ".join(f"{name} {n}" for name, n in top))


def run(rows: list[str]) -> None:
    """Each row's sm90 kernel and FA4, twice each, on the same inputs (the target for ncu):
    the first dense workload of each named declaration."""
    import warnings

    import mhadsl
    from mhadsl.host.bench import make_inputs, require_gpu
    sys.path.insert(0, str(Path(__file__).parent))
    from hopper import FA4_MASKS, SOURCE, WORKLOADS
    workloads = {}
    for name, problem in WORKLOADS:
        if name in rows and not problem.seqlens:
            workloads.setdefault(name, problem)
    unknown = sorted(set(rows) - set(workloads))
    if unknown:
        raise SystemExit(f"--rows: no dense hopper.py row for {', '.join(unknown)}")
    torch = require_gpu()
    from flash_attn.cute import flash_attn_func
    warnings.filterwarnings("ignore", message="Argument aux_data")
    program = mhadsl.compile(SOURCE, name="<ncu_loop>")
    for name, problem in workloads.items():
        kernel = program[name]
        kernel.backend = "sm90"
        args = make_inputs(torch, kernel, problem)
        causal, window = FA4_MASKS[name]
        for _ in range(2):
            kernel(args["q"], args["k"], args["v"])
            flash_attn_func(args["q"], args["k"], args["v"], causal=causal, window_size=window)
        torch.cuda.synchronize()
        print(f"ran {name} {problem.describe()}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="the kernels to profile (GPU, under ncu)")
    run_parser.add_argument("--rows", required=True, help="hopper.py declarations, comma-separated")
    summary = sub.add_parser("summarize", help="read an exported source page")
    summary.add_argument("csv", type=Path)
    summary.add_argument("--sites", type=int, default=20, help="stall sites per kernel")
    cli = parser.parse_args()
    if cli.command == "run":
        run(cli.rows.split(","))
    else:
        summarize(cli.csv, cli.sites)


if __name__ == "__main__":
    main()
