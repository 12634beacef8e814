"""Shared pytest setup: tests marked `gpu` are skipped on machines without a usable GPU."""

import pytest


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
