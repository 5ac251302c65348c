"""Standalone forwards over a :class:`~hicache.model.DenseKV` (a plain in-memory KV view), without
an engine: the reference runs the model tests (and a few benchmarks and tools) compare against.
A sequence's recurrent state (models with recurrent layers) starts from the zero state (slot 0)
and lives in state slot 1."""

from __future__ import annotations

from typing import Collection

import torch

from hicache.model import DenseKV, LlamaForCausalLM, make_forward_batch


def prefill_logits(model: LlamaForCausalLM, ids: list[int], num_slots: int | None = None) -> torch.Tensor:
    """All-position logits ``[len(ids), vocab]`` of a cold single-sequence prefill (slots 1..n)."""
    kv = DenseKV(model.spec, num_slots or len(ids) + 1, model.dtype, model.device)
    batch = make_forward_batch([ids], [0], [torch.arange(1, len(ids) + 1)], logits="all", device=model.device,
                               state_slots=[(0, 1)])
    return model(batch, kv)


def greedy_paged(model: LlamaForCausalLM, ids: list[int], steps: int, stop_ids: Collection[int] = ()) -> list[int]:
    """Greedy continuation of at most ``steps`` tokens (ending early after a ``stop_ids`` token):
    one prefill, then one-token decode steps that read the context from the cache by slot."""
    kv = DenseKV(model.spec, len(ids) + steps + 1, model.dtype, model.device)
    slots = torch.arange(1, len(ids) + steps + 1)
    batch = make_forward_batch([ids], [0], [slots[: len(ids)]], device=model.device, state_slots=[(0, 1)])
    out: list[int] = []
    while len(out) < steps:
        out.append(int(model(batch, kv)[-1].argmax()))
        if out[-1] in stop_ids:
            break
        n = len(ids) + len(out)
        batch = make_forward_batch([out[-1:]], [n - 1], [slots[:n]], device=model.device, generated=True,
                                   state_slots=[(1, 1)])
    return out
