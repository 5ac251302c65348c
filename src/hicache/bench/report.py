"""Turn request records into a report: numbers (JSON-ready), a printed table, a PNG."""

from __future__ import annotations

import re
import statistics
from collections import Counter
from typing import Any

from .client import RequestRecord

_TIER = re.compile(r'^hicache_cached_tokens_total\{tier="(\w+)"\}$')


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _dist_ms(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {"mean": statistics.fmean(ms) if ms else 0.0, "median": _pct(ms, 0.5), "p90": _pct(ms, 0.9),
            "p99": _pct(ms, 0.99)}


def server_hit_rates(before: dict[str, float], after: dict[str, float]) -> dict[str, Any] | None:
    """Per-tier hit rate over the run from hicache's /metrics counters; None if not hicache."""
    if not after or "hicache_prompt_tokens_total{}" not in after:
        return None
    prompt = after["hicache_prompt_tokens_total{}"] - before.get("hicache_prompt_tokens_total{}", 0.0)
    tiers = {m.group(1): value - before.get(key, 0.0) for key, value in after.items() if (m := _TIER.match(key))}
    rates = {t: (n / prompt if prompt else 0.0) for t, n in tiers.items()}
    return {"prompt_tokens": prompt, "cached_tokens": tiers, "hit_rate": rates,
            "total_hit_rate": sum(rates.values())}


def server_speculation(before: dict[str, float], after: dict[str, float]) -> dict[str, Any] | None:
    """Accept length over the run (tokens per verify pass, token-weighted, as SGLang's
    bench_serving reports it) from hicache's /metrics; None when the server does not speculate."""
    steps, tokens = (after.get(key, 0.0) - before.get(key, 0.0)
                     for key in ("hicache_spec_verify_steps_sum{}", "hicache_spec_accepted_tokens_total{}"))
    if steps <= 0:
        return None
    return {"verify_steps": steps, "accepted_tokens": tokens, "accept_length": tokens / steps}


def summarize(records: list[RequestRecord], duration_s: float, workload: dict[str, Any],
              metrics_before: dict[str, float], metrics_after: dict[str, float], client_cpu_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    inp = sum(r.prompt_tokens for r in ok)
    out = sum(r.completion_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    by_turn: dict[int, list[RequestRecord]] = {}
    for r in ok:
        by_turn.setdefault(r.turn, []).append(r)
    turns = {
        t: {"requests": len(rs), "ttft_ms": _dist_ms([r.ttft_s for r in rs]),
            "prompt_tokens": statistics.fmean(r.prompt_tokens for r in rs),
            "hit_rate": (sum(r.cached_tokens for r in rs) / max(sum(r.prompt_tokens for r in rs), 1))}
        for t, rs in sorted(by_turn.items())
    }
    errors = dict(Counter(r.error for r in records if not r.ok))
    return {
        "workload": workload,
        "completed": len(ok), "failed": len(records) - len(ok), "errors": errors,
        "duration_s": duration_s,
        "total_input_tokens": inp, "total_output_tokens": out, "total_cached_tokens": cached,
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "input_throughput": inp / duration_s if duration_s else 0.0,
        "output_throughput": out / duration_s if duration_s else 0.0,
        "total_token_throughput": (inp + out) / duration_s if duration_s else 0.0,
        "ttft_ms": _dist_ms([r.ttft_s for r in ok]),
        "itl_ms": _dist_ms([x for r in ok for x in r.itl_s]),
        "e2e_ms": _dist_ms([r.e2e_s for r in ok]),
        "usage_hit_rate": cached / inp if inp else 0.0,
        "by_turn": turns,
        "server_cache": server_hit_rates(metrics_before, metrics_after),
        "speculative": server_speculation(metrics_before, metrics_after),
        "client_cpu_s": client_cpu_s,
        "client_cpu_util": client_cpu_s / duration_s if duration_s else 0.0,
    }


def format_report(rep: dict[str, Any]) -> str:
    w = rep["workload"]
    lines = [f"{' hicache bench ':=^60}"]

    def row(label: str, value: Any) -> None:
        text = str(value)
        lines.append(f"{label:<40}{text:>20}" if len(text) <= 20 else f"{label} {text}")

    row("Base URL:", w.get("base_url", ""))
    row("Model:", w.get("model", ""))
    row("Workload:", w.get("name", ""))
    row("Successful requests:", rep["completed"])
    row("Failed requests:", rep["failed"])
    row("Benchmark duration (s):", f"{rep['duration_s']:.2f}")
    row("Total input tokens:", rep["total_input_tokens"])
    row("Total cached input tokens (usage):", rep["total_cached_tokens"])
    row("Total output tokens:", rep["total_output_tokens"])
    row("Request throughput (req/s):", f"{rep['request_throughput']:.2f}")
    row("Input token throughput (tok/s):", f"{rep['input_throughput']:.1f}")
    row("Output token throughput (tok/s):", f"{rep['output_throughput']:.1f}")
    row("Total token throughput (tok/s):", f"{rep['total_token_throughput']:.1f}")
    for key, title in (("ttft_ms", "Time to First Token"), ("itl_ms", "Inter-Token Latency"),
                       ("e2e_ms", "End-to-End Latency")):
        lines.append(f"{' ' + title + ' (ms) ':-^60}")
        for stat in ("mean", "median", "p90", "p99"):
            row(f"{stat.capitalize()}:", f"{rep[key][stat]:.2f}")
    lines.append(f"{' Cache hit rate ':-^60}")
    row("Hit rate from usage (cached/input):", f"{rep['usage_hit_rate']:.1%}")
    sc = rep.get("server_cache")
    if sc:
        for tier, rate in sc["hit_rate"].items():
            row(f"Server /metrics hit rate, {tier}:", f"{rate:.1%}")
        row("Server /metrics hit rate, all tiers:", f"{sc['total_hit_rate']:.1%}")
    else:
        row("Server /metrics:", "not hicache")
    spec = rep.get("speculative")
    if spec:
        lines.append(f"{' Speculative decoding ':-^60}")
        row("Accept length:", f"{spec['accept_length']:.2f}")
        row("Verify steps:", f"{spec['verify_steps']:.0f}")
    lines.append(f"{' By turn ':-^60}")
    lines.append(f"{'turn':>6}{'requests':>10}{'prompt tok':>12}{'hit rate':>10}{'TTFT mean':>11}{'TTFT p90':>11}")
    for t, d in rep["by_turn"].items():
        lines.append(f"{t:>6}{d['requests']:>10}{d['prompt_tokens']:>12.0f}{d['hit_rate']:>10.1%}"
                     f"{d['ttft_ms']['mean']:>11.2f}{d['ttft_ms']['p90']:>11.2f}")
    lines.append(f"{' Client ':-^60}")
    row("Client CPU time (s):", f"{rep['client_cpu_s']:.2f}")
    row("Client CPU use (fraction of one core):", f"{rep['client_cpu_util']:.1%}")
    lines.extend(f"error x{n}: {err}" for err, n in rep["errors"].items())
    lines.append("=" * 60)
    return "\n".join(lines)


def plot_report(rep: dict[str, Any], path: str) -> None:
    """PNG: TTFT by turn (mean and p90), and hit rate by tier (server) or by turn (usage)."""
    from ..sim.cli import saved_figure

    with saved_figure(path, 100, nrows=1, ncols=2, figsize=(11, 4)) as (fig, (ax1, ax2)):
        turns = list(rep["by_turn"])
        ax1.plot(turns, [rep["by_turn"][t]["ttft_ms"]["mean"] for t in turns], marker="o", label="mean")
        ax1.plot(turns, [rep["by_turn"][t]["ttft_ms"]["p90"] for t in turns], marker="s", label="p90")
        ax1.set(title="TTFT by turn", xlabel="turn", ylabel="ms", xticks=turns)
        ax1.legend()
        sc = rep.get("server_cache")
        if sc:
            tiers = list(sc["hit_rate"])
            ax2.bar(tiers, [100 * sc["hit_rate"][t] for t in tiers], color=["#3b7", "#37b", "#b73"][: len(tiers)])
            ax2.set(title="Cache hit rate by tier (server /metrics)", ylabel="% of prompt tokens", ylim=(0, 100))
        else:
            ax2.bar([str(t) for t in turns], [100 * rep["by_turn"][t]["hit_rate"] for t in turns])
            ax2.set(title="Cache hit rate by turn (usage)", xlabel="turn", ylabel="% of prompt tokens",
                    ylim=(0, 100))
        fig.suptitle(f"{rep['workload'].get('name', '')} on {rep['workload'].get('model', '')}", fontsize=9)
