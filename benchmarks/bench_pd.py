"""P/D with and without decode-side prefix reuse, side by side in one run (seed section 5's
benchmark at this machine's scale).

    python benchmarks/bench_pd.py [--model smollm2] [--groups 2] [--prompts-per-group 2]
                                  [--system-len 512] [--question-len 64] [--output-len 16]
                                  [--turns 4] [--concurrency 4] [--transfer-backend {zmq,mooncake}]
                                  [--prefill-tp 1] [--decode-tp 1]

Each arm starts a prefill and a decode ``hicache serve`` and SGLang's router in PD mode
(``hicache.launch.servers``), flushes both caches, and runs ``hicache bench`` through the router
on a generated-shared-prefix multi-turn workload (groups share a system prompt; every turn adds
a question and the previous answer). The prefill server is the same in both arms; the decode
server either keeps no tree (every turn receives its whole prompt's KV) or keeps its device and
host tiers (``--disaggregation-decode-enable-radix-cache --enable-hierarchical-cache``: a turn
receives only what the decode server lacks). Printed per arm: mean and median TTFT, output
throughput, and the KV that crossed per request (from the decode server's ``/stats``; "KV ms":
from the decode server's ask to the rows stored, which includes waiting for the prefill).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import httpx  # noqa: E402

from hicache.launch.servers import pd_servers  # noqa: E402

ARMS = {
    "decode reuse off": "",
    "decode device + host reuse": "--disaggregation-decode-enable-radix-cache --enable-hierarchical-cache",
}


def run_arm(args: argparse.Namespace, decode_args: str) -> dict:
    common = (f"--model {args.model} --max-total-tokens {args.max_total_tokens} "
              f"--disaggregation-transfer-backend {args.transfer_backend}")
    with pd_servers(common, prefill_args=f"--tp-size {args.prefill_tp}",
                    decode_args=f"--tp-size {args.decode_tp} {decode_args}") as pd:
        for url in (pd.prefill_url, pd.decode_url):
            httpx.post(f"{url}/flush_cache", timeout=30).raise_for_status()
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        cmd = [sys.executable, "-m", "hicache.cli", "bench", "--base-url", pd.url, "--model", args.model,
               "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(args.groups),
               "--gsp-prompts-per-group", str(args.prompts_per_group), "--gsp-system-prompt-len", str(args.system_len),
               "--gsp-question-len", str(args.question_len), "--gsp-output-len", str(args.output_len),
               "--gsp-num-turns", str(args.turns), "--max-concurrency", str(args.concurrency),
               "--seed", "1", "--disable-tqdm", "--output-file", out]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(out, encoding="utf-8") as f:
            rep = json.load(f)
        os.unlink(out)
        pd_stats = httpx.get(f"{pd.decode_url}/stats", timeout=30).json()["disaggregation"]
    return {"report": rep, "pd": pd_stats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--prompts-per-group", type=int, default=2)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-total-tokens", type=int, default=16384)
    ap.add_argument("--transfer-backend", choices=("zmq", "mooncake"), default="zmq")
    ap.add_argument("--prefill-tp", type=int, default=1, help="the prefill server's --tp-size")
    ap.add_argument("--decode-tp", type=int, default=1, help="the decode server's --tp-size (KV heads re-split on receipt)")
    args = ap.parse_args()
    print(f"bench_pd: {args.model}, {args.groups} groups x {args.prompts_per_group} conversations x {args.turns} "
          f"turns (system {args.system_len}, question {args.question_len}, output {args.output_len} tokens), "
          f"concurrency {args.concurrency}, {args.transfer_backend} transfers, prefill TP{args.prefill_tp} -> "
          f"decode TP{args.decode_tp}; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs")
    rows = {name: run_arm(args, decode_args) for name, decode_args in ARMS.items()}
    print(f"\n{'arm':<28}{'requests':>9}{'TTFT mean ms':>14}{'TTFT median ms':>16}{'out tok/s':>11}"
          f"{'KV tok/req':>12}{'KV MiB/req':>12}{'KV ms/req':>11}{'decode prefix':>15}")
    for name, r in rows.items():
        rep, pd = r["report"], r["pd"]
        n = max(pd["requests"], 1)
        prefix = pd["decode_prefix_tokens"] / max(pd["decode_prefix_tokens"] + pd["tokens"], 1)
        print(f"{name:<28}{rep['completed']:>9}{rep['ttft_ms']['mean']:>14.1f}{rep['ttft_ms']['median']:>16.1f}"
              f"{rep['output_throughput']:>11.1f}{pd['tokens'] / n:>12.0f}{pd['bytes'] / n / 2**20:>12.2f}"
              f"{pd['seconds'] / n * 1000:>11.0f}{prefix:>14.0%}")
    off, on = rows["decode reuse off"]["report"], rows["decode device + host reuse"]["report"]
    print(f"\nreuse on vs off: TTFT mean {on['ttft_ms']['mean'] / off['ttft_ms']['mean']:.2f}x, median "
          f"{on['ttft_ms']['median'] / off['ttft_ms']['median']:.2f}x, output throughput "
          f"{on['output_throughput'] / off['output_throughput']:.2f}x")


if __name__ == "__main__":
    main()
