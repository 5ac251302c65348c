"""Turns a scheduled batch into one forward pass of the model over the device KV pool."""

from __future__ import annotations

import torch

from ..model.batch import KVView, make_forward_batch


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVView, device: torch.device) -> None:
        self.model = model
        self.kv = kv
        self.device = device

    @torch.inference_mode()
    def forward(self, input_ids: list[list[int]], prefix_lens: list[int], context_slots: list[torch.Tensor],
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, vocab]`` (float32) at each sequence's last new token; on a pipeline
        stage before the last, the hidden states of all new tokens (``hidden``: the previous
        stage's)."""
        batch = make_forward_batch(input_ids, prefix_lens, context_slots, logits="last", device=self.device)
        return self.model(batch, self.kv, hidden)
