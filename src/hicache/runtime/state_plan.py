"""Sizing the recurrent-state slots of one rank (issue 59), before its KV pages are sized.

A recurrent layer's state is per sequence, not per token: the pool holds one slot per running
request (``--max-running-requests``) and the snapshots the prefix tree keeps at cached boundaries
(``--recurrent-snapshot-ratio`` per 1K KV tokens), each slot every recurrent layer's state tensors.
Their bytes come out of the device budget first; the KV pages get the rest.

Shapes are this rank's (:meth:`~hicache.model.parallel.ModelShard.state_shapes`): under TP each rank's
pool holds its shard of every state tensor (its conv channels, its gated DeltaNet heads), at the same
slot ids as every other rank's -- the slot counts are MIN-agreed over the ranks (``plan_rank``).

Dtypes: a conv state holds the layer's recent inputs, activations, so it is kept in the model's
dtype (lossless); a recurrent matrix (gated DeltaNet, Mamba2: the later families) accumulates over
the whole context and is kept in float32, as their configs' ``mamba_ssm_dtype`` says.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import torch

from ..cache.state_pool import LayerState, slot_bytes
from ..model.parallel import ModelShard
from ..model.projection import DECODE_ROWS
from ..model.spec import ModelSpec

logger = logging.getLogger(__name__)

BUDGET_SHARE = 4  # running slots take at most 1 / BUDGET_SHARE of the device budget
SNAPSHOT_SHARE = 2  # snapshot slots at most 1 / SNAPSHOT_SHARE
SNAPSHOTS_PER_1K_TOKENS = 1.0  # the default: two snapshots per 2K-token conversation the KV pool holds
SNAPSHOT_FLOOR = 8  # and at least 2 per running request + this many
# What a pipeline stage plans for what it does not hold (snapshot slots without recurrent layers, pages without
# attention layers): a count every other rank's bounds, as the counts are MIN-agreed.
UNBOUNDED = 2**62


@dataclass(frozen=True)
class StatePlan:
    """This rank's state pool: ``layers`` (each recurrent layer's tensors); ``running`` slots (one
    per running request) and ``snapshots`` slots (the tree's); ``grid``: tokens between the
    boundaries a snapshot may be taken at (:func:`snapshot_grid`)."""

    layers: tuple[LayerState, ...]
    running: int
    snapshots: int
    grid: int
    host_snapshots: int = 0  # the host tier's (0: none): as many per host KV page as the device has per page
    scratch: int = 0  # the states a speculative verify pass leaves after each row (:func:`verify_scratch`)

    def with_counts(self, running: int, snapshots: int) -> StatePlan:
        """This plan with the slot counts every rank agreed on (each the least any rank planned)."""
        return replace(self, running=running, snapshots=snapshots)

    def with_host(self, device_pages: int, host_pages: int) -> StatePlan:
        """This plan with host snapshot slots for a host pool of ``host_pages`` beside ``device_pages``
        (counts with the reserved page 0): at least the device's, more with a larger host pool."""
        if host_pages <= 1:
            return self
        return replace(self, host_snapshots=max(self.snapshots, self.snapshots * (host_pages - 1) // max(device_pages - 1, 1)))

    @property
    def slot_bytes(self) -> int:
        return slot_bytes(self.layers)

    @property
    def total_bytes(self) -> int:
        return self.slot_bytes * (1 + self.running + self.snapshots + self.scratch)


def snapshot_grid(spec: ModelSpec, page_size: int) -> int:
    """``lcm(page_size, scan chunk)``: a snapshot ends a page (the tree's boundaries) and a scan
    chunk (so a hit's scan starts where the cold run's chunk did, docs/recurrent_plan.md rule 1)."""
    return math.lcm(page_size, spec.scan_chunk)


def layer_states(spec: ModelSpec, layers: range | list[int], dtype: torch.dtype,
                 shard: ModelShard | None = None) -> tuple[LayerState, ...]:
    """The state tensors of each recurrent layer among ``layers`` as ``shard`` holds them (None: the
    whole model's): the first (the conv state) in ``dtype``, any other (a recurrent matrix) in float32."""
    def shapes(layer: int) -> tuple[tuple[int, ...], ...]:
        return shard.state_shapes(spec, layer) if shard is not None else spec.state_shapes(layer)
    return tuple(tuple((shape, dtype if i == 0 else torch.float32) for i, shape in enumerate(shapes(layer)))
                 for layer in layers if spec.is_recurrent(layer))


@dataclass(frozen=True)
class StateBudget:
    """What sizes the slots: ``running`` requests, the KV pool's ``kv_tokens`` (estimated before its
    pages are sized), the snapshots' ``ratio`` per 1K of them (None: the default), the device
    ``budget_bytes`` they may take a share of (None: not drawn from a budget)."""

    running: int
    kv_tokens: int
    ratio: float | None
    budget_bytes: int | None
    scratch: int = 0  # slots for verify passes' row states (:func:`verify_scratch`)


def plan_states(spec: ModelSpec, layers: range | list[int], dtype: torch.dtype, page_size: int,
                budget: StateBudget, shard: ModelShard | None = None) -> StatePlan | None:
    """The state pool over this rank's ``layers`` as ``shard`` holds them (None: the model has no
    recurrent layer). Running slots are cut (said in one line) where they would take more than a
    quarter of the budget, snapshots where they would take more than half. A pipeline stage without
    recurrent layers plans a pool of none with as many slots as it would allow (:data:`UNBOUNDED`
    snapshots): the counts every rank agrees on are the other stages'."""
    if not spec.recurrent_layers:
        return None
    states = layer_states(spec, layers, dtype, shard)
    if not states:
        return StatePlan((), budget.running, UNBOUNDED, snapshot_grid(spec, page_size),
                         scratch=budget.scratch)
    one = slot_bytes(states)
    running, cap = budget.running, None if budget.budget_bytes is None else budget.budget_bytes // one
    if cap is not None and running > cap // BUDGET_SHARE:
        fit = max(cap // BUDGET_SHARE, 1)
        logger.info("recurrent state slots: %d, not --max-running-requests %d: %d slots of %.1f KiB would take over "
                    "1/%d of the %.0f MiB budget; at most %d requests run at once", fit, running, running,
                    one / 2**10, BUDGET_SHARE, budget.budget_bytes / 2**20, fit)
        running = fit
    ratio = budget.ratio if budget.ratio is not None else SNAPSHOTS_PER_1K_TOKENS
    snapshots = int(budget.kv_tokens * ratio / 1000)
    if budget.ratio is None:
        snapshots = max(snapshots, 2 * running + SNAPSHOT_FLOOR)
    if cap is not None and snapshots > cap // SNAPSHOT_SHARE:
        logger.info("recurrent state snapshots: %d slots, not %d: at most 1/%d of the budget", cap // SNAPSHOT_SHARE,
                    snapshots, SNAPSHOT_SHARE)
        snapshots = cap // SNAPSHOT_SHARE
    return StatePlan(states, running, max(snapshots, 1), snapshot_grid(spec, page_size), scratch=budget.scratch)


def verify_scratch(speculative_algorithm: str | None, pp_size: int) -> int:
    """Scratch slots for the state after each row of a speculative verify pass but each request's last
    (kept until acceptance picks one; docs/hybrid_kv.md): with NGRAM a verify pass has at most
    ``DECODE_ROWS`` rows (runtime/ngram.py) and at least one request, and a pipeline keeps ``pp_size``
    batches in flight. Qwen3.5-0.8B: 7 slots of 19.3 MiB (18 layers of a 1 MiB float32 matrix and a conv
    state), 135 MiB. 0 without speculation (STANDALONE is refused with recurrent layers)."""
    return (DECODE_ROWS - 1) * pp_size if speculative_algorithm == "NGRAM" else 0
