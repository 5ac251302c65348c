"""``hicache simulate``: flags, the report, and ``--sweep`` (see docs/simulation.md)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from typing import Any, Iterator

from ..config import ConfigError, EngineConfig
from ..errors import HicacheError
from .costs import PROFILES
from .agentic import CLIENTS, agentic_trace
from .compare import compare, parse_policies, parse_storage_writes, policy_table
from .router import ROUTERS
from .run import TIERS, UNLIMITED, Capacities, SimConfig, simulate
from .trace import BLOCK_TOKENS, SHIPPED_TRACE, TraceError, TraceRequest, load_trace


def _tokens(text: str) -> float:
    """A capacity in tokens: a number (1e6 and 2_000_000 work) or ``unlimited``."""
    if text.strip().lower() in ("unlimited", "inf", "infinite"):
        return UNLIMITED
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of tokens or 'unlimited'") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a capacity cannot be negative ({text})")
    return value


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=SHIPPED_TRACE,
                   help="Mooncake-format trace (JSON Lines: timestamp ms, input_length, output_length, hash_ids); "
                        "default: the Mooncake FAST'25 conversation trace shipped with hicache; 'agentic': the "
                        "generated agentic trace (a lead agent, subagents, a flood; hit ratios per class).")
    a = p.add_argument_group("--trace agentic (hicache.sim.agentic; the flags and defaults of hicache bench --dataset "
                             "agentic, so both replay one trace)")
    a.add_argument("--seed", type=int, default=1, help="The agentic trace's seed.")
    a.add_argument("--agentic-client", default="claude-code", choices=CLIENTS,
                   help="Whose hints the requests carry (cache_control breakpoints, or 24h retention).")
    a.add_argument("--agentic-time-factor", type=float, default=1.0, help="Pauses and arrivals multiplied by this.")
    a.add_argument("--agentic-lead-turns", type=int, default=24)
    a.add_argument("--agentic-subagents", type=int, default=4)
    a.add_argument("--agentic-flood-sessions", type=int, default=200)
    p.add_argument("--max-requests", type=int, default=None, help="Replay only the first N requests.")
    g = p.add_argument_group("capacities (tokens, or 'unlimited'; with none, every tier is unlimited)")
    g.add_argument("--device-tokens", type=_tokens, default=UNLIMITED,
                   help="L1: each engine's device KV pool (default unlimited).")
    g.add_argument("--host-tokens", type=_tokens, default=None, help="L2: each engine's host KV pool (default: none).")
    g.add_argument("--hicache-size", type=float, default=None,
                   help="L2 in GB instead (x 10^9 bytes / --kv-bytes-per-token).")
    g.add_argument("--storage-tokens", type=_tokens, default=None,
                   help="L3: one store every engine shares (default: no storage tier).")
    g.add_argument("--kv-bytes-per-token", type=int, default=None,
                   help="The model's KV bytes per token (default: the cost profile's model).")
    p.add_argument("--page-size", type=int, default=BLOCK_TOKENS, help="Tokens per KV page (default: one trace block).")
    p.add_argument("--block-tokens", type=int, default=None,
                   help=f"Synthetic token ids per {BLOCK_TOKENS}-token trace block (default: two per page, the "
                        "fewest that keep each request's own last token out of the cache).")
    p.add_argument("--hicache-write-policy", default="write_through",
                   choices=EngineConfig.choices("hicache_write_policy"))
    p.add_argument("--hicache-storage-write-policy", default="write_through",
                   help="Which host copies are written to storage: write_through (every one) or selective "
                        "(retained or hit-twice prefixes); both comma-separated run side by side.")
    p.add_argument("--cache-retention-max-fraction", type=float, default=0.5,
                   help="Share of each tier that retention hints may hold (lru+hints).")
    p.add_argument("--radix-eviction-policy", default="lru", choices=EngineConfig.choices("radix_eviction_policy"),
                   help="The tree's own order, which the lru and lru+hints policies use.")
    p.add_argument("--policy", default="lru",
                   help="Eviction policy, or several comma-separated run side by side on the same trace and "
                        "capacities: lru (the tree's own order; hints ignored), lru+hints (the trace's retention "
                        "hints honoured), belady (the offline optimal per tier: the leaf next used farthest in the "
                        "future goes first, in every tier; one engine). With belady, each policy's "
                        "gap to it.")
    p.add_argument("--engines", type=int, default=1, help="Engines (data parallel) behind the router.")
    p.add_argument("--router", default="cache-aware", choices=ROUTERS, help="sglang-router's policy over the engines.")
    p.add_argument("--kv-sharding", type=int, default=1,
                   help="Page-sharded CP over N ranks (--enable-kv-cache-sharding): N x the device and host "
                        "capacity per engine (each rank holds its share of the pages).")
    p.add_argument("--profile", default="gpu", choices=sorted(PROFILES), help="Cost model for the TTFT estimates.")
    p.add_argument("--json", action="store_true", help="Print the result as one JSON object.")
    p.add_argument("--sweep", choices=TIERS, default=None,
                   help="Run once per --sweep-tokens value of this tier's capacity; plot the hit ratio per tier.")
    p.add_argument("--sweep-tokens", default="1e6,4e6,16e6,64e6", help="Comma-separated capacities for --sweep.")
    p.add_argument("--plot", default="simulate_sweep.png", help="Where --sweep writes its PNG.")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    cost = PROFILES[args.profile]
    if args.kv_bytes_per_token is not None:
        if args.kv_bytes_per_token < 1:
            raise ConfigError("--kv-bytes-per-token must be positive.")
        cost = dataclasses.replace(cost, kv_bytes_per_token=args.kv_bytes_per_token)
    host = args.host_tokens
    if args.hicache_size is not None:
        if host is not None:
            raise ConfigError("give --host-tokens or --hicache-size, not both.")
        host = args.hicache_size * 1e9 / cost.kv_bytes_per_token
    if args.page_size < 1 or BLOCK_TOKENS % args.page_size and args.page_size % BLOCK_TOKENS:
        raise ConfigError(f"--page-size must divide {BLOCK_TOKENS} (a trace block) or be a multiple of it.")
    block_tokens = args.block_tokens or max(2, 2 * BLOCK_TOKENS // args.page_size)  # two or more per page
    policies, writes = parse_policies(args.policy), parse_storage_writes(args.hicache_storage_write_policy)
    if args.sweep and len(policies) * len(writes) > 1:
        raise ConfigError("--sweep runs one --policy and one --hicache-storage-write-policy at a time.")
    if not 0.0 <= args.cache_retention_max_fraction <= 1.0:
        raise ConfigError("--cache-retention-max-fraction must be in [0, 1].")
    cfg = SimConfig(Capacities(args.device_tokens, host, args.storage_tokens), args.page_size, block_tokens,
                    args.hicache_write_policy, args.radix_eviction_policy, args.engines, args.router,
                    args.kv_sharding, cost, policies[0], writes[0], args.cache_retention_max_fraction)
    for p in policies:  # refused before any runs
        dataclasses.replace(cfg, policy=p).check()
    return cfg


def _shares(out: dict) -> str:
    """Each tier's hits as a share of the input tokens."""
    return ", ".join(f"{t} {out['hit_tokens'][t] / max(out['input_tokens'], 1):.1%}" for t in TIERS)


