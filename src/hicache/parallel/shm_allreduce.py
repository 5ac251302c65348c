"""Tensor-parallel all-reduce through shared memory, for TP ranks on one host's CPUs.

A gloo all-reduce over loopback costs ~2 ms here whatever the size (two process wake-ups per
call); a forward does two per layer. Ranks on one host can instead write their partial sums
into one shared buffer and read each other's: the cost is then a few copies plus waiting for
the slowest rank.

Protocol, per call ``n`` (every TP rank makes the same calls in the same order):
1. write the partial sum into this rank's slot of buffer ``n % 2``;
2. publish ``n`` in this rank's flag;
3. wait until every rank's flag is ``>= n``; sum the slots in rank order (so every rank gets
   bit-identical results).
Double buffering makes one wait per call enough: a rank writes buffer ``n % 2`` again only at
call ``n + 2``, after every rank has published ``n + 1``, i.e. finished reading call ``n``.
Visibility relies on x86's in-order stores (data before flag); other machines use gloo.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import platform
import time
import uuid
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

FLAG_STRIDE = 8  # int64s per flag: one cache line each, so ranks never write the same line
SPIN_BEFORE_YIELD = 200
SHM_DIR = "/dev/shm"
PARENT_CHECK_SPINS = 100_000  # while waiting for peers, look at the frontend this often (~0.1-1 s)


def parent_alive() -> bool:
    """Whether the process that spawned this one still runs (True in a process not spawned
    by multiprocessing)."""
    parent = multiprocessing.parent_process()
    return parent is None or parent.is_alive()


def shm_allreduce_supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and os.environ.get("HICACHE_TP_ALLREDUCE", "shm") == "shm"


def _flag_bytes(tp_size: int) -> int:
    return tp_size * FLAG_STRIDE * 8


def segment_bytes(tp_size: int, max_elems: int) -> int:
    """Bytes of one TP group's segment: a flag per rank, two buffers of a slot per rank."""
    return _flag_bytes(tp_size) + 2 * tp_size * max_elems * 4


def shm_free_bytes() -> int | None:
    """Free bytes in /dev/shm (None where there is no such file system to ask)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def open_shm_allreduce(tp_rank: int, tp_size: int, max_elems: int, group: Any, leader: int) -> "ShmAllReduce | None":
    """The group's shared-memory all-reduce, or None on every rank of ``group`` when the stage
    leader (global rank ``leader``) finds too little room for the segment: a tmpfs that runs
    full under a mapping kills the process with SIGBUS (a container's default /dev/shm is 64 MiB)."""
    box: list[str | None] = [None]
    if tp_rank == 0:
        need, free = segment_bytes(tp_size, max_elems), shm_free_bytes()
        box = [f"hicache-tp-{uuid.uuid4().hex[:12]}"]
        if free is not None and free < need:
            logger.warning("the shared-memory TP all-reduce needs %.1f MiB but %s has %.1f MiB free: "
                           "summing through gloo instead (slower)", need / 2**20, SHM_DIR, free / 2**20)
            box = [""]
    dist.broadcast_object_list(box, src=leader, group=group)
    return ShmAllReduce(tp_rank, tp_size, max_elems, group, box[0]) if box[0] else None


class ShmAllReduce:
    """Sum of float32 CPU tensors of up to ``max_elems`` elements over one TP group."""

    def __init__(self, tp_rank: int, tp_size: int, max_elems: int, group: Any, name: str) -> None:
        """Collective over ``group``; ``name`` (the same on every rank) names the new segment.
        Use :func:`open_shm_allreduce`."""
        self.rank, self.size, self.max_elems = tp_rank, tp_size, max_elems
        flag_bytes = _flag_bytes(tp_size)
        self.nbytes = segment_bytes(tp_size, max_elems)  # the whole segment, shared by the group's ranks
        if tp_rank == 0:
            self.shm = shared_memory.SharedMemory(name=name, create=True, size=self.nbytes)
            self.shm.buf[:flag_bytes] = bytes(flag_bytes)
        dist.barrier(group=group)
        if tp_rank != 0:
            # Ranks share the frontend's resource tracker: attaching registers the same name
            # again (a set) and the creator's unlink below unregisters it.
            self.shm = shared_memory.SharedMemory(name=name)
        self.flags = np.ndarray((tp_size * FLAG_STRIDE,), dtype=np.int64, buffer=self.shm.buf)[::FLAG_STRIDE]
        self.data = torch.frombuffer(self.shm.buf, dtype=torch.float32, offset=flag_bytes,
                                     count=2 * tp_size * max_elems).view(2, tp_size, max_elems)
        self.calls = 0
        dist.barrier(group=group)
        if tp_rank == 0:
            # Every rank has mapped the segment: drop its name now, so that nothing is left in
            # /dev/shm however the ranks end (the mappings live until each rank closes or dies).
            self.shm.unlink()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (float32) summed over the group in rank order (a new tensor); larger than the
        segment, in pieces (every element's sum is the same)."""
        n = x.numel()
        if n > self.max_elems:
            flat = x.reshape(-1)
            return torch.cat([self(flat[i:i + self.max_elems]) for i in range(0, n, self.max_elems)]).view_as(x)
        self.calls += 1
        slots = self.data[self.calls % 2]
        slots[self.rank, :n].copy_(x.reshape(-1))
        self.flags[self.rank] = self.calls
        spins = 0
        while (self.flags < self.calls).any():
            spins += 1
            if spins > SPIN_BEFORE_YIELD:
                time.sleep(0)  # give the core to a rank that has not arrived yet
                if spins % PARENT_CHECK_SPINS == 0 and not parent_alive():
                    # A dead peer is the frontend's to handle (it stops every rank); with the
                    # frontend gone too, nobody would: stop spinning.
                    raise RuntimeError("the frontend process is gone")
        return slots[:, :n].sum(0).view_as(x)

    def close(self) -> None:
        del self.data, self.flags
        self.shm.close()
