"""The shared-memory TP all-reduce between two real processes: identical sums on every rank,
and the fallback to gloo when /dev/shm has no room for the segment."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing

from hicache.parallel import shm_allreduce
from hicache.parallel.shm_allreduce import open_shm_allreduce, segment_bytes
from hicache.ports import free_port

pytestmark = [pytest.mark.parallel, pytest.mark.multirank,
              pytest.mark.skipif(not shm_allreduce.shm_allreduce_supported(), reason="x86 only")]

MAX_ELEMS = 1024


def _rank(rank: int, port: int, free_bytes: int | None, out: dict) -> None:
    shm_allreduce.shm_free_bytes = lambda: free_bytes  # what /dev/shm reports in this scenario
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1], backend="gloo")
        reducer = open_shm_allreduce(rank, 2, MAX_ELEMS, group, leader=0)
        if reducer is None:
            out[rank] = None
            return
        sums = []
        for call in range(5):  # more calls than buffers: the double buffering is exercised
            x = torch.arange(MAX_ELEMS, dtype=torch.float32) * (rank + 1) + call
            sums.append(reducer(x).tolist())
        out[rank] = (sums, sorted(n for n in os.listdir("/dev/shm") if n.startswith("hicache-tp-")))
        reducer.close()
    finally:
        dist.destroy_process_group()


def _run(free_bytes: int | None) -> dict:
    with torch.multiprocessing.Manager() as manager:
        out = manager.dict()
        torch.multiprocessing.spawn(_rank, args=(free_port(), free_bytes, out), nprocs=2)
        return dict(out)


def test_two_ranks_get_identical_sums_and_leave_no_name_in_dev_shm() -> None:
    before = {n for n in os.listdir("/dev/shm") if n.startswith("hicache-tp-")}
    out = _run(free_bytes=None)
    (sums0, names0), (sums1, _) = out[0], out[1]
    assert sums0 == sums1  # bit-identical on both ranks
    for call, got in enumerate(sums0):
        assert got == [3 * i + 2 * call for i in range(MAX_ELEMS)]  # i*1 + i*2 + call on each rank
    assert set(names0) <= before  # the segment's name was dropped once both ranks mapped it


def test_too_little_room_in_dev_shm_falls_back_on_every_rank() -> None:
    out = _run(free_bytes=segment_bytes(2, MAX_ELEMS) - 1)
    assert out == {0: None, 1: None}
