"""Only the thread that runs steps keeps an OpenMP pool (hicache/openmp.py): with more OpenMP
threads than CPUs, GNU libgomp sleeps at every barrier of every step."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from hicache.openmp import _libgomp, release_omp_pool, run_torch_alone

pytestmark = [pytest.mark.engine, pytest.mark.skipif(
    _libgomp() is None or not os.path.isdir("/proc/self/task"), reason="needs GNU OpenMP (torch's libgomp) and /proc")]


@pytest.fixture(autouse=True)
def two_threads_or_more(machine_threads: int) -> None:
    """Torch at the machine's width (the test process runs it on one thread, conftest.py)."""
    if machine_threads < 2:
        pytest.skip(f"needs 2+ torch threads (this machine gives torch {machine_threads})")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _in_a_fresh_thread(body) -> dict:
    seen: dict = {}
    t = threading.Thread(target=body, args=(seen,))
    t.start()
    t.join()
    return seen


def test_release_omp_pool_lets_the_callers_openmp_workers_exit() -> None:
    """EngineLoop.start() frees the starting thread's OpenMP workers; torch still works there."""
    def body(seen: dict) -> None:  # its own pool, whatever other threads hold
        a = torch.ones(1 << 22)
        torch.add(a, a)  # a parallel region: this thread's pool gets its workers
        seen["with_pool"] = _threads()
        seen["released"] = release_omp_pool()
        deadline = time.monotonic() + 5
        while _threads() >= seen["with_pool"] and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["after"] = _threads()
        seen["sum"] = float(torch.add(a, a).sum())  # the pool comes back

    seen = _in_a_fresh_thread(body)
    assert seen["released"] is True
    assert seen["after"] < seen["with_pool"]
    assert seen["sum"] == 2.0 * (1 << 22)


def test_a_helper_thread_runs_torch_alone_and_starts_no_workers() -> None:
    """The cache tiers' copy threads: their torch ops run on them, no OpenMP pool of their own;
    the calling (step) thread keeps its width."""
    width = torch.get_num_threads()

    def body(seen: dict) -> None:
        seen["alone"] = run_torch_alone()
        before = set(os.listdir("/proc/self/task"))  # thread ids: others may end meanwhile
        a = torch.ones(1 << 22)
        seen["sum"] = float(torch.add(a, a).sum())  # large enough to be a parallel region elsewhere
        seen["started"] = len(set(os.listdir("/proc/self/task")) - before)

    seen = _in_a_fresh_thread(body)
    assert seen["alone"] is True and seen["started"] == 0
    assert seen["sum"] == 2.0 * (1 << 22)
    assert torch.get_num_threads() == width
