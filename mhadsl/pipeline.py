"""The compilation stages as one ordered table; every stage's artifact is kept.

    parse -> check -> llvm -> llvm-opt -> ptx -> cubin

`compile_stages` runs the table up to a stage and returns a `Compilation` whose
`artifacts` hold each result in order, so `--emit llvm|ptx|cubin` is a lookup. The table
builds one module of scheduler trace kernels; each attention declaration gives a unit per
pass asked for (`kernels`: its forward, backward and decode builds, `PASSES`), built for the
same arch by `mhadsl.build` (the one build path of attention kernels, through the on-disk
cache).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from mhadsl.front import ast
from mhadsl.front.check import CheckedProgram, check_program
from mhadsl.codegen import target as targets
from mhadsl.codegen.assemble import Assembled, assemble
from mhadsl.front.attention_spec import AttentionOptions, resolve_attention
from mhadsl.abi import classifies_per_call
from mhadsl.build import (
    BlockClassesBuild, KernelRequest, RequestError, build_block_classes, build_kernel,
    decode_splits_by_length,
)
from mhadsl.codegen import backends
from mhadsl.codegen.backends import CacheLayout, KernelBuild, KernelLaunch, Layout
from mhadsl.codegen.scheduler import SchedulerSpec, lower_scheduler
from mhadsl.codegen.trace_kernel import build_trace_kernel
from mhadsl.front.diagnostics import MhaError
from mhadsl.front.parse import load_program, no_cyclic_gc

STD_SCHEDULERS = "std/schedulers.mha"
# From this many schedulers on, a compile takes long enough (about 30 ms of LLVM and
# ptxas per scheduler) that `progress` is told of each stage.
MANY_SCHEDULERS = 100

# What a declaration is built for: its forward (prefill) call, the backward pass of that
# call, and a decode step against a KV cache.
PASSES = ("forward", "backward", "decode")
# The cache a decode unit is built for: one new query row per sequence, appended to the
# cache by the step (`k_new`/`v_new`: the append's kernel, then decode), pages of 64
# positions, and the 64-row KV tile `serving.kv_tile` picks for such a call (32 only once
# the batch gives 1.5 work tiles per multiprocessor).
DECODE_CACHE = CacheLayout(query_rows=1, page_size=64, block_n=64, appends=True)


@dataclass(frozen=True)
class CompileOptions:
    """Everything besides the source that changes the output (part of cache keys)."""

    arch: str = "sm_90a"
    ptx_version: int = targets.DEFAULT_PTX_VERSION
    tile_m: int = 128  # tile height schedulers compiled on their own are specialised for
    backend: str | None = None  # attention kernel design; None: the arch's first
    passes: tuple[str, ...] = ("forward",)  # which builds of each declaration (`PASSES`)
    deterministic: bool = False  # the backward pass's deterministic (bitwise repeatable) mode

    @property
    def target(self) -> targets.Target:
        return targets.gpu_target(self.arch, self.ptx_version)


@dataclass
class Compilation:
    name: str
    options: CompileOptions
    artifacts: dict[str, object] = field(default_factory=dict)
    # one unit per (attention declaration, pass), named by `unit_name`
    kernels: dict[str, KernelBuild] = field(default_factory=dict)
    # the classes kernel of each declaration whose mask reads data, by `classes_unit`
    classes: dict[str, BlockClassesBuild] = field(default_factory=dict)

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
    """One module: a trace kernel per scheduler (see codegen.trace_kernel)."""
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
    return modules, check_program(modules, backends.declaration_problems)


def _needs_default_scheduler(modules: list[ast.Module]) -> bool:
    """An attention declaration without `scheduler =` uses the standard library's default."""
    loaded = {m.span.source.name for m in modules}
    return STD_SCHEDULERS not in loaded and any(
        isinstance(d, ast.AttentionDecl) and all(c.name != "scheduler" for c in d.constants)
        for m in modules for d in m.decls)


