"""Issue 50's figures on a GPU, side by side in one run (``--device cpu --quick`` checks the logic anywhere):

    python benchmarks/bench_gpu.py [--device cuda] [--quick] [--json OUT.jsonl]

1. **Copy bandwidth**: a page backup (device -> host) and a load-back (host -> device) through the host
   tier's transfer controller -- pinned host pages on a GPU, page-scattered (a shuffled page list), per
   layer, the staging gather included -- against one contiguous copy of the same bytes (the target: >= 0.8x).
2. **TTFT from L2 vs recompute** on a random model of Llama-3-8B's shape (32 layers, 8 KV heads of 128,
   hidden 4096; bf16, random init on the device: nothing downloaded) at 8K and 32K tokens, and the fraction
   of the load-back hidden behind compute: the same hit run layer-wise (layer i's forward waits only for
   layer i) and load-all-then-compute (the forward waits for the last layer first).
3. **Decode tokens/s** of SmolLM2 at batch 1 and 32.

Each result is printed and, with ``--json``, appended to that file as one JSON line as it is measured (a
cut run still reports).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from hicache import Engine, SamplingParams  # noqa: E402
from hicache.cache.host_pool import HostKVPool  # noqa: E402
from hicache.cache.host_transfer import BACKUP, LOAD, TransferController  # noqa: E402
from hicache.cache.pools import DeviceKVPool  # noqa: E402

LLAMA3_8B = {"num_layers": 32, "hidden_size": 4096, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
             "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 65536}


class Report:
    def __init__(self, path: str | None) -> None:
        self.path = path

    def __call__(self, part: str, **figures) -> None:
        print(f"{part}: " + ", ".join(f"{k} {v}" for k, v in figures.items()), flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({"part": part, **figures}) + "\n")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(report: Report, device: torch.device, pages: int, layers: int, page_size: int) -> None:
    """Backup and load-back of ``pages`` shuffled pages through the controller vs one contiguous copy."""
    pool = DeviceKVPool(layers, 8, 128, pages + 1, page_size, torch.bfloat16, device)
    host = HostKVPool(pool, pages + 1, "layer_first")
    ctrl = TransferController(pool, host)
    rng = np.random.default_rng(0)
    dev_pages, host_pages = rng.permutation(np.arange(1, pages + 1)), rng.permutation(np.arange(1, pages + 1))
    nbytes = pool.bytes_per_page * pages
    flat_dev = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    flat_host = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=device.type == "cuda")
    for kind in (BACKUP, LOAD):
        times, plain = [], []
        for _ in range(5):
            sync(device)
            t0 = time.perf_counter()
            op = ctrl.submit(kind, dev_pages, host_pages, [])
            op.done.wait()
            times.append(time.perf_counter() - t0)
            ctrl.pop(kind, 1)
            t0 = time.perf_counter()
            (flat_host.copy_(flat_dev, non_blocking=False) if kind == BACKUP else flat_dev.copy_(flat_host))
            sync(device)
            plain.append(time.perf_counter() - t0)
        ours, base = nbytes / statistics.median(times) / 1e9, nbytes / statistics.median(plain) / 1e9
        report(f"1. {kind}", pages=pages, page_tokens=page_size, layers=layers, mib=round(nbytes / 2**20),
               gb_per_s=round(ours, 2), contiguous_gb_per_s=round(base, 2), ratio=round(ours / base, 3))
    ctrl.shutdown()


def ttft_from_l2(report: Report, device: torch.device, model: str, contexts: list[int], dtype: str) -> None:
    """A prompt evicted to the host tier and hit again, layer-wise and load-all-then-compute, vs cold."""
    greedy = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    for n in contexts:
        # the device pool holds one prompt: a second one pushes the first to host memory
        engine = Engine(model, device=str(device), dtype=dtype, max_total_tokens=n + 256, enable_hierarchical_cache=True,
                        hicache_ratio=3.0, context_length=n + 64, chunked_prefill_size=min(n, 8192))
        vocab = engine.loaded.spec.vocab_size
        prompt = [(11 * i) % (vocab - 10) + 10 for i in range(n)]
        other = [(13 * i + 5) % (vocab - 10) + 10 for i in range(n)]
        cold = engine.generate([prompt], greedy, cache_salt="cold")[0].ttft_s
        results = {}
        for mode in ("layer-wise", "load-all"):
            engine.generate([prompt], greedy)
            engine.generate([other], greedy)  # evicts the prompt to L2
            runner = engine.backend.core.runner
            forward = runner.forward
            if mode == "load-all":  # wait for every layer's load before the forward
                last = len(runner.kv.k_buffers) - 1
                runner.forward = lambda *a, **k: (runner.kv.wait_layer(last), forward(*a, **k))[1]
            stats0 = engine.stats()["transfers"]
            hit = engine.generate([prompt], greedy)[0]
            engine.backend.core.cache.drain()  # the load's ack is consumed (and timed) at a later step otherwise
            stats1 = engine.stats()["transfers"]
            runner.forward = forward
            results[mode] = (hit.ttft_s, hit.cached_tokens_details["host"], stats1["load_time_s"] - stats0["load_time_s"])
        engine.shutdown()
        (lw, host_hit, load_s), (la, _, _) = results["layer-wise"], results["load-all"]
        hidden = (la - lw) / load_s if load_s > 0 else 0.0
        name = model if len(model) < 32 else "random:llama-3-8b-shape"
        note = {"note": "a CPU: copies and compute share its cores, the hidden fraction means nothing here"} \
            if device.type == "cpu" else {}
        report(f"2. TTFT from L2 at {n} tokens", model=name, dtype=dtype, host_hit_tokens=host_hit,
               cold_s=round(cold, 4), layerwise_s=round(lw, 4), load_all_s=round(la, 4), load_s=round(load_s, 4),
               hidden_fraction=round(hidden, 3), vs_cold=round(lw / cold, 3), **note)


def decode_rate(report: Report, device: torch.device, model: str, batches: list[int], dtype: str) -> None:
    engine = Engine(model, device=str(device), dtype=dtype, max_total_tokens=65536)
    sampling = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    for b in batches:
        vocab = engine.loaded.spec.vocab_size
        prompts = [[(7 * i + j) % (vocab - 10) + 10 for i in range(128)] for j in range(b)]
        engine.generate(prompts, SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))  # warm
        t0 = time.perf_counter()
        rs = engine.generate(prompts, sampling)
        wall = time.perf_counter() - t0
        decode_s = max(r.e2e_s - r.ttft_s for r in rs)
        report(f"3. decode batch {b}", model=model, dtype=dtype, tokens_per_s=round(b * 63 / decode_s, 1),
               per_step_ms=round(decode_s / 63 * 1000, 3), wall_s=round(wall, 2))
    engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks the logic (CPU) in seconds")
    ap.add_argument("--json", default=None, help="append each result to this file as a JSON line")
    args = ap.parse_args()
    device, report = torch.device(args.device), Report(args.json)
    if args.quick:
        copy_bandwidth(report, device, pages=64, layers=4, page_size=16)
        ttft_from_l2(report, device, "random:small", [512], "float32")
        decode_rate(report, device, "random:small", [1, 4], "float32")
        return
    copy_bandwidth(report, device, pages=2048, layers=32, page_size=16)  # 2048 x 32 x 8 x 128 x 2 x 2 B x 16 = 4 GiB
    ttft_from_l2(report, device, "random:" + json.dumps(LLAMA3_8B), [8192, 32768], "bfloat16")
    decode_rate(report, device, "smollm2", [1, 32], "bfloat16")


if __name__ == "__main__":
    main()
