"""The serving layer's overhead, measured side by side in one run.

    python benchmarks/bench_server.py [--model smollm2] [--prefix 1024] [--suffix 32] [--repeats 5]
                                      [--conversations 64] [--skip-ttft] [--skip-client]

1. TTFT of a cached turn (K-token prefix cached, S new tokens) in-process (``Engine.generate``
   wall time, max_new_tokens=1) vs through HTTP on the same engine (``/v1/completions`` with
   token ids, max_tokens=1: non-streaming round trip, and time to the first streamed chunk).
   Target: HTTP within 10% of in-process.
2. ``hicache bench`` keeping N conversations in flight (max concurrency N) against a launched
   ``random:tiny`` server: the client's own CPU time, to show it is not the bottleneck.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
sys.path.insert(0, SRC)

from hicache import Engine, SamplingParams  # noqa: E402

ONE = SamplingParams(max_new_tokens=1, temperature=0.0)


def ttft_in_process_vs_http(args: argparse.Namespace) -> None:
    import httpx

    from hicache.server.serve import ServerThread

    engine = Engine(args.model, max_total_tokens=(args.prefix + args.suffix) * 4 + 4096, page_size=16)
    vocab = engine.loaded.spec.vocab_size
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, vocab, args.prefix).tolist()
    # Fresh suffixes for each path, so every sample is "K cached + S new" tokens.
    fresh = iter([rng.integers(100, vocab, args.suffix).tolist() for _ in range(3 * args.repeats + 1)])
    local_s, rt_s, stream_s = ([next(fresh) for _ in range(args.repeats)] for _ in range(3))

    engine.generate([prefix + [1]], ONE)  # caches the prefix; also warms kernels up
    local, local_engine = [], []
    for s in local_s:
        t = time.perf_counter()
        res = engine.generate([prefix + s], ONE)[0]
        local.append(time.perf_counter() - t)
        local_engine.append(res.ttft_s)

    srv = ServerThread(engine)
    url = srv.start()
    http_rt, http_stream, http_engine = [], [], []
    with httpx.Client(timeout=300) as c:
        body = {"model": args.model, "max_tokens": 1, "temperature": 0}
        c.post(f"{url}/v1/completions", json={**body, "prompt": prefix + next(fresh)})  # warm the HTTP path
        for s in rt_s:
            t = time.perf_counter()
            r = c.post(f"{url}/v1/completions", json={**body, "prompt": prefix + s})
            http_rt.append(time.perf_counter() - t)
            http_engine.append(r.json()["timing"]["ttft_s"])
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= args.prefix - 16
        for s in stream_s:
            t = time.perf_counter()
            with c.stream("POST", f"{url}/v1/completions", json={**body, "prompt": prefix + s, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        http_stream.append(time.perf_counter() - t)
                        break
    srv.stop()

    med = statistics.median
    base = med(local)
    print(f"model={args.model} dtype={engine.config.dtype} cached prefix={args.prefix} new={args.suffix} "
          f"repeats={args.repeats}")
    print(f"{'path':<46}{'median ms':>10}{'vs in-process':>15}")
    rows = [
        ("in-process Engine.generate wall", local),
        ("  (engine TTFT, arrival -> first token)", local_engine),
        ("HTTP /v1/completions round trip (max_tokens=1)", http_rt),
        ("HTTP streamed, time to first chunk", http_stream),
        ("  (engine TTFT seen by the server)", http_engine),
    ]
    for name, xs in rows:
        print(f"{name:<46}{med(xs) * 1000:>10.2f}{med(xs) / base:>14.2f}x")


def client_capacity(args: argparse.Namespace) -> None:
    n = args.conversations
    groups = 8
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "report.json")
        cmd = [sys.executable, "-m", "hicache.cli", "bench", "--launch-server",
               "--server-args", "--model random:tiny --dtype float32 --max-total-tokens 262144 "
                                f"--max-running-requests {n}",
               "--gsp-num-groups", str(groups), "--gsp-prompts-per-group", str(n // groups),
               "--gsp-system-prompt-len", "256", "--gsp-question-len", "32", "--gsp-output-len", "32",
               "--gsp-num-turns", "2", "--max-concurrency", str(n), "--disable-tqdm", "--output-file", out]
        env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        with open(out) as f:
            rep = json.load(f)
    reqs = rep["completed"]
    print(f"\nbench client, {n} concurrent conversations x 2 turns against random:tiny (server in another process):")
    print(f"  requests {reqs}, failed {rep['failed']}, duration {rep['duration_s']:.2f} s, "
          f"{rep['output_throughput']:.0f} output tok/s, {rep['request_throughput']:.1f} req/s")
    print(f"  client CPU {rep['client_cpu_s']:.2f} s = {rep['client_cpu_util']:.0%} of one core over the run; "
          f"{rep['client_cpu_s'] / max(reqs, 1) * 1000:.2f} ms CPU per request, "
          f"{rep['client_cpu_s'] / max(rep['total_output_tokens'], 1) * 1e6:.0f} us CPU per streamed token")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--skip-client", action="store_true")
    args = ap.parse_args()
    if not args.skip_ttft:
        ttft_in_process_vs_http(args)
    if not args.skip_client:
        client_capacity(args)


if __name__ == "__main__":
    main()
