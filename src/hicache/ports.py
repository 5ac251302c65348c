"""Free local ports, for servers and rank groups started on this machine, and ``host:port``
addresses."""

from __future__ import annotations

import socket
from typing import Optional


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (another process may take it before the caller binds)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def split_host_port(addr: Optional[str]) -> Optional[tuple[str, int]]:
    """``("host", port)`` from ``"host:port"`` (``"[::1]:port"`` for IPv6), or None if malformed."""
    if not addr or ":" not in addr:
        return None
    host, _, port = addr.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)
