"""Device <-> host transfers: queued, executed asynchronously, acknowledged in order.

Each submitted operation executes on a worker thread (one per direction, FIFO), layer by
layer, setting one ready event per layer and a done event at the end. On CPU the copies are
numpy copies that release the GIL while they run, and a layer's ready event is set when its
copy has ended. On CUDA the worker enqueues its copies on a stream of its own, ordered after the
compute that produced the data (``after_compute``), and records one CUDA event per layer behind
them; a layer's ready event then means "enqueued", and :meth:`wait_layer` makes the compute
stream wait on that layer's CUDA event -- on the GPU, without blocking the thread that launches
the forward -- so layer i's attention waits for layer i's copy only. The worker synchronizes the
op's ``finish_event`` before setting ``done``, and the tree's bookkeeping only ever follows
``done`` (through :meth:`pop`).

The scheduler thread never looks at events to change cache state. It asks how many leading
acks are ready (:meth:`ready_count`), decides how many to consume (today: that count; with
several ranks: an agreed count), and :meth:`pop` hands back exactly that many, waiting for any
that are not locally done yet (DESIGN invariant 3).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np
import torch

from ..openmp import run_torch_alone
from .host_pool import HostKVPool, device_page_view
from .page_copy import PageBuf, PagePlan, copy_pages, cpu_page_arrays
from .placement import ShardView
from .pools import DeviceKVPool

logger = logging.getLogger(__name__)

BACKUP, LOAD = "backup", "load"
# A copy worker's staging buffer on a GPU, in pages of one layer's K or V (8 MiB for Llama-3-8B's rows of
# 16 tokens): a longer op goes through it in chunks, so its size is fixed and budgeted (staging_budget).
STAGING_PAGES = 256


def staging_budget(row_bytes: Sequence[int]) -> int:
    """Device bytes the transfer workers' staging buffers take on a GPU: one buffer per direction
    per pool pair (``row_bytes``: each pair's page of one layer's K or V, in bytes)."""
    return 2 * STAGING_PAGES * sum(row_bytes)


@dataclass
class TransferOp:
    """One merged copy between device pages and host pages (same length, same order)."""

    op_id: int
    kind: str  # BACKUP (device -> host) | LOAD (host -> device)
    device_pages: np.ndarray
    host_pages: np.ndarray
    payload: list = field(default_factory=list)  # what the cache attaches (nodes to unlock)
    layer_done: list[threading.Event] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    submit_time: float = 0.0
    finish_time: float = 0.0
    error: Optional[BaseException] = None
    after_compute: Optional[object] = None  # CUDA event: the data's producer on the compute stream
    layer_events: list = field(default_factory=list)  # CUDA: each layer's copies done on the copy stream
    finish_event: Optional[object] = None  # CUDA: every copy of the op done (synchronized before ``done``)
    # a hybrid pool's window layers: their device and host window pages (a subset of the pages: checkpoints)
    window_device_pages: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    window_host_pages: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    window_device_rows: np.ndarray = field(default_factory=lambda: np.zeros((1, 0), dtype=np.int64))  # [group, page]
    window_host_rows: np.ndarray = field(default_factory=lambda: np.zeros((1, 0), dtype=np.int64))  # [group, page]

    @property
    def num_pages(self) -> int:
        return len(self.device_pages)


class TransferController:
    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool, shard: ShardView | None = None,
                 sidecars: Sequence[tuple[DeviceKVPool, HostKVPool]] = (),
                 window_host: HostKVPool | None = None) -> None:
        """``shard``: page ids are logical and sharded; this rank copies the pages it holds
        (every rank runs every op, so acks and their order stay the same on all).
        ``sidecars``: more (device, host) pool pairs on the same page ids with rows of their own
        (a speculative draft's KV): an op copies their pages too, as layers after the target's,
        with their own ready events (``wait_layer(num_target_layers + i)``). ``window_host``: a
        hybrid pool's window layers' host pool (``host_pool`` then holds its full layers; or
        ``host_pool`` itself, a pool of shared blocks); those layers copy an op's window pages."""
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.shard = shard
        self.pairs = [(device_pool, host_pool), *sidecars]
        # Global layer index -> (pool pair, device layer, host layer): the target's layers (a hybrid
        # pool's window layers on the window pair, the last), then each sidecar's.
        self.window_host = window_host
        self.window_pair = len(self.pairs) if window_host is not None else None
        if window_host is not None:
            self.pairs.append((device_pool, window_host))
        target = [(0, i, host_pool.rows[i]) if i in host_pool.layers else
                  (self.window_pair, i, window_host.rows[i]) for i in range(len(device_pool.k_buffers))]
        self._layers = target + [(p, i, i) for p, (dev, _) in enumerate(self.pairs[1:len(sidecars) + 1], 1)
                                 for i in range(len(dev.k_buffers))]
        self.num_layers = len(self._layers)
        self.cuda = device_pool.k_buffers[0].is_cuda
        self._ids = itertools.count()
        self._acks: dict[str, deque[TransferOp]] = {BACKUP: deque(), LOAD: deque()}
        self._last_load: TransferOp | None = None
        # Test hook (fault injection): seconds to sleep before copying each layer of an op.
        self.delay_fn: Callable[[TransferOp, int], float] | None = None
        # Test hook: a load copies only its first ``load_layers`` layers (None: all), e.g. to show
        # what a prefix hit is worth without the speculative draft's layers (runtime/speculative.py).
        self.load_layers: int | None = None
        self._staging_bufs: dict[tuple[str, int], torch.Tensor] = {}
        self._views = [[self._page_views(pair, layer, host_layer, kv) for kv in (0, 1)]
                       for pair, layer, host_layer in self._layers]
        self._queues = {kind: queue.Queue() for kind in (BACKUP, LOAD)}
        self._inline = False  # see run_inline
        self._workers = [
            threading.Thread(target=self._work, args=(kind,), name=f"hicache-{kind}", daemon=True)
            for kind in (BACKUP, LOAD)
        ]
        for w in self._workers:
            w.start()
        # Workers must be joined before the interpreter tears torch down under them.
        atexit.register(self.shutdown)

    @property
    def sidecar_pairs(self) -> list[tuple[DeviceKVPool, HostKVPool]]:
        """The (device, host) pools of the sidecars, in order (the window pair is not one)."""
        return [p for i, p in enumerate(self.pairs) if 0 < i != self.window_pair]

    # ---- scheduler-thread API ------------------------------------------------------------
    def submit(self, kind: str, device_pages: np.ndarray, host_pages: np.ndarray, payload: list,
               window: tuple[np.ndarray, np.ndarray] | None = None) -> TransferOp:
        """``window``: a hybrid pool's (device, host) window pages the op copies too."""
        # a hybrid load may carry window pages alone (a device hit's tombstones held on the host)
        assert len(device_pages) == len(host_pages) and (len(device_pages) or (window is not None and len(window[0])))
        op = TransferOp(next(self._ids), kind, np.asarray(device_pages), np.asarray(host_pages), payload,
                        [threading.Event() for _ in range(self.num_layers)], submit_time=time.perf_counter(),
                        layer_events=[None] * self.num_layers)
        if window is not None and len(window[0]):
            assert self.window_pair is not None and len(window[0]) == len(window[1])
            op.window_device_pages, op.window_host_pages = np.asarray(window[0]), np.asarray(window[1])
            # each sliding group's rows on both sides, read now: a shared pool's window pages map to blocks (issue 56)
            op.window_device_rows = np.stack([self.device_pool.window_rows(op.window_device_pages, k)
                                              for k in range(self.device_pool.groups)])
            op.window_host_rows = np.stack([self.window_host.window_rows(op.window_host_pages, k)
                                            for k in range(self.device_pool.groups)])
        if self.cuda:
            op.after_compute = torch.cuda.Event()
            op.after_compute.record(torch.cuda.current_stream(device_pool_device(self.device_pool)))
        self._acks[kind].append(op)
        if kind == LOAD:
            self._last_load = op
        if self._inline:
            self._execute(op, None)
        else:
            self._queues[kind].put(op)
        return op

    def run_inline(self) -> None:
        """From now on run each op on the submitting thread, when it is submitted (the trace
        simulator: no copy engine to overlap with, and no thread hand-offs to pay). CPU, one
        rank only."""
        if self.cuda:
            raise RuntimeError("inline transfers are for CPU pools")
        self.shutdown()
        self._inline = True

    def ready_count(self, kind: str) -> int:
        """How many leading ops of ``kind`` have finished locally."""
        return leading_done(self._acks[kind])

    def pending(self, kind: str) -> int:
        return len(self._acks[kind])

    def pop(self, kind: str, n: int) -> list[TransferOp]:
        """Remove exactly the first ``n`` acks of ``kind``, waiting for any still running."""
        ops = [self._acks[kind].popleft() for _ in range(n)]
        for op in ops:
            op.done.wait()
            if op.error is not None:
                raise RuntimeError(f"{kind} transfer {op.op_id} failed") from op.error
        return ops

    def layer_ready(self, layer: int) -> bool:
        """Whether :meth:`wait_layer` would return at once."""
        op = self._last_load
        return op is None or op.done.is_set() or op.layer_done[layer].is_set()

    def wait_layer(self, layer: int) -> None:
        """Order what comes next after every load submitted so far has finished ``layer`` (loads
        run FIFO): on CPU, block until it has; on CUDA, block until its copies are enqueued and
        make the current stream wait for them on the GPU."""
        op = self._last_load
        if op is None or op.done.is_set():
            return
        op.layer_done[layer].wait()
        event = op.layer_events[layer]
        if event is not None:
            torch.cuda.current_stream(device_pool_device(self.device_pool)).wait_event(event)

    def shutdown(self) -> None:
        """Stop the workers after the ops already queued (idempotent)."""
        if not any(w.is_alive() for w in self._workers):
            return
        for kind in (BACKUP, LOAD):
            self._queues[kind].put(None)
        for w in self._workers:
            w.join(timeout=5)
        atexit.unregister(self.shutdown)

    # ---- worker threads ------------------------------------------------------------------
    def _work(self, kind: str) -> None:
        run_torch_alone()  # its copies on this thread: an OpenMP pool of its own would slow every step
        stream = None
        if self.cuda:
            torch.cuda.set_device(device_pool_device(self.device_pool))  # a thread starts on GPU 0
            stream = torch.cuda.Stream(device_pool_device(self.device_pool))
        while (op := self._queues[kind].get()) is not None:
            self._execute(op, stream)

    def _execute(self, op: TransferOp, stream) -> None:
        try:
            if stream is not None:
                with torch.cuda.stream(stream):
                    stream.wait_event(op.after_compute)
                    self._run(op, stream)
            else:
                self._run(op, None)
        except BaseException as e:  # surfaced to the scheduler by pop()
            if self._inline and not isinstance(e, Exception):  # Ctrl-C on the caller's own thread
                raise
            op.error = e
            logger.error("%s transfer %d of %d pages failed: %s", op.kind, op.op_id, op.num_pages, e)
        finally:
            for ev in op.layer_done:
                ev.set()
            op.finish_time = time.perf_counter()
            op.done.set()

    def _run(self, op: TransferOp, stream) -> None:
        backup = op.kind == BACKUP
        dev_pages, host_pages = op.device_pages, op.host_pages
        if self.shard is not None:  # this rank's pages only, as its pools number them
            mine = self.shard.owned(dev_pages)
            if not np.array_equal(mine, self.shard.owned(host_pages)):
                raise RuntimeError(f"{op.kind} {op.op_id}: a device page and its host page have different owners")
            dev_pages, host_pages = self.shard.local(dev_pages[mine]), self.shard.local(host_pages[mine])
        full_plan = None if not len(op.device_pages) else \
            PagePlan(dev_pages, host_pages) if backup else PagePlan(host_pages, dev_pages)
        window_plans = [PagePlan(*(dev, host)[::1 if backup else -1])
                        for dev, host in zip(op.window_device_rows, op.window_host_rows)] \
            if len(op.window_device_pages) else None
        for layer, (pair, dev_layer, _) in enumerate(self._layers):
            if self.delay_fn is not None:
                time.sleep(self.delay_fn(op, layer))
            plan = full_plan if pair != self.window_pair else \
                window_plans[self.device_pool.window_group(dev_layer)] if window_plans else None
            if (not backup and self.load_layers is not None and layer >= self.load_layers) or plan is None:
                op.layer_done[layer].set()
                continue
            # On CUDA the device side of the copy is staged in a buffer this worker reuses (stream
            # order keeps a layer's gather behind the previous layer's copies); CPU copies need none.
            staging = self._staging(op.kind, pair) if self.cuda else None
            for dev, host in self._views[layer]:
                src, dst = (dev, host) if backup else (host, dev)
                copy_pages(src, dst, plan, staging, self.cuda and self.pairs[pair][1].pinned)
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
                op.layer_events[layer] = event
            op.layer_done[layer].set()
        if stream is not None:  # the seed's finish_event.synchronize(): the bookkeeping follows ``done``
            op.finish_event = torch.cuda.Event()
            op.finish_event.record(stream)
            op.finish_event.synchronize()

    def _page_views(self, pair: int, layer: int, host_layer: int, kv: int) -> tuple[PageBuf, PageBuf]:
        """Pool pair ``pair``'s device ``layer`` (its host pool's ``host_layer``), K (0) or V (1)
        pages on device and host, made once (the buffers never move); as numpy page items on
        CPU, where copies run through numpy."""
        device_pool, host_pool = self.pairs[pair]
        bufs = device_pool.k_buffers if kv == 0 else device_pool.v_buffers
        host = host_pool.page_view(host_layer, kv)
        dev = device_page_view(bufs[layer], device_pool.page_size)
        dev = dev.view(dev.shape[0], *host.shape[1:])  # head groups split out as the host has them
        return (dev, host) if self.cuda else cpu_page_arrays(dev, host)

    def _staging(self, kind: str, pair: int) -> torch.Tensor:
        """A ``[STAGING_PAGES, *row]`` device buffer of pool pair ``pair``'s page rows (as its page
        views shape them), owned by ``kind``'s worker, made at its first op (its bytes are in the
        budget: :func:`staging_budget`; :attr:`staging_bytes` counts what was made)."""
        buf = self._staging_bufs.get((kind, pair))
        if buf is None:
            like = self.pairs[pair][0].k_buffers[0]
            first_layer = next(i for i, (p, _, _) in enumerate(self._layers) if p == pair)
            row = self._views[first_layer][0][0].shape[1:]
            buf = torch.empty((STAGING_PAGES, *row), dtype=like.dtype, device=like.device)
            self._staging_bufs[(kind, pair)] = buf
        return buf

    @property
    def staging_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._staging_bufs.values())


def leading_done(ops: Iterable[Any]) -> int:
    """How many ops at the head of an ordered queue have finished (``op.done`` set): the
    ready count of an ack queue, the input to agreement."""
    n = 0
    for op in ops:
        if not op.done.is_set():
            break
        n += 1
    return n


def device_pool_device(pool: DeviceKVPool) -> torch.device:
    return pool.k_buffers[0].device
