"""Device <-> host transfers: queued, executed asynchronously, acknowledged in order.

Each submitted operation executes on a worker thread (one per direction, FIFO), layer by
layer, setting one ready event per layer and a done event at the end. On CPU the copies are
numpy copies that release the GIL while they run, and a layer's ready event is set when its
copy has ended. On CUDA the worker enqueues its copies on a stream of its own, ordered after the
compute that produced the data (``after_compute``), and records one CUDA event per layer behind
them; a layer's ready event then means "enqueued", and :meth:`wait_layer` makes the compute
stream wait on that layer's CUDA event -- on the GPU, without blocking the thread that launches
the forward -- so layer i's attention waits for layer i's copy only. The worker synchronizes an
event recorded behind the op's copies before setting ``done``, and the tree's bookkeeping only ever follows
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
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np
import torch

from ..openmp import run_torch_alone
from .host_pool import HostKVPool, device_page_view
from .page_copy import PageBuf, PagePlan, copy_pages, cpu_page_arrays
from .placement import ShardView
from .pools import DeviceKVPool

logger = logging.getLogger(__name__)

BACKUP, LOAD = "backup", "load"
FULL = "full"  # the op's own pages: the tree's page ids (the target's full layers, each sidecar's layers)
# A copy worker's staging buffer on a GPU, in pages of one layer's K or V (8 MiB for Llama-3-8B's rows of
# 16 tokens): a longer op goes through it in chunks, so its size is fixed and budgeted (staging_budget).
STAGING_PAGES = 256


def staging_budget(row_bytes: Sequence[int]) -> int:
    """Device bytes the transfer workers' staging buffers take on a GPU: one buffer per direction
    per pool pair (``row_bytes``: each pair's page of one layer's K or V, in bytes)."""
    return 2 * STAGING_PAGES * sum(row_bytes)


@dataclass(frozen=True)
class PartPages:
    """An op's pages of a component in a page space of its own (a hybrid pool's window: the
    checkpoint pages, a subset of the op's): device and host ids (same length, same order) and,
    per group of its layers, the (device, host) rows they copy, read at submit (a shared pool's
    window page is one block per sliding group, issue 56)."""

    device: np.ndarray
    host: np.ndarray
    rows: list[tuple[np.ndarray, np.ndarray]]


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
    parts: dict[str, PartPages] = field(default_factory=dict)  # by component: pages of a space of its own

    @property
    def num_pages(self) -> int:
        return len(self.device_pages)


class TransferController:
    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool, shard: ShardView | None = None,
                 sidecars: Sequence[tuple[DeviceKVPool, HostKVPool]] = (),
                 parts: Mapping[str, HostKVPool] = {}) -> None:
        """``shard``: page ids are logical and sharded; this rank copies the pages it holds
        (every rank runs every op, so acks and their order stay the same on all).
        ``sidecars``: more (device, host) pool pairs on the same page ids with rows of their own
        (a speculative draft's KV): an op copies their pages too, as layers after the target's,
        with their own ready events (``wait_layer(num_target_layers + i)``). ``parts``: by component
        name, the host pool of target layers ``host_pool`` does not hold, whose pages have ids of
        their own (a hybrid pool's window layers: ``{"window": ...}``, another pool, or
        ``host_pool`` itself, a pool of shared blocks); those layers copy an op's ``parts``."""
        self.device_pool = device_pool
        self.shard = shard
        self.sidecar_pairs = list(sidecars)
        self.pairs = [(device_pool, host_pool), *sidecars, *((device_pool, h) for h in parts.values())]
        self._part_hosts = dict(parts)
        # Global layer index -> (pool pair, device layer, host layer, component, group): the target's
        # layers (those of a part on its pair, after the sidecars'), then each sidecar's.
        part_pair = {name: i for i, name in enumerate(parts, 1 + len(sidecars))}
        target = [(0, i, host_pool.rows[i], FULL, 0) if i in host_pool.layers else
                  next((part_pair[n], i, h.rows[i], n, device_pool.windows.group(i)) for n, h in parts.items()
                       if i in h.rows) for i in range(len(device_pool.k_buffers))]
        self._layers = target + [(p, i, i, FULL, 0) for p, (dev, _) in enumerate(sidecars, 1)
                                 for i in range(len(dev.k_buffers))]
        self.num_layers = len(self._layers)
        self.device = device_pool.device
        self.cuda = self.device.type == "cuda"
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
                       for pair, layer, host_layer, *_ in self._layers]
        self.workers = OpThreads({kind: (f"hicache-{kind}", self._execute) for kind in (BACKUP, LOAD)},
                                 self._copy_stream)
        # Workers must be joined before the interpreter tears torch down under them.
        atexit.register(self.shutdown)

    # ---- scheduler-thread API ------------------------------------------------------------
    def submit(self, kind: str, device_pages: np.ndarray, host_pages: np.ndarray, payload: list,
               parts: Mapping[str, tuple[np.ndarray, np.ndarray]] = {}) -> TransferOp:
        """``parts``: by component, the (device, host) pages of its own ids the op copies too."""
        parts = {name: self._part_pages(name, *pages) for name, pages in parts.items() if len(pages[0])}
        # a hybrid load may carry window pages alone (a device hit's tombstones held on the host)
        assert len(device_pages) == len(host_pages) and (len(device_pages) or parts)
        op = TransferOp(next(self._ids), kind, np.asarray(device_pages), np.asarray(host_pages), payload,
                        [threading.Event() for _ in range(self.num_layers)], submit_time=time.perf_counter(),
                        layer_events=[None] * self.num_layers, parts=parts)
        if self.cuda:
            op.after_compute = torch.cuda.current_stream(self.device).record_event()
        self._acks[kind].append(op)
        if kind == LOAD:
            self._last_load = op
        self.workers.put(kind, op)
        return op

    def _part_pages(self, name: str, device: np.ndarray, host: np.ndarray) -> PartPages:
        """Component ``name``'s pages with each group's rows on both sides, read now (a shared
        pool's window page maps to one block per sliding group, issue 56; each copy's plan checks their lengths)."""
        device, host, host_pool = np.asarray(device), np.asarray(host), self._part_hosts[name]
        w = self.device_pool.windows
        return PartPages(device, host, [(w.rows(device, k), host_pool.windows.rows(host, k)) for k in range(w.groups)])

    def run_inline(self) -> None:
        """From now on run each op on the submitting thread, when it is submitted (the trace
        simulator: no copy engine to overlap with, and no thread hand-offs to pay). CPU, one
        rank only."""
        if self.cuda:
            raise RuntimeError("inline transfers are for CPU pools")
        self.shutdown()
        self.workers.inline = True  # ops run on the submitting thread

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

    def unacked(self, kind: str) -> list[TransferOp]:
        """The ops of ``kind`` whose ack is not consumed yet (their destination may still be written)."""
        return list(self._acks[kind])

    def layer_ready(self, layer: int) -> bool:
        """Whether :meth:`wait_layer` would return at once."""
        op = self._last_load
        return op is None or op.done.is_set() or op.layer_done[layer].is_set()

    def wait_layer(self, layer: int) -> None:
        """Order what comes next after every load submitted so far has finished ``layer`` (loads
        run FIFO): on CPU, block until it has; on CUDA, block until its copies are enqueued and
        make the current stream wait for them on the GPU."""
        op = self._last_load
        if op is not None and not op.done.is_set():
            op.layer_done[layer].wait()
            if (event := op.layer_events[layer]) is not None:
                torch.cuda.current_stream(self.device).wait_event(event)

    def shutdown(self) -> None:
        """Stop the workers after the ops already queued (idempotent)."""
        if self.workers.stop():
            atexit.unregister(self.shutdown)

    # ---- worker threads ------------------------------------------------------------------
    def _copy_stream(self) -> torch.cuda.Stream | None:
        """A worker's CUDA stream for its copies (made on its thread); None on CPU."""
        if not self.cuda:
            return None
        torch.cuda.set_device(self.device)  # a thread starts on GPU 0
        return torch.cuda.Stream(self.device)

    def _execute(self, op: TransferOp, stream) -> None:
        try:
            with torch.cuda.stream(stream):  # (None, on CPU: the calling thread's own copies)
                self._run(op, stream)
        except BaseException as e:  # surfaced to the scheduler by pop()
            if self.workers.inline and not isinstance(e, Exception):  # Ctrl-C on the caller's own thread
                raise
            op.error = e
            logger.error("%s transfer %d of %d pages failed: %s", op.kind, op.op_id, op.num_pages, e)
        finally:
            for ev in op.layer_done:
                ev.set()
            op.finish_time = time.perf_counter()
            op.done.set()

    def _run(self, op: TransferOp, stream) -> None:
        if stream is not None:
            stream.wait_event(op.after_compute)
        backup = op.kind == BACKUP
        dev_pages, host_pages = op.device_pages, op.host_pages
        if self.shard is not None:  # this rank's pages only, as its pools number them
            mine = self.shard.owned(dev_pages)
            if not np.array_equal(mine, self.shard.owned(host_pages)):
                raise RuntimeError(f"{op.kind} {op.op_id}: a device page and its host page have different owners")
            dev_pages, host_pages = self.shard.local(dev_pages[mine]), self.shard.local(host_pages[mine])
        # each component's (device, host) pages by group and their copies, source first (none: the op has none of it)
        rows = {name: part.rows for name, part in op.parts.items()}
        if len(op.device_pages):
            rows[FULL] = [(dev_pages, host_pages)]
        plans = {name: [PagePlan(d, h) if backup else PagePlan(h, d) for d, h in pairs] for name, pairs in rows.items()}
        for layer, (pair, _, _, part, group) in enumerate(self._layers):
            if self.delay_fn is not None:
                time.sleep(self.delay_fn(op, layer))
            plan = plans[part][group] if part in plans else None
            if (not backup and self.load_layers is not None and layer >= self.load_layers) or plan is None:
                op.layer_done[layer].set()
                continue
            # On CUDA the device side of the copy is staged in a buffer this worker reuses (stream
            # order keeps a layer's gather behind the previous layer's copies); CPU copies need none.
            staging = self._staging(op.kind, pair, layer) if self.cuda else None
            for dev, host in self._views[layer]:
                src, dst = (dev, host) if backup else (host, dev)
                copy_pages(src, dst, plan, staging, self.cuda and self.pairs[pair][1].pinned)
            if stream is not None:
                op.layer_events[layer] = stream.record_event()
            op.layer_done[layer].set()
        if stream is not None:  # every copy of the op done before ``done``: the bookkeeping follows it
            stream.record_event().synchronize()

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

    def _staging(self, kind: str, pair: int, layer: int) -> torch.Tensor:
        """A ``[STAGING_PAGES, *row]`` device buffer of pool pair ``pair``'s page rows (as its page
        views shape them, ``layer`` one of its layers), owned by ``kind``'s worker, made at its first op
        (its bytes are in the budget: :func:`staging_budget`; :attr:`staging_bytes` counts what was made)."""
        if (kind, pair) not in self._staging_bufs:
            dev = self._views[layer][0][0]
            self._staging_bufs[(kind, pair)] = torch.empty((STAGING_PAGES, *dev.shape[1:]), dtype=dev.dtype,
                                                           device=dev.device)
        return self._staging_bufs[(kind, pair)]

    @property
    def staging_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._staging_bufs.values())


