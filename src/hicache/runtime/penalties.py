"""Penalties, ``logit_bias`` and ``min_tokens``: a request's logits adjusted before any sampler.

For every logits row a request samples from, in this order (each leaves -inf at -inf, so the
order against a grammar's mask does not matter):

- ``repetition_penalty`` r (CTRL; vLLM's and SGLang's rule): the logit of every token in the
  prompt or the output so far is divided by r when positive, multiplied by r when negative;
- ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's rule): ``logit -= f * count + p *
  (count > 0)``, counts over the output so far;
- ``logit_bias``: added to the named tokens' logits;
- ``min_tokens``: EOS and ``stop_token_ids`` are -inf while the output is shorter.

"The output so far" is the row's own position: a verify pass's row j counts drafts 1..j too, so
speculative decoding accepts exactly the tokens plain decoding could give. Greedy requests take
the argmax of the adjusted logits; logprobs report them (runtime/logprobs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .batch import Batch, BatchKind
from .modes import Mode, ModeContext
from .request import Request
from .sampling import SamplingParams


@dataclass
class PenaltyState:
    """One request's token counts: ``counts[t]`` occurrences of t in the first ``counted`` output
    tokens (float32 ``[vocab]``); ``in_prompt`` the prompt's tokens (repetition penalty only)."""

    counts: torch.Tensor
    in_prompt: Optional[torch.Tensor]
    counted: int = 0

    @classmethod
    def admitted(cls, req: Request, vocab_size: int) -> "PenaltyState":
        in_prompt = None
        if req.sampling.repetition_penalty != 1.0:
            in_prompt = torch.zeros(vocab_size, dtype=torch.bool)
            in_prompt[torch.as_tensor(req.prompt_ids, dtype=torch.long)] = True
        return cls(torch.zeros(vocab_size, dtype=torch.float32), in_prompt)

    def catch_up(self, output_ids: Sequence[int]) -> None:
        self.add(output_ids[self.counted:], 1.0)
        self.counted = len(output_ids)

    def add(self, tokens: Sequence[int], sign: float) -> None:
        if tokens:
            ids = torch.as_tensor(list(tokens), dtype=torch.long)
            self.counts.index_put_((ids,), torch.full((len(ids),), sign), accumulate=True)


def adjust_row(row: torch.Tensor, sp: SamplingParams, state: PenaltyState, outputs: int,
               stop_ids: torch.Tensor) -> None:
    """Adjust one logits row in place; ``state.counts`` holds the row's ``outputs`` tokens. The
    state lives on the CPU; what meets the row goes to the row's device (a no-op on a CPU)."""
    dev = row.device
    counts = state.counts.to(dev)
    seen = counts > 0 if sp.repetition_penalty != 1.0 or sp.presence_penalty else None
    if sp.repetition_penalty != 1.0:
        hit = seen | state.in_prompt.to(dev)
        r = sp.repetition_penalty
        row[hit] = torch.where(row[hit] > 0, row[hit] / r, row[hit] * r)
    if sp.frequency_penalty:
        row.sub_(counts * sp.frequency_penalty)
    if sp.presence_penalty:
        row.sub_(seen.to(row.dtype) * sp.presence_penalty)
    if sp.logit_bias:
        ids = torch.as_tensor(list(sp.logit_bias), dtype=torch.long, device=dev)
        row.index_add_(0, ids, torch.as_tensor(list(sp.logit_bias.values()), dtype=row.dtype, device=dev))
    if outputs < sp.min_tokens:
        row[stop_ids.to(dev)] = float("-inf")
        if sp.stop_token_ids:
            row[torch.as_tensor(list(sp.stop_token_ids), dtype=torch.long, device=dev)] = float("-inf")


class PenaltyMode(Mode):
    """Adjusts the logits rows of requests with penalties, ``logit_bias`` or ``min_tokens``."""

    name = "penalties"

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], samples: bool = True) -> None:
        self.vocab_size = vocab_size
        self.samples = samples  # this rank samples (not an earlier pipeline stage): it keeps counts
        self.stop_ids = torch.as_tensor(sorted(eos_token_ids), dtype=torch.long)
        self.adjusted_rows = 0

    def on_admit(self, req: Request) -> None:
        if req.sampling.adjusts_logits and self.samples:
            req.penalty = PenaltyState.admitted(req, self.vocab_size)

    def constrain(self, batch: Batch, logits: torch.Tensor) -> dict[int, tuple[str, str]]:
        """Adjust the rows of requests with a :class:`PenaltyState`; it fails no request."""
        if not any(r.penalty is not None for r in batch.reqs):
            return {}
        rows, verify = batch.first_rows(), batch.kind == BatchKind.VERIFY
        with torch.inference_mode():  # the forward's logits are inference tensors
            for i in batch.result_rows():  # (a verify pass: every request's, a row per draft after its first)
                drafts = batch.proposal.tokens[i] if verify else ()
                for j in range(len(drafts) + 1):  # row j: after the last token and drafts[:j]
                    self._adjust(batch.reqs[i], logits[rows[i] + j], drafts[:j])
        return {}

    def _adjust(self, req: Request, row: torch.Tensor, drafts: Sequence[int]) -> None:
        state = req.penalty
        if state is None:
            return
        state.catch_up(req.output_ids)
        state.add(drafts, 1.0)
        adjust_row(row, req.sampling, state, len(req.output_ids) + len(drafts), self.stop_ids)
        state.add(drafts, -1.0)
        self.adjusted_rows += 1

    def on_finish(self, req: Request) -> bool:
        req.penalty = None
        return False

    def stats(self) -> dict[str, Any]:
        return {"adjusted_rows": self.adjusted_rows} if self.adjusted_rows else {}


def build(ctx: ModeContext) -> Optional[Mode]:
    """Always on (a batch without adjusted requests costs one check); counts kept where tokens are sampled."""
    eos = ctx.tokenizer.eos_token_ids if ctx.tokenizer is not None else ()
    return PenaltyMode(ctx.vocab_size, eos, samples=ctx.samples)
