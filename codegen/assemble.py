"""PTX -> cubin with NVIDIA's `ptxas`, and its resource report per kernel.

`ptxas` is looked up on PATH, then in the `nvidia-cuda-nvcc` wheel (the `test` extra
installs it), so a machine without a CUDA toolkit can still assemble and count spills.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KernelResources:
    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    shared_bytes: int

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


@dataclass(frozen=True)
class Assembled:
    cubin: bytes
    kernels: dict[str, KernelResources]
    log: str


class AssemblerError(RuntimeError):
    pass


@functools.cache
def find_ptxas() -> str | None:
    """The ptxas executable: $MHADSL_PTXAS, PATH, or the nvidia-cuda-nvcc wheel."""
    explicit = os.environ.get("MHADSL_PTXAS")
    if explicit:
        return explicit
    found = shutil.which("ptxas")
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted(Path(root).glob("*/bin/ptxas")):
            if not os.access(candidate, os.X_OK):
                candidate.chmod(0o755)  # wheels may drop the executable bit
            return str(candidate)
    return None


_FUNCTION = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_resources(log: str) -> dict[str, KernelResources]:
    """Read `ptxas -v` output into one record per entry function."""
    kernels: dict[str, KernelResources] = {}
    current, frame = None, (0, 0, 0)
    for line in log.splitlines():
        if m := _FUNCTION.search(line):
            current, frame = m.group(1), (0, 0, 0)
        elif (m := _FRAME.search(line)) and current:
            frame = tuple(int(g) for g in m.groups())
        elif (m := _USED.search(line)) and current:
            kernels[current] = KernelResources(current, int(m.group(1)), frame[1], frame[2],
                                               frame[0], int(m.group(2) or 0))
    return kernels


def assemble(ptx: str, arch: str) -> Assembled:
    """Assemble PTX for `arch` (sm_80, sm_90a) and report each kernel's resources."""
    ptxas = find_ptxas()
    if ptxas is None:
        raise AssemblerError("ptxas not found: install the test extra "
                             "(pip install 'mhadsl[test]') or put CUDA's ptxas on PATH")
    with tempfile.TemporaryDirectory(prefix="mhadsl-") as tmp:
        src, out = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
        src.write_text(ptx)
        proc = subprocess.run([ptxas, f"-arch={arch}", "-v", "-O3", str(src), "-o", str(out)],
                              capture_output=True, text=True)
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise AssemblerError(f"ptxas failed for {arch}:\n{log.strip()}")
        return Assembled(out.read_bytes(), parse_resources(log), log)
