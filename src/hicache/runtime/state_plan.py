"""Sizing the recurrent-state slots of one rank (issue 59), before its KV pages are sized.

A recurrent layer's state is per sequence, not per token: the pool holds one slot per running
request (``--max-running-requests``), each slot every recurrent layer's state tensors. Their bytes
come out of the device budget first; the KV pages get the rest.

Dtypes: a conv state holds the layer's recent inputs, activations, so it is kept in the model's
dtype (lossless); a recurrent matrix (gated DeltaNet, Mamba2: the later families) accumulates over
the whole context and is kept in float32, as their configs' ``mamba_ssm_dtype`` says.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..cache.state_pool import LayerState, slot_bytes
from ..model.spec import ModelSpec

logger = logging.getLogger(__name__)

BUDGET_SHARE = 4  # running slots take at most 1 / BUDGET_SHARE of the device budget


@dataclass(frozen=True)
class StatePlan:
    """This rank's state pool: ``layers`` (each recurrent layer's tensors), ``slots`` (usable + the zero slot 0)."""

    layers: tuple[LayerState, ...]
    slots: int

    @property
    def slot_bytes(self) -> int:
        return slot_bytes(self.layers)

    @property
    def total_bytes(self) -> int:
        return self.slot_bytes * self.slots


def layer_states(spec: ModelSpec, layers: range | list[int], dtype: torch.dtype) -> tuple[LayerState, ...]:
    """The state tensors of each recurrent layer among ``layers``: the first (the conv state) in
    ``dtype``, any other (a recurrent matrix) in float32."""
    return tuple(tuple((shape, dtype if i == 0 else torch.float32) for i, shape in enumerate(spec.state_shapes(layer)))
                 for layer in layers if spec.is_recurrent(layer))


def plan_states(spec: ModelSpec, layers: range | list[int], dtype: torch.dtype, running: int,
                budget_bytes: int | None) -> StatePlan | None:
    """The state pool for ``running`` requests over this rank's ``layers`` (None: none is recurrent),
    cut (said in one line) where its slots would take more than a quarter of ``budget_bytes`` (None:
    the pool's size is not drawn from a budget)."""
    states = layer_states(spec, layers, dtype)
    if not states:
        return None
    plan = StatePlan(states, running + 1)
    if budget_bytes is not None and plan.total_bytes > budget_bytes // BUDGET_SHARE:
        fit = max(budget_bytes // BUDGET_SHARE // plan.slot_bytes - 1, 1)
        logger.info("recurrent state slots: %d, not --max-running-requests %d: %d slots of %.1f KiB would take over "
                    "1/%d of the %.0f MiB budget; at most %d requests run at once", fit, running, running,
                    plan.slot_bytes / 2**10, BUDGET_SHARE, budget_bytes / 2**20, fit)
        plan = StatePlan(states, fit + 1)
    return plan
