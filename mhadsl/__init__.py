"""mhadsl: a compiler for attention kernels and their tile schedulers.

    prog = mhadsl.compile("examples/causal.mha")     # a path, or source text
    o = prog["causal_fwd"](q, k, v)
"""
import importlib as _importlib
from pathlib import Path as _Path

__version__ = "0.1.0"

# In a source checkout the subpackages mhadsl.codegen, mhadsl.runtime and mhadsl.grammar
# are the sibling folders codegen/, runtime/ and grammar/ (pyproject maps them when
# installing); let the import system find them there too, so running from the repo root
# works whether or not the install was editable.
_checkout = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "codegen").is_dir() and (_checkout / "codegen" / "nvptx.py").is_file():
    __path__.append(str(_checkout))

# The public names and their modules, imported on first use: importing the package (or
# only its runtime) loads no code generator and no LLVM, and no CUDA driver bindings.
_PUBLIC = {
    "MhaError": "mhadsl.front.diagnostics",
    "SchedulerError": "mhadsl.runtime.faults",
    "CudaError": "mhadsl.runtime.driver",
    "NoGpuError": "mhadsl.runtime.driver",
    "Kernel": "mhadsl.host.api",
    "Program": "mhadsl.host.api",
    "compile": "mhadsl.host.api",
    "reference": "mhadsl.analysis.reference",
    "reference_backward": "mhadsl.analysis.reference",
    "reference_decode": "mhadsl.analysis.reference",
    "reference_block_classes": "mhadsl.analysis.reference",
}


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'mhadsl' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def synchronize(device: int | None = None) -> None:
    """Wait for every launch on the device (default: the current one) and raise
    SchedulerError for a scheduler fault one of them recorded."""
    from mhadsl.runtime import driver  # needs the CUDA driver library, so only when called
    driver.synchronize(device)


__all__ = ["MhaError", "SchedulerError", "CudaError", "NoGpuError", "Kernel", "Program",
           "compile", "reference", "reference_backward", "reference_decode",
           "reference_block_classes",
           "synchronize", "__version__"]
