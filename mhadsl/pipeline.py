"""The compilation stages as one ordered table; every stage's artifact is kept.

    parse -> check -> llvm -> llvm-opt -> ptx -> cubin

`compile_stages` runs the table up to a stage and returns a `Compilation` whose
`artifacts` hold each result in order, so `--emit llvm|ptx|cubin` is a lookup. The table
builds one module of scheduler trace kernels; each attention declaration is its own unit
(`kernels`), built for the same arch by `mhadsl.build` (the one build path of attention
kernels, through the on-disk cache).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mhadsl import ast
from mhadsl.check import CheckedProgram, check_program
from mhadsl.codegen import target as targets
from mhadsl.codegen.assemble import Assembled, assemble
from mhadsl.attention_spec import resolve_attention
from mhadsl.build import KernelRequest, build_kernel
from mhadsl.codegen.backends import KernelBuild, Layout
from mhadsl.codegen.scheduler import SchedulerSpec, build_trace_kernel, lower_scheduler
from mhadsl.parse import load_program, no_cyclic_gc

STD_SCHEDULERS = "std/schedulers.mha"
# From this many schedulers on, a compile takes long enough (about 30 ms of LLVM and
# ptxas per scheduler) that `progress` is told of each stage.
MANY_SCHEDULERS = 100


@dataclass(frozen=True)
class CompileOptions:
    """Everything besides the source that changes the output (part of cache keys)."""

    arch: str = "sm_90a"
    ptx_version: int = targets.DEFAULT_PTX_VERSION
    tile_m: int = 128  # tile height schedulers compiled on their own are specialised for
    backend: str | None = None  # attention kernel design; None: the arch's first

    @property
    def target(self) -> targets.Target:
        return targets.gpu_target(self.arch, self.ptx_version)


@dataclass
class Compilation:
    name: str
    options: CompileOptions
    artifacts: dict[str, object] = field(default_factory=dict)
    kernels: dict[str, KernelBuild] = field(default_factory=dict)  # attention declarations

    @property
    def checked(self) -> CheckedProgram:
        return self.artifacts["check"]

    def text(self, stage: str) -> str | bytes:
        """The artifact of a stage as a user dumps it."""
        artifact = self.artifacts[stage]
        if isinstance(artifact, Assembled):
            return artifact.cubin
        return artifact if isinstance(artifact, (str, bytes)) else str(artifact)


def _lower(c: Compilation) -> str:
    """One module: a trace kernel per scheduler (see codegen.scheduler)."""
    target = c.options.target
    module = targets.new_module(c.name, target)
    with no_cyclic_gc():
        for name in c.checked.schedulers:
            lowered = lower_scheduler(module, c.checked,
                                      SchedulerSpec(name, (), c.options.tile_m), target)
            build_trace_kernel(module, lowered)
        return str(module)


STAGES: tuple[tuple[str, Callable[[Compilation], object]], ...] = (
    ("llvm", _lower),
    ("llvm-opt", lambda c: targets.optimize(c.artifacts["llvm"], c.options.target)),
    ("ptx", lambda c: targets.emit_ptx(c.artifacts["llvm-opt"], c.options.target)),
    ("cubin", lambda c: assemble(c.artifacts["ptx"], c.options.arch)),
)
STAGE_NAMES = ("parse", "check") + tuple(name for name, _ in STAGES)


def front_end(text: str, name: str, base_dir: Path | None = None,
              include_dirs: Sequence[str | os.PathLike] = ()
              ) -> tuple[list[ast.Module], CheckedProgram]:
    """Parse (with imports; see `load_program` for where they are found) and check; raises
    `MhaError` listing every user error."""
    modules = load_program(text, name, base_dir or Path.cwd(), include_dirs)
    if _needs_default_scheduler(modules):
        modules = load_program(f'import "{STD_SCHEDULERS}"', "<prelude>", Path.cwd())[:-1] \
            + modules
    return modules, check_program(modules)


def _needs_default_scheduler(modules: list[ast.Module]) -> bool:
    """An attention declaration without `scheduler =` uses the standard library's default."""
    loaded = {m.span.source.name for m in modules}
    return STD_SCHEDULERS not in loaded and any(
        isinstance(d, ast.AttentionDecl) and all(c.name != "scheduler" for c in d.constants)
        for m in modules for d in m.decls)


def compile_stages(text: str, name: str, options: CompileOptions, *, until: str = "ptx",
                   base_dir: Path | None = None,
                   include_dirs: Sequence[str | os.PathLike] = (),
                   progress: Callable[[str], None] | None = None) -> Compilation:
    if until not in STAGE_NAMES:
        raise ValueError(f"unknown stage {until!r}; stages are {', '.join(STAGE_NAMES)}")
    c = Compilation(name, options)
    c.artifacts["parse"], c.artifacts["check"] = front_end(text, name, base_dir, include_dirs)
    many = len(c.checked.schedulers) >= MANY_SCHEDULERS
    if c.checked.schedulers:
        for stage, run in STAGES:
            if STAGE_NAMES.index(stage) > STAGE_NAMES.index(until):
                break
            if progress and many:
                progress(f"{stage} of {len(c.checked.schedulers)} schedulers")
            c.artifacts[stage] = run(c)
    if STAGE_NAMES.index(until) >= STAGE_NAMES.index("llvm"):
        for name, decl in c.checked.attentions.items():
            declared = resolve_attention(decl)
            layout = Layout(gqa_group=declared.gqa or 1, return_lse=declared.return_lse)
            c.kernels[name] = build_kernel(c.checked, KernelRequest(
                name, options.arch, options.backend, layout, options.ptx_version))
    return c

