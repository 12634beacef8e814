"""The host launcher: a call -> its design's kernels -> launch plans, for every design.

Each `Kernel` (an attention declaration) has one `Launcher`. It loads the build a call's
layout selects on a device (once per layout and device; the build path picks the design:
`mhadsl.build`), compiles the scheduler's rules for the host (once per specialisation), and
plans a call signature's launches (`plan`): for each kernel its design lists, in launch
order (`Backend.kernels`), the grid (the scheduler's own `grid_dim` over the design's work
space, or the kernel's fixed grid) and the parameter block (`runtime.launch.LaunchPlan`),
whose values are the call's sizes (`CallSizes.values`), the design's own
(`Backend.call_values`) and the device's; every kernel takes the declaration's operands after
its design's parameters (`mhadsl.abi.with_operands`), their values packed at each launch. A
ragged call's scheduled kernel builds its tile index first, over the row offsets its design
names (`Backend.tile_offsets`). A call whose mask reads data classifies its tiles first
(`ClassesPlan`: the declaration's classes kernel, `codegen.block_classes`).

The forward (`mhadsl.host.forward`), decode (`mhadsl.host.serving`) and backward
(`mhadsl.host.backward`) calls check their arguments, plan through here once per call
signature and keep the plans in `plans` (by validated signature) and `fast_plans` (by torch
signature; a change of the kernel's forced design or tracing clears them).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from mhadsl.abi import (
    CallSizes, block_class_bytes, block_class_values, classifies_per_call,
    declaration_params, with_operands,
)
from mhadsl.analysis.classify import band_operands, short_band
from mhadsl.build import RequestError, build_block_classes, tile_index_kernel
from mhadsl.codegen import backends
from mhadsl.codegen.backends import Backend, KernelBuild, Layout
from mhadsl.runtime.launch import LaunchPlan, TensorShape

_host_schedulers: dict = {}  # (program text, SchedulerSpec) -> HostScheduler, per process


@dataclass(frozen=True)
class Loaded:
    """A build loaded on a device: its design (`KernelBuild.backend`: a design may hand over
    to another's build) and its kernels by name."""

    build: KernelBuild
    design: Backend
    layout: Layout
    device: int
    functions: dict  # kernel name -> runtime.driver.Function
    module: object  # keeps the CUDA module loaded

    @property
    def config(self):
        return self.build.config


class Launcher:
    """One kernel's loaded builds, host schedulers and launch plans (the module's
    docstring)."""

    def __init__(self, kernel):
        self.kernel = kernel  # api.Kernel
        self.loaded: dict[tuple, Loaded] = {}  # by (layout, device, forced design, trace)
        self.plans: dict[tuple, object] = {}
        self.fast_plans: dict[tuple, object] = {}
        # per-stream scratch buffers (stream -> {name: buffer}), by (device, the bytes of
        # each): a call planned again (not a torch signature's) reuses its stream's
        self.scratch: dict[tuple, dict] = {}
        # the classes kernel (`classes_plan`), loaded: (build, module, function) by
        # (ragged, device)
        self.classes: dict[tuple, tuple] = {}
        # the i32 operands that decide whether a call's mask is a short band, and what each
        # of their values decided (`short_band`)
        self.band_operands = band_operands(kernel.options.mask, kernel.program.checked)
        self.short_bands: dict[tuple, bool] = {}

    def short_band(self, operands: dict | None) -> bool:
        """Whether a forward call's i32 operands (checked values, by name) make its mask a
        short band of keys (`Layout.short_band`: a run-time window that selects the build
        for one); each set of values is decided once."""
        if not self.band_operands:
            return False
        values = tuple(operands[n] for n in self.band_operands)
        decided = self.short_bands.get(values)
        if decided is None:
            decided = self.short_bands[values] = short_band(
                self.kernel.options.mask, self.kernel.program.checked,
                dict(zip(self.band_operands, values)))
        return decided

    def load(self, layout: Layout, device: int) -> Loaded:
        """The build of `layout` for `device`, loaded (once)."""
        kernel = self.kernel
        key = (layout, device, kernel.backend, kernel.trace)
        if key in self.loaded:
            return self.loaded[key]
        from mhadsl.runtime import driver
        target = backends.select_target(driver.device_info(device).compute_capability)
        build = self.build(layout, target.arch)
        driver.ensure_context(device)
        module = (driver.Module.from_cubin(build.assembled.cubin, device)
                  if target.load == "cubin" and build.assembled else
                  driver.Module.from_ptx(build.ptx.encode(), device))
        design = backends.backend(build.backend)
        functions = {k.name: module.function(k.name) for k in design.kernels(build.config)}
        self.loaded[key] = Loaded(build, design, layout, device, functions, module)
        if self.band_operands and layout.workload == "prefill":
            # the other value of `short_band` too: a call's new operand values never build
            self.load(replace(layout, short_band=not layout.short_band), device)
        for sibling in design.sibling_layouts(kernel.options, layout):
            self.load(sibling, device)  # (nor do its new sizes)
        return self.loaded[key]

    def load_call(self, layout: Layout, call: CallSizes, device: int) -> Loaded:
        """The build a call of `layout` with these sizes runs on `device`, loaded: the one
        its design picks by the sizes (`Backend.call_layout`)."""
        loaded = self.load(layout, device)
        sized = loaded.design.call_layout(self.kernel.options, layout, call)
        return loaded if sized == layout else self.load(sized, device)

    def build(self, layout: Layout, arch: str) -> KernelBuild:
        """The kernel's build of `layout` for `arch` (`Kernel.build`), by its forced design
        where that design runs the layout's workload."""
        kernel = self.kernel
        forced = kernel.backend
        if forced in backends.REGISTRY and backends.backend(forced).workload != layout.workload:
            forced = None  # a forced design of another workload leaves this call's alone
        try:
            return kernel.build(arch, gqa_group=layout.gqa_group, ragged=layout.ragged,
                                return_lse=layout.return_lse, backend=forced,
                                cache=layout.cache, backward=layout.backward,
                                deterministic=layout.deterministic,
                                operand_grads=layout.operand_grads,
                                short_band=layout.short_band, narrow_kv=layout.narrow_kv)
        except RequestError as err:
            raise RuntimeError(f"kernel '{kernel.name}': {err}") from None

    def host_scheduler(self, config, design: Backend):
        """The scheduler's rules compiled for the host, for a build of `config` by `design`
        (`Kernel.scheduler_spec`)."""
        from mhadsl.analysis.simulate import HostScheduler
        kernel = self.kernel
        spec = kernel.scheduler_spec(config, design)
        key = (kernel.program.text, spec)
        if key not in _host_schedulers:
            _host_schedulers[key] = HostScheduler(kernel.program.checked, spec)
        return _host_schedulers[key]

    @staticmethod
    def occupancy(loaded: Loaded) -> tuple[int, int]:
        """(multiprocessors of the device, CTAs of the scheduled kernel that fit on one)."""
        from mhadsl.runtime import driver
        scheduled = loaded.design.scheduled(loaded.config)
        return (driver.device_info(loaded.device).multiprocessor_count,
                loaded.functions[scheduled.name].max_active_blocks(scheduled.threads,
                                                                   scheduled.shared_bytes))

    def values(self, loaded: Loaded, call: CallSizes) -> dict:
        """The `CallValue`s of a call of these sizes: the shared ones, the design's, the
        device's, and the sizes of its tile classes where it makes them."""
        num_sms, fit = self.occupancy(loaded)
        config, options = loaded.config, self.kernel.options
        ctas_per_sm = loaded.design.resident_ctas(config, call, num_sms, fit)
        values = {**call.values(), **loaded.design.call_values(config, call),
                  "num_sms": num_sms, "ctas_per_sm": ctas_per_sm}
        if classifies_per_call(options, loaded.layout.workload):
            values.update(block_class_values(call, options.mask_reads_head,
                                             (config.block_m, config.block_n)))
        return values

    def plan(self, loaded: Loaded, call: CallSizes,
             tensors: Mapping[str, TensorShape | None]) -> list[LaunchPlan]:
        """The launches of a call of these sizes on tensors of these shapes, in order; a
        scheduled kernel whose work space has no tiles is left out (nothing to do)."""
        design, config, device = loaded.design, loaded.config, loaded.device
        values = self.values(loaded, call)
        num_sms, ctas_per_sm = values["num_sms"], values["ctas_per_sm"]
        plans = []
        options = self.kernel.options
        operands = declaration_params(options, loaded.layout.workload,
                                      loaded.layout.operand_grads)
        if classifies_per_call(options, loaded.layout.workload):
            plans.append(self.classes_plan(loaded, call, tensors, values))
        for kernel in design.kernels(config):
            index = None
            if kernel.grid is not None:
                grid = kernel.grid(call)
            else:
                space = design.work_space(config, call)
                if not space[1]:
                    continue
                grid = self.host_scheduler(config, design).grid(*space, num_sms, ctas_per_sm)
                if loaded.layout.ragged:
                    from mhadsl.runtime import tile_index
                    index = tile_index.plan(tile_index_kernel(loaded.build.arch), call.batch,
                                            design.scheduler_shape(config)[0], device)
            plans.append(LaunchPlan(loaded.functions[kernel.name], grid, kernel.threads,
                                    kernel.shared_bytes, with_operands(kernel.abi, operands),
                                    config, device, tensors,
                                    values, index, design.tile_offsets,
                                    loaded.build.grid_dependent))
        return plans

    def classes_plan(self, loaded: Loaded, call: CallSizes,
                     tensors: Mapping[str, TensorShape | None], values: dict) -> ClassesPlan:
        """The launch of the declaration's classes kernel (`codegen.block_classes`) for a
        call of these sizes."""
        from mhadsl.runtime import driver
        kernel, ragged = self.kernel, loaded.layout.ragged
        key = (ragged, loaded.device)
        if key not in self.classes:
            build = build_block_classes(kernel.program.checked, kernel.name, ragged,
                                        loaded.build.arch)
            module = driver.Module.from_ptx(build.ptx.encode(), loaded.device)
            self.classes[key] = (build, module, module.function(build.name))
        build, _, function = self.classes[key]
        cells = block_class_bytes(values, call.batch)
        if cells > MAX_CELLS:
            raise ValueError(f"kernel '{kernel.name}': the call's tile classes would take "
                             f"{cells} cells (sequences x heads x query tiles x KV tiles), "
                             f"more than {MAX_CELLS}")
        grid = (max(1, -(-cells * 32 // build.threads)), 1, 1)
        launch = LaunchPlan(function, grid, build.threads, 0, build.abi, None, loaded.device,
                            tensors, values, grid_dependent=build.grid_dependent)
        return ClassesPlan(launch, cells, loaded.device,
                           (call.batch, *(values[n] for n in CLASS_SIZES)),
                           (call.seqlen_q, call.seqlen_k, call.max_seqlen_q, call.max_seqlen_k))


# the cells of a call's classes: the kernels' offsets into them are 32-bit
MAX_CELLS = 2**31 - 1
# the values that size a call's classes (`abi.block_class_values`)
CLASS_SIZES = ("block_rows", "block_cols", "block_heads", "cell_rows", "cell_keys")


@dataclass
class ClassesPlan:
    """A call's classes kernel (`codegen.block_classes`), which fills its stream's
    `block_classes` buffer before the call's kernels read it, unless the call passes its
    own (`mhadsl.BlockClasses`)."""

    plan: LaunchPlan
    nbytes: int
    device: int
    sizes: tuple[int, ...]  # the call's sequences, then its values of CLASS_SIZES
    lengths: tuple[int, ...]  # its dense seqlen_q and seqlen_k, its max_seqlen_q and _k

    def run(self, addresses: Mapping[str, int], buffer: int, stream: int,
            scalars: Mapping | None) -> None:
        """Queue the kernel on `stream`, writing the classes to device address `buffer`."""
        self.plan.launch({**addresses, "block_classes": buffer}, stream, scalars=scalars)

    def prepare(self, addresses: Mapping[str, int], stream: int,
                scalars: Mapping | None) -> Mapping[str, int]:
        """`addresses` with the call's classes: those passed, else its stream's buffer,
        filled by the kernel queued on `stream` here."""
        if addresses.get("block_classes"):
            return addresses
        from mhadsl.runtime import driver
        buffer = driver.stream_buffer("block_classes", self.nbytes, stream, self.device,
                                      "a call whose mask reads data")
        self.run(addresses, buffer, stream, scalars)
        return {**addresses, "block_classes": buffer}


def launch(plans: list, addresses: Mapping[str, int], stream: int,
           workspace: int | None = None, scalars: Mapping | None = None) -> None:
    """Queue a call's launches on `stream`, in order; `scalars`: its operands' values."""
    for plan in plans:
        if isinstance(plan, ClassesPlan):
            addresses = plan.prepare(addresses, stream, scalars)
        else:
            plan.launch(addresses, stream, workspace, scalars)
