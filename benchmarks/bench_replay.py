"""Live replay of real Mooncake trace requests on data-parallel engines behind sglang-router,
round_robin vs cache_aware, next to what ``hicache simulate`` predicts for the same requests.

    python benchmarks/bench_replay.py [--engines 2] [--conversations 12] [--requests 80]
                                      [--block-tokens 16] [--pages 96] [--host-ratio 2]

The requests: the trace's largest conversations (``largest_conversations``: real lines, kept
whole), replayed one at a time (``--max-concurrency 1``, arrivals compressed) through the router
to ``--engines`` ``hicache serve`` (SmolLM2, ``--page-size 16``, a device pool of ``--pages``
pages and a host tier ``--host-ratio`` times that). Text prompts (the router routes on text):
each 512-token block becomes ``--block-tokens`` tokens of words, so a live block is only
approximately one page. Per policy and engine: requests, prompt tokens and hit rate per tier
from each engine's /metrics; then the simulator's prediction (``--engines``, ``--router``, the
same capacities in real tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import httpx  # noqa: E402

from hicache.bench.client import scrape_metrics  # noqa: E402
from hicache.bench.report import server_hit_rates  # noqa: E402
from hicache.launch.servers import dp_servers  # noqa: E402
from hicache.sim.run import Capacities, SimConfig, simulate  # noqa: E402
from hicache.sim.trace import (  # noqa: E402
    BLOCK_TOKENS,
    SHIPPED_TRACE,
    largest_conversations,
    load_trace,
)

POLICIES = {"round_robin": "round-robin", "cache_aware": "cache-aware"}  # sglang-router's name -> simulate's


async def _metrics(urls: list[str]) -> list[dict]:
    async with httpx.AsyncClient(timeout=30) as client:
        return [await scrape_metrics(client, u) for u in urls]


def live(args: argparse.Namespace, trace: str, policy: str) -> list[dict]:
    server = (f"--model {args.model} --page-size 16 --max-total-tokens {args.pages * 16} "
              f"--enable-hierarchical-cache --hicache-ratio {args.host_ratio}")
    with dp_servers(server, args.engines, policy) as dp:
        before = asyncio.run(_metrics(dp.worker_urls))
        cmd = [sys.executable, "-m", "hicache.cli", "bench", "--base-url", dp.url, "--model", args.model,
               "--dataset", "mooncake", "--trace", trace, "--block-tokens", str(args.block_tokens),
               "--max-output-tokens", "1", "--time-scale", "1e-9", "--max-concurrency", "1", "--disable-tqdm"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        after = asyncio.run(_metrics(dp.worker_urls))
    out = []
    for b, a in zip(before, after):
        rates = server_hit_rates(b, a)
        rates["requests"] = round(sum(v - b.get(k, 0.0) for k, v in a.items() if k.startswith("hicache_requests_total")))
        out.append(rates)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--pages", type=int, default=96, help="Device pages (16 tokens) per engine.")
    ap.add_argument("--host-ratio", type=float, default=2.0)
    args = ap.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write("\n".join(largest_conversations(SHIPPED_TRACE, args.conversations, args.requests, 40)) + "\n")
        trace = f.name
    requests = load_trace(trace)
    print(f"bench_replay: {len(requests)} requests of the {args.conversations} largest conversations, "
          f"{args.engines} engines ({args.model}, {args.pages} device pages, host x{args.host_ratio:g}), "
          f"{args.block_tokens} tokens per block")
    scale = BLOCK_TOKENS / args.block_tokens  # real tokens per live token
    caps = Capacities(device=args.pages * 16 * scale, host=args.pages * 16 * args.host_ratio * scale)
    print(f"\n{'policy':<13}{'engine':<8}{'requests':>9}{'device':>8}{'host':>8}{'total':>8}    simulated: "
          f"{'requests':>8}{'device':>8}{'host':>8}{'total':>8}")
    for policy, router in POLICIES.items():
        got = live(args, trace, policy)
        sim = simulate(requests, SimConfig(caps, engines=args.engines, router=router)).to_json()
        rows = [(str(i), g, s) for i, (g, s) in enumerate(zip(got, sim["per_engine"]))]
        total_live = {"requests": sum(g["requests"] for g in got), "prompt_tokens": sum(g["prompt_tokens"] for g in got),
                      "cached_tokens": {
            t: sum(g["cached_tokens"].get(t, 0) for g in got) for t in ("device", "host")}}
        total_live["hit_rate"] = {t: n / max(total_live["prompt_tokens"], 1) for t, n in total_live["cached_tokens"].items()}
        rows.append(("all", total_live, sim))
        for name, g, s in rows:
            lr = g["hit_rate"]
            sr = {t: n / max(s["input_tokens"], 1) for t, n in s["hit_tokens"].items()}
            print(f"{policy:<13}{name:<8}{g['requests']:>9}{lr.get('device', 0):>8.1%}{lr.get('host', 0):>8.1%}"
                  f"{lr.get('device', 0) + lr.get('host', 0):>8.1%}               {s['requests']:>8}"
                  f"{sr['device']:>8.1%}{sr['host']:>8.1%}{sr['device'] + sr['host']:>8.1%}", flush=True)
    os.unlink(trace)


if __name__ == "__main__":
    main()
