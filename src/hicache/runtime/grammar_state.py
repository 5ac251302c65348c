"""The grammar mode's state (runtime/grammar.py): a grammar's matcher template on this rank, a
request's own matcher (or, for a lazy grammar, its trigger scan), and a batch's row masks."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .events import WorkEvent
from .grammar_trigger import TriggerScan
from .grammar_worker import first_line
from .request import Request
from .sampling import GrammarSpec


@dataclass(eq=False)
class Template:
    """One grammar's matcher on this rank, built once (``build``: None on a rank that does not
    sample) and copied for each request. ``agreed``: built on every rank of the group."""

    spec: GrammarSpec
    build: Optional[Future]
    agreed: bool = False
    retired: bool = False  # a request's matcher failed: its copies may share a spent lexer, new requests get a new one
    users: int = 0  # admitted requests of this grammar
    patterns: tuple = ()  # a lazy grammar's triggers, compiled (runtime/grammar_trigger.py)
    unseen: Optional[frozenset[int]] = None  # ... and the special ids its scans pass over (made on the mask thread)
    waiting: list[Request] = field(default_factory=list)  # requests seen waiting for the build

    @property
    def bytes(self) -> int:
        return self.spec.cost.template_bytes

    def local_event(self) -> WorkEvent:
        if self.build is None:
            return WorkEvent(True, True)
        return WorkEvent(self.build.done(), not self.build.done() or self.build.exception() is None)


@dataclass(eq=False)
class GrammarState:
    """One request's grammar: its template, its own matcher (copied at its first mask, on the mask
    thread) and how many output tokens the matcher has taken (it catches up before each mask).
    A lazy grammar's ``scan`` watches the output until a trigger matches; ``released``: it let go."""

    template: Template
    matcher: Any = None
    consumed: int = 0
    scan: Optional[TriggerScan] = None
    released: bool = False

    @property
    def holds(self) -> bool:
        """The grammar masks this request's rows now (a lazy one: triggered, not released)."""
        return self.scan is None and not self.released

    def catch_up(self, req: Request) -> str:
        """Feed the matcher the output tokens it has not seen: "" or why the grammar cannot be kept."""
        if not self.holds:
            return ""
        if self.matcher is None:
            self.matcher = self.template.build.result().deep_copy()
        new = req.output_ids[self.consumed:]
        if new and not self.matcher.consume_tokens(new):
            return f"its matcher failed on output token {len(req.output_ids)}: {first_line(self.matcher.get_error())}"
        self.consumed = len(req.output_ids)
        return ""


@dataclass
class RowMasks:
    """Allowed tokens per logits row (``masks``: (row, its mask)); ``failed``: requests (index in the
    batch) whose grammar cannot be kept, with why."""

    masks: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
