"""The group a context-parallel forward runs over, and the per-layer all-gather of page-sharded
cached prefixes into two alternating scratch buffers (see :mod:`hicache.model.context_parallel`).

Units: a gather moves whole pages (``page_size`` rows of ``[KvH, D]``); every rank sends the same
number of pages (its own, padded with its padding page 0), K rows then V rows.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Protocol, Sequence

import torch

from hicache.model.batch import KVView

logger = logging.getLogger(__name__)


class CPGroup(Protocol):
    """The ranks one KV is sharded over and/or tokens split over: the CP ranks that hold this
    rank's heads (same heads, other tokens), or an MLA latent's attention-TP ranks (other
    heads, the same tokens and latent)."""

    rank: int
    size: int

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[size, *x.shape]``: every rank's ``x``, in rank order."""
        ...

    def all_gather_start(self, x: torch.Tensor, out: torch.Tensor) -> Callable[[], float]:
        """Start gathering every rank's ``x`` into ``out`` ``[size, *x.shape]``; returns the wait,
        which returns when the gather completed (``time.perf_counter()``)."""
        ...

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor: ...


class GatheredPrefix(Protocol):
    """One sequence's cached prefix as the gather sees it (a CP batch's sequence)."""

    prefix_rows: Optional[torch.Tensor]  # [prefix_len] each position's K row in the gathered pages
    gather_pages: Optional[torch.Tensor]  # this rank's pages to send; None: nothing to gather


class PrefixGather:
    """The per-layer all-gather of sharded prefixes into two alternating scratch buffers.

    A forward's gathers run in a fixed order -- layer by layer, each sequence with a cached
    prefix in batch order -- the same on every rank. Waiting for gather i starts gather i + 1
    into the other buffer, so it travels while gather i's attention computes. ``capacity``:
    elements of one buffer, counted in the rank's memory budget before the pool is sized."""

    def __init__(self, group: CPGroup, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self.group = group
        self.buffers = [torch.empty(capacity, dtype=dtype, device=device) for _ in range(2)]
        self.gathers = 0
        self.gathered_bytes = 0
        self.wait_s = 0.0  # time layers waited for a gather (what the overlap did not hide)
        self.busy_s = 0.0  # each gather's launch to completion, summed
        self._seqs: Sequence[GatheredPrefix] = ()
        self._page_size = 0
        self._plan: list[tuple[int, int]] = []
        self._jobs: dict[tuple[int, int], int] = {}
        self._pending: dict[int, tuple[Callable[[], float], torch.Tensor, float]] = {}
        self._grown = False

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    @staticmethod
    def scratch_elems(size: int, context_tokens: int, page_size: int, kv_heads: int, head_dim: int) -> int:
        """One buffer's elements for a prefix of up to ``context_tokens``: every rank sends
        ceil(pages / size) pages of K and V."""
        pages = -(-context_tokens // page_size)
        return size * -(-pages // size) * page_size * 2 * kv_heads * head_dim

    def begin(self, seqs: Sequence[GatheredPrefix], num_layers: int, page_size: int) -> None:
        """Plan this forward's gathers (called once, before the first layer)."""
        self._seqs, self._page_size = seqs, page_size
        self._plan = [(layer, b) for layer in range(num_layers)
                      for b, seq in enumerate(seqs) if seq.gather_pages is not None]
        self._jobs = {job: i for i, job in enumerate(self._plan)}
        self._pending.clear()

    def prefix(self, layer: int, b: int, kv: KVView) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence b's cached prefix K and V ``[prefix_len, KvH, D]`` for ``layer``, in logical order."""
        i = self._jobs[(layer, b)]
        if i not in self._pending:
            self._start(i, kv)
        wait, out, started = self._pending.pop(i)
        t0 = time.perf_counter()
        completed = wait()
        self.wait_s += time.perf_counter() - t0
        self.busy_s += completed - started
        nxt = i + 1
        if nxt < len(self._plan) and (self._plan[nxt][0] == layer or kv.layer_ready(self._plan[nxt][0])):
            # The next gather travels during this attention -- unless its layer is still being
            # restored from host memory: then its own prefix() call starts it (never wait for a
            # later layer's restore here). Every rank still starts the gathers in plan order.
            self._start(nxt, kv)
        prefix_rows = self._seqs[b].prefix_rows
        rows = out.view(-1, *kv.k_buffers[layer].shape[1:])  # [KvH, D] rows
        page_rows = out.shape[1] // 2  # W pages of K, then W of V, per rank
        return rows.index_select(0, prefix_rows), rows.index_select(0, prefix_rows + page_rows)

    def _start(self, i: int, kv: KVView) -> None:
        layer, b = self._plan[i]
        kv.wait_layer(layer)  # restore local pages -> gather -> attention
        k_buf, v_buf = kv.k_buffers[layer], kv.v_buffers[layer]
        rows = _page_rows(self._seqs[b].gather_pages, self._page_size)
        mine = torch.cat([k_buf.index_select(0, rows), v_buf.index_select(0, rows)])  # [2 * W * p, KvH, D]
        need = self.group.size * mine.numel()
        buf = self.buffers[i % 2]
        if need > buf.numel():  # longer than budgeted (it should not be): grow once, say so
            if not self._grown:
                logger.warning("prefix gather needs %d elements, scratch holds %d: growing it", need, buf.numel())
                self._grown = True
            buf = self.buffers[i % 2] = torch.empty(need, dtype=buf.dtype, device=buf.device)
        out = buf[:need].view(self.group.size, *mine.shape)
        self._pending[i] = (self.group.all_gather_start(mine, out), out, time.perf_counter())
        self.gathers += 1
        self.gathered_bytes += need * buf.element_size()


def _page_rows(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    return (pages.view(-1, 1) * page_size + torch.arange(page_size, device=pages.device).view(1, -1)).view(-1)
