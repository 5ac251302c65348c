"""Where a lazy grammar takes over: a request's output scanned for its grammar's triggers
(``GrammarSpec.triggers``), one token at a time, on the mask thread (runtime/grammar.py).

The output is kept as Latin-1 text, one character per byte (the token table's spelling,
runtime/grammar_vet.py :func:`tokenizer_config`), so a pattern sees the bytes the model wrote,
special tokens as their text, and a match maps back to bytes exactly. Patterns are ASCII
(``re.ASCII``: ``\\s`` is ASCII whitespace only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence


def compile_triggers(triggers: Sequence[tuple[str, str]]) -> tuple[tuple[re.Pattern, str], ...]:
    return tuple((re.compile(pattern, re.ASCII), prefix) for pattern, prefix in triggers)


@dataclass
class TriggerScan:
    """A lazy-grammar request's output until a trigger matches: ``text`` holds the bytes of its first
    ``scanned`` output tokens."""

    patterns: tuple[tuple[re.Pattern, str], ...]
    text: str = ""
    scanned: int = 0

    def feed(self, output_ids: Sequence[int], token_text: Sequence[str]) -> Optional[str]:
        """Take the output tokens not seen yet; once a trigger matches, the text the grammar starts
        from: the trigger's prefix, then the output after the match (None: no trigger yet)."""
        new = output_ids[self.scanned:]
        if not new:
            return None
        self.text += "".join(token_text[t] for t in new)
        self.scanned = len(output_ids)
        found = [(m.start(), i, m.end(), prefix) for i, (pattern, prefix) in enumerate(self.patterns)
                 if (m := pattern.search(self.text)) is not None]
        if not found:
            return None
        _, _, end, prefix = min(found)  # the earliest match; among equal starts, the trigger listed first
        return prefix + self.text[end:].encode("latin-1").decode("utf-8", errors="replace")
