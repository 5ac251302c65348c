"""Prompts an n-gram drafter finds drafts in (tests/test_ngram.py, test_recurrent_ngram.py)."""

from __future__ import annotations


def looping_prompts(n: int) -> list[list[int]]:
    """Prompts with repeated runs, as tool output quoted back is: text to copy from."""
    out = []
    for j in range(n):
        block = [(i * 7 + 3 * j) % 200 + 20 for i in range(12 + j)]
        out.append(block * 3 + block[:5])
    return out
