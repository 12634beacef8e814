"""PTX -> cubin with NVIDIA's `ptxas`, and its resource report per kernel.

`ptxas` is $MHADSL_PTXAS when set (a path, or a command on PATH), else looked up on PATH,
then in the `nvidia-cuda-nvcc` wheel (the `test` extra installs it), so a machine without a
CUDA toolkit can still assemble and count spills. An $MHADSL_PTXAS that is not an executable
file is an `AssemblerError` naming it, never a fall back to another ptxas.

A run of ptxas that lasts past $MHADSL_PTXAS_TIMEOUT seconds (default 300: the largest
kernels take tens of seconds) is stopped, with every process it started, and is an
`AssemblerError`.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import shutil
import signal
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


DEFAULT_PTXAS_TIMEOUT = 300  # seconds


@functools.cache
def find_ptxas() -> str | None:
    """The ptxas executable: $MHADSL_PTXAS, PATH, or the nvidia-cuda-nvcc wheel."""
    explicit = os.environ.get("MHADSL_PTXAS")
    if explicit:
        found = shutil.which(explicit)
        if found is None:
            raise AssemblerError(f"MHADSL_PTXAS={explicit}: not an executable file (nor a "
                                 f"command on PATH)")
        return found
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


def ptxas_timeout() -> float:
    """Seconds a run of ptxas may last: $MHADSL_PTXAS_TIMEOUT, else the default."""
    text = os.environ.get("MHADSL_PTXAS_TIMEOUT")
    if not text:
        return DEFAULT_PTXAS_TIMEOUT
    # ASCII digits only: float() would also take "nan", "inf" and other scripts' digits
    if not re.fullmatch(r"[0-9]+(\.[0-9]+)?", text) or float(text) == 0:
        raise AssemblerError(f"MHADSL_PTXAS_TIMEOUT={text}: give a number of seconds above 0")
    return float(text)


def run_ptxas(arguments: list[str]) -> tuple[int, str]:
    """Run ptxas (which must be found) with `arguments`: its exit status and its output,
    stdout then stderr. A run past `ptxas_timeout()` is killed and an `AssemblerError`."""
    ptxas, timeout = find_ptxas(), ptxas_timeout()
    if ptxas is None:
        raise AssemblerError("ptxas not found: install the test extra "
                             "(pip install 'mhadsl[test]') or put CUDA's ptxas on PATH")
    try:
        # A session of its own, so that a kill reaches whatever it started too.
        process = subprocess.Popen([ptxas, *arguments], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True)
    except OSError as err:  # the file went away or lost its executable bit since
        raise AssemblerError(f"cannot run ptxas {ptxas}: {err.strerror}") from None
    with process:
        try:
            out, err = process.communicate(timeout=timeout)
        except BaseException as stopped:  # past the timeout, or interrupted (Ctrl-C)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            if isinstance(stopped, subprocess.TimeoutExpired):
                raise AssemblerError(f"ptxas ran past {timeout:g} s (MHADSL_PTXAS_TIMEOUT) "
                                     f"and was stopped") from None
            raise
    return process.returncode, out + err


def assemble(ptx: str, arch: str) -> Assembled:
    """Assemble PTX for `arch` (sm_80, sm_90a) and report each kernel's resources."""
    with tempfile.TemporaryDirectory(prefix="mhadsl-") as tmp:
        src, out = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
        src.write_text(ptx)
        status, log = run_ptxas([f"-arch={arch}", "-v", "-O3", str(src), "-o", str(out)])
        if status != 0:
            raise AssemblerError(f"ptxas failed for {arch}:\n{log.strip()}")
        try:
            cubin = out.read_bytes()
        except OSError:
            raise AssemblerError(f"ptxas exited 0 but wrote no cubin for {arch}") from None
        return Assembled(cubin, parse_resources(log), log)
