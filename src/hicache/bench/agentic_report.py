"""The agentic replay's report, per class of request (lead, subagent, flood).

Ratios are of tokens the server reported (usage): ``hit_ratio`` = cached / prompt tokens;
``prefix_hit_ratio`` = of the tokens a turn shares with its session's previous prompt (its
prompt tokens, cut to whole KV pages: a turn's prompt extends the previous one, and the cache
holds whole pages), the part served from the cache (turns 2+): a cache that lost nothing scores
1. TTFT in ms; "after pause" are the first requests after a tool pause, "warm" the lead's turns
after a quick tool; beside TTFT (on a small CPU mostly the flood's requests sharing it), the
prompt tokens each computed (the cache's share of TTFT). The subagents' prefill ratio: prompt
tokens the subagents' first turns computed, over one first turn's prompt tokens (what one
subagent computes alone and cold).
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from ..sim.trace import TraceRequest
from .client import RequestRecord

CLASSES = ("lead", "subagent", "flood")


def _ms(values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values)
    return {"n": len(ms), "mean": statistics.fmean(ms) if ms else 0.0, "p50": statistics.median(ms) if ms else 0.0}


def _mean(values: list[int]) -> float | None:
    return statistics.fmean(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if b else None


def class_summary(pairs: Sequence[tuple[TraceRequest, RequestRecord]], previous: dict[int, int]) -> dict[str, Any]:
    """One class's figures; ``previous``: id(record) -> its session's previous prompt tokens."""
    ok = [(q, r) for q, r in pairs if r.ok]
    prompt, cached = sum(r.prompt_tokens for _, r in ok), sum(r.cached_tokens for _, r in ok)
    shared = [(previous[id(r)], min(r.cached_tokens, previous[id(r)])) for _, r in ok if id(r) in previous]
    paused = [r for q, r in ok if q.after_pause]
    warm = [r for q, r in ok if q.turn > 1 and not q.after_pause]
    retained = [r.retention for _, r in ok if r.retention]
    tiers: dict[str, int] = {}
    for q, r in ok:
        if q.after_pause:  # where a pause left the prefix: the device, or demoted to the host (or storage)
            for t, n in r.cached_tiers.items():
                tiers[t] = tiers.get(t, 0) + n
    return {"requests": len(pairs), "failed": len(pairs) - len(ok), "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_ratio": _ratio(cached, prompt),
            "prefix_hit_ratio": _ratio(sum(h for _, h in shared), sum(p for p, _ in shared)),
            "ttft_ms": _ms([r.ttft_s for _, r in ok]), "ttft_after_pause_ms": _ms([r.ttft_s for r in paused]),
            "ttft_warm_ms": _ms([r.ttft_s for r in warm]),
            "computed_after_pause": _mean([r.prompt_tokens - r.cached_tokens for r in paused]),
            "computed_warm": _mean([r.prompt_tokens - r.cached_tokens for r in warm]),
            "after_pause_cached_by_tier": tiers,
            "retention": {"reported": len(retained), "retained_tokens": sum(x.get("retained_tokens") or 0
                                                                            for x in retained),
                          "clipped": sum(1 for x in retained if x.get("clipped"))}}


def agentic_summary(reqs: Sequence[TraceRequest], records: Sequence[RequestRecord], page_size: int = 1) -> dict[str, Any]:
    """Per class figures and the ratios issue 60's "Show" asks for (None where undefined);
    ``page_size``: the server's tokens per KV page."""
    pairs = list(zip(reqs, records))
    last: dict[str, RequestRecord] = {}
    previous: dict[int, int] = {}
    for q, r in pairs:  # arrival order is each session's turn order
        if q.session in last and last[q.session].ok:
            previous[id(r)] = last[q.session].prompt_tokens // page_size * page_size
        last[q.session] = r
    classes = {c: class_summary([p for p in pairs if p[0].cls == c], previous) for c in CLASSES}
    lead = classes["lead"]
    firsts = [r for q, r in pairs if q.cls == "subagent" and q.turn == 1 and r.ok]
    computed = sum(r.prompt_tokens - r.cached_tokens for r in firsts)
    one = statistics.fmean(r.prompt_tokens for r in firsts) if firsts else 0.0
    return {"classes": classes, "show": {
        "lead_prefix_hit_ratio": lead["prefix_hit_ratio"],
        "ttft_after_pause_over_warm_p50": _ratio(lead["ttft_after_pause_ms"]["p50"], lead["ttft_warm_ms"]["p50"]),
        "ttft_after_pause_over_warm_mean": _ratio(lead["ttft_after_pause_ms"]["mean"], lead["ttft_warm_ms"]["mean"]),
        "prefill_after_pause_over_warm": _ratio(lead["computed_after_pause"], lead["computed_warm"]),
        "subagents": len(firsts), "subagents_prefill_tokens": computed,
        "subagents_prefill_over_one": _ratio(computed, one)}}


def outputs(reqs: Sequence[TraceRequest], records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """Each request's reply and figures, in trace order (greedy replays compare the replies token
    for token)."""
    return [{"session": q.session, "turn": q.turn, "after_pause": q.after_pause, "ok": r.ok, "text": r.text,
             "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens, "cached_tiers": r.cached_tiers,
             "ttft_ms": round(r.ttft_s * 1000, 2)}
            for q, r in zip(reqs, records)]


def _f(x: float | None, pct: bool = False) -> str:
    return "-" if x is None else f"{x:.1%}" if pct else f"{x:.2f}"


def format_agentic(summary: dict[str, Any]) -> str:
    lines = [f"{' Agentic trace, by class ':-^84}",
             f"{'class':<9}{'req':>5}{'prompt tok':>11}{'hit':>8}{'prefix hit':>11}{'TTFT mean':>10}"
             f"{'TTFT p50':>10}{'pause p50':>10}{'warm p50':>10}"]
    for c, d in summary["classes"].items():
        lines.append(f"{c:<9}{d['requests']:>5}{d['prompt_tokens']:>11}{_f(d['hit_ratio'], True):>8}"
                     f"{_f(d['prefix_hit_ratio'], True):>11}{d['ttft_ms']['mean']:>10.1f}{d['ttft_ms']['p50']:>10.1f}"
                     f"{d['ttft_after_pause_ms']['p50']:>10.1f}{d['ttft_warm_ms']['p50']:>10.1f}")
    s = summary["show"]
    tiers = summary["classes"]["lead"]["after_pause_cached_by_tier"]
    lines += [f"lead after a pause, hits by tier: {', '.join(f'{t} {n}' for t, n in tiers.items()) or '-'}",
              f"lead prefix hit ratio: {_f(s['lead_prefix_hit_ratio'], True)}; lead TTFT after a pause / warm: "
              f"p50 {_f(s['ttft_after_pause_over_warm_p50'])}, mean {_f(s['ttft_after_pause_over_warm_mean'])}; "
              f"prompt tokens computed after a pause / warm: {_f(s['prefill_after_pause_over_warm'])}",
              f"{s['subagents']} subagents' first turns computed {s['subagents_prefill_tokens']} prompt tokens: "
              f"{_f(s['subagents_prefill_over_one'])}x one first turn's prompt"]
    return "\n".join(lines)
