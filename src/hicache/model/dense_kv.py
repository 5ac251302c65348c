"""A plain in-memory :class:`~hicache.model.batch.KVView` for standalone forwards and tests."""

from __future__ import annotations

import torch

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