class OpThreads:
    """One daemon thread per kind of op, each running its kind's ops in the order put, as ``run(op,
    state)`` (``state``: what ``start()`` made on that thread); with ``inline`` set (after :meth:`stop`),
    each op at once on the thread that puts it (``state`` None)."""

    def __init__(self, kinds: Mapping[str, tuple[str, Callable[[Any, Any], None]]],
                 start: Callable[[], Any] = lambda: None) -> None:
        """``kinds``: (thread name, ``run``) by kind."""
        self.kinds, self.start, self.inline = dict(kinds), start, False
        self._queues: dict[str, queue.Queue] = {kind: queue.Queue() for kind in kinds}
        self._threads = [threading.Thread(target=self._work, args=(kind,), name=name, daemon=True)
                         for kind, (name, _) in kinds.items()]
        for t in self._threads:
            t.start()

    def put(self, kind: str, op: Any) -> None:
        if self.inline:
            self.kinds[kind][1](op, None)
        else:
            self._queues[kind].put(op)

    def stop(self) -> bool:
        """Stop the threads after the ops already put; False when they were stopped already."""
        if not any(t.is_alive() for t in self._threads):
            return False
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join(timeout=5)
        return True

    def _work(self, kind: str) -> None:
        run_torch_alone()  # its copies on this thread: an OpenMP pool of its own would slow every step
        state, run = self.start(), self.kinds[kind][1]
        while (op := self._queues[kind].get()) is not None:
            run(op, state)


def leading_done(ops: Iterable[Any]) -> int:
    """How many ops at the head of an ordered queue have finished (``op.done`` set): the
    ready count of an ack queue, the input to agreement."""
    return sum(1 for _ in itertools.takewhile(lambda op: op.done.is_set(), ops))
