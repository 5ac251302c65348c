"""The Responses API's server-held conversations (server/responses.py): each stored response's
messages, the token ids the model saw and wrote, and the response object, in a bounded LRU.

Invariant: the bytes the store counts are the bytes it holds. A stored response is kept
serialized (:class:`Stored`: compact UTF-8 JSON, the ids as 4-byte integers), never as the Python
object tree a request parsed into -- whose size JSON text does not tell (an empty object ``{}``
is 2 characters of JSON and 64 bytes in Python) -- so ``--responses-store-mb`` bounds the memory
the store takes, within its per-entry overhead (:data:`ENTRY_OVERHEAD`, counted too). Counts are
kept as the entries come and go: ``put`` is O(1) amortized (each entry is dropped at most once).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from array import array
from collections import OrderedDict
from typing import Any, Callable, Optional

from ..runtime.request import GenerateResult

logger = logging.getLogger(__name__)

DEFAULT_STORE_SIZE = 1024  # responses kept for previous_response_id (LRU)
DEFAULT_STORE_MB = 256  # and the bytes they may hold together
# Bytes an entry costs beyond its objects' own: its id string (a response id, ~90 B), the LRU's and
# the size table's entries (~100 B each), rounded up.
ENTRY_OVERHEAD = 512


def _dump(obj: Any) -> bytes:
    """``obj`` as compact UTF-8 JSON (a lone surrogate a client sent is kept as it came)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def _load(raw: bytes) -> Any:
    return json.loads(raw.decode("utf-8", "surrogatepass"))


class Stored:
    """A stored response: its conversation as chat messages (reply included), the token ids the model
    saw and wrote (prompt + output: what a continuation starts from, as cached), the response object.
    Kept serialized (module docstring); each read of ``messages`` / ``response`` parses a fresh copy."""

    __slots__ = ("_messages", "_ids", "_response")

    def __init__(self, messages: list[dict[str, Any]], ids: list[int], response: dict[str, Any]) -> None:
        self._messages, self._response = _dump(messages), _dump(response)
        self._ids = array("i", ids)  # token ids are < 2^31

    @property
    def messages(self) -> list[dict[str, Any]]:
        return _load(self._messages)

    @property
    def ids(self) -> list[int]:
        return self._ids.tolist()

    @property
    def response(self) -> dict[str, Any]:
        return _load(self._response)

    def nbytes(self) -> int:
        """The bytes it holds, every object's header included, plus :data:`ENTRY_OVERHEAD`."""
        return ENTRY_OVERHEAD + sum(map(sys.getsizeof, (self, self._messages, self._response, self._ids)))


class ResponseStore:
    """Stored responses by id (:class:`Stored`), at most ``size`` of them holding at most ``max_bytes``
    together, the least recently used dropped first (one larger than ``max_bytes`` alone is not kept).
    ``on_drop(stored)`` (optional) is called for each one the bounds dropped, after the store let go."""

    def __init__(self, size: int = DEFAULT_STORE_SIZE, max_bytes: int = DEFAULT_STORE_MB << 20,
                 on_drop: Optional[Callable[[Stored], None]] = None) -> None:
        self.size, self.max_bytes, self.on_drop = size, max_bytes, on_drop
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._total = 0  # their nbytes() (each the same for as long as it is held: nothing in it changes)
        self._lock = threading.Lock()  # preparation runs on worker threads
        # continued turns (previous_response_id): their prompt tokens, and those the prefix cache served
        self.continued = self.continued_prompt_tokens = self.continued_cached_tokens = 0

    def count_continued(self, res: GenerateResult) -> None:
        with self._lock:
            self.continued += 1
            self.continued_prompt_tokens += res.prompt_tokens
            self.continued_cached_tokens += res.cached_tokens

    def stats(self) -> dict[str, int]:
        """For /stats: how many responses are held, and what continued turns computed."""
        with self._lock:
            return {"stored": len(self._items), "store_size": self.size, "stored_bytes": self._total,
                    "store_max_bytes": self.max_bytes, "continued": self.continued,
                    "continued_prompt_tokens": self.continued_prompt_tokens,
                    "continued_computed_tokens": self.continued_prompt_tokens - self.continued_cached_tokens}

    def put(self, rid: str, stored: Stored) -> None:
        """Keep ``stored`` as ``rid`` (the most recently used), dropping the least recently used ones
        until both bounds hold; O(1) amortized."""
        size = stored.nbytes()
        if size > self.max_bytes:
            logger.info("response %s not stored: %d bytes, over --responses-store-mb", rid, size)
            return
        dropped = []
        with self._lock:
            self._drop(rid)
            self._items[rid] = stored
            self._total += size
            while len(self._items) > self.size or self._total > self.max_bytes:
                oldest = next(iter(self._items))
                dropped.append(self._items[oldest])
                self._drop(oldest)
        for gone in dropped if self.on_drop is not None else ():
            self.on_drop(gone)

    def _drop(self, rid: str) -> bool:
        """Forget ``rid`` (the lock held); whether it was stored."""
        dropped = self._items.pop(rid, None)
        if dropped is not None:
            self._total -= dropped.nbytes()
        return dropped is not None

    def get(self, rid: str) -> Optional[Stored]:
        with self._lock:
            item = self._items.get(rid)
            if item is not None:
                self._items.move_to_end(rid)
            return item

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._drop(rid)

    def in_a_stored_chain(self, ids: list[int]) -> bool:
        """Whether a stored response's ids begin with ``ids`` (a later turn of that conversation) or are
        a prefix of them (an earlier turn): releasing ``ids``' retention would release theirs too (it
        clears the whole path). O(the ids stored), compared in C."""
        mine = array("i", ids)
        with self._lock:
            for s in self._items.values():
                n = min(len(s._ids), len(mine))
                if s._ids[:n] == mine[:n]:
                    return True
        return False
