"""Shared pytest setup: one fresh compile cache per run, and tests marked `gpu` are skipped
on machines without a usable GPU."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory):
    """The run's compile cache ($MHADSL_CACHE_DIR, inherited by the `mhadsl` child
    processes): each kernel the tests build is built once per run and shared by every test
    that needs it, and never loaded from an earlier run's or the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MHADSL_CACHE_DIR", str(tmp_path_factory.mktemp("mhadsl-cache")))
        yield


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
