"""Where each short run of tokens (an n-gram) ends, most recent places last: the lookup behind
NGRAM drafts, over one request's own text (runtime/ngram.py) or every sequence the prefix tree
holds (:mod:`.tree_tokens`).

Units: a *place* is an int the owner chooses (a position, or a sequence id and a position packed
together); an n-gram is keyed by a 64-bit polynomial hash of its ``n`` tokens, computed for a
whole run of tokens at once. Two n-grams may share a hash: whoever reads a place compares the
tokens themselves.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Iterator, Sequence

import numpy as np

_MULT = np.uint64(0x100000001B3)  # FNV-64's prime: a multiplier whose low bits mix well


def ngram_keys(tokens: np.ndarray, n: int) -> list[int]:
    """The key of every n-gram of ``tokens``, in order: entry ``i`` is the n-gram ending at
    ``tokens[i + n - 1]`` (``len(tokens) - n + 1`` keys; none when fewer than ``n`` tokens)."""
    t = np.asarray(tokens, dtype=np.int64).astype(np.uint64)
    count = len(t) - n + 1
    if count <= 0:
        return []
    h = np.zeros(count, dtype=np.uint64)
    with np.errstate(over="ignore"):  # the hash wraps modulo 2**64 on purpose
        for j in range(n):
            h = h * _MULT + t[j:j + count] + np.uint64(1)
    return h.tolist()


def tail_key(tokens: Sequence[int], n: int) -> int:
    """The key of the last ``n`` of ``tokens`` (as :func:`ngram_keys` computes it)."""
    h = 0
    for tok in tokens[len(tokens) - n:]:
        h = (h * 0x100000001B3 + int(tok) + 1) & 0xFFFFFFFFFFFFFFFF
    return h


class NgramTable:
    """n-gram key -> the last ``per_key`` places it ended at (oldest first). Bounded: a common
    n-gram keeps only its most recent places, which are the ones drafts should copy."""

    def __init__(self, n: int, per_key: int) -> None:
        self.n = n
        self.per_key = per_key
        self._places: defaultdict[int, list[int]] = defaultdict(list)

    def add(self, keys: Iterable[int], places: Iterable[int]) -> None:
        """Record each key's place, in order (later ones are more recent)."""
        table, cap = self._places, self.per_key
        for key, place in zip(keys, places):
            entry = table[key]
            entry.append(place)
            if len(entry) > cap:
                del entry[0]

    def remove(self, keys: Iterable[int], places: Iterable[int]) -> None:
        """Forget these places (those still held: a common key may have dropped them already)."""
        table = self._places
        for key, place in zip(keys, places):
            entry = table.get(key)
            if entry is not None and place in entry:
                entry.remove(place)
                if not entry:
                    del table[key]

    def places(self, key: int) -> list[int]:
        """The places ``key`` ended at, oldest first (empty when none)."""
        return self._places.get(key, [])

    def all_places(self) -> Iterator[int]:
        for places in self._places.values():
            yield from places
