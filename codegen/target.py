"""Targets, LLVM optimisation, PTX emission and the host JIT.

llvmlite 0.50 wraps LLVM 22 with its NVPTX backend. A `Target` is the arch plus the PTX
ISA version (both belong in any cache key); `emit_ptx` runs LLVM's O3 pipeline and the
NVPTX asm printer; `HostJit` compiles the same rules for this CPU.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import llvmlite
import llvmlite.binding as llvm
from llvmlite import ir

NVPTX_TRIPLE = "nvptx64-nvidia-cuda"
GPU_ARCHS = ("sm_80", "sm_90a")
# The driver this project targets (580, CUDA 13.0) accepts PTX ISA up to 9.0.
DEFAULT_PTX_VERSION = 85


@dataclass(frozen=True)
class Target:
    arch: str  # "host" or one of GPU_ARCHS
    ptx_version: int = DEFAULT_PTX_VERSION

    @property
    def is_gpu(self) -> bool:
        return self.arch != "host"

    @property
    def triple(self) -> str:
        return NVPTX_TRIPLE if self.is_gpu else llvm.get_process_triple()

    @property
    def features(self) -> str:
        return f"+ptx{self.ptx_version}" if self.is_gpu else ""

    @property
    def grid_dependent(self) -> bool:
        """Whether its kernels begin with programmatic dependent launch's two instructions
        (`hopper.begin_after_prior_grids`: sm_90 and later), so the runtime launches them
        while the grid before them in the stream drains."""
        return self.arch == "sm_90a"

    def cache_fields(self) -> dict:
        return {"arch": self.arch, "ptx_version": self.ptx_version,
                "llvm": ".".join(map(str, llvm.llvm_version_info)),
                "llvmlite": llvmlite.__version__}


HOST = Target("host")


def gpu_target(arch: str, ptx_version: int = DEFAULT_PTX_VERSION) -> Target:
    if arch not in GPU_ARCHS:
        raise ValueError(f"unknown GPU arch {arch!r}; expected one of {', '.join(GPU_ARCHS)}")
    return Target(arch, ptx_version)


@functools.cache
def _init_llvm() -> None:
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()


@functools.cache
def target_machine(target: Target) -> llvm.TargetMachine:
    _init_llvm()
    if target.is_gpu:
        return llvm.Target.from_triple(NVPTX_TRIPLE).create_target_machine(
            cpu=target.arch, features=target.features, opt=3)
    return llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), opt=2, jit=True)


def new_module(name: str, target: Target) -> ir.Module:
    module = ir.Module(name=name)
    module.triple = target.triple
    module.data_layout = str(target_machine(target).target_data)
    return module


def optimize(module: ir.Module | str, target: Target) -> llvm.ModuleRef:
    """Parse, verify and run LLVM's O3 pipeline; returns the optimised module."""
    _init_llvm()
    ref = llvm.parse_assembly(str(module))
    ref.verify()
    tm = target_machine(target)
    tuning = llvm.create_pipeline_tuning_options(speed_level=3)
    builder = llvm.create_pass_builder(tm, tuning)
    builder.getModulePassManager().run(ref, builder)
    return ref


def emit_ptx(optimized: llvm.ModuleRef, target: Target) -> str:
    # The NVPTX printer numbers call sequences ("// callseq 27") with a counter that runs on
    # across compilations in a process; renumbering per module keeps the PTX reproducible.
    ptx = target_machine(target).emit_assembly(optimized)
    numbers: dict[str, str] = {}
    return _CALLSEQ.sub(lambda m: f"callseq {numbers.setdefault(m[1], str(len(numbers)))}",
                        ptx)


_CALLSEQ = re.compile(r"callseq (\d+)")


class HostJit:
    """Keeps a host-compiled module alive and hands out its functions' addresses."""

    def __init__(self, module: ir.Module | str):
        ref = optimize(module, HOST)
        # The engine takes ownership of its target machine: give it a fresh one.
        _init_llvm()
        machine = llvm.Target.from_default_triple().create_target_machine(
            cpu=llvm.get_host_cpu_name(), opt=2, jit=True)
        self.engine = llvm.create_mcjit_compiler(ref, machine)
        self.engine.finalize_object()
        self.engine.run_static_constructors()
        self._module = ref  # the engine owns it; keep the reference for dumps

    def address(self, name: str) -> int:
        return self.engine.get_function_address(name)