def compile_stages(text: str, name: str, options: CompileOptions, *, until: str = "ptx",
                   base_dir: Path | None = None,
                   include_dirs: Sequence[str | os.PathLike] = (),
                   progress: Callable[[str], None] | None = None,
                   attentions: Sequence[str] | None = None) -> Compilation:
    """Run the stages up to `until`, then build each pass of `options.passes` for the
    attention declarations named in `attentions` (None: every one); an unknown name is a
    `RequestError`."""
    if until not in STAGE_NAMES:
        raise ValueError(f"unknown stage {until!r}; stages are {', '.join(STAGE_NAMES)}")
    if unknown := [p for p in options.passes if p not in PASSES]:
        raise ValueError(f"unknown pass {unknown[0]!r}; passes are {', '.join(PASSES)}")
    c = Compilation(name, options)
    c.artifacts["parse"], c.artifacts["check"] = front_end(text, name, base_dir, include_dirs)
    declarations = c.checked.attentions
    if missing := [a for a in attentions or () if a not in declarations]:
        raise RequestError(f"no attention kernel '{missing[0]}' in {name} (it has: "
                           f"{', '.join(declarations) or 'none'})")
    many = len(c.checked.schedulers) >= MANY_SCHEDULERS
    if c.checked.schedulers:
        for stage, run in STAGES:
            if STAGE_NAMES.index(stage) > STAGE_NAMES.index(until):
                break
            if progress and many:
                progress(f"{stage} of {len(c.checked.schedulers)} schedulers")
            c.artifacts[stage] = run(c)
    if STAGE_NAMES.index(until) >= STAGE_NAMES.index("llvm"):
        for attention in declarations if attentions is None else attentions:
            for pass_name in options.passes:
                c.kernels[unit_name(attention, pass_name)] = _build_pass(
                    c.checked, attention, pass_name, options)
            # a call of these passes classifies its tiles first (`codegen.block_classes`)
            declared = resolve_attention(declarations[attention])
            if any(classifies_per_call(declared, p) for p in options.passes):
                c.classes[classes_unit(attention)] = build_block_classes(
                    c.checked, attention, False, options.arch)
    return c


def classes_unit(attention: str) -> str:
    """The unit of a declaration's classes kernel."""
    return f"{attention}.classes"


def unit_name(attention: str, pass_name: str) -> str:
    """A forward unit is named after its declaration; another pass's adds the pass."""
    return attention if pass_name == "forward" else f"{attention}.{pass_name}"


def pass_layout(pass_name: str, declared: AttentionOptions, program: CheckedProgram,
                deterministic: bool = False) -> Layout:
    """The call a pass builds a declaration for: its declared GQA ratio (1 where it declares
    none); the forward and decode with its declared log-sum-exp, decode against
    `DECODE_CACHE` with the splits a call that fixes none takes (by length, where its
    scheduler allows: `build.decode_splits_by_length`); the backward dense, in its default
    (atomic) mode or its `deterministic` one, as `Kernel.backward_build()` asks for it."""
    group = declared.gqa or 1
    if pass_name == "backward":
        return Layout(gqa_group=group, backward=True, deterministic=deterministic)
    cache = None if pass_name != "decode" else replace(
        DECODE_CACHE, balanced=decode_splits_by_length(program, declared))
    return Layout(gqa_group=group, return_lse=declared.return_lse, cache=cache)


class PassError(MhaError):
    """A declaration that a pass other than the forward cannot be built for on an arch (a
    design refuses it, or its score has no derivative), rendered on one line; the forward's
    refusals stay the diagnostics at the setting at fault."""

    def __init__(self, attention: str, pass_name: str, arch: str, error: MhaError):
        super().__init__(error.diagnostics, omitted=error.omitted)
        self.attention, self.pass_name, self.arch = attention, pass_name, arch

    def render(self) -> str:
        first = self.diagnostics[0]
        span = first.span
        where = f"{span.source.name}:{span.line}:{span.column}: " if span else ""
        why = first.message.removeprefix(f"attention '{self.attention}': ")
        more = len(self.diagnostics) - 1 + self.omitted
        return (f"{where}error: no {self.pass_name} build of attention '{self.attention}' "
                f"for {self.arch}: {why}" + (f" (and {more} more)" if more else ""))


def _build_pass(program: CheckedProgram, attention: str, pass_name: str,
                options: CompileOptions) -> KernelBuild:
    declared = resolve_attention(program.attentions[attention])
    layout = pass_layout(pass_name, declared, program, options.deterministic)
    request = KernelRequest(attention, options.arch, options.backend, layout,
                            options.ptx_version,
                            scheduler=declared.scheduler_for_layout(layout))
    try:
        return build_kernel(program, request)
    except MhaError as err:
        if pass_name == "forward":
            raise
        raise PassError(attention, pass_name, options.arch, err) from None


def kernel_launches(build: KernelBuild) -> dict[str, KernelLaunch]:
    """Each kernel of a build by name, in launch order (`Backend.kernels`): a backward build
    holds several (preprocess, main, then postprocess or the deterministic dQ kernel)."""
    return {k.name: k for k in backends.backend(build.backend).kernels(build.config)}


def tile_shape(build: KernelBuild) -> tuple[int, int]:
    """(query rows, K/V rows) of a build's tile. A decode work tile holds its packed query
    rows (`rows`); the scheduler sees it as one row (`block_m` 1: a KV split)."""
    decode = backends.backend(build.backend).workload == "decode"
    rows = build.config.rows if decode else build.config.block_m
    return rows, build.config.block_n
