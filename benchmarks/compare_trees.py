"""Benchmark: the sm90 rows of hopper.py (or, with --backward, backward.py's dense rows)
under several source trees of mhadsl, side by side.

    python benchmarks/compare_trees.py [--backward] [--only TEXT] ROUNDS TREE [TREE ...]

Each TREE is a checkout of this repository (e.g. `git worktree add /tmp/base main`). For
each of ROUNDS rounds, each tree in turn is installed (`pip install -e TREE`, no
dependencies) and hopper.py's workloads are timed in a fresh process with its own compile
cache, so the variants get the GPU in turn rather than one after another (the GPU's speed
drifts over a call by more than the differences being compared). The first round also
checks each kernel against the float64 reference. cuDNN is timed in every process, in turn
with the kernel (`time_side_by_side`): its spread is the noise floor. Prints one row per
workload (those whose name and shape contain TEXT, with --only): each tree's TFLOP/s per
round. With --backward each process times the atomic and the deterministic backward of
each row side by side and checks that two deterministic calls give the same bits; a cell
reads atomic / deterministic TFLOP/s per round, then deterministic / atomic.
"""
import json
import os
import subprocess
import sys
import tempfile

WORKER = r'''
import json, sys
import mhadsl
from mhadsl.host.bench import Problem, allowed_pairs, check, make_inputs, require_gpu, \
    time_side_by_side, torch_baseline_fns
sys.path.insert(0, "benchmarks")
from hopper import SOURCE, WORKLOADS
torch = require_gpu()
program = mhadsl.compile(SOURCE, name="<compare_trees>")
rows = []
for name, p in WORKLOADS:
    if sys.argv[2] not in f"{name} {p.describe()}":
        continue
    k = program[name]
    k.backend = "sm90"
    err = 0.0
    if sys.argv[1] == "check":
        for small in (Problem(1, 1000, 1000, p.heads, p.kv_heads, p.head_dim),
                      Problem(0, 0, 0, p.heads, p.kv_heads, p.head_dim, (0, 1, 127, 129, 3000))):
            err = max(err, check(torch, k, small)[0])
    args = make_inputs(torch, k, p)
    flops = 4.0 * p.head_dim * p.heads * allowed_pairs(k, p)
    times = time_side_by_side(torch, {"ours": lambda: k(**args),
                                      "cudnn": torch_baseline_fns(torch, k, p, args)["cudnn"]})
    rows.append({"workload": f"{name} {p.describe()}", "err": err,
                 "tflops": flops / times["ours"].ms / 1e9,
                 "cudnn": None if times["cudnn"] is None else flops / times["cudnn"].ms / 1e9})
print("JSON" + json.dumps(rows))
'''

BACKWARD_WORKER = r'''
import json, sys
import mhadsl
from mhadsl.host.bench import require_gpu, time_side_by_side
sys.path.insert(0, "benchmarks")
from backward import ROWS, SOURCE, tflops
torch = require_gpu()
program = mhadsl.compile(SOURCE, name="<compare_trees>")
rows = []
for _, name, B, Hq, Hkv, S, D in ROWS:
    workload = f"{name} B{B} H{Hq}:{Hkv} S{S} D{D}"
    if sys.argv[2] not in workload:
        continue
    kern = program[name]
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v, dout = torch.randn_like(k), torch.randn_like(q)
    out, lse = kern(q, k, v, return_lse=True)
    atomic = kern.backward(q, k, v, out, lse, dout)
    exact = [kern.backward(q, k, v, out, lse, dout, deterministic=True) for _ in range(2)]
    same = all(torch.equal(x, y) for x, y in zip(*exact))
    err = max(float((x.float() - y.float()).norm() / y.float().norm())
              for x, y in zip(exact[0], atomic))
    times = time_side_by_side(torch, {
        "atomic": lambda: kern.backward(q, k, v, out, lse, dout),
        "deterministic": lambda: kern.backward(q, k, v, out, lse, dout, deterministic=True)})
    tf = tflops(times, B, Hq, S, D, not name.startswith("plain"))
    rows.append({"workload": workload, "err": err, "same": same, "atomic": tf["atomic"],
                 "deterministic": tf["deterministic"]})
print("JSON" + json.dumps(rows))
'''


def run_tree(tree: str, cache_dir: str, check: bool, only: str,
             worker: str = WORKER) -> list[dict]:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "-e", tree], check=True, capture_output=True)
    done = subprocess.run([sys.executable, "-c", worker, "check" if check else "time", only],
                          env=dict(os.environ, MHADSL_CACHE_DIR=cache_dir),
                          capture_output=True, text=True, cwd=tree)
    for line in done.stdout.splitlines():
        if line.startswith("JSON"):
            return json.loads(line[4:])
    raise SystemExit(f"{tree}: no result\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")


def main() -> None:
    args = sys.argv[1:]
    backward = args[:1] == ["--backward"]
    args = args[1:] if backward else args
    only = ""
    if args[:1] == ["--only"] and len(args) > 1:
        only, args = args[1], args[2:]
    if len(args) < 2:
        raise SystemExit(__doc__)
    rounds, trees = int(args[0]), args[1:]
    caches = {tree: tempfile.mkdtemp() for tree in trees}
    results = {tree: [] for tree in trees}
    for r in range(rounds):
        for tree in trees:
            results[tree].append(run_tree(tree, caches[tree], check=r == 0, only=only,
                                          worker=BACKWARD_WORKER if backward else WORKER))
            print(f"{tree}: round {r + 1} of {rounds}", file=sys.stderr, flush=True)
    if backward:
        print_backward(trees, results)
        return
    print("| workload | " + " | ".join(trees) + " | cuDNN (each process) |")
    print("|---|" + "---|" * (len(trees) + 1))
    for j, row in enumerate(results[trees[0]][0]):
        cells = [" / ".join(f"{run[j]['tflops']:.0f}" for run in results[tree])
                 + f" (error {max(run[j]['err'] for run in results[tree]):.0e})"
                 for tree in trees]
        cudnn = " ".join("—" if run[j]["cudnn"] is None else f"{run[j]['cudnn']:.0f}"
                         for tree in trees for run in results[tree])
        print(f"| {row['workload']} | " + " | ".join(cells) + f" | {cudnn} |")


def print_backward(trees: list[str], results: dict) -> None:
    print("| workload | " + " | ".join(trees) + " |")
    print("|---|" + "---|" * len(trees))
    for j, row in enumerate(results[trees[0]][0]):
        cells = []
        for tree in trees:
            runs = [run[j] for run in results[tree]]
            cells.append(" ".join(f"{r['atomic']:.0f}/{r['deterministic']:.0f}" for r in runs)
                         + " (" + " ".join(f"{r['deterministic'] / r['atomic']:.2f}"
                                           for r in runs) + ")"
                         + ("" if all(r["same"] for r in runs) else " NOT BITWISE")
                         + f" error {max(r['err'] for r in runs):.0e}")
        print(f"| {row['workload']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
