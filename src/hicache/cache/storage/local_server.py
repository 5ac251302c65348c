"""A throw-away server process on 127.0.0.1 (tests and benchmarks; not the engine), as
:mod:`.valkey_server` and ``tests/mooncake_servers.py`` start theirs: on a free port, its output in
a log file of a temp dir (a file, not a pipe: an unread pipe could fill and stall it), retried on a
new port when it does not come up (a free port can be taken meanwhile), stopped (SIGTERM, then
SIGKILL) on exit."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, TypeVar

from ...ports import free_port
from ...processes import stop_process

LOG_NAME = "out.log"


def package_dir(name: str) -> Path | None:
    """The folder of the installed package ``name``, found without importing it (None: not installed)."""
    spec = importlib.util.find_spec(name)
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


def find_binary(env: str, candidates: Iterable[Path], *names: str) -> str | None:
    """A server binary: ``$env`` when set (None unless it is executable), else the first executable
    file of ``candidates``, else the first of ``names`` on ``PATH``."""
    path = os.environ.get(env)
    if path:
        return path if os.access(path, os.X_OK) else None
    found = next((p for p in candidates if p.is_file() and os.access(p, os.X_OK)), None)
    return str(found) if found is not None else next(filter(None, map(shutil.which, names)), None)


@dataclass
class LocalServer(contextlib.AbstractContextManager):
    """A started process with its log, listening on ``host:port``; ``stop()`` (or leaving the ``with``
    block) ends it."""

    proc: subprocess.Popen
    workdir: tempfile.TemporaryDirectory = field(repr=False)
    port: int = 0
    host: str = "127.0.0.1"

    def log_tail(self, chars: int = 400) -> str:
        try:
            return (Path(self.workdir.name) / LOG_NAME).read_text(errors="replace").strip()[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        stop_process(self.proc)
        self.workdir.cleanup()

    def __exit__(self, *exc: object) -> None:
        self.stop()


S = TypeVar("S", bound=LocalServer)


def start_local(what: str, args: Callable[[int, str], list[str]], make: Callable[..., S],
                ready: Callable[[int], bool], prefix: str, start_timeout_s: float, attempts: int) -> S:
    """``make(proc, workdir, port)`` of the process ``args(port, workdir)`` runs, once ``ready(port)``;
    RuntimeError ``"{what}: {log tail}"`` when it does not come up in ``attempts`` tries."""
    last = ""
    for _ in range(attempts):
        port = free_port()
        workdir = tempfile.TemporaryDirectory(prefix=prefix)
        with open(Path(workdir.name) / LOG_NAME, "wb") as out:
            proc = subprocess.Popen(args(port, workdir.name), stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                    cwd=workdir.name)
        server = make(proc, workdir, port)
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            if ready(port):
                return server
            time.sleep(0.02)
        last = server.log_tail()
        server.stop()
    raise RuntimeError(f"{what}: {last}")
