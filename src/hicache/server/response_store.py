"""The Responses API's server-held conversations (server/responses.py): each stored response's
messages, the token ids the model saw and wrote, and the response object, in a bounded LRU."""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from ..runtime.request import GenerateResult

logger = logging.getLogger(__name__)

DEFAULT_STORE_SIZE = 1024  # responses kept for previous_response_id (LRU)
DEFAULT_STORE_MB = 256  # and the bytes they may hold together


@dataclass(frozen=True)
class Stored:
    """A stored response: its conversation as chat messages (reply included), the token ids the model
    saw and wrote (prompt + output: what a continuation starts from, as cached), the response object."""

    messages: list[dict[str, Any]]
    ids: list[int]
    response: dict[str, Any]

    def nbytes(self) -> int:
        """What it holds, roughly: its ids as Python ints in a list, its messages and response as JSON."""
        return 36 * len(self.ids) + len(json.dumps(self.messages)) + len(json.dumps(self.response))


class ResponseStore:
    """Stored responses by id (:class:`Stored`), at most ``size`` of them holding at most ``max_bytes``
    together, the least recently used dropped first (one larger than ``max_bytes`` alone is not kept)."""

    def __init__(self, size: int = DEFAULT_STORE_SIZE, max_bytes: int = DEFAULT_STORE_MB << 20) -> None:
        self.size, self.max_bytes = size, max_bytes
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._bytes: dict[str, int] = {}
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
            return {"stored": len(self._items), "store_size": self.size, "stored_bytes": sum(self._bytes.values()),
                    "store_max_bytes": self.max_bytes, "continued": self.continued,
                    "continued_prompt_tokens": self.continued_prompt_tokens,
                    "continued_computed_tokens": self.continued_prompt_tokens - self.continued_cached_tokens}

    def put(self, rid: str, stored: Stored) -> None:
        size = stored.nbytes()
        if size > self.max_bytes:
            logger.info("response %s not stored: %d bytes, over --responses-store-mb", rid, size)
            return
        with self._lock:
            self._items[rid], self._bytes[rid] = stored, size
            while self._items and (len(self._items) > self.size or sum(self._bytes.values()) > self.max_bytes):
                old, _ = self._items.popitem(last=False)
                del self._bytes[old]

    def get(self, rid: str) -> Optional[Stored]:
        with self._lock:
            item = self._items.get(rid)
            if item is not None:
                self._items.move_to_end(rid)
            return item

    def delete(self, rid: str) -> bool:
        with self._lock:
            self._bytes.pop(rid, None)
            return self._items.pop(rid, None) is not None
