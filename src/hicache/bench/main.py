"""``hicache bench``: flags, optional server launch, run, report.

A pure HTTP client: it imports neither torch nor the engine, so it can measure any
OpenAI-compatible server (hicache-only features, /tokenize and /metrics, are used when the
server is hicache).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time
from typing import Any, Callable

from ..errors import HicacheError
from ..ports import free_port
from ..processes import child_env, stop_process


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="Server to measure (OpenAI-compatible).")
    p.add_argument("--model", default=None, help="Model name to request (default: the server's first model).")
    p.add_argument("--dataset-name", "--dataset", default="generated-shared-prefix",
                   choices=["generated-shared-prefix", "trace", "mooncake", "agentic"])
    g = p.add_argument_group("generated-shared-prefix (lengths in tokens)")
    g.add_argument("--gsp-num-groups", type=int, default=4, help="Groups; one shared system prompt each.")
    g.add_argument("--gsp-prompts-per-group", type=int, default=4, help="Conversations per group.")
    g.add_argument("--gsp-system-prompt-len", type=int, default=512)
    g.add_argument("--gsp-question-len", type=int, default=64, help="New user text per turn.")
    g.add_argument("--gsp-output-len", type=int, default=32, help="max_tokens of each turn.")
    g.add_argument("--gsp-num-turns", type=int, default=3)
    g = p.add_argument_group("trace replay (trace: timestamped requests; mooncake: a Mooncake-format trace)")
    g.add_argument("--trace-file", "--trace", default=None,
                   help="JSON Lines of timestamped requests (see bench/workload.py); with --dataset-name mooncake, a "
                        "Mooncake-format trace (default: the conversation trace shipped with hicache).")
    g.add_argument("--trace-speed", type=float, default=1.0, help="Replay speed-up factor.")
    g.add_argument("--time-scale", type=float, default=None,
                   help="Arrival times multiplied by this (0.01: 100x faster); the inverse of --trace-speed.")
    g.add_argument("--block-tokens", type=int, default=16,
                   help="mooncake: tokens per 512-token trace block; agentic: tokens per block of the generated trace.")
    g.add_argument("--max-requests", type=int, default=None, help="mooncake: replay only the first N requests.")
    g.add_argument("--max-output-tokens", type=int, default=None,
                   help="mooncake: cap on max_tokens (default: the trace's output length, scaled like the blocks).")
    g.add_argument("--prompt-format", choices=["text", "token-ids"], default="text",
                   help="mooncake: prompts as words (any server) or as token ids (exactly --block-tokens per block).")
    g.add_argument("--trace-max-tokens", type=int, default=64, help="max_tokens when a line gives none.")
    g = p.add_argument_group("agentic (hicache.sim.agentic; --trace-file: a trace it wrote, instead of generating one)")
    g.add_argument("--agentic-client", choices=["claude-code", "codex"], default="claude-code",
                   help="claude-code: the Messages API with cache_control; codex: Chat Completions with "
                        "prompt_cache_retention=24h.")
    g.add_argument("--agentic-hints", choices=["on", "off"], default="on", help="Send the client's cache hints.")
    g.add_argument("--agentic-time-factor", type=float, default=1.0, help="Pauses and arrivals multiplied by this.")
    g.add_argument("--agentic-lead-turns", type=int, default=24)
    g.add_argument("--agentic-subagents", type=int, default=4)
    g.add_argument("--agentic-flood-sessions", type=int, default=200)
    g.add_argument("--save-outputs", default=None, help="agentic: write each request's reply here (JSON Lines).")
    g = p.add_argument_group("load")
    g.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight (default: no limit).")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Conversation arrivals per second (Poisson); inf starts all at once.")
    g.add_argument("--seed", type=int, default=1)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--disable-ignore-eos", action="store_true", help="Let requests stop at EOS.")
    g.add_argument("--flush-cache", action="store_true", help="POST /flush_cache before the run (hicache).")
    g = p.add_argument_group("output")
    g.add_argument("--output-file", default=None, help="Write the report as JSON here.")
    g.add_argument("--plot", default=None, help="Write a PNG (TTFT by turn, hit rate by tier) here.")
    g.add_argument("--disable-tqdm", action="store_true")
    g = p.add_argument_group("launch a server for the run")
    g.add_argument("--launch-server", action="store_true",
                   help="Start `hicache serve` on a free local port for the run, then stop it.")
    g.add_argument("--server-args", default="--model smollm2",
                   help="Flags for the launched server, one string (e.g. \"--model random:tiny --dtype float32\").")
    g.add_argument("--server-timeout", type=float, default=600.0, help="Seconds to wait for the launched server.")


def launch_server(server_args: str, timeout: float) -> tuple[subprocess.Popen, str]:
    """Start ``hicache serve`` in a subprocess; returns (process, base URL) once /health answers."""
    proc, url = start_server(server_args)
    wait_server(proc, url, timeout)
    return proc, url


def start_server(server_args: str) -> tuple[subprocess.Popen, str]:
    """Start ``hicache serve`` in a subprocess on a free local port; returns (process, base URL)
    at once: servers started together load their models side by side (see :func:`wait_server`)."""
    port = free_port()
    cmd = [sys.executable, "-m", "hicache.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           *shlex.split(server_args)]
    print(f"launching: {' '.join(shlex.quote(c) for c in cmd)}", file=sys.stderr)
    return subprocess.Popen(cmd, env=child_env()), f"http://127.0.0.1:{port}"


def wait_server(proc: subprocess.Popen, url: str, timeout: float) -> None:
    """Return once the server at ``url`` answers /health; stop it and raise if it exits first or
    is not ready within ``timeout`` seconds."""
    import httpx

    wait_ready(proc, "the launched server", lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200,
               timeout, 0.5)


def wait_ready(proc: subprocess.Popen, what: str, ready: Callable[[], bool], timeout: float, interval: float) -> None:
    """Poll ``ready()`` every ``interval`` seconds (an HTTP error or a bad reply counts as not
    ready); HicacheError naming ``what`` if ``proc`` exits first, or, after stopping it, if it is
    not ready within ``timeout`` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise HicacheError(f"{what} exited with status {proc.returncode} before it was ready.")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            if ready():
                return
        time.sleep(interval)
    proc.terminate()
    raise HicacheError(f"{what} was not ready within {timeout:.0f} s.")


