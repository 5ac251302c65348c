"""Start a P/D pair on this machine: a prefill and a decode ``hicache serve`` plus SGLang's own
router (``sglang-router``, PyPI) in PD mode in front of them, for tests, ``benchmarks/bench_pd.py``
and the demo. Everything listens on 127.0.0.1 and stops when the context exits.

    with pd_servers("--model smollm2", decode_args="--disaggregation-decode-enable-radix-cache") as pd:
        httpx.post(f"{pd.url}/v1/chat/completions", json=...)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Iterator

from ..errors import HicacheError
from ..ports import free_port
from ..processes import stop_process


def find_sglang_router() -> str | None:
    """The ``sglang-router`` executable: next to this Python's, or on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "sglang-router")
    return here if os.access(here, os.X_OK) else shutil.which("sglang-router")


@dataclass
class PDServers:
    url: str  # the router: where clients send requests
    prefill_url: str
    decode_url: str
    bootstrap_port: int


def launch_router(prefill_url: str, bootstrap_port: int, decode_url: str, timeout: float = 60.0,
                  log=subprocess.DEVNULL) -> tuple[subprocess.Popen, str]:
    """``sglang-router launch --pd-disaggregation`` on a free port; returns once it lists both
    workers as healthy."""
    import httpx

    binary = find_sglang_router()
    if binary is None:
        raise HicacheError("sglang-router is not installed: pip install sglang-router (the test extra has it).")
    port = free_port()
    proc = subprocess.Popen([binary, "launch", "--pd-disaggregation", "--prefill", prefill_url, str(bootstrap_port),
                             "--decode", decode_url, "--host", "127.0.0.1", "--port", str(port),
                             # its own metrics listener: a fixed default port would clash between routers
                             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise HicacheError(f"sglang-router exited with status {proc.returncode} before it was ready.")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            workers = httpx.get(f"{url}/workers", timeout=2).json().get("workers", [])
            if sum(bool(w.get("is_healthy")) for w in workers) >= 2:
                return proc, url
        time.sleep(0.2)
    proc.terminate()
    raise HicacheError(f"sglang-router was not ready within {timeout:.0f} s.")


@contextlib.contextmanager
def pd_servers(common_args: str, prefill_args: str = "", decode_args: str = "",
               timeout: float = 120.0) -> Iterator[PDServers]:
    """A prefill server, a decode server (both ``hicache serve`` with ``common_args``) and the
    router; stopped (SIGTERM, then killed) on exit."""
    from ..bench.main import launch_server

    bootstrap = free_port()
    procs: list[subprocess.Popen] = []
    try:
        prefill, prefill_url = launch_server(f"{common_args} --disaggregation-mode prefill "
                                             f"--disaggregation-bootstrap-port {bootstrap} {prefill_args}", timeout)
        procs.append(prefill)
        decode, decode_url = launch_server(f"{common_args} --disaggregation-mode decode {decode_args}", timeout)
        procs.append(decode)
        router, url = launch_router(prefill_url, bootstrap, decode_url, timeout)
        procs.append(router)
        yield PDServers(url, prefill_url, decode_url, bootstrap)
    finally:
        for proc in reversed(procs):
            proc.terminate()  # all at once, then wait for each
        for proc in reversed(procs):
            stop_process(proc, 15)
