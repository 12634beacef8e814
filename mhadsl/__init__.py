"""mhadsl: a compiler for attention kernels and their tile schedulers.

    prog = mhadsl.compile("examples/causal.mha")     # a path, or source text
    o = prog["causal_fwd"](q, k, v)
"""
from pathlib import Path as _Path

__version__ = "0.1.0"

# In a source checkout the subpackages mhadsl.codegen, mhadsl.runtime and mhadsl.grammar
# are the sibling folders codegen/, runtime/ and grammar/ (pyproject maps them when
# installing); let the import system find them there too, so running from the repo root
# works whether or not the install was editable.
_checkout = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "codegen").is_dir() and (_checkout / "codegen" / "nvptx.py").is_file():
    __path__.append(str(_checkout))

from mhadsl.diagnostics import MhaError  # noqa: E402
from mhadsl.api import Kernel, Program, compile  # noqa: E402
from mhadsl.reference import reference, reference_backward, reference_decode  # noqa: E402
from mhadsl.runtime.faults import SchedulerError  # noqa: E402


def __getattr__(name: str):
    # The runtime's error types, without loading the CUDA driver bindings at import.
    if name in ("CudaError", "NoGpuError"):
        from mhadsl.runtime import driver
        return getattr(driver, name)
    raise AttributeError(f"module 'mhadsl' has no attribute {name!r}")


def synchronize(device: int | None = None) -> None:
    """Wait for every launch on the device (default: the current one) and raise
    SchedulerError for a scheduler fault one of them recorded."""
    from mhadsl.runtime import driver  # needs the CUDA driver library, so only when called
    driver.synchronize(device)


__all__ = ["MhaError", "SchedulerError", "CudaError", "NoGpuError", "Kernel", "Program",
           "compile", "reference", "reference_backward", "reference_decode",
           "synchronize", "__version__"]