async def _tokens_per_word(client: Any, base_url: str, seed: int) -> float:
    """Tokens per word of the workloads' text, measured with the server's tokenizer (hicache's)."""
    import random

    from .client import count_tokens
    from .workload import random_text

    return (await count_tokens(client, base_url, [random_text(random.Random(seed + 7), 2000)]))[0] / 2000


async def _workload(args: argparse.Namespace, client: Any, base_url: str, info: dict[str, Any],
                    workload: dict[str, Any]) -> tuple[list, int]:
    """(trace requests or conversations, request count); describes the workload into
    ``workload`` (measured with the server's tokenizer when it is hicache)."""
    from .client import count_tokens
    from .workload import WORDS, generated_shared_prefix, load_trace

    if args.dataset_name == "mooncake":
        reqs = await _mooncake(args, client, base_url, info, workload)
        return reqs, len(reqs)
    if args.dataset_name == "agentic":
        calls = await _agentic(args, client, base_url, info, workload)
        return calls, len(calls)
    if args.dataset_name == "trace":
        if not args.trace_file:
            raise HicacheError("--dataset-name trace needs --trace-file FILE.")
        try:
            reqs = load_trace(args.trace_file, args.trace_max_tokens)
        except (OSError, ValueError) as e:
            raise HicacheError(f"cannot read the trace: {e}.") from None
        workload.update(name=f"trace {os.path.basename(args.trace_file)} ({len(reqs)} requests, x{args.trace_speed})")
        return reqs, len(reqs)
    tpw = await _tokens_per_word(client, base_url, args.seed) if info["hicache"] else 1.0
    convs = generated_shared_prefix(args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_system_prompt_len,
                                    args.gsp_question_len, args.gsp_num_turns, args.seed, tpw)
    workload.update(
        name=(f"generated-shared-prefix {args.gsp_num_groups} groups x {args.gsp_prompts_per_group} "
              f"conversations x {args.gsp_num_turns} turns"),
        tokens_per_word=tpw, num_words=len(WORDS),
        **{k: getattr(args, k) for k in ("gsp_system_prompt_len", "gsp_question_len", "gsp_output_len")},
    )
    if info["hicache"]:
        systems = sorted({c.system for c in convs})
        qs = [q for c in convs for q in c.questions]
        counts = await count_tokens(client, base_url, systems + qs)
        workload["measured_system_prompt_len"] = sum(counts[: len(systems)]) / len(systems)
        workload["measured_question_len"] = sum(counts[len(systems):]) / max(len(qs), 1)
    return convs, len(convs) * args.gsp_num_turns


