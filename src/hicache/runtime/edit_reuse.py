"""Reuse after an edit (issue 61, docs/edit_reuse.md): a mode that, past a prompt's cached prefix,
fills spans of the prompt with the KV of equal cached pages found at other positions, and computes
only the rest.

At admission the request's prompt past its exact hit is searched in the device pages of its
namespace (:func:`~hicache.cache.content_index.find_spans`); each span found is copied into the
request's own pages at once, keys re-rotated to their new positions
(:class:`~hicache.model.rope_shift.RopeShift`). Its prefill then runs as chunks that end where a
span's first ``recompute`` tokens end: those tokens (and every edited token before them) are
computed over the prompt so far -- the exact prefix, the edits, the spans already kept -- and the
span's rest is skipped (``Request.computed`` jumps to its end). A span's first tokens absorb the
change before it; the gate compares what the forward wrote for the last of them with the reused
values saved at admission: the largest relative L2 deviation over every layer's K and V. Past
``max_deviation`` the request falls back to exact prefix reuse: its computed length goes back to
the end of the first span's head (what came before was exact) and every later token is computed.

The KV past the first span is approximate: ``Request.kv_exact`` keeps it out of the tree (only the
exact prefix is cached at chunk boundaries and at the finish), so no request without edit reuse, and
no tier below, ever reads it. One rank only (the config refuses TP/PP: the gate would read each
rank's own heads). Units: positions and lengths are tokens.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ..cache.content_index import EDIT_PREFIX, ReusedSpan, edit_namespace, exact_namespace, find_spans
from ..cache.pools import pages_to_slots
from ..consensus_record import consensus_check
from ..edit_reuse_outcome import EditReuseOutcome
from ..model.rope_shift import RopeShift
from .modes import Mode, ModeContext
from .request import Request, Status

logger = logging.getLogger(__name__)

DEFAULT_MAX_DEVIATION = 0.35  # relative L2, any layer: for a model with no calibrated value (docs/edit_reuse.md)
CALIBRATION_FILE = Path(__file__).with_name("edit_reuse_calibration.json")  # `hicache calibrate-edit-reuse`
GATE_TOKENS = 4  # the last tokens of each span's head the gate compares


@dataclass
class EditPlan:
    """A request's reused spans (prompt order) and how far its prefill has got through them."""

    spans: list[ReusedSpan]
    head: int  # tokens computed at the start of each span
    saved: list[list[tuple[torch.Tensor, torch.Tensor]]]  # per span, per layer: reused K/V of its gate tokens
    outcome: EditReuseOutcome = field(default_factory=EditReuseOutcome)
    next: int = 0  # the span whose head the prefill is computing

    def splice_point(self) -> Optional[int]:
        """Where the current chunk must end (the next span's head), or None once every span is done."""
        if self.next >= len(self.spans):
            return None
        span = self.spans[self.next]
        return span.dst + self.head


@dataclass(frozen=True)
class SpanSource:
    """Where a span's rows are read, worked out once for every layer: the device slots of its device
    pages, and (some pages on the host) which of its tokens are there and their host pages."""

    device_slots: torch.Tensor
    on_host: Optional[torch.Tensor]  # bool per token; None: every page on the device
    host_pages: Optional[torch.Tensor]

    @classmethod
    def of(cls, span: ReusedSpan, page_size: int, device: torch.device) -> "SpanSource":
        slots = pages_to_slots(span.pages[~span.host], page_size).to(device)
        if not span.host.any():
            return cls(slots, None, None)
        on_host = torch.from_numpy(np.repeat(span.host, page_size)).to(device)
        return cls(slots, on_host, torch.from_numpy(span.pages[span.host]))


