"""A thread with a stack of a chosen size that runs submitted calls in order (the grammar
mode's builder and mask threads: llguidance recurses as deep as a grammar nests)."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

_STACK_LOCK = threading.Lock()  # threading.stack_size is process-wide: set, start, restore


class StackedWorker:
    """One daemon thread with a stack of ``stack_bytes`` that runs submitted calls in order."""

    def __init__(self, name: str, stack_bytes: int) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        with _STACK_LOCK:
            before = threading.stack_size(stack_bytes)
            try:
                self._thread = threading.Thread(target=self._run, name=name, daemon=True)
                self._thread.start()
            finally:
                threading.stack_size(before)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
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
        self._jobs.put(None)
        self._thread.join(timeout=10)
