"""The grammar mode's state (runtime/grammar.py): a grammar's matcher template on this rank, a
request's own matcher (or, for a lazy grammar, its trigger scan), and a batch's row masks.

A lazy grammar's trigger scan (:class:`TriggerScan`): where it takes over, a request's output
scanned for its grammar's triggers (``GrammarSpec.triggers``), one token at a time, on the mask
thread (runtime/grammar.py).

The output is kept as Latin-1 text, one character per byte (the token table's spelling,
runtime/grammar_vet.py :func:`tokenizer_config`), so a pattern sees the bytes the model wrote and a
match maps back to bytes exactly. It is the text the reply shows (what the tool-call parser reads):
special tokens the server's decoding leaves out are left out here too, except one a trigger names
(a ``[TOOL_CALLS]`` control token), so a stray ``<|im_start|>`` before a call does not hide the
call's start from a pattern anchored at the reply's beginning. Patterns are ASCII (``re.ASCII``:
``\\s`` is ASCII whitespace only).
"""

from __future__ import annotations

import re
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import torch

from .events import WorkEvent
from .grammar_worker import first_line
from .request import Request
from .sampling import GrammarSpec


def compile_triggers(triggers: Sequence[tuple[str, str]]) -> tuple[tuple[re.Pattern, str], ...]:
    return tuple((re.compile(pattern, re.ASCII), prefix) for pattern, prefix in triggers)


def unseen_specials(patterns: Sequence[tuple[re.Pattern, str]], token_text: Sequence[str],
                    special: Iterable[int]) -> frozenset[int]:
    """The special ids a scan passes over: those no trigger finds in their own text."""
    return frozenset(i for i in special if not any(pattern.search(token_text[i]) for pattern, _ in patterns))


@dataclass
class TriggerScan:
    """A lazy-grammar request's output until a trigger matches: ``text`` holds the bytes of its first
    ``scanned`` output tokens."""

    patterns: tuple[tuple[re.Pattern, str], ...]
    text: str = ""
    scanned: int = 0

    def feed(self, output_ids: Sequence[int], token_text: Sequence[str],
             unseen: frozenset[int] = frozenset()) -> Optional[str]:
        """Take the output tokens not seen yet (``unseen`` ids add no text: :func:`unseen_specials`);
        once a trigger matches, the text the grammar starts from: the trigger's prefix, then the
        output after the match (None: no trigger yet)."""
        new = output_ids[self.scanned:]
        if not new:
            return None
        self.text += "".join(token_text[t] for t in new if t not in unseen)
        self.scanned = len(output_ids)
        found = [(m.start(), i, m.end(), prefix) for i, (pattern, prefix) in enumerate(self.patterns)
                 if (m := pattern.search(self.text)) is not None]
        if not found:
            return None
        _, _, end, prefix = min(found)  # the earliest match; among equal starts, the trigger listed first
        return prefix + self.text[end:].encode("latin-1").decode("utf-8", errors="replace")


@dataclass(eq=False)
class Template:
    """One grammar's matcher on this rank, built once (``build``: None on a rank that does not
    sample) and copied for each request. ``agreed``: built on every rank of the group."""

    spec: GrammarSpec
    build: Optional[Future]
    agreed: bool = False
    retired: bool = False  # a request's matcher failed: its copies may share a spent lexer, new requests get a new one
    users: int = 0  # admitted requests of this grammar
    patterns: tuple = ()  # a lazy grammar's triggers, compiled (compile_triggers)
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
