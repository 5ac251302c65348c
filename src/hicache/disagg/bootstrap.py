"""Where a request's other half runs in prefill/decode disaggregation."""

from __future__ import annotations

from dataclasses import dataclass

from .wire import MAX_ROOM, WireError, host


def endpoint(host: str, port: int) -> str:
    """A ZeroMQ TCP endpoint (IPv6 hosts in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


@dataclass(frozen=True)
class Bootstrap:
    """Where a request's other half is: the prefill server's bootstrap address and the room
    (a number both servers received from the router for this request). Checked when built:
    a host name or IP address, a port in [1, 65535], a room in [0, 2**63 - 1] (ValueError
    otherwise), so a request that could never connect fails at once, not at the timeout."""

    host: str
    port: int
    room: int

    def __post_init__(self) -> None:
        try:
            host(self.host, "bootstrap_host")
            if self.host in ("0.0.0.0", "::"):
                raise WireError("bootstrap_host must be an address to connect to, not a wildcard")
        except WireError as e:
            raise ValueError(f"{e} (got {self.host!r}).") from None
        if type(self.port) is not int or not 1 <= self.port <= 65535:
            raise ValueError(f"bootstrap_port must be in [1, 65535], got {self.port!r}.")
        if type(self.room) is not int or not 0 <= self.room <= MAX_ROOM:
            raise ValueError(f"bootstrap_room must be in [0, 2**63 - 1], got {self.room!r}.")

    @property
    def address(self) -> str:
        return endpoint(self.host, self.port)
