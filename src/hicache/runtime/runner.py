"""Turns a scheduled batch into one forward pass of the model over the device KV pool, through
the attention backend chosen once when the runner is built (paged, or context parallel)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..cache.placement import GatherPlan, PagePlacement
from ..model.batch import AttentionBackend, KVView, StateSlots
from ..model.context_parallel import CPBackend, ShardedContext
from ..model.paged import PagedBackend
from ..model.prefix_gather import CPGroup, PrefixGather


@dataclass
class ContextParallel:
    """This rank's place in a CP group (a :class:`~hicache.model.context_parallel.CPSetup`).
    ``placement``: the KV is page-sharded over the group (None: replicated, every rank stores
    every token); ``gather``: its prefix-gather scratch."""

    group: CPGroup
    strategy: str
    page_size: int
    placement: Optional[PagePlacement] = None
    gather: Optional[PrefixGather] = None
    split_tokens: bool = True  # False: the group's ranks hold other heads of the same tokens (MLA TP)

    def contexts(self, prefix_lens: list[int], context_slots: list[torch.Tensor], gathered: bool) -> list:
        """Each context as the model reads it: local slots (replicated), or where every logical
        slot lives and, when ``gathered``, how its cached prefix is gathered (sharded) -- the
        pool's copy boundary."""
        if self.placement is None:
            return context_slots
        out = []
        for prefix_len, slots in zip(prefix_lens, context_slots):
            slots = torch.as_tensor(slots).long()
            owners, rows = self.placement.locate(slots)
            if not gathered:
                out.append(ShardedContext(owners, rows, None, None))
                continue
            prefix_pages = slots[:prefix_len:self.page_size] // self.page_size  # one slot per page
            plan = GatherPlan.for_prefix(self.placement, prefix_pages.numpy())
            out.append(ShardedContext(owners, rows, torch.from_numpy(plan.contributions[self.group.rank]),
                                      torch.from_numpy(np.ascontiguousarray(plan.page_table))))
        return out


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVView, device: torch.device,
                 cp: Optional[ContextParallel] = None) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.cp = cp
        # Chosen once: every forward of this engine runs its attention through this backend.
        rowwise = getattr(model, "deterministic", False)  # deterministic inference: every pass row by row
        self.backend: AttentionBackend = (PagedBackend(device, rowwise) if cp is None
                                          else CPBackend(cp, device, len(kv.k_buffers)))

    @torch.inference_mode()
    def forward(self, input_ids: list[list[int]], prefix_lens: list[int], context_slots: list[torch.Tensor],
                hidden: torch.Tensor | None = None, logits: str = "last",
                window_slots: list[torch.Tensor] | None = None, generated: bool = False,
                state_slots: list[tuple] | None = None) -> torch.Tensor:
        """Logits ``[B, vocab]`` (float32) at each sequence's last new token (``logits="all"``:
        ``[T, vocab]``, at every new token; not under context parallelism); on a pipeline stage
        before the last, the hidden states of all new tokens (``hidden``: the previous stage's).
        ``window_slots``: each context's slots in a hybrid pool's window component (None: none).
        ``generated``: the new tokens are generated ones (decode, verify, draft passes), which may
        take the decode arithmetic; prompt tokens never do (``ForwardBatch.generated``).
        ``state_slots``: each sequence's (source, running[, emit]) recurrent-state slots (None: no recurrent
        layers; :class:`~hicache.model.batch.StateSlots`)."""
        batch = self.backend.prepare(input_ids, prefix_lens, context_slots, logits, window_slots, generated)
        if state_slots is not None:
            batch.state = StateSlots.of(state_slots, [len(ids) for ids in input_ids], self.device)
        return self.model(batch, self.kv, hidden)
