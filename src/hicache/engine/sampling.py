"""Sampling parameters and the sampler (greedy, temperature, top-p, top-k, seeded)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..errors import InvalidRequestError


@dataclass
class SamplingParams:
    """Per-request decoding options (SGLang's names and defaults).

    ``temperature=0`` is greedy. ``seed`` makes sampling reproducible for that request,
    whatever else shares its batch.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: Optional[Sequence[str] | str] = None
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: Optional[int] = None

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}.")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k != -1 and self.top_k < 1:
            raise InvalidRequestError(f"top_k must be -1 (off) or >= 1, got {self.top_k}.")

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` ``[B, vocab]`` (float32)."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k > 0:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest head whose mass reaches top_p (always at least one token).
            drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
