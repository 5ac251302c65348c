"""One scheduled forward pass: which requests, how many new tokens each, and what it reads."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from .request import Request


class BatchKind(str, Enum):
    """What a batch computes: prompt chunks, one generated token each, or a verify pass (speculative:
    the last token + k drafts each). A ``str``: equal to its value, printed and JSON-encoded as it."""

    PREFILL = "prefill"
    DECODE = "decode"
    VERIFY = "verify"
    __str__ = str.__str__


@dataclass
class Batch:
    """One forward pass as scheduled: ``reqs[i]`` computes ``new_tokens[i]`` tokens (a prompt
    chunk, 1 in decode, the last token + k drafts in verify). Built once; every pipeline stage
    schedules an equal one."""

    kind: BatchKind
    reqs: list[Request]
    new_tokens: list[int]
    proposal: Any = None  # verify: the drafts (runtime.speculative.Proposal), set before the forward

    @property
    def generated(self) -> bool:
        """The pass's new tokens are generated ones (a decode step, a verify pass's last token and
        drafts), not prompt tokens: only such passes may take the decode arithmetic (issue 57)."""
        return self.kind != BatchKind.PREFILL

    def rids(self) -> list[int]:
        return [r.rid for r in self.reqs]

    def input_ids(self) -> list[list[int]]:
        if self.kind == BatchKind.DECODE:
            return [[r.output_ids[-1]] for r in self.reqs]
        if self.kind == BatchKind.VERIFY:
            return [[r.output_ids[-1]] + drafts for r, drafts in zip(self.reqs, self.proposal.tokens)]
        return [r.prompt_ids[r.computed : r.computed + n] for r, n in zip(self.reqs, self.new_tokens)]

    def prefix_lens(self) -> list[int]:
        return [r.computed for r in self.reqs]

    def context_slots(self) -> list[torch.Tensor]:
        return [r.kv.slots[: r.computed + n] for r, n in zip(self.reqs, self.new_tokens)]

    def state_slots(self) -> list[tuple] | None:
        """Each sequence's (source, running, emit) recurrent-state slots (None: the model has no
        recurrent layers; emits: the snapshots its pass also writes, ``(position, slot)`` pairs)."""
        if not self.reqs or self.reqs[0].kv.state is None:
            return None
        return [r.kv.state.slots(r.computed) for r in self.reqs]

    def window_slots(self) -> list[torch.Tensor] | None:
        """Each context's slots in a hybrid pool's window component (None: the pool has none)."""
        if not self.reqs or self.reqs[0].kv.window is None:
            return None
        return [r.kv.window.slots[..., : r.computed + n] for r, n in zip(self.reqs, self.new_tokens)]

    def first_rows(self) -> list[int]:
        """Each request's first logits row: a verify pass has ``new_tokens[i]`` rows per request
        (sequence after sequence), any other pass one."""
        if self.kind != BatchKind.VERIFY:
            return list(range(len(self.reqs)))
        return list(itertools.accumulate(self.new_tokens[:-1], initial=0))

    def result_rows(self) -> list[int]:
        """Rows whose logits give a token: decode rows, and prefill rows that end their prompt."""
        if self.kind != BatchKind.PREFILL:
            return list(range(len(self.reqs)))
        return [i for i, (r, n) in enumerate(zip(self.reqs, self.new_tokens)) if r.computed + n == len(r.prompt_ids)]


@dataclass
class Sampled:
    """What sampling a batch gave: ``tokens[i]`` for ``reqs[i]`` (its next token, -1 after a prompt
    chunk, or a verify pass's accepted tokens) and, for requests that asked, ``logprobs[i]``: one
    ``runtime.logprobs.TokenLogprob`` per token; ``failed[i]``: ``reqs[i]`` cannot go on (a mode's
    error code and why; its token is -1). Sent as is from a pipeline's last stage to stage 0."""

    tokens: list
    logprobs: dict[int, list] = field(default_factory=dict)
    failed: dict[int, tuple[str, str]] = field(default_factory=dict)  # i -> (code, error): ends reqs[i]
