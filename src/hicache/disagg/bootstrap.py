"""Where a request's other half runs in prefill/decode disaggregation."""

from __future__ import annotations

from dataclasses import dataclass


def endpoint(host: str, port: int) -> str:
    """A ZeroMQ TCP endpoint (IPv6 hosts in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


@dataclass(frozen=True)
class Bootstrap:
    """Where a request's other half is: the prefill server's bootstrap address and the room
    (a number both servers received from the router for this request)."""

    host: str
    port: int
    room: int

    @property
    def address(self) -> str:
        return endpoint(self.host, self.port)
