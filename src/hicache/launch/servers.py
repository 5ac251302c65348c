"""Start ``hicache serve`` processes behind SGLang's own router (``sglang-router``, PyPI) on this
machine: a P/D pair in PD mode (tests, ``benchmarks/bench_pd.py``, the demo) or N data-parallel
engines under a routing policy (``benchmarks/bench_replay.py``). Everything listens on 127.0.0.1
and stops when the context exits.

    with pd_servers("--model smollm2", decode_args="--disaggregation-decode-enable-radix-cache") as pd:
        httpx.post(f"{pd.url}/v1/chat/completions", json=...)
    with dp_servers("--model smollm2", engines=2, policy="cache_aware") as dp:
        ...  # dp.url: the router; dp.worker_urls: each engine
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Iterator

from ..errors import HicacheError
from ..ports import free_port
from ..bench.main import start_server, wait_ready, wait_server
from ..processes import stop_process


@dataclass
class PDServers:
    url: str  # the router: where clients send requests
    prefill_url: str
    decode_url: str
    bootstrap_port: int


@dataclass
class DPServers:
    url: str  # the router
    worker_urls: list[str]


def launch_router(mode_args: list[str], workers: int, timeout: float = 60.0,
                  log=subprocess.DEVNULL) -> tuple[subprocess.Popen, str]:
    """``sglang-router launch <mode_args>`` on a free port; returns once it lists ``workers``
    healthy workers."""
    import httpx

    here = os.path.join(os.path.dirname(sys.executable), "sglang-router")  # next to this Python's, or on PATH
    binary = here if os.access(here, os.X_OK) else shutil.which("sglang-router")
    if binary is None:
        raise HicacheError("sglang-router is not installed: pip install sglang-router (the test extra has it).")
    port = free_port()
    proc = subprocess.Popen([binary, "launch", *mode_args, "--host", "127.0.0.1", "--port", str(port),
                             # its own metrics listener: a fixed default port would clash between routers
                             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        listed = httpx.get(f"{url}/workers", timeout=2).json().get("workers", [])
        return sum(bool(w.get("is_healthy")) for w in listed) >= workers

    wait_ready(proc, "sglang-router", ready, timeout, 0.2)
    return proc, url


@contextlib.contextmanager
def _servers(args: list[str], timeout: float) -> Iterator[tuple[list[subprocess.Popen], list[str]]]:
    """``hicache serve`` with each of ``args``, started together (their start-ups -- imports, model
    loads: one core each -- overlap), then each waited for; yields (processes, URLs), a list a
    router may join; on exit all are stopped (SIGTERM at once, then killed each after 15 s)."""
    procs: list[subprocess.Popen] = []
    try:
        urls = []
        for a in args:
            proc, url = start_server(a)
            procs.append(proc)
            urls.append(url)
        for proc, url in zip(procs, urls):
            wait_server(proc, url, timeout)
        yield procs, urls
    finally:
        for proc in reversed(procs):
            proc.terminate()  # all at once, then wait for each
        for proc in reversed(procs):
            stop_process(proc, 15)


@contextlib.contextmanager
def pd_servers(common_args: str, prefill_args: str = "", decode_args: str = "",
               timeout: float = 120.0) -> Iterator[PDServers]:
    """A prefill server, a decode server (both ``hicache serve`` with ``common_args``) and the
    router; stopped (SIGTERM, then killed) on exit."""
    bootstrap = free_port()
    with _servers([f"{common_args} --disaggregation-mode prefill --disaggregation-bootstrap-port {bootstrap} "
                   f"{prefill_args}", f"{common_args} --disaggregation-mode decode {decode_args}"],
                  timeout) as (procs, (prefill_url, decode_url)):
        router, url = launch_router(["--pd-disaggregation", "--prefill", prefill_url, str(bootstrap),
                                     "--decode", decode_url], 2, timeout)
        procs.append(router)
        yield PDServers(url, prefill_url, decode_url, bootstrap)


@contextlib.contextmanager
def dp_servers(server_args: str, engines: int, policy: str, timeout: float = 120.0) -> Iterator[DPServers]:
    """``engines`` ``hicache serve`` processes (each with ``server_args``) behind the router with
    ``--policy`` ``policy`` (``round_robin``, ``cache_aware``, ...); stopped on exit."""
    with _servers([server_args] * engines, timeout) as (procs, urls):
        router, url = launch_router(["--worker-urls", *urls, "--policy", policy], engines, timeout)
        procs.append(router)
        yield DPServers(url, urls)
