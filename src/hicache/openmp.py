"""The OpenMP runtime under torch's CPU ops, per thread (GNU libgomp, which the CPU wheel ships).

libgomp keeps a pool of worker threads for every thread that ran a parallel region, and once the
process holds more OpenMP threads than CPUs it stops spinning at barriers and puts every thread to
sleep at the end of each region: a decode step has hundreds of regions, each wake-up costs tens of
microseconds on a 2-core VM, and a step on the engine loop thread took 1.5-1.9x as long as the same
step on the loading thread (HTTP median ITL 25 ms vs 13 ms in process, ``benchmarks/bench_server.py
--decode-only --keep-omp-pool-too``). So only the thread that runs steps keeps a pool: the thread
that loaded the model lets its pool go (:func:`release_omp_pool`), and helper threads that run
torch ops (the cache tiers' copy workers) run them on themselves alone (:func:`run_torch_alone`).
Elsewhere (another OpenMP runtime, not Linux) both do nothing and say so.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from typing import Optional

import torch


def release_omp_pool() -> bool:
    """Let the calling thread's idle OpenMP workers exit; True if it did. The pool comes back if
    the thread runs a parallel region again."""
    lib = _libgomp()  # (a libgomp older than OpenMP 5.0 lacks the call; omp_pause_soft frees this thread's pool)
    return lib is not None and hasattr(lib, "omp_pause_resource_all") and lib.omp_pause_resource_all(1) == 0


def run_torch_alone() -> bool:
    """From now on the calling thread runs torch's CPU ops on itself: no OpenMP workers of its own
    to outnumber the CPUs (their copies are small; the step thread keeps every core). True if set."""
    lib = _libgomp()
    if lib is None:
        return False
    torch.get_num_threads()  # torch sets a thread's OpenMP width on its first use: let that happen first
    lib.omp_set_num_threads(1)  # this thread's own setting (an OpenMP per-thread variable)
    return torch.get_num_threads() == 1


@functools.lru_cache(maxsize=1)
def _libgomp() -> Optional[ctypes.CDLL]:
    """The GNU OpenMP runtime this process loaded (torch's), or None (another runtime, not Linux)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith("libgomp") and os.path.exists(path):
            with contextlib.suppress(OSError):
                return ctypes.CDLL(path)  # already loaded: the same handle, nothing new runs
    return None
