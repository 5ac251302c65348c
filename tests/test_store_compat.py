"""Storage objects written by an older checkout are still read, never misread (issue 58's must-hold).

``tests/data/stores`` holds file stores written by ``tools/make_store_fixture.py`` at the commit each
case's JSON names (before the KV-component redesign), with every prompt of the session and its cold
greedy output. A fresh engine of this checkout over a copy of each store must get storage hits for
the session's prompts and answer each exactly as the cold engine did: a changed object layout or key
either misses (no hits: refused by key) or is caught here (outputs differ: misread).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hicache import Engine
from hicache.runtime.sampling import SamplingParams

pytestmark = [pytest.mark.storage, pytest.mark.slow]

STORES = Path(__file__).parent / "data" / "stores"
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
EXACT = dict(dtype="float32", kv_cache_dtype="float32", page_size=4, chunked_prefill_size=16)


@pytest.mark.parametrize("case", sorted(p.stem for p in STORES.glob("*.json")))
def test_a_store_written_before_is_read_and_answers_as_cold(case: str, tmp_path: Path) -> None:
    record = json.loads((STORES / f"{case}.json").read_text())
    store = tmp_path / "store"
    shutil.copytree(STORES / case, store)  # the engine writes backups of its own: keep the fixture as it is
    engine = Engine(record["model"], **EXACT, **record["options"], max_total_tokens=96,
                    enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_storage_backend="file",
                    hicache_storage_backend_extra_config=json.dumps({"path": str(store)}),
                    hicache_storage_prefetch_threshold=4, hicache_storage_prefetch_policy="wait_complete")
    try:
        outputs = [engine.generate([p], GREEDY)[0].output_ids for p in record["prompts"]]
        hits = engine.stats()["hit_tokens"]
    finally:
        engine.shutdown()
    assert hits["storage"] > 0, f"nothing read from the store written by {record['written_by'][:12]}: {hits}"
    assert outputs == record["outputs"]
