"""Incremental detokenization for streaming: text deltas whose concatenation is the final text."""

from __future__ import annotations

from typing import Callable, Sequence


class IncrementalText:
    """Decodes the growing output and hands out only text that cannot change any more.

    Held back: a trailing replacement character (an incomplete UTF-8 sequence may still be
    completed by the next token) and, when stop strings are set, the last ``len(stop) - 1``
    characters (they may be the start of a stop string the final text will cut).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._emitted = 0  # characters already handed out
        self._hold = max((len(s) for s in stops), default=1) - 1

    def add(self, token_ids: Sequence[int]) -> str:
        """Text that became final with these new tokens (may be empty)."""
        self._ids.extend(token_ids)
        text = self._decode(self._ids)
        end = len(text) - self._hold
        while end > self._emitted and text[end - 1] == "\ufffd":
            end -= 1
        out, self._emitted = text[self._emitted : end], max(end, self._emitted)
        return out

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (the engine's text, stop string already cut)."""
        out, self._emitted = final_text[self._emitted :], len(final_text)
        return out