async def _mooncake(args: argparse.Namespace, client: Any, base_url: str, info: dict[str, Any],
                    workload: dict[str, Any]) -> list:
    """A Mooncake-format trace as scaled-down completion prompts (bench/workload.py)."""
    from ..sim.trace import SHIPPED_TRACE, TraceError
    from .workload import mooncake_requests

    if args.block_tokens < 1:
        raise HicacheError("--block-tokens must be at least 1.")
    text = info["hicache"] and args.prompt_format == "text"
    tpw = await _tokens_per_word(client, base_url, args.seed) if text else 1.0
    path = args.trace_file or SHIPPED_TRACE
    try:
        reqs = mooncake_requests(path, args.block_tokens, tpw, args.max_requests, args.prompt_format == "token-ids")
    except (OSError, TraceError) as e:
        raise HicacheError(f"cannot read the trace: {e}") from None
    if args.max_output_tokens is not None:
        if args.max_output_tokens < 1:
            raise HicacheError("--max-output-tokens must be at least 1.")
        for r in reqs:
            r.max_tokens = min(r.max_tokens, args.max_output_tokens)
    if not reqs:
        raise HicacheError(f"{path} holds no requests.")
    workload.update(name=f"mooncake {os.path.basename(path)} ({len(reqs)} requests, {args.block_tokens} tokens per "
                         f"block, x{args.trace_speed:g} time)", tokens_per_word=tpw, block_tokens=args.block_tokens)
    return reqs


async def _agentic(args: argparse.Namespace, client: Any, base_url: str, info: dict[str, Any],
                   workload: dict[str, Any]) -> list:
    """The agentic trace as its client's requests (bench/agentic.py)."""
    from ..sim.agentic import agentic_trace
    from ..sim.trace import TraceError, load_trace
    from .agentic import agentic_call

    try:
        trace = load_trace(args.trace_file) if args.trace_file else agentic_trace(
            args.seed, args.agentic_time_factor, args.block_tokens, args.agentic_lead_turns, args.agentic_subagents,
            args.agentic_flood_sessions, args.agentic_client)
    except (OSError, TraceError) as e:
        raise HicacheError(f"cannot read the trace: {e}") from None
    except ValueError as e:
        raise HicacheError(f"cannot generate the agentic trace: {e}.") from None
    tpw = await _tokens_per_word(client, base_url, args.seed) if info["hicache"] else 1.0
    if info["hicache"]:  # the prefix hit ratio counts whole pages
        workload["page_size"] = (await client.get(f"{base_url}/server_info")).json().get("page_size", 1)
    try:
        calls = [agentic_call(r, args.agentic_client, args.agentic_hints == "on",
                              max(1, round(r.block_tokens / tpw)), min(r.output_length, args.max_output_tokens or
                                                                       r.output_length)) for r in trace]
    except ValueError as e:
        raise HicacheError(f"cannot replay the trace: {e}.") from None
    workload.update(name=f"agentic ({len(calls)} requests, {args.agentic_client} client, hints "
                         f"{args.agentic_hints}, {trace[0].block_tokens if trace else 0} tokens per block)",
                    tokens_per_word=tpw, client=args.agentic_client, hints=args.agentic_hints)
    return calls


