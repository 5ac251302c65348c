"""Free local ports, for servers and rank groups started on this machine."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (another process may take it before the caller binds)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
