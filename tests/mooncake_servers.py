"""Locate and run a throw-away Mooncake Store (the tests' ``mooncake_store`` fixture): a
``mooncake_master`` and, to hold the objects, a ``mooncake_client`` store service.

Objects live in memory segments that clients contribute; a segment (and every object in it)
goes away with the process that contributed it. Engines come and go (a test writes in one
process and reads in another), so the memory comes from a store service: ``mooncake_client``,
a standalone Mooncake client process that mounts ``segment_bytes`` of its own memory into the
pool and does nothing else. Engines then connect with ``global_segment_size=0``.

Where a binary comes from, first match wins (``name`` is ``mooncake_master`` or
``mooncake_client``):
  1. ``$HICACHE_MOONCAKE_MASTER`` / ``$HICACHE_MOONCAKE_CLIENT`` (a path);
  2. next to the running Python (a venv's ``bin/``, where the wheel installs its launchers);
  3. inside the installed ``mooncake`` package (the wheel's own copies);
  4. ``PATH``.

Everything runs on 127.0.0.1 on free ports (the master's RPC port and its admin/metrics
port), logs to a file in a temp dir, and is stopped (SIGTERM, then SIGKILL) on exit. Peers
exchange transfer metadata directly (``P2PHANDSHAKE``): the master's HTTP metadata server
listens on 0.0.0.0 whatever ``-http_metadata_server_host`` says (Mooncake 0.3.13), so it stays
off. The transfer engine inside every Mooncake client (the store service, each engine's
backend) still listens on every address, for its handshake and data ports: Mooncake has no
option to bind them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

from local_server import LocalServer, find_binary, package_dir, start_local

from hicache.cache.storage.mooncake_backend import reachable


def find_mooncake_binary(name: str = "mooncake_master") -> str | None:
    """Path of a runnable ``name`` binary, or None (see the module docstring for the order; the
    variable is ``$HICACHE_<NAME>``)."""
    pkg = package_dir("mooncake")
    candidates = [Path(sys.executable).parent / name, *([pkg / name] if pkg else [])]
    return find_binary(f"HICACHE_{name.upper()}", candidates, name)


@dataclass
class MooncakeMaster(LocalServer):
    """A master on 127.0.0.1 (``port``: its RPC port); its clients exchange transfer metadata peer to peer."""

    metadata_server: str = "P2PHANDSHAKE"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def backend_config(self, **overrides) -> dict:
        """The ``MooncakeBackend`` options (extra-config JSON) of a client of this store that
        contributes no memory of its own."""
        return {"master_server_address": self.address, "metadata_server": self.metadata_server,
                "local_hostname": self.host, "protocol": "tcp", "global_segment_size": 0, **overrides}


@dataclass
class MooncakeStoreService(LocalServer):
    """A ``mooncake_client`` holding ``segment_bytes`` of the pool."""

    segment_bytes: int = 0


def _start(name: str, args: list[str], where: str, make: Callable[..., LocalServer], binary: str | None,
           start_timeout_s: float, attempts: int):
    """Start ``name`` (``binary``, else :func:`find_mooncake_binary`'s) with ``args`` on a free port
    and wait until it listens (see :func:`local_server.start_local`)."""
    binary = binary or find_mooncake_binary(name)
    if binary is None:
        raise FileNotFoundError(f"no {name} found: pip install mooncake-transfer-engine-non-cuda, put {name} on "
                                f"PATH, or set HICACHE_{name.upper()}")
    flag = "-rpc_port" if name == "mooncake_master" else "-port"
    return start_local(f"{name} did not start {where}",
                       lambda port, _: [binary, f"{flag}={port}", *args, "-logtostderr"], make,
                       lambda port: reachable("127.0.0.1", port, 0.2), f"hicache-{name.replace('_', '-')}-",
                       start_timeout_s, attempts)


def start_mooncake_master(binary: str | None = None, start_timeout_s: float = 15.0,
                          attempts: int = 3) -> MooncakeMaster:
    """Start a master on a free port of 127.0.0.1 and wait until it accepts connections.
    FileNotFoundError without a binary, RuntimeError when it does not come up (retried on new
    ports ``attempts`` times)."""
    return _start("mooncake_master", [
        "-rpc_address=127.0.0.1", "-enable_http_metadata_server=false",
        "-metrics_host=127.0.0.1", "-metrics_port=0", "-enable_metric_reporting=false",
    ], "on 127.0.0.1", MooncakeMaster, binary, start_timeout_s, attempts)  # fmt: skip


def start_store_service(master: MooncakeMaster, segment_bytes: int = 256 << 20, binary: str | None = None,
                        start_timeout_s: float = 15.0, attempts: int = 3) -> MooncakeStoreService:
    """Start a ``mooncake_client`` that mounts ``segment_bytes`` into ``master``'s pool and
    wait until it serves (it listens once its segment is mounted)."""
    return _start("mooncake_client", [
        "-host=127.0.0.1", f"-global_segment_size={int(segment_bytes)}",
        f"-master_server_address={master.address}", f"-metadata_server={master.metadata_server}",
        "-protocol=tcp",
    ], f"against {master.address}", partial(MooncakeStoreService, segment_bytes=int(segment_bytes)), binary,
        start_timeout_s, attempts)  # fmt: skip
