"""The suite's own setup (conftest.py): the xdist workers' thread pools."""
import os

from conftest import THREAD_POOL_VARIABLES, worker_thread_limits


def test_workers_get_one_thread_per_pool_unless_the_user_sized_it():
    assert worker_thread_limits({}, 14) == {name: "1" for name in THREAD_POOL_VARIABLES}
    assert worker_thread_limits({}, "auto") == {name: "1" for name in THREAD_POOL_VARIABLES}
    sized = worker_thread_limits({"OMP_NUM_THREADS": "4"}, 14)
    assert "OMP_NUM_THREADS" not in sized and sized["MKL_NUM_THREADS"] == "1"


def test_one_process_keeps_its_thread_pools():
    assert worker_thread_limits({}, 0) == {}
    assert worker_thread_limits({}, None) == {}


def test_this_worker_inherited_the_limits():
    if "PYTEST_XDIST_WORKER" in os.environ:  # (a user's own size is left as it was)
        assert all(os.environ.get(name) for name in THREAD_POOL_VARIABLES)
