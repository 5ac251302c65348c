"""Why a request stops after its last output token: EOS or a stop token ("stop"), a stop string
in its text ("stop": the string itself is cut from the answer), ``max_new_tokens`` ("length").

Stop strings are matched in time independent of how many a request has: one Aho-Corasick
automaton per stop list (:class:`StopStrings`, pyahocorasick), and per token only the text that
token added plus the characters before it that a stop string ending in the new text can start in
(:class:`StopScan`). A token's check costs O(longest stop + new characters); the list itself is
bounded by :meth:`SamplingParams.validate` (``MAX_STOP_STRINGS`` strings of at most
``MAX_STOP_STRING_BYTES`` UTF-8 bytes each). Units: characters of the decoded output text.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import ahocorasick

from .request import Request

# Characters before the last scanned end that are scanned again: a decoder may rewrite the end of
# the text when the next token comes (an incomplete UTF-8 sequence, spaces cleaned up before
# punctuation), never more than its last few characters.
REDECODE_MARGIN = 8


class StopStrings:
    """A request's stop strings as one automaton; ``longest``: the longest one, in characters."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.longest = max(len(s) for s in stops)
        self._automaton = ahocorasick.Automaton()
        for s in stops:
            self._automaton.add_word(s, len(s))
        self._automaton.make_automaton()

    def first(self, text: str, start: int = 0) -> int:
        """Where the earliest-starting stop string lying wholly in ``text[start:]`` starts, or -1.
        Matches come in order of their ends; none ending past ``best + longest - 1`` can start
        before ``best``, so the walk stops there."""
        best = -1
        for end, length in self._automaton.iter(text, max(0, start)):
            if best >= 0 and end - self.longest + 1 > best:
                break
            begin = end - length + 1
            if best < 0 or begin < best:
                best = begin
        return best


@functools.lru_cache(maxsize=64)
def stop_strings_of(stops: tuple[str, ...]) -> StopStrings:
    """One automaton per distinct stop list (the ``n`` choices of a request share theirs)."""
    return StopStrings(stops)


class StopScan:
    """How far a request's output text was searched for its stop strings: its first ``checked``
    characters hold no stop string (invariant; text being decoded at the end is not counted)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.strings: Optional[StopStrings] = stop_strings_of(tuple(stops)) if stops else None
        self.checked = 0

    def hit(self, text: str) -> bool:
        """Whether ``text`` (the whole output so far) holds a stop string; only what is new since
        the last call is searched, with the ``longest - 1`` characters before it."""
        if self.strings is None:
            return False
        start = self.checked - (self.strings.longest - 1) - REDECODE_MARGIN
        if self.strings.first(text, start) >= 0:
            return True
        end = len(text)
        while end > 0 and text[end - 1] == "\ufffd":  # an incomplete UTF-8 sequence: not final yet
            end -= 1
        self.checked = end
        return False


def stop_reason(req: Request, eos_token_ids: set[int], decode_text: Callable[[Sequence[int]], str]) -> str:
    """Why ``req`` stops after its last output token ("stop", "length"), or ""."""
    tok, sp = req.output_ids[-1], req.sampling
    if (tok in eos_token_ids and not sp.ignore_eos) or tok in sp.stop_token_ids:
        return "stop"
    if req.stop_scan is None:
        req.stop_scan = StopScan(sp.stop_strings)
    if req.stop_scan.strings is not None and req.stop_scan.hit(decode_text(req.output_ids)):
        return "stop"
    if len(req.output_ids) >= req.max_new_tokens:
        return "length"
    return ""


def stop_index(text: str, stops: Sequence[str]) -> int:
    """Where the earliest stop string starts in ``text``, or -1."""
    return stop_strings_of(tuple(stops)).first(text) if stops else -1