class EditReuseMode(Mode):
    name = "edit_reuse"

    def __init__(self, ctx: ModeContext) -> None:
        cfg = ctx.cfg
        self.cache = ctx.cache
        self.pool = ctx.cache.pool
        self.page_size = ctx.cache.page_size
        self.head = cfg.edit_reuse_recompute_tokens
        self.max_deviation = cfg.edit_reuse_max_deviation or calibrated_max_deviation(cfg.model) or DEFAULT_MAX_DEVIATION
        self.shift = RopeShift(ctx.spec, ctx.device)
        self.counts = {"requests": 0, "spans": 0, "reused_tokens": 0, "reused_host_tokens": 0, "recomputed_tokens": 0,
                       "gated_off": 0}

    # ---- admission -----------------------------------------------------------------------
    def wants(self, req: Request) -> bool:
        return req.sampling.edit_reuse is not False and self.cache.tree is not None

    def admission_namespace(self, req: Request) -> Optional[str]:
        """The approximate namespace, where an earlier edited turn of the conversation left more of
        this prompt than the exact one holds."""
        if not self.wants(req) or req.namespace.startswith(EDIT_PREFIX):
            return None
        edited = edit_namespace(req.namespace)
        return edited if self._held(edited, req) > self._held(req.namespace, req) else None

    def _held(self, namespace: str, req: Request) -> int:
        """Tokens of ``req``'s prompt a match in ``namespace`` would hit (device and host)."""
        peek = self.cache.tree.peek_prefix(namespace, req.tokens_np[:-1])
        return peek.device_hit_tokens + peek.host_hit_tokens

    def on_admit(self, req: Request) -> None:
        if not self.wants(req) or req.status is not Status.PREFILL:
            return
        self.counts["requests"] += 1
        start, req.kv_exact = req.computed, None
        approximate = req.namespace.startswith(EDIT_PREFIX)  # (then everything it caches goes there)
        spans = self._find(req)
        req.edit = EditPlan(spans, self.head, [self._splice(req, span) for span in spans])
        req.edit.outcome.approximate_hit_tokens = start if approximate else 0
        if spans:
            req.kv_exact = None if approximate else spans[0].dst
            logger.info("edit reuse rid=%d prompt=%d hit=%d spans=%d found=%d", req.rid, len(req.prompt_ids), start,
                        len(spans), sum(s.length for s in spans))

    # (logical positions only, never page ids: ranks with other pool sizes agree on these)
    @consensus_check("edit_reuse.find", args=lambda self, req: (req.rid, req.namespace, req.computed),
                     result=lambda spans: [(s.dst, s.src, s.length) for s in spans])
    def _find(self, req: Request) -> list[ReusedSpan]:
        """The spans of ``req``'s prompt past its hit found in its namespaces (its own first)."""
        exact = exact_namespace(req.namespace)
        namespaces = [req.namespace, exact] if req.namespace != exact else [exact, edit_namespace(exact)]
        return find_spans(self.cache.tree, namespaces, req.tokens_np, req.computed, len(req.tokens_np) - 1,
                          self.head + self.page_size, self.cache.unreadable_pages())

    def _splice(self, req: Request, span: ReusedSpan) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copy ``span``'s cached KV into the request's slots, keys re-rotated; returns the reused
        K/V of its gate tokens, per layer (the forward overwrites them with computed ones)."""
        dst = req.kv.slots[span.dst : span.dst + span.length]
        gate = slice(self.head - min(GATE_TOKENS, self.head), self.head)
        source = SpanSource.of(span, self.page_size, dst.device)
        saved = []
        for layer, (k, v) in enumerate(zip(self.pool.k_buffers, self.pool.v_buffers)):
            k[dst] = self.shift.keys(self._rows(source, layer, 0, k), span.shift)
            v[dst] = self._rows(source, layer, 1, v)
            saved.append((k[dst[gate]].clone(), v[dst[gate]].clone()))
        return saved

    def _rows(self, source: "SpanSource", layer: int, kv: int, buffer: torch.Tensor) -> torch.Tensor:
        """The span's cached K (0) or V (1) rows of ``layer``, ``[length, KvH, D]`` on the device: from
        the device pool, and from the host pool where the span's pages are there."""
        if source.on_host is None:
            return buffer[source.device_slots]
        rows = buffer.new_empty((len(source.on_host), *buffer.shape[1:]))
        rows[~source.on_host] = buffer[source.device_slots]
        host = self.cache.host_pool.page_view(layer, kv)[source.host_pages]
        rows[source.on_host] = host.reshape(-1, *buffer.shape[1:]).to(buffer.device)
        return rows

    # ---- prefill -------------------------------------------------------------------------
    def chunk_limit(self, req: Request) -> Optional[int]:
        plan: Optional[EditPlan] = req.edit
        point = plan.splice_point() if plan is not None else None
        return None if point is None else point - req.computed

    def after_chunk(self, req: Request) -> Optional[int]:
        plan: Optional[EditPlan] = req.edit
        point = plan.splice_point() if plan is not None else None
        if point is None or req.computed != point:
            return None
        span = plan.spans[plan.next]
        deviation = self._deviation(req, span, plan.saved[plan.next])
        plan.outcome.deviation = max(plan.outcome.deviation, deviation)
        if deviation > self.max_deviation:
            return self._fall_back(req, plan, deviation)
        plan.outcome.reused_tokens += span.length - self.head
        self.counts["reused_host_tokens"] += int(span.host.sum()) * self.page_size  # (its head included)
        plan.outcome.recomputed_tokens += self.head
        plan.next += 1
        return span.dst + span.length

    def _deviation(self, req: Request, span: ReusedSpan, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """The largest relative L2 deviation, over layers and K/V, of the computed gate tokens from the reused ones."""
        gate = req.kv.slots[span.dst + self.head - len(saved[0][0]) : span.dst + self.head]
        worst = 0.0
        for (k, v), (old_k, old_v) in zip(zip(self.pool.k_buffers, self.pool.v_buffers), saved):
            for new, old in ((k[gate], old_k), (v[gate], old_v)):
                new, old = new.float(), old.float()
                worst = max(worst, float((new - old).norm() / new.norm().clamp_min(1e-12)))
        return worst

    def _fall_back(self, req: Request, plan: EditPlan, deviation: float) -> Optional[int]:
        """The gate refused a span: every token past the first span's head is computed exactly."""
        logger.info("edit reuse gated rid=%d span=%d deviation=%.3f > %.3f", req.rid, plan.next, deviation,
                    self.max_deviation)
        plan.outcome = EditReuseOutcome(gated=True, deviation=plan.outcome.deviation)
        first = plan.spans[0].dst + self.head
        plan.spans, plan.saved, plan.next = [], [], 0
        req.kv_exact = None
        return first if req.computed != first else None

    # ---- finish --------------------------------------------------------------------------
    def on_finish(self, req: Request) -> bool:
        plan: Optional[EditPlan] = req.edit
        if req.kv_exact is not None and req.kv is not None:
            self._cache_approximate(req)
        if plan is not None:
            out = plan.outcome
            self.counts["spans"] += plan.next
            self.counts["reused_tokens"] += out.reused_tokens
            self.counts["recomputed_tokens"] += out.recomputed_tokens
            self.counts["gated_off"] += out.gated
        return False

    def _cache_approximate(self, req: Request) -> None:
        """Before its release: the exact part of ``req``'s KV goes to its namespace, the whole of it
        (the exact part copied; its reply too, whatever --cache-generated-kv says: the KV is
        approximate already) to the approximate one, for its conversation's next turns."""
        exact = req.tokens_with_kv()
        self.cache.cache_prefix(req.namespace, exact, req.kv)
        pages = self.cache.device.cache_copy(edit_namespace(req.namespace), req.tokens_with_kv(approximate=True),
                                             req.kv, self._copy_pages)
        logger.info("edit reuse cached rid=%d exact=%d approximate=%d", req.rid, len(exact), pages * self.page_size)

    def _copy_pages(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Device pages ``src`` -> ``dst`` in every layer's K and V."""
        src_slots, dst_slots = (pages_to_slots(p, self.page_size) for p in (src, dst))
        for k, v in zip(self.pool.k_buffers, self.pool.v_buffers):
            k[dst_slots] = k[src_slots]
            v[dst_slots] = v[src_slots]

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "recompute_tokens": self.head, "max_deviation": self.max_deviation}


def calibrated_max_deviation(model: str) -> Optional[float]:
    """The gate threshold ``hicache calibrate-edit-reuse --write`` measured for ``model`` (its --model
    name), or None."""
    table = json.loads(CALIBRATION_FILE.read_text()) if CALIBRATION_FILE.exists() else {}
    entry = table.get(model)
    return float(entry["max_deviation"]) if entry else None


def build(ctx: ModeContext) -> Optional[EditReuseMode]:
    return EditReuseMode(ctx) if ctx.cfg.enable_edit_reuse else None

