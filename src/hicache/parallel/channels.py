"""Queues between the frontend and the ranks, and how each side notices the other is gone.

A ``multiprocessing.Queue`` keeps both ends of its pipe in every process that holds it. So a
reader never sees end-of-file: when a writer dies in the middle of a message (SIGKILL, the OOM
killer) the reader waits forever for the rest. And a writer never sees a broken pipe: when the
reader dies, its feeder thread fills the pipe and blocks, and so does the writer's exit. Each
side therefore gives up the end it does not use: a reader's read then raises one of
:data:`WRITERS_GONE` once every writer has exited, and a writer's puts fail (and are dropped)
once the reader has.
"""

from __future__ import annotations

import queue
import time
from typing import Any, Iterator

WRITERS_GONE = (EOFError, OSError)  # a whole message was never coming: every writer has exited


def reader_only(*queues: Any) -> None:
    """Close this process's write end of ``queues`` (after the writers have started); ``put``
    on them is then an error here. ``None`` entries are skipped."""
    for q in queues:
        if q is not None:
            q._writer.close()  # CPython's Queue has no public way to give up one end


def writer_only(*queues: Any) -> None:
    """Close this process's read end of ``queues``; ``get`` on them is then an error here."""
    for q in queues:
        if q is not None:
            q._reader.close()


def queued_now(q: Any) -> Iterator[Any]:
    """The items ``q`` holds now, oldest first; stops at empty or once every writer is gone."""
    while True:
        try:
            yield q.get_nowait()
        except (queue.Empty, *WRITERS_GONE):
            return


def poll(q: Any, timeout: float) -> Any:
    """The next item of ``q`` within ``timeout`` seconds, or None; None after a pause of ``timeout``
    once every writer is gone (their exit codes then tell the rest)."""
    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        return None
    except WRITERS_GONE:
        time.sleep(timeout)
        return None


def kill_all(procs: list[Any]) -> None:
    """Kill the processes still running, then reap them (ranks ignore SIGINT and SIGTERM)."""
    for p in procs:
        if p.exitcode is None:
            p.kill()
    for p in procs:
        p.join(timeout=10)


def exit_text(proc: Any) -> str:
    """How a finished process ended, for a message: killed by which signal, or its code."""
    return f"was killed by signal {-proc.exitcode}" if proc.exitcode < 0 else f"exited with code {proc.exitcode}"
