"""Issue 50's fail-fast checks before GPU time goes to the tests and the bench (tools/gpu_check.sh runs it;
``--device cpu`` runs the same checks here, less what only a GPU has). One JSON line per check.

    python tools/gpu_smoke.py [--device cuda] [--part core|features]

core: random:small in bf16 and float32 with the host tier -- a prompt, the same again (a device hit), another
pushing the first to host memory, the first again (a host hit, loaded on the copy stream); the model and the
pool on the device, the host pool pinned, the copy staged, float32 hits token-equal.
features: what greedy decoding does not reach -- a seeded sampled request (its CPU generator, the draw on the
device) with penalties and a logit bias, a grammar, a host hit through the page_first layout (equal to
layer_first), two engines in one process without a token budget (the second's pool as large as the first's),
and the resident memory a 1 GiB host pool takes (pinned by registration: its size, not a power of two).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hicache import Engine, SamplingParams
from hicache.device import resident_bytes
from hicache.runtime.sampling import GrammarSpec

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
FIRST = [(7 * i) % 300 + 10 for i in range(297)]  # random:small's vocabulary holds 320 ids
OTHER = [(11 * i + 3) % 300 + 10 for i in range(297)]


def say(check: str, **figures) -> None:
    print(json.dumps({"check": check, **figures}), flush=True)


def host_hit(device: str, dtype: str, **options) -> tuple[list[list[int]], dict, Engine]:
    """Outputs of FIRST, FIRST again, OTHER, FIRST again (from host memory); the engine still open."""
    e = Engine("random:small", device=device, dtype=dtype, max_total_tokens=512, enable_hierarchical_cache=True,
               hicache_ratio=4.0, **options)
    outs = [e.generate([p], GREEDY)[0] for p in (FIRST, FIRST, OTHER, FIRST)]
    return [r.output_ids for r in outs], outs[3].cached_tokens_details, e


def core(device: str) -> None:
    gpu = device.startswith("cuda")
    for dtype in ("bfloat16", "float32"):
        t0 = time.perf_counter()
        outs, hit, e = host_hit(device, dtype)
        try:
            host = e.cache.host
            assert next(e.loaded.model.parameters()).device.type == torch.device(device).type
            assert e.cache.pool.k_buffers[0].device.type == torch.device(device).type
            assert hit["host"] > 0, hit
            if gpu:
                assert host.host_pool.pinned and host.host_pool.buffer.is_pinned(), "the host pool is not pinned"
                assert host.controller.staging_bytes > 0, "no copy went through the staging buffers"
            if dtype == "float32":
                assert outs[0] == outs[1] == outs[3], outs
            say("core", dtype=dtype, seconds=round(time.perf_counter() - t0, 2), host_hit=hit,
                same_tokens=outs[0] == outs[1] == outs[3], staging_bytes=host.controller.staging_bytes,
                transfers=e.stats()["transfers"])
        finally:
            e.shutdown()


def features(device: str) -> None:
    e = Engine("random:small", device=device, dtype="bfloat16", max_total_tokens=4096)
    try:
        sampled = SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=7, frequency_penalty=0.5,
                                 presence_penalty=0.3, repetition_penalty=1.1, logit_bias={65: 2.0}, min_tokens=2)
        a, b = (e.generate([FIRST[:40]], sampled)[0].output_ids for _ in range(2))
        assert a == b, (a, b)  # one seed, one stream
        say("seeded sampling with penalties", tokens=a)
        grammar = SamplingParams(max_new_tokens=6, temperature=0.0, grammar=GrammarSpec("regex", "[ab]+"))
        text = e.generate([FIRST[:40]], grammar)[0].text
        assert text and set(text) <= {"a", "b"}, text
        say("grammar", text=text)
    finally:
        e.shutdown()
    layer_first, _, e1 = host_hit(device, "float32")
    e1.shutdown()
    page_first, hit, e2 = host_hit(device, "float32", hicache_mem_layout="page_first")
    e2.shutdown()
    assert page_first == layer_first and hit["host"] > 0, (page_first, layer_first, hit)
    say("page_first host hit", host_hit=hit)
    budgets = []
    for _ in range(2):
        e = Engine("random:small", device=device, dtype="bfloat16")
        budgets.append(e.cache.usage()["capacity_pages"])
        e.shutdown()
    assert budgets[1] >= 0.9 * budgets[0], budgets  # memory the first engine held is handed back
    say("two engines without a budget", capacity_pages=budgets)
    resident_growth(device)


def resident_growth(device: str) -> None:
    from hicache.cache.host_pool import HostKVPool
    from hicache.cache.pools import DeviceKVPool

    pool = DeviceKVPool(8, 8, 128, 2, 16, torch.bfloat16, device)  # 512 KiB a page of 8 layers
    before = resident_bytes()
    host = HostKVPool(pool, 2049, "layer_first")  # 1 GiB
    grown = resident_bytes() - before
    say("host pool of 1 GiB", resident_growth_mib=round(grown / 2**20), pinned=host.pinned)
    assert not host.pinned or grown < 1.5 * 2**30, grown


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--part", choices=("core", "features"), default="core")
    args = ap.parse_args()
    core(args.device) if args.part == "core" else features(args.device)


if __name__ == "__main__":
    main()
