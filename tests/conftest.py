"""Shared pytest setup: one fresh compile cache per run of the suite, one BLAS/OpenMP thread
per xdist worker, and tests marked `gpu` are skipped on machines without a usable GPU."""
import os
import shutil
import tempfile

import pytest

_cache = pytest.MonkeyPatch()


def pytest_configure(config: pytest.Config) -> None:
    """The run's compile cache ($MHADSL_CACHE_DIR): each kernel the tests build is built
    once per run and shared by every test that needs it, and never loaded from an earlier
    run's or the user's cache. xdist's workers and the `mhadsl` child processes inherit it
    from the environment, so only the controlling process makes it."""
    if not hasattr(config, "workerinput"):
        _cache.setenv("MHADSL_CACHE_DIR", tempfile.mkdtemp(prefix="mhadsl-test-cache-"))
        for name, value in worker_thread_limits(os.environ, config.getoption("numprocesses",
                                                                             None)).items():
            _cache.setenv(name, value)


# The thread pools of NumPy's BLAS and torch, which size themselves to the machine's cores in
# every process: under xdist's one worker a core they oversubscribe the CPU many times over
# (the GPU suite's float64 references ran about 4x slower on 16 cores and 14 workers).
THREAD_POOL_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def worker_thread_limits(environ, workers) -> dict[str, str]:
    """The variables the controlling process sets for its xdist workers to inherit: one
    thread per pool where workers run (`-n` other than 0) and the user set no size."""
    if not workers:
        return {}
    return {name: "1" for name in THREAD_POOL_VARIABLES if name not in environ}


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ["MHADSL_CACHE_DIR"], ignore_errors=True)
        _cache.undo()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    from mhadsl.runtime.driver import gpu_available  # only touch the driver when needed

    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (no CUDA driver or device found)")
    for item in gpu_items:
        item.add_marker(skip)