def _report(out: dict, seconds: float) -> str:
    lines = [f"{out['requests']} requests, {out['input_tokens'] / 1e6:.1f}M input tokens, simulated in {seconds:.1f} s",
             f"hit ratio {out['hit_ratio']:.1%}: {_shares(out)}",
             "TTFT ({} profile) mean {mean:.2f} s, p50 {p50:.2f} s, p99 {p99:.2f} s".format(
                 out["config"]["cost"], **out["ttft_s"])]
    if len(out["per_engine"]) > 1:
        for i, e in enumerate(out["per_engine"]):
            lines.append(f"  engine {i}: {e['requests']} requests, hit ratio {e['hit_ratio']:.1%}")
    return "\n".join(lines)


def _sweep(args: argparse.Namespace, cfg: SimConfig, trace: list) -> list[dict]:
    points = []
    for text in args.sweep_tokens.split(","):
        value = _tokens(text)
        caps = dataclasses.replace(cfg.capacities, **{args.sweep: value})
        out = simulate(trace, dataclasses.replace(cfg, capacities=caps)).to_json()
        out["swept_tokens"] = "unlimited" if value == UNLIMITED else value
        points.append(out)
        if not args.json:
            print(f"{args.sweep} {value:g} tokens: hit ratio {out['hit_ratio']:.1%} {_shares(out)}", flush=True)
    plot_sweep(points, args.sweep, args.plot)
    return points


