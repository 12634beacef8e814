"""The PTX of every example build, as one SHA-256 per build: proof that a refactor changed
no generated code.

    python benchmarks/ptx_digests.py [--tree DIR] > after.json    # needs ptxas, no GPU
    python benchmarks/ptx_digests.py --compare before.json after.json

Builds, for both arches (sm_90a, sm_80): every attention declaration of `examples/` with
every design that runs it (forward dense, ragged, with the log-sum-exp; decode against a
contiguous and a paged cache, one and sixteen query rows and ragged, splits fixed and by
length; the backward, atomic and deterministic, dense and ragged), each driven by the
scheduler a call of that layout runs (`AttentionOptions.scheduler_for`), the four standard
schedulers driving the causal example, each example's scheduler trace module, and the ragged
launch's tile-index kernel.

`--tree DIR` digests another checkout of this repository (e.g. `git worktree add /tmp/base
main`) in a child process, with the package laid out as an install maps it, and its own
compile cache. `--compare` prints every build whose digest differs or that only one side has,
and exits 1 if there is any.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARCHES = ("sm_90a", "sm_80")
SCHEDULERS = ("Transient", "Persistent", "Queued", "LPT")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def layouts():
    """(label, Layout) of every layout built per declaration and design."""
    from mhadsl.codegen.backends import CacheLayout, Layout
    yield "dense", Layout()
    yield "ragged", Layout(ragged=True)
    yield "lse", Layout(return_lse=True)
    yield "ragged-lse", Layout(ragged=True, return_lse=True)
    yield "gqa4", Layout(gqa_group=4)
    for rows, page, block_n in ((1, 0, 64), (1, 64, 64), (16, 64, 64), (0, 0, 64)):
        yield f"decode-q{rows}-page{page}", Layout(gqa_group=4, cache=CacheLayout(rows, page, block_n))
    for rows, page, block_n in ((1, 64, 64), (0, 16, 64)):  # splits by length
        yield f"decode-q{rows}-page{page}-by-length", Layout(
            gqa_group=4, cache=CacheLayout(rows, page, block_n, balanced=True))
    for ragged in (False, True):
        for deterministic in (False, True):
            yield (f"backward{'-ragged' if ragged else ''}{'-det' if deterministic else ''}",
                   Layout(ragged=ragged, backward=True, deterministic=deterministic))


def digests(examples: Path) -> dict[str, str]:
    import mhadsl
    from mhadsl.build import KernelRequest, RequestError, build_kernel
    from mhadsl.codegen import backends
    from mhadsl.front.attention_spec import resolve_attention
    from mhadsl.front.diagnostics import MhaError
    from mhadsl.pipeline import CompileOptions, compile_stages

    out: dict[str, str] = {}
    for path in sorted(examples.glob("*.mha")):
        program = mhadsl.compile(str(path))
        checked = program.checked
        for arch in ARCHES:
            comp = compile_stages(path.read_text(), str(path), CompileOptions(arch=arch),
                                  until="ptx", base_dir=path.parent)
            out[f"{path.name} trace-module {arch}"] = _digest(comp.text("ptx"))
            for name in program.attentions:
                options = resolve_attention(checked.attentions[name])
                for label, layout in layouts():
                    for design in backends.backends(layout.workload):
                        if arch not in design.targets or not design.runs_layout(layout):
                            continue
                        # the scheduler a call of this layout runs
                        scheduler = options.scheduler_for_layout(layout)
                        request = KernelRequest(name, arch, design.name, layout,
                                                scheduler=scheduler)
                        try:
                            build = build_kernel(checked, request)
                        except (MhaError, RequestError):
                            continue  # the design does not run this declaration
                        if build.backend != design.name:
                            continue  # handed over to another design's build
                        out[f"{path.name} {name} {arch} {design.name} {label}"] = \
                            _digest(build.ptx)
    causal = examples / "causal.mha"
    program = mhadsl.compile(str(causal))
    checked = program.checked
    for arch in ARCHES:
        for sched in SCHEDULERS:
            for label, layout in (("dense", backends.Layout()),
                                  ("ragged", backends.Layout(ragged=True))):
                request = KernelRequest("causal_fwd", arch, None, layout, scheduler=(sched, ()))
                out[f"causal.mha causal_fwd {arch} scheduler={sched} {label}"] = \
                    _digest(build_kernel(checked, request).ptx)
    from mhadsl.codegen.target import emit_ptx, gpu_target, new_module, optimize
    from mhadsl.codegen.tile_index import build_tile_index_kernel
    target = gpu_target("sm_80")
    module = new_module("tile_index", target)
    build_tile_index_kernel(module)
    out["tile-index sm_80"] = _digest(emit_ptx(optimize(module, target), target))
    return out


def _installed_layout(tree: Path, into: Path) -> Path:
    """A folder that imports `tree` the way its pyproject maps it (mhadsl.codegen =
    codegen/, ...), made of links."""
    package = into / "mhadsl"
    package.mkdir()
    for entry in (tree / "mhadsl").iterdir():
        (package / entry.name).symlink_to(entry)
    for sub in ("codegen", "runtime", "grammar"):
        (package / sub).symlink_to(tree / sub)
    return into


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, help="digest this checkout instead")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        differ = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        for key in differ:
            print(f"{'differs' if key in before and key in after else 'only one side'}: {key}")
        print(f"{len(before.keys() & after.keys()) - sum(k in before and k in after for k in differ)}"
              f" builds the same, {len(differ)} not")
        return 1 if differ else 0
    if args.tree is not None:
        tree = args.tree.resolve()
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "site").mkdir()
            env = dict(os.environ, PYTHONPATH=str(_installed_layout(tree, Path(tmp) / "site")),
                       MHADSL_CACHE_DIR=str(Path(tmp) / "cache"))
            return subprocess.run([sys.executable, __file__, "--examples",
                                   str(tree / "examples")], env=env, cwd=tmp).returncode
    json.dump(digests(REPO / "examples"), sys.stdout, indent=1, sort_keys=True)
    print()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--examples":  # the child of --tree
        json.dump(digests(Path(sys.argv[2])), sys.stdout, indent=1, sort_keys=True)
        print()
        sys.exit(0)
    sys.exit(main())
