"""A thread with a stack of a chosen size that runs submitted calls in order (the grammar
mode's builder and mask threads: llguidance recurses as deep as a grammar nests)."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional

_STACK_LOCK = threading.Lock()  # threading.stack_size is process-wide: set, start, restore


class StackedWorker:
    """One daemon thread with a stack of ``stack_bytes`` that runs submitted calls in order; it
    starts at the first call (an engine that never submits one has no thread)."""

    def __init__(self, name: str, stack_bytes: int) -> None:
        self.name, self.stack_bytes = name, stack_bytes
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self._thread is None:
            with _STACK_LOCK:
                before = threading.stack_size(self.stack_bytes)
                try:
                    self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                    self._thread.start()
                finally:
                    threading.stack_size(before)
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # the caller's future carries it
                future.set_exception(e)

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=10)
