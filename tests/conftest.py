"""Shared pytest setup: one fresh compile cache per run of the suite, and tests marked `gpu`
are skipped on machines without a usable GPU."""
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
