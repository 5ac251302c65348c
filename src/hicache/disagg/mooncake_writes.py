"""``--disaggregation-transfer-backend mooncake``: Mooncake's transfer engine writes the KV rows
straight from the prefill server's pool into the pages the decode server reserved (TCP on this
machine, RDMA in production); ZeroMQ still carries the small bootstrap messages.

Every rank of both servers registers the K and V buffers of its device pool with its own
transfer engine at start. Each decode rank's ask also names its engine (``session``), its
buffers' base addresses, the pages reserved for the suffix and where the asked heads sit in its
rows; the prefill rank writes ``2 x layers`` spans per run of pages that follow each other on
both sides (a page's rows are contiguous on both sides: the suffix starts on a page boundary and
both pools use the same page size), or per token when only a slice of a row crosses (the TP
sizes differ), then tells the decode rank it is done.
"""

from __future__ import annotations

import logging

import torch

from ..cache.pools import DeviceKVPool
from ..cache.state_pool import StatePool
from ..config import ConfigError
from .transfer import head_bytes
from .window_tail import TailPages
from .wire import MooncakeTarget

logger = logging.getLogger(__name__)

MAX_SPANS = 256  # spans per batched write: a TCP lane refused a batch of thousands ("queue-full")


class MooncakeWrites:
    """One server's transfer engine, with its pool's buffers registered."""

    def __init__(self, pool: DeviceKVPool, hostname: str = "127.0.0.1", states: StatePool | None = None) -> None:
        """``states``: the recurrent layers' state slots, registered too (their states cross whole)."""
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise ConfigError("--disaggregation-transfer-backend mooncake needs Mooncake's transfer engine: pip "
                              "install mooncake-transfer-engine-non-cuda (and libibverbs1 from the OS packages) "
                              f"({e}).") from None
        self.pool = pool
        self.engine = TransferEngine()
        if self.engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "") != 0:
            raise ConfigError(f"Mooncake's transfer engine could not start on {hostname}.")
        # (a pool of shared blocks lists each of its tensors once per layer that reads it: registered once)
        buffers = {buf.data_ptr(): buf for buf in pool.k_buffers + pool.v_buffers}
        buffers.update({t.data_ptr(): t for layer in (states.buffers if states is not None else []) for t in layer})
        for buf in buffers.values():
            if self.engine.register_memory(buf.data_ptr(), buf.numel() * buf.element_size()) != 0:
                raise ConfigError("Mooncake's transfer engine could not register the KV pool's memory.")
        self.session = f"{hostname}:{self.engine.get_rpc_port()}"
        logger.info("P/D: Mooncake transfer engine at %s, %d KV buffers registered", self.session, len(buffers))

    def describe(self, slots: torch.Tensor, start: int, end: int, heads: range,
                 parts: dict[str, TailPages] = {}) -> MooncakeTarget:
        """Decode side: where the prefill rank should write tokens ``[start, end)`` of the
        pool-local ``heads`` (``slots``: the prompt's slots in this pool; ``start`` is a page
        boundary); ``parts``: the pages of the parts asked apart (by component)."""
        pool, ps, k = self.pool, self.pool.page_size, self.pool.k_buffers[0]
        return MooncakeTarget(self.session, ps, k.shape[1], heads.start, [b.data_ptr() for b in pool.k_buffers],
                              [b.data_ptr() for b in pool.v_buffers],
                              [int(slots[t]) // ps for t in range(start, end, ps)], parts)

    def write(self, target: MooncakeTarget, rows: list[tuple[int, torch.Tensor, list[int]]], end: int,
              heads: range) -> int:
        """Prefill side: write each layer's rows (its first token, this pool's slot of every token of
        the prompt, the pages of ``target`` they go to) up to token ``end``, of the pool-local
        ``heads``; returns the bytes written. Whole rows on both sides go a run of pages per span;
        a slice of a row (TP sizes differ) a token per span. Raises ValueError on a layout
        mismatch, RuntimeError when the engine fails."""
        pool, ps, hb = self.pool, self.pool.page_size, head_bytes(self.pool)
        src_row, dst_row, width = pool.k_buffers[0].shape[1] * hb, target.row_heads * hb, len(heads) * hb
        firsts = sorted({first for first, _, _ in rows})
        if target.page_size != ps or len(target.k) != len(pool.k_buffers) or any(f % ps for f in firsts):
            raise ValueError(f"the decode pool has {len(target.k)} layers of pages of {target.page_size} "
                             f"tokens, this one {len(pool.k_buffers)} of {ps} (rows from tokens {firsts})")
        if target.first_head + len(heads) > target.row_heads:
            raise ValueError(f"the decode rows hold {target.row_heads} heads, not {target.first_head + len(heads)}")
        if not heads:
            return 0
        whole = width == src_row == dst_row

        def spans_of(first: int, src_slots: torch.Tensor, pages: list[int]) -> list[tuple[int, int, int]]:
            """(source offset, destination offset, bytes) within one buffer, for tokens ``[first, end)``."""
            out = []
            for src_slot, dst_slot, n in _runs(src_slots, pages, first, end, ps):
                if whole:
                    out.append((src_slot * src_row, dst_slot * dst_row, n * src_row))
                else:
                    out += [((src_slot + t) * src_row + heads.start * hb,
                             (dst_slot + t) * dst_row + target.first_head * hb, width) for t in range(n)]
            return out

        memo: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}  # layers that share their rows and pages
        layer_spans = []
        for first, src, pages in rows:
            key = (first, id(src), id(pages))
            layer_spans.append(memo[key] if key in memo else memo.setdefault(key, spans_of(first, src, pages)))
        spans = [(buf.data_ptr() + s_off, peer_base + d_off, n_bytes)
                 for bufs, peer in ((pool.k_buffers, target.k), (pool.v_buffers, target.v))
                 for buf, peer_base, layer in zip(bufs, peer, layer_spans) for s_off, d_off, n_bytes in layer]
        return self.write_spans(target.session, spans)

    def write_spans(self, session: str, spans: list[tuple[int, int, int]]) -> int:
        """Write ``spans`` (source address, destination address, bytes) to the engine at ``session``;
        returns the bytes written. Raises RuntimeError when the engine fails."""
        for i in range(0, len(spans), MAX_SPANS):  # the engine's queue takes so many spans per call
            src, dst, lengths = map(list, zip(*spans[i : i + MAX_SPANS]))
            if self.engine.batch_transfer_sync_write(session, src, dst, lengths) != 0:
                raise RuntimeError(f"Mooncake's transfer engine failed to write to {session}")
        return sum(n for _, _, n in spans)


def _runs(slots: torch.Tensor, pages: list[int], start: int, end: int, ps: int) -> list[tuple[int, int, int]]:
    """Tokens ``[start, end)`` as ``(source slot, destination slot, tokens)`` runs: a page at a
    time, merged while the pages follow each other on both sides."""
    runs: list[list[int]] = []
    for j, page in enumerate(pages):
        t0 = start + j * ps
        src, dst, n = int(slots[t0]), page * ps, min(ps, end - t0)
        if runs and (last := runs[-1])[0] + last[2] == src and last[1] + last[2] == dst and last[2] % ps == 0:
            last[2] += n
        else:
            runs.append([src, dst, n])
    return [tuple(r) for r in runs]