async def _run(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    import httpx
    from tqdm import tqdm

    from .client import Endpoint, RequestOptions, flush_cache, scrape_metrics, server_info
    from .report import summarize
    from .runner import run_conversations, run_trace

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        try:
            info = await server_info(client, base_url)
        except httpx.HTTPError as e:
            raise HicacheError(f"cannot reach {base_url}/v1/models: {e}.") from None
        model = args.model or info["model"]
        workload: dict[str, Any] = {"base_url": base_url, "model": model, "server_is_hicache": info["hicache"],
                                    "max_concurrency": args.max_concurrency, "request_rate": args.request_rate,
                                    "seed": args.seed}
        work, total = await _workload(args, client, base_url, info, workload)
        if args.flush_cache and info["hicache"] and not await flush_cache(client, base_url):
            raise HicacheError("the server refused /flush_cache (requests still running).")

        before = await scrape_metrics(client, base_url) if info["hicache"] else {}
        bar = tqdm(total=total, desc="bench", unit="req", disable=args.disable_tqdm, file=sys.stderr)
        cpu0, t0 = time.process_time(), time.perf_counter()
        endpoint = Endpoint(client, base_url, model)
        options = RequestOptions(args.temperature, ignore_eos=not args.disable_ignore_eos)
        if args.dataset_name == "agentic":
            from .agentic import run_agentic

            records = await run_agentic(endpoint, work, options, speed=args.trace_speed, on_done=bar.update)
        elif args.dataset_name in ("trace", "mooncake"):
            records = await run_trace(endpoint, work, options, speed=args.trace_speed,
                                      max_concurrency=args.max_concurrency, on_done=bar.update)
        else:
            records = await run_conversations(endpoint, work, options, output_len=args.gsp_output_len,
                                              max_concurrency=args.max_concurrency, request_rate=args.request_rate,
                                              seed=args.seed, on_done=bar.update)
        duration, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        bar.close()
        after = await scrape_metrics(client, base_url) if info["hicache"] else {}
    rep = summarize(records, duration, workload, before, after, cpu)
    if args.dataset_name == "agentic":
        from .agentic_report import agentic_summary, outputs

        reqs = [c.req for c in work]
        rep["agentic"] = agentic_summary(reqs, records, workload.get("page_size", 1))
        rep["outputs"] = outputs(reqs, records)
    return rep


def run_bench(args: argparse.Namespace) -> int:
    from .report import format_report, plot_report

    if args.time_scale is not None:
        if not args.time_scale > 0:
            raise HicacheError("--time-scale must be > 0.")
        args.trace_speed = 1 / args.time_scale

    proc = None
    base_url = args.base_url.rstrip("/")
    try:
        if args.launch_server:
            proc, base_url = launch_server(args.server_args, args.server_timeout)
        rep = asyncio.run(_run(args, base_url))
    finally:
        if proc is not None:
            stop_process(proc, 30)
    print(format_report(rep))
    if "agentic" in rep:
        from .agentic_report import format_agentic

        print(format_agentic(rep["agentic"]))
        if args.save_outputs:
            pathlib.Path(args.save_outputs).write_text("".join(json.dumps(o) + "\n" for o in rep["outputs"]),
                                                       encoding="utf-8")
    if args.output_file:
        pathlib.Path(args.output_file).write_text(json.dumps(rep, indent=2), encoding="utf-8")
        print(f"report written to {args.output_file}", file=sys.stderr)
    if args.plot:
        plot_report(rep, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0 if rep["completed"] else 1
