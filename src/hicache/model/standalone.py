"""Standalone forwards over a :class:`DenseKV` (a plain in-memory
:class:`~hicache.model.batch.KVView`), without an engine: handy for tests and debugging."""

from __future__ import annotations

from typing import Collection

import torch

from hicache.model.llama import LlamaForCausalLM
from hicache.model.paged import make_forward_batch
from hicache.model.spec import ModelSpec


class DenseKV:
    """Per-layer ``[num_slots, num_kv_heads, head_dim]`` K/V buffers with nothing to wait for.

    Slot 0 is the padding slot (never holds real data), so usable slots are ``1..num_slots-1``.
    """

    def __init__(self, spec: ModelSpec, num_slots: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_slots, spec.num_kv_heads, spec.head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]

    def wait_layer(self, layer: int) -> None:
        """Nothing is ever loaded in the background here."""

    def layer_ready(self, layer: int) -> bool:
        return True


def prefill_logits(model: LlamaForCausalLM, ids: list[int], num_slots: int | None = None) -> torch.Tensor:
    """All-position logits ``[len(ids), vocab]`` of a cold single-sequence prefill (slots 1..n)."""
    kv = DenseKV(model.spec, num_slots or len(ids) + 1, model.dtype, model.device)
    batch = make_forward_batch([ids], [0], [torch.arange(1, len(ids) + 1)], logits="all", device=model.device)
    return model(batch, kv)


def greedy_paged(model: LlamaForCausalLM, ids: list[int], steps: int, stop_ids: Collection[int] = ()) -> list[int]:
    """Greedy continuation of at most ``steps`` tokens (ending early after a ``stop_ids`` token):
    one prefill, then one-token decode steps that read the context from the cache by slot."""
    kv = DenseKV(model.spec, len(ids) + steps + 1, model.dtype, model.device)
    slots = torch.arange(1, len(ids) + steps + 1)
    batch = make_forward_batch([ids], [0], [slots[: len(ids)]], device=model.device)
    out: list[int] = []
    while len(out) < steps:
        out.append(int(model(batch, kv)[-1].argmax()))
        if out[-1] in stop_ids:
            break
        n = len(ids) + len(out)
        batch = make_forward_batch([out[-1:]], [n - 1], [slots[:n]], device=model.device, generated=True)
    return out
