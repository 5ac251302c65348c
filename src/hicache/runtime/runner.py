"""Turns a scheduled batch into one forward pass of the model over the device KV pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..cache.placement import GatherPlan, PagePlacement
from ..model.batch import KVView, make_forward_batch
from ..model.context_parallel import (
    CPGroup,
    PrefixGather,
    ShardedContext,
    make_cp_batch,
)


@dataclass
class ContextParallel:
    """This rank's place in a CP group. ``placement``: the KV is page-sharded over the group
    (None: replicated, every rank stores every token); ``gather``: its prefix-gather scratch."""

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

    @torch.inference_mode()
    def forward(self, input_ids: list[list[int]], prefix_lens: list[int], context_slots: list[torch.Tensor],
                hidden: torch.Tensor | None = None, logits: str = "last") -> torch.Tensor:
        """Logits ``[B, vocab]`` (float32) at each sequence's last new token (``logits="all"``:
        ``[T, vocab]``, at every new token); on a pipeline stage before the last, the hidden
        states of all new tokens (``hidden``: the previous stage's)."""
        cp = self.cp
        if cp is None:
            batch = make_forward_batch(input_ids, prefix_lens, context_slots, logits=logits, device=self.device)
        else:
            assert logits == "last", "context parallelism returns each sequence's last logits only"
            # A decode batch split over CP ranks merges partial attention: no prefix gather.
            gathered = not (cp.split_tokens and max(len(ids) for ids in input_ids) == 1)
            batch = make_cp_batch(input_ids, prefix_lens, cp.contexts(prefix_lens, context_slots, gathered), cp.group,
                                  cp.strategy, cp.page_size, cp.gather, self.device, cp.split_tokens)
            if batch.cp is not None and cp.gather is not None:
                cp.gather.begin(batch.cp, len(self.kv.k_buffers))
        return self.model(batch, self.kv, hidden)
