"""L3 storage tier end to end: restart, corruption, faults, namespaces, prefetch policies,
and the Valkey backend against a real server. Greedy output never changes (DESIGN inv. 1, 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hicache import Engine, SamplingParams
from hicache.cache.storage import controller as storage_controller
from hicache.cache.storage.faulty import FaultyBackend
from hicache.cache.storage.keys import page_hashes

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
SRC = str(Path(__file__).resolve().parents[1] / "src")
PROMPT = [(i * 37 + 11) % 240 + 5 for i in range(400)]


def storage_engine(path: Path, **kw) -> Engine:
    opts = dict(dtype="float32", page_size=16, max_total_tokens=2048, enable_hierarchical_cache=True,
                hicache_storage_backend="file",
                hicache_storage_backend_extra_config=json.dumps({"path": str(path)}),
                hicache_storage_prefetch_threshold=64, hicache_storage_prefetch_policy="wait_complete")
    opts.update(kw)
    return Engine(opts.pop("model", "random:tiny"), **opts)


@pytest.fixture(scope="module")
def reference() -> list[int]:
    plain = Engine("random:tiny", dtype="float32", max_total_tokens=2048, disable_radix_cache=True)
    return plain.generate([PROMPT], GREEDY)[0].output_ids


def write_history(path: Path) -> None:
    """One engine computes PROMPT and, on shutdown, has flushed its pages down to storage."""
    engine = storage_engine(path)
    engine.generate([PROMPT], GREEDY)
    engine.shutdown()


def test_new_process_serves_stored_history(tmp_path: Path, reference: list[int]) -> None:
    write_history(tmp_path)
    code = f"""
import json
from hicache import Engine, SamplingParams
e = Engine("random:tiny", dtype="float32", page_size=16, max_total_tokens=2048, enable_hierarchical_cache=True,
           hicache_storage_backend="file", hicache_storage_backend_extra_config=json.dumps({{"path": {str(tmp_path)!r}}}),
           hicache_storage_prefetch_threshold=64, hicache_storage_prefetch_policy="wait_complete")
