"""The serving layer's overhead, measured side by side in one run.

    python benchmarks/bench_server.py [--model smollm2] [--prefix 1024] [--suffix 32] [--repeats 5]
                                      [--conversations 64] [--skip-ttft] [--skip-client]
                                      [--skip-decode] [--decode-only] [--keep-omp-pool-too]

1. TTFT of a cached turn (K-token prefix cached, S new tokens) in-process (``Engine.generate``
   wall time, max_new_tokens=1) vs through HTTP on the same engine (``/v1/completions`` with
   token ids, max_tokens=1: non-streaming round trip, and time to the first streamed chunk).
   Target: HTTP within 10% of in-process.
2. ``hicache bench`` keeping N conversations in flight (max concurrency N) against a launched
   ``random:tiny`` server: the client's own CPU time, to show it is not the bottleneck.
3. Decode, in-process vs streamed over HTTP: the per-token time of
   ``Engine.generate`` at batch 1 and 4 (each prompt: the cached ``--prefix`` + 64 new ids, 32
   greedy tokens) next to a ``hicache serve`` process streaming the same requests to 1 and 4
   concurrent clients (median ITL, mean E2E). ``--keep-omp-pool-too`` also serves with the
   loading thread's OpenMP workers kept alive, as before ``release_omp_pool`` (openmp.py).
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


DECODE_NEW, DECODE_OUT = 64, 32  # part 3: new prompt ids per request, greedy output tokens
DECODE_REQUESTS = {1: 4, 4: 8}  # part 3: concurrency -> streamed requests
# Part 3's "before": the server as it was before release_omp_pool (hicache/openmp.py, called by frontend/loop.py).
KEEP_POOL = "import hicache.frontend.loop as L; L.release_omp_pool = lambda: False\n"


def decode_in_process(model: str, prefix: list[int], rng: np.random.Generator) -> dict[int, float]:
    """Seconds per decode step of ``Engine.generate`` at batch 1 and 4, median of 3."""
    engine = Engine(model)
    sp = SamplingParams(max_new_tokens=DECODE_OUT, temperature=0.0, ignore_eos=True)
    engine.generate([prefix + [1]], SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))
    out = {}
    for batch in (1, 4):
        runs = []
        for _ in range(3):
            res = engine.generate([prefix + rng.integers(100, 40000, DECODE_NEW).tolist() for _ in range(batch)], sp)
            runs.append(statistics.mean((r.e2e_s - r.ttft_s) / (DECODE_OUT - 1) for r in res))
        out[batch] = statistics.median(runs)
    engine.shutdown()
    return out


async def _stream_requests(url: str, model: str, prefix: list[int], conc: int, n: int,
                           rng: np.random.Generator) -> tuple[float, float]:
    """(median ITL, mean E2E) of ``n`` streamed completions, ``conc`` at a time."""
    import asyncio

    import httpx

    from hicache.bench.client import Endpoint, RequestOptions, RequestRecord, stream_request

    async with httpx.AsyncClient(timeout=300) as client:
        endpoint, options = Endpoint(client, url, model), RequestOptions()
        await stream_request(endpoint, RequestRecord(0), options, prompt=prefix + [1], max_tokens=2)  # caches it
        gate = asyncio.Semaphore(conc)

        async def one() -> RequestRecord:
            async with gate:
                return await stream_request(endpoint, RequestRecord(0), options, max_tokens=DECODE_OUT,
                                            prompt=prefix + rng.integers(100, 40000, DECODE_NEW).tolist())

        recs = await asyncio.gather(*[one() for _ in range(n)])
    bad = [r.error for r in recs if not r.ok]
    if bad:
        raise SystemExit(f"error: a streamed request failed: {bad[0]}")
    return statistics.median(x for r in recs for x in r.itl_s), statistics.mean(r.e2e_s for r in recs)


def decode_over_http(model: str, prefix: list[int], rng: np.random.Generator, prelude: str) -> dict[int, tuple]:
    """{concurrency: (median ITL s, mean E2E s), "busy": CPU busy before} from a ``hicache serve``
    process (``prelude``: Python run in it first)."""
    import asyncio

    from bench_peers import free_port, start_server, stop_server, wait_idle

    busy = wait_idle(30)  # other processes on the CPU skew every figure
    port = free_port()
    code = (f"import sys\n{prelude}from hicache.cli import main\n"
            f"sys.exit(main(['serve', '--host', '127.0.0.1', '--port', '{port}', '--model', {model!r}, "
            "'--served-model-name', 'smollm2']))")  # the name start_server's warm-up asks for
    with tempfile.TemporaryFile("w+") as log:
        proc = start_server([sys.executable, "-c", code], f"http://127.0.0.1:{port}", log)
        try:
            out = {c: asyncio.run(_stream_requests(f"http://127.0.0.1:{port}", "smollm2", prefix, c, n, rng))
                   for c, n in DECODE_REQUESTS.items()}
        finally:
            stop_server(proc)
    return {**out, "busy": busy}


def decode_in_process_vs_http(model: str, prefix_len: int, keep_pool_too: bool) -> None:
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, 40000, prefix_len).tolist()
    from bench_peers import wait_idle

    busy = wait_idle(30)
    local = decode_in_process(model, prefix, rng)
    variants = {"HTTP": ""}
    if keep_pool_too:
        variants = {"HTTP, loading thread's OpenMP pool kept (before)": KEEP_POOL, "HTTP (now)": ""}
    served = {name: decode_over_http(model, prefix, rng, prelude) for name, prelude in variants.items()}
    print(f"\ndecode, model={model}: each request {prefix_len} cached + {DECODE_NEW} new prompt ids, {DECODE_OUT} "
          f"greedy tokens; HTTP: `hicache serve` streaming /v1/completions, 4 requests at c=1, 8 at c=4")
    print(f"{'path':<52}{'c=1 ITL ms':>11}{'vs in-proc':>11}{'c=4 ITL ms':>11}{'vs in-proc':>11}"
          f"{'c=1 E2E ms':>11}{'c=4 E2E ms':>11}{'CPU busy':>9}")
    print(f"{'in-process Engine.generate, per decode step (batch)':<52}{local[1] * 1e3:>11.2f}{'':>11}"
          f"{local[4] * 1e3:>11.2f}{'':>33}{busy:>9.0%}")
    for name, res in served.items():
        (itl1, e2e1), (itl4, e2e4) = res[1], res[4]
        print(f"{name:<52}{itl1 * 1e3:>11.2f}{itl1 / local[1]:>10.2f}x{itl4 * 1e3:>11.2f}{itl4 / local[4]:>10.2f}x"
              f"{e2e1 * 1e3:>11.0f}{e2e4 * 1e3:>11.0f}{res['busy']:>9.0%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--skip-client", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--decode-only", action="store_true", help="Only part 3 (decode, in-process vs HTTP).")
    ap.add_argument("--keep-omp-pool-too", action="store_true",
                    help="Part 3: also serve as before the fix (the loading thread's OpenMP pool kept).")
    args = ap.parse_args()
    if not args.skip_ttft and not args.decode_only:
        ttft_in_process_vs_http(args)
    if not args.skip_client and not args.decode_only:
        client_capacity(args)
    if not args.skip_decode:
        decode_in_process_vs_http(args.model, args.prefix, args.keep_omp_pool_too)


if __name__ == "__main__":
    main()
