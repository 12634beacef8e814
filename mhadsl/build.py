"""The one build path of attention kernels: a checked program and a `KernelRequest` ->
every stage's artifact (LLVM IR, PTX, cubin and its resources), through the on-disk cache.

The CLI (`mhadsl compile`, through `pipeline.compile_stages`) and the Python API
(`Kernel.build`, through which `mhadsl.host.launcher` loads a call's build) both call
`build_kernel`, so they share one cache and one place where a user's mistake becomes an
error: a declaration the chosen backend cannot run is an `MhaError` at the setting at
fault; an arch or backend that does not exist is a `RequestError`.

The cache key covers everything that changes the output: the text of every file the
program loaded (imports and the standard library included), the declaration's name, the
backend, the call's layout, the target (arch, PTX ISA), LLVM's and llvmlite's versions,
ptxas's version, and a hash of the compiler's own sources.

The tile index kernel that ragged launches run first (`codegen.tile_index`) and the classes
kernel of a declaration whose mask reads data (`codegen.block_classes`) are built here too
(`build_tile_index`, `build_block_classes`), so the runtime only loads and launches what it
is handed.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass

from mhadsl.abi import KernelABI
from mhadsl.front.attention_spec import AttentionOptions, resolve_attention
from mhadsl.front.check import CheckedProgram
from mhadsl.analysis.classify import SHORT_BAND_TILES, kv_band_tiles
from mhadsl.codegen import backends, block_classes, hopper, tile_index
from mhadsl.codegen.assemble import (
    Assembled, KernelResources, assemble, find_ptxas, run_ptxas,
)
from mhadsl.codegen.backends import Backend, KernelBuild, Layout
from mhadsl.codegen.kernel import expr_hooks, kernel_source
from mhadsl.codegen.scheduler import SchedulerSpec, may_advance
from mhadsl.codegen.target import (
    DEFAULT_PTX_VERSION, Target, emit_ptx, gpu_target, new_module, optimize,
)
from mhadsl.runtime import cache


class RequestError(ValueError):
    """A request no build can serve: an unknown arch, or a backend that does not exist or
    does not build for the arch."""


@dataclass(frozen=True)
class KernelRequest:
    kernel: str  # the attention declaration's name
    arch: str = "sm_90a"
    backend: str | None = None  # None: the arch's preferred backend that runs the declaration
    layout: Layout = Layout()
    ptx_version: int = DEFAULT_PTX_VERSION
    # (name, ((param, value), ...)) in place of the declaration's scheduler; None: its own
    scheduler: tuple[str, tuple[tuple[str, object], ...]] | None = None
    trace: bool = False  # record every work item (`mhadsl trace`, `runtime.trace_records`)


@dataclass(frozen=True)
class Plan:
    """What a request resolves to before anything is generated."""

    options: AttentionOptions
    backend: Backend
    target: Target
    configs: tuple  # the backend's configs to try, best first


def plan(program: CheckedProgram, request: KernelRequest) -> Plan:
    """Resolve a request; raises `MhaError` (at the declaration's setting at fault) when its
    backend cannot run the declaration on the target, `RequestError` for a bad request."""
    options = resolve_attention(program.attentions[request.kernel])
    band = kv_band_tiles(options.mask, program)
    if band is None and request.layout.short_band:  # (at most: the call's values decide)
        band = SHORT_BAND_TILES
    options = dataclasses.replace(options, kv_band=band)
    if request.scheduler is not None:
        name, args = request.scheduler
        options = dataclasses.replace(options, scheduler=name, scheduler_args=tuple(args))
    try:
        target = gpu_target(request.arch, request.ptx_version)
        backend = backends.backend_for_arch(request.arch, request.backend, options,
                                           request.layout.workload, request.layout)
    except ValueError as err:
        raise RequestError(str(err)) from None
    if problems := backend.problems(options, request.arch):
        raise options.backend_error(problems)
    return Plan(options, backend, target, backend.configs(options, request.layout))


def decode_splits_by_length(program: CheckedProgram, options: AttentionOptions) -> bool:
    """Whether a decode call of declaration `options` that fixes no split count splits each
    sequence by its own length (`CacheLayout.balanced`): unless the scheduler it names has
    a `kv_splits` rule or runs one work tile per CTA (`may_advance = false`: it would launch
    a CTA for every split a sequence may take). One that names none runs these calls by
    `attention_spec.BALANCED_DECODE_SCHEDULER`."""
    if not options.scheduler_named:
        return True
    name, args = options.scheduler_for("decode")
    if any(r.name == "kv_splits" for r in program.schedulers[name].rules):
        return False
    return may_advance(program, SchedulerSpec(name, args))


def build_kernel(program: CheckedProgram, request: KernelRequest,
                 store: cache.CompileCache | None = None) -> KernelBuild:
    """The kernel's artifacts: from the cache when an entry for exactly these inputs is
    there and whole, else generated and stored (`store`: the default cache if None)."""
    resolved = plan(program, request)
    store = store if store is not None else cache.CompileCache()
    key = cache_key(program, request, resolved)
    entry = store.get(key)
    loaded = _from_entry(entry, resolved.backend) if entry is not None else None
    if loaded is not None:
        return loaded
    configs = resolved.configs
    if request.trace:  # record the kernel that runs untraced: its config (tile) exactly
        configs = (build_kernel(program, dataclasses.replace(request, trace=False),
                                store).config,)
    source = kernel_source(program, resolved.options, resolved.target, request.trace,
                           request.layout.workload, request.layout.operand_grads)
    build = resolved.backend.build(source, configs, resolved.target)
    store.put(key, _to_entry(build))
    return build


def cache_key(program: CheckedProgram, request: KernelRequest, resolved: Plan) -> str:
    return cache.cache_key(
        what="attention kernel", sources=[s.text for s in program.sources],
        kernel=request.kernel, backend=resolved.backend.name, layout=request.layout,
        scheduler=[resolved.options.scheduler, list(resolved.options.scheduler_args)],
        trace=request.trace,
        **resolved.target.cache_fields(), ptxas=_ptxas_version(),
        compiler=cache.compiler_hash())


@dataclass(frozen=True)
class TileIndexBuild:
    """The tile index kernel as `runtime.tile_index` loads and launches it."""

    ptx: str
    name: str = tile_index.KERNEL_NAME
    threads: int = tile_index.THREADS  # per CTA
    abi: KernelABI = tile_index.ABI

    @property
    def grid_dependent(self) -> bool:
        return hopper.waits_for_prior_grids(self.ptx)


def build_tile_index(arch: str = "sm_80",
                     store: cache.CompileCache | None = None) -> TileIndexBuild:
    """The tile index kernel's PTX for `arch`: from the cache when an entry for exactly these
    inputs is there, else generated and stored (`store`: the default cache if None)."""
    target = gpu_target(arch)
    store = store if store is not None else cache.CompileCache()
    key = cache.cache_key(what="tile index kernel", **target.cache_fields(),
                          compiler=cache.compiler_hash())
    entry = store.get(key)
    if entry is None or "ptx" not in entry:
        module = new_module("tile_index", target)
        tile_index.build_tile_index_kernel(module)
        hopper.begin_after_prior_grids(module, target)
        entry = {"ptx": emit_ptx(optimize(module, target), target).encode()}
        store.put(key, entry)
    return TileIndexBuild(entry["ptx"].decode())


@functools.cache
def tile_index_kernel(arch: str = "sm_80") -> TileIndexBuild:
    """The tile index kernel ragged launches of builds for `arch` run, once per process and
    arch (sm_80 PTX runs on every later GPU too, which compiles it when it loads it)."""
    return build_tile_index(arch)


@dataclass(frozen=True)
class BlockClassesBuild:
    """A declaration's classes kernel (`codegen.block_classes`) as the launcher loads and
    launches it before a call's kernels (and `mhadsl compile` shows it)."""

    llvm: str
    ptx: str
    assembled: Assembled | None  # None when no ptxas is at hand
    abi: KernelABI
    name: str = block_classes.KERNEL_NAME
    threads: int = block_classes.THREADS  # per CTA

    @property
    def grid_dependent(self) -> bool:
        return hopper.waits_for_prior_grids(self.ptx)


def build_block_classes(program: CheckedProgram, kernel: str, ragged: bool,
                        arch: str = "sm_80",
                        store: cache.CompileCache | None = None) -> BlockClassesBuild:
    """The classes kernel of declaration `kernel` (whose mask reads data) for dense or
    `ragged` calls, for `arch` (sm_80 PTX runs on every later GPU, which compiles it when it
    loads it): from the cache when an entry for exactly these inputs is there, else
    generated and stored (`store`: the default cache if None)."""
    options = resolve_attention(program.attentions[kernel])
    hooks = expr_hooks(program, options.mask, None, options.operands)
    target = gpu_target(arch)
    store = store if store is not None else cache.CompileCache()
    key = cache.cache_key(what="block classes kernel", sources=[s.text for s in program.sources],
                          kernel=kernel, ragged=ragged, **target.cache_fields(),
                          ptxas=_ptxas_version(), compiler=cache.compiler_hash())
    entry = store.get(key)
    if entry is None or "ptx" not in entry:
        module = new_module("block_classes", target)
        block_classes.build_block_classes_kernel(module, hooks, ragged)
        hopper.begin_after_prior_grids(module, target)
        ptx = emit_ptx(optimize(module, target), target)
        entry = {"llvm": str(module).encode(), "ptx": ptx.encode()}
        if find_ptxas() is not None:
            assembled = assemble(ptx, arch)
            entry["cubin"] = assembled.cubin
            entry["meta"] = json.dumps({name: dataclasses.asdict(k) for name, k in
                                        assembled.kernels.items()}).encode()
        store.put(key, entry)
    assembled = None
    if "cubin" in entry:
        resources = {name: KernelResources(**k) for name, k in json.loads(entry["meta"]).items()}
        assembled = Assembled(entry["cubin"], resources, "")
    return BlockClassesBuild(entry["llvm"].decode(), entry["ptx"].decode(), assembled,
                             hooks.kernel_abi(block_classes.ABI))


@functools.cache
def _ptxas_version() -> str | None:
    """ptxas's version banner (its cubins are part of an entry), None without ptxas."""
    if find_ptxas() is None:
        return None
    return run_ptxas(["--version"])[1]


def _to_entry(build: KernelBuild) -> dict[str, bytes]:
    meta = {"backend": build.backend, "arch": build.arch,
            "config": dataclasses.asdict(build.config)}
    entry = {"llvm": build.llvm.encode(), "ptx": build.ptx.encode()}
    if build.assembled is not None:
        entry["cubin"] = build.assembled.cubin
        meta["resources"] = {name: dataclasses.asdict(k)
                             for name, k in build.assembled.kernels.items()}
        meta["log"] = build.assembled.log
    entry["meta"] = json.dumps(meta).encode()
    return entry


def _from_entry(entry: dict[str, bytes], backend: Backend) -> KernelBuild | None:
    """The build an entry holds; None for one this code did not write (it is rebuilt)."""
    try:
        meta = json.loads(entry["meta"])
        assembled = None
        if "cubin" in entry:
            resources = {name: KernelResources(**k) for name, k in meta["resources"].items()}
            assembled = Assembled(entry["cubin"], resources, meta["log"])
        # (a design may hand over to another's build: `backward_sm90`'s fallback)
        config_type = backend.config_type if meta["backend"] == backend.name else \
            backends.backend(meta["backend"]).config_type
        return KernelBuild(meta["backend"], meta["arch"], entry["llvm"].decode(),
                           entry["ptx"].decode(), assembled,
                           config_type(**meta["config"]), cached=True)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
