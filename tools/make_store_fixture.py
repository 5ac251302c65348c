"""Write the storage fixture `tests/test_store_compat.py` reads: file stores written by one checkout,
which every later checkout must still read (issue 58: "storage objects written before this change
are still read, or refused by key, never misread").

Each case runs a few greedy multi-turn conversations through a small device pool, a host tier and
a file store, then records every prompt and its cold output (an engine without prefix reuse).
Only the public Engine API is used, so it runs against an older checkout:

    PYTHONPATH=/path/to/old/src .venv/bin/python tools/make_store_fixture.py tests/data/stores

The cases are tiny random models in fp32 (exact comparisons): a full-attention model and a
hybrid (sliding-window) one, on the default key scheme and on the unified grid.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from hicache import Engine
from hicache.runtime.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
EXACT = dict(dtype="float32", kv_cache_dtype="float32", page_size=4, chunked_prefill_size=16)
CASES = {
    "tiny-rank-suffix": ("random:tiny", {}),
    "gemma-small-rank-suffix": ("random:gemma-small", {}),
    "tiny-unified": ("random:tiny", {"hicache_storage_key_scheme": "unified"}),
    "gemma-small-unified": ("random:gemma-small", {"hicache_storage_key_scheme": "unified"}),
}
HEAD = [(7 * i + 3) % 200 + 20 for i in range(29)]  # a shared head, several windows long


def store_options(path: Path, **more) -> dict:
    """A device pool too small for the session over a host tier over a file store at ``path``."""
    return dict(EXACT, max_total_tokens=96, enable_hierarchical_cache=True, hicache_ratio=1.0,
                hicache_storage_backend="file", hicache_storage_backend_extra_config=json.dumps({"path": str(path)}),
                hicache_storage_prefetch_threshold=4, **more)


def prompts_of(engine: Engine, agents: int = 2, turns: int = 2) -> list[list[int]]:
    """Each conversation's prompts, turn by turn, answered greedily by ``engine`` (which fills the store)."""
    histories = [HEAD + [(11 * a + i) % 200 + 20 for i in range(5 + 3 * a)] for a in range(agents)]
    asked = []
    for turn in range(turns):
        for a in range(agents):
            asked.append(histories[a])
            out = engine.generate([histories[a]], GREEDY)[0].output_ids
            histories[a] = histories[a] + out + [(13 * turn + a + i) % 200 + 20 for i in range(3)]
    return asked + histories  # the last prompts: what a next session would ask


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__import__("hicache").__file__).parent).stdout.strip()
    for name, (model, options) in CASES.items():
        store = out / name
        shutil.rmtree(store, ignore_errors=True)
        engine = Engine(model, **store_options(store, **options))
        try:
            prompts = prompts_of(engine)
        finally:
            engine.shutdown()
        cold = Engine(model, disable_radix_cache=True, **EXACT)
        try:
            outputs = [cold.generate([p], GREEDY)[0].output_ids for p in prompts]
        finally:
            cold.shutdown()
        record = {"model": model, "options": options, "written_by": commit, "prompts": prompts, "outputs": outputs}
        (out / f"{name}.json").write_text(json.dumps(record) + "\n")
        size = sum(f.stat().st_size for f in store.rglob("*") if f.is_file())
        print(f"{name}: {len(prompts)} prompts, store {size / 1024:.0f} KiB, written by {commit[:12]}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "tests/data/stores"))