@contextlib.contextmanager
def saved_figure(path: str, dpi: int, **subplots: Any) -> Iterator[tuple[Any, Any]]:
    """``plt.subplots(**subplots)`` on the Agg backend (no display needed), laid out, written to
    ``path`` and closed when the block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(**subplots)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def plot_sweep(points: list[dict], tier: str, path: str) -> None:
    points = [p for p in points if p["swept_tokens"] != "unlimited"]  # a log axis has no place for "unlimited"
    xs = [p["swept_tokens"] for p in points]
    with saved_figure(path, 110, figsize=(6, 4)) as (fig, ax):
        bottom = [0.0] * len(points)
        for t in TIERS:  # each tier's share stacked on the ones before
            top = [b + p["hit_tokens"][t] / p["input_tokens"] for b, p in zip(bottom, points)]
            ax.fill_between(xs, bottom, top, step=None, alpha=0.6, label=t)
            bottom = top
        ax.plot(xs, bottom, "k.-", label="combined")
        ax.set(xscale="log", xlabel=f"{tier} capacity per engine (tokens)", ylabel="hit ratio (share of input tokens)",
               ylim=(0, 1))
        ax.legend(loc="upper left")


def read_trace_arg(args: argparse.Namespace) -> list[TraceRequest]:
    """``--trace``: a file, or ``agentic`` (generated from --seed, --time-factor, --client)."""
    if args.trace == "agentic":
        try:
            trace = agentic_trace(args.seed, args.agentic_time_factor, BLOCK_TOKENS, args.agentic_lead_turns,
                                  args.agentic_subagents, args.agentic_flood_sessions, args.agentic_client)
        except ValueError as e:
            raise ConfigError(f"--trace agentic: {e}.") from None
        return trace[:args.max_requests]
    try:
        trace = load_trace(args.trace, args.max_requests)
    except (OSError, TraceError) as e:
        raise HicacheError(f"cannot read the trace: {e}") from None
    if not trace:
        raise HicacheError(f"{args.trace} holds no requests.")
    return trace


def run_simulate(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    trace = read_trace_arg(args)
    t0 = time.perf_counter()
    policies, writes = parse_policies(args.policy), parse_storage_writes(args.hicache_storage_write_policy)
    if not args.sweep and (len(policies) * len(writes) > 1 or trace[0].cls):  # agentic: per class
        results = compare(trace, cfg, policies, writes)
        print(json.dumps({"policies": results}) if args.json else
              f"{len(trace)} requests, simulated in {time.perf_counter() - t0:.1f} s\n{policy_table(results)}")
        return 0
    result = _sweep(args, cfg, trace) if args.sweep else simulate(trace, cfg).to_json()
    if args.json:
        print(json.dumps(result))
    elif args.sweep:
        print(f"wrote {args.plot}")
    else:
        print(_report(result, time.perf_counter() - t0))
    return 0
