"""Where a lazy grammar takes over: a request's output scanned for its grammar's triggers
(``GrammarSpec.triggers``), one token at a time, on the mask thread (runtime/grammar.py).

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
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence


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
