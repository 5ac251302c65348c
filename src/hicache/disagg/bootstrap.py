"""Where a request's other half runs in prefill/decode disaggregation."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bootstrap:
    """Where a request's other half is: the prefill server's bootstrap address and the room
    (a number both servers received from the router for this request)."""

    host: str
    port: int
    room: int

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"