r = e.generate([{PROMPT!r}], SamplingParams(max_new_tokens=8, temperature=0.0))[0]
print(json.dumps({{"ids": r.output_ids, "details": r.cached_tokens_details}}))
e.shutdown()
"""
    env = dict(os.environ, PYTHONPATH=SRC)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["details"]["storage"] == 384  # 24 whole pages before the last prompt token
    assert got["ids"] == reference


def computed_tokens(engine: Engine) -> list[int]:
    """Record how many new tokens each forward computes (a hit must skip its tokens)."""
    counts: list[int] = []
    forward = engine.scheduler.forward

    def spy(ids, *rest):
        counts.append(sum(len(x) for x in ids))
        return forward(ids, *rest)

    engine.scheduler.forward = spy
    return counts


def test_storage_hit_skips_compute(tmp_path: Path, reference: list[int]) -> None:
    write_history(tmp_path)
    engine = storage_engine(tmp_path)
    counts = computed_tokens(engine)
    res = engine.generate([PROMPT], GREEDY)[0]
    assert res.output_ids == reference and res.cached_tokens_details["storage"] == 384
    assert counts[0] == len(PROMPT) - 384  # the prefill computed only the uncached tail
    engine.shutdown()


def _object_files(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")]


def test_corrupt_object_is_detected_and_recomputed(tmp_path: Path, reference: list[int]) -> None:
    write_history(tmp_path)
    engine = storage_engine(tmp_path)
    # The key chain for PROMPT, as the engine computes it.
    keys = [h.hex() for h in page_hashes(np.asarray(PROMPT[:384], dtype=np.int32), 16,
                                         engine.cache.ns_digest(engine.model_namespace))]
    files = {p.name.split(".")[0]: p for p in _object_files(tmp_path)}
    victim = files[keys[10]]
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF
    victim.write_bytes(bytes(data))
    res = engine.generate([PROMPT], GREEDY)[0]
    assert res.output_ids == reference
    assert res.cached_tokens_details["storage"] == 160  # the 10 good pages before the corrupt one
    assert engine.stats()["storage"]["failures"] == {"checksum": 1}
    engine.shutdown()


def test_hanging_backend_ends_with_timeout_policy(tmp_path: Path, reference: list[int]) -> None:
    write_history(tmp_path)
    engine = storage_engine(tmp_path, hicache_storage_prefetch_policy="timeout",
                            hicache_storage_prefetch_timeout_base=0.2, hicache_storage_prefetch_timeout_per_1k_tokens=0.0)
    engine.cache.storage.backend = FaultyBackend(engine.cache.storage.backend, hang_s=3.0)
    t = time.perf_counter()
    res = engine.generate([PROMPT], GREEDY)[0]
    assert time.perf_counter() - t < 2.5
    assert res.output_ids == reference and res.cached_tokens_details["storage"] == 0
    engine.shutdown()


def test_erroring_backend_degrades_to_recompute(tmp_path: Path, reference: list[int]) -> None:
    write_history(tmp_path)
    engine = storage_engine(tmp_path)
    engine.cache.storage.backend = FaultyBackend(engine.cache.storage.backend, fail_get=True)
    res = engine.generate([PROMPT], GREEDY)[0]
    assert res.output_ids == reference and res.cached_tokens_details["storage"] == 0
    assert engine.stats()["storage"]["failures"].get("backend_error", 0) >= 1
    engine.shutdown()


def test_backend_down_at_start_warns_and_serves(caplog, reference: list[int]) -> None:
    engine = Engine("random:tiny", dtype="float32", max_total_tokens=2048, enable_hierarchical_cache=True,
                    hicache_storage_backend="valkey",
                    hicache_storage_backend_extra_config=json.dumps({"host": "127.0.0.1", "port": 1}))
    assert engine.generate([PROMPT], GREEDY)[0].output_ids == reference
    assert "storage" in caplog.text.lower()
    engine.shutdown()


def test_namespaces_do_not_share_storage(tmp_path: Path) -> None:
    write_history(tmp_path)
    salted = storage_engine(tmp_path)
    assert salted.generate([PROMPT], GREEDY, cache_salt="other-tenant")[0].cached_tokens == 0
    salted.shutdown()
    other_model = storage_engine(tmp_path, random_seed=1)
    assert other_model.generate([PROMPT], GREEDY)[0].cached_tokens == 0
    other_model.shutdown()


@pytest.mark.parametrize("policy, expect", [("best_effort", "none"), ("wait_complete", "all"), ("timeout", "some")])
def test_prefetch_policies_on_a_slow_backend(tmp_path: Path, reference: list[int], policy: str, expect: str) -> None:
    write_history(tmp_path)
    engine = storage_engine(tmp_path, hicache_storage_prefetch_policy=policy,
                            hicache_storage_prefetch_timeout_base=0.35, hicache_storage_prefetch_timeout_per_1k_tokens=0.0)
    engine.cache.storage.read_delay_fn = lambda op: 0.25  # before each batch
    old_batch, storage_controller.BATCH_PAGES = storage_controller.BATCH_PAGES, 8  # 24 pages: 3 slow batches
    try:
        res = engine.generate([PROMPT], GREEDY)[0]
    finally:
        storage_controller.BATCH_PAGES = old_batch
    got = res.cached_tokens_details["storage"]
    assert res.output_ids == reference
    if expect == "none":
        assert got == 0
    elif expect == "all":
        assert got == 384
    else:
        assert 0 < got < 384
    engine.shutdown()


def test_valkey_backend_end_to_end(valkey_server, reference: list[int]) -> None:
    host, port = valkey_server
    extra = json.dumps({"host": host, "port": port})
    opts = dict(dtype="float32", page_size=16, max_total_tokens=2048, enable_hierarchical_cache=True,
                hicache_storage_backend="valkey", hicache_storage_backend_extra_config=extra,
                hicache_storage_prefetch_threshold=64, hicache_storage_prefetch_policy="wait_complete")
    writer = Engine("random:tiny", **opts)
    writer.generate([PROMPT], GREEDY)
    writer.shutdown()
    reader = Engine("random:tiny", **opts)
    res = reader.generate([PROMPT], GREEDY)[0]
    assert res.output_ids == reference and res.cached_tokens_details["storage"] == 384
    reader.shutdown()
