"""Speculative decoding, NGRAM: drafts copied from text already seen, verified at decode cost.

Agentic and multi-turn work repeats text it has seen (code being edited, tool output quoted
back, JSON keys, earlier answers). Each step, a decoding request's last tokens are looked up in

- its own text (prompt and output so far: prompt lookup), and
- every token sequence the radix tree holds (other requests, earlier turns, in every tier the
  tree knows: :class:`~hicache.cache.tree_tokens.TreeTokenIndex`, kept by the tree's own hooks);

the continuation of the longest match (``--speculative-ngram-match-type`` BFS: its most recent
occurrence; PROB: the continuation most occurrences share) is the draft. There is no draft
model and no draft KV: a verify pass is the last token + the drafts, read row by row like a
decode step (model/paged.py), so it costs about one.

Drafting never costs much more than plain decoding: a request drafts only after a match, at most
``2 x (match length)`` tokens, and its draft length follows its recent acceptance (halved to
what was accepted after a miss). A request whose drafts keep failing asks for more evidence
instead of pausing: each pass that accepted nothing raises the match length it needs by one
(at most ``max_window``), each pass that accepted something lowers it again -- a long match
is rarely wrong, so text copied after a stretch of new words is still caught the step it
starts. A batch holds at most ``DECODE_ROWS`` rows while any request drafts (one pass of the
block kernels), and requests without a match ride along as plain rows.

Every rank proposes the same drafts: the lookups read only the request's tokens and the tree,
which every rank changes at the same points (DESIGN invariant 3).
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np

from ..cache.ngram_table import NgramTable, ngram_keys, tail_key
from ..cache.tree_tokens import Occurrence, TreeTokenIndex
from ..consensus_record import consensus_check
from ..model.projection import DECODE_ROWS
from .batch import BatchKind
from .modes import DecodePlan, Mode, ModeContext
from .request import Request
from .speculative import Proposal, SpeculativeMode

PER_KEY = 8  # places kept per n-gram: the most recent ones


@dataclass(frozen=True)
class NgramSettings:
    """The lookup's knobs (from the ``--speculative-ngram-*`` flags). ``levels``: the n-gram
    lengths indexed, longest tried first (a short one finds what a long one misses)."""

    max_drafts: int
    min_window: int
    max_window: int
    match_type: str
    levels: tuple[int, ...]

    @classmethod
    def from_config(cls, cfg) -> "NgramSettings":
        max_window = min(cfg.speculative_ngram_max_match_window_size, cfg.ngram_trie_depth)
        min_window = min(cfg.speculative_ngram_min_match_window_size, max_window)
        levels = tuple(sorted({min_window, min(max(min_window, 3), max_window)}))
        return cls(cfg.speculative_steps, min_window, max_window, cfg.speculative_ngram_match_type, levels)


class OwnText:
    """One request's tokens (prompt + output), indexed as they grow: where each n-gram ended.
    The last token is never indexed (it is what the next lookup asks about)."""

    def __init__(self, levels: tuple[int, ...]) -> None:
        self.tokens = array("i")
        self.tables = {n: NgramTable(n, PER_KEY) for n in levels}
        self.indexed = 0  # n-grams ending before this position are in the tables

    def update(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        have = len(self.tokens)
        if have < len(prompt):
            self.tokens.extend(prompt[have:])
            have = len(prompt)
        self.tokens.extend(output[have - len(prompt):])
        last = len(self.tokens) - 1
        if last <= self.indexed:
            return
        arr = np.frombuffer(self.tokens, dtype=np.int32)
        for n, table in self.tables.items():
            first = max(self.indexed, n - 1)
            if first < last:
                table.add(ngram_keys(arr[first - n + 1:last], n), range(first, last))
        self.indexed = last

    def occurrences(self, n: int, key: int) -> Iterator[Occurrence]:
        for end in reversed(self.tables[n].places(key)):
            yield Occurrence(self.tokens, end, len(self.tokens))  # own text first


@dataclass
class Drafting:
    """A request's NGRAM state: its text index, the most drafts it may take now, and the match
    length (tokens) a lookup needs before it drafts."""

    own: OwnText
    cap: int
    need: int
    proposed: int = 0  # drafts in the pass in flight


def match_length(tail: array, occ: Occurrence, most: int) -> int:
    """How many tokens before and at ``occ.end`` equal the end of ``tail`` (at most ``most``)."""
    j, last = 0, len(tail) - 1
    seq, end = occ.tokens, occ.end
    most = min(most, end + 1, last + 1)
    while j < most and seq[end - j] == tail[last - j]:
        j += 1
    return j


def pick_draft(tail: array, sources: Sequence, settings: NgramSettings, want: int) -> tuple[list[int], int]:
    """The draft (at most ``want`` tokens) and its match length: the longest match over the
    ``sources`` (callables ``(n, key) -> occurrences``), longest n-gram level first."""
    for n in reversed(settings.levels):
        if n > len(tail):
            continue
        key = tail_key(tail, n)
        found: list[tuple[int, Occurrence]] = []
        for source in sources:
            for occ in source(n, key):
                m = match_length(tail, occ, settings.max_window)
                if m >= n and occ.end + 1 < occ.limit:
                    found.append((m, occ))
        if found:
            break
    else:
        return [], 0
    best = max(m for m, _ in found)
    top = [occ for m, occ in found if m == best]  # own text first, then the most recent
    if settings.match_type == "PROB":  # the continuation most occurrences share (ties: the earliest in order)
        first = Counter(occ.tokens[occ.end + 1] for occ in top).most_common(1)[0][0]
        top = [occ for occ in top if occ.tokens[occ.end + 1] == first]
    occ = top[0]
    return list(occ.tokens[occ.end + 1:min(occ.limit, occ.end + 1 + want)]), best


class NgramSpeculator(SpeculativeMode):
    """The mode: proposes while scheduling (the drafts decide each request's rows), verifies
    with the shared acceptance rule. ``index``: the tree's token index (None: no radix cache)."""

    draft_kv = False

    def __init__(self, settings: NgramSettings, index: Optional[TreeTokenIndex], deterministic: bool = False) -> None:
        super().__init__(settings.max_drafts, deterministic)
        self.settings = settings
        self.index = index
        self.lookups = 0
        self.drafted_tokens = 0

    def on_admit(self, req: Request) -> None:
        super().on_admit(req)
        req.spec.drafting = Drafting(OwnText(self.settings.levels), self.settings.max_drafts,
                                     self.settings.min_window)

    @consensus_check("ngram.decode_batch", args=lambda self, reqs: [r.rid for r in reqs],
                     result=lambda plan: None if plan is None else plan.proposal.tokens)
    def decode_batch(self, reqs: Sequence[Request]) -> Optional[DecodePlan]:
        """Each request's draft (maybe none), within the batch's row budget; None when no
        request drafts (a plain decode batch)."""
        budget = max(DECODE_ROWS, len(reqs)) - len(reqs)
        found = [self._draft(r) for r in reqs]
        order = sorted(range(len(reqs)), key=lambda i: -found[i][1])  # the longest matches first
        drafts: list[list[int]] = [[] for _ in reqs]
        for i in order:
            drafts[i] = found[i][0][:budget]
            budget -= len(drafts[i])
            reqs[i].spec.drafting.proposed = len(drafts[i])
        if not any(drafts):
            return None
        self.drafted_tokens += sum(map(len, drafts))
        return DecodePlan(BatchKind.VERIFY, [1 + len(d) for d in drafts], Proposal(drafts, [None] * len(reqs)))

    def _draft(self, req: Request) -> tuple[list[int], int]:
        state: Drafting = req.spec.drafting
        want = min(state.cap, req.max_new_tokens - len(req.output_ids) - 1)
        if want <= 0:
            return [], 0
        state.own.update(req.prompt_ids, req.output_ids)
        sources = [state.own.occurrences]
        if self.index is not None:
            sources.append(lambda n, key: self.index.occurrences(req.namespace, n, key))
        self.lookups += 1
        draft, matched = pick_draft(state.own.tokens, sources, self.settings, want)
        if matched < state.need:
            return [], 0
        return draft[:max(1, 2 * matched)], matched

    def on_accepted(self, req: Request, drafts: int, taken: int) -> None:
        """Adapt the request's draft length to what its pass accepted (``drafts`` of the
        ``state.proposed``): grow after a pass that took them all, shrink to what was accepted
        otherwise; a pass that took none raises the match length needed, one that took some lowers
        it. A pass it rode along in without drafts (a plain row) counts nowhere: accept lengths are
        per pass that verified drafts."""
        state: Drafting = req.spec.drafting
        proposed, state.proposed = state.proposed, 0
        if proposed == 0:
            return
        super().on_accepted(req, drafts, taken)
        if drafts == 0:
            state.need = min(state.need + 1, self.settings.max_window)
            state.cap = max(1, state.cap // 2)
            return
        state.need = max(state.need - 1, self.settings.min_window)
        state.cap = min(self.settings.max_drafts, state.cap + 2 if drafts == proposed else drafts + 1)

    def stats(self) -> dict:
        return {**super().stats(), "algorithm": "NGRAM", "lookups": self.lookups, "drafted_tokens": self.drafted_tokens,
                "indexed_tokens": self.index.tokens_held if self.index is not None else 0}


def build(ctx: ModeContext) -> Optional[Mode]:
    """The NGRAM mode (``--speculative-algorithm NGRAM``), its token index on the radix tree."""
    if ctx.cfg.speculative_algorithm != "NGRAM":
        return None
    settings = NgramSettings.from_config(ctx.cfg)
    tree = ctx.cache.tree
    index = None
    if tree is not None:
        if tree.observer is not None:
            raise RuntimeError("the radix tree already has an observer")
        index = TreeTokenIndex(settings.levels, PER_KEY, ctx.cfg.speculative_ngram_capacity)
        tree.observer = index
    return NgramSpeculator(settings, index, deterministic=ctx.cfg.enable_deterministic_inference)
