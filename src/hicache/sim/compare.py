"""Eviction policies side by side on one trace and one set of capacities, and each one's distance
to the offline optimal (``hicache simulate --policy lru,lru+hints,belady``).

Units: hit ratios are shares of the trace's input tokens; a gap is in percentage points
(``belady - policy``) and as the policy's share of the optimal's hits; L3 writes are real tokens
and bytes at the cost profile's KV bytes per token.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from ..config import ConfigError
from .run import POLICIES, TIERS, SimConfig, simulate

STORAGE_WRITES = ("write_through", "selective")  # --hicache-storage-write-policy
from .trace import TraceRequest


def parse_policies(text: str) -> list[str]:
    """``lru,belady`` -> the names, each once, in the order given."""
    names = list(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise ConfigError(f"--policy takes {', '.join(POLICIES)} (comma-separated), not {text!r}.")
    return names


def gap(out: dict, optimal: dict) -> dict:
    """``out``'s distance to ``optimal`` (both :meth:`SimResult.to_json`): points and share."""
    best, hit = optimal["hit_ratio"], out["hit_ratio"]
    return {"points": 100 * (best - hit), "share_of_optimal": hit / best if best else None}


def parse_storage_writes(text: str) -> list[str]:
    """``write_through,selective`` -> the names, each once, in the order given."""
    names = list(dict.fromkeys(w.strip() for w in text.split(",") if w.strip()))
    if not names or any(w not in STORAGE_WRITES for w in names):
        raise ConfigError(f"--hicache-storage-write-policy takes {', '.join(STORAGE_WRITES)} (comma-separated), "
                          f"not {text!r}.")
    return names


def compare(trace: Sequence[TraceRequest], cfg: SimConfig, policies: Sequence[str],
            storage_writes: Sequence[str] = ()) -> dict[str, dict]:
    """Each policy's result on ``trace`` at ``cfg``'s capacities, by name (``policy, storage write
    policy`` with several of those; none given: ``cfg``'s). With ``belady`` among them, each carries
    ``gap_to_belady`` (and each class's, under ``per_class``): the distance to belady writing
    every host copy to storage (the first belady run when that one is not among them)."""
    writes = list(storage_writes) or [cfg.storage_write_policy]
    results = {}
    for w in writes:
        for p in policies:
            name = p if len(writes) == 1 else f"{p}, {w}"
            results[name] = simulate(trace, replace(cfg, policy=p, storage_write_policy=w)).to_json()
    optimal = results.get("belady", results.get("belady, write_through"))
    if optimal is None:
        optimal = next((out for out in results.values() if out["config"]["policy"] == "belady"), None)
    if optimal is not None:
        for out in results.values():
            out["gap_to_belady"] = gap(out, optimal)
            for name, cls in out.get("per_class", {}).items():
                cls["gap_to_belady"] = gap(cls, optimal["per_class"][name])
    return results


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:.1%}"


def _gap_cells(out: dict) -> list[str]:
    g = out.get("gap_to_belady")
    return ["", ""] if g is None else [f"{g['points']:+.1f}", _pct(g["share_of_optimal"])]


def policy_table(results: dict[str, dict]) -> str:
    """Per policy: hit ratio per tier and total, gap to belady, L3 writes; then per class."""
    storage = any(out["config"]["capacities"]["storage"] is not None for out in results.values())
    rows = [["policy", *TIERS, "total", "gap (points)", "of optimal"]
            + (["L3 written (tokens)", "L3 written (GB)"] if storage else [])]
    for name, out in results.items():
        shares = [_pct(out["hit_tokens"][t] / max(out["input_tokens"], 1)) for t in TIERS]
        written = [f"{out['storage_written_tokens']:,}", f"{out['storage_written_bytes'] / 1e9:.1f}"]
        rows.append([name, *shares, _pct(out["hit_ratio"]), *_gap_cells(out), *(written if storage else [])])
    classes = sorted({c for out in results.values() for c in out.get("per_class", {})})
    if classes:
        rows.append([])
        rows.append(["class / policy", *TIERS, "total", "gap (points)", "of optimal"])
        for c in classes:
            for name, out in results.items():
                cls = out["per_class"][c]
                shares = [_pct(cls["hit_tokens"][t] / max(cls["input_tokens"], 1)) for t in TIERS]
                rows.append([f"{c} / {name}", *shares, _pct(cls["hit_ratio"]), *_gap_cells(cls)])
    return format_rows(rows)


def format_rows(rows: list[list[str]]) -> str:
    """Left-aligned columns, two spaces apart; an empty row is a blank line."""
    width = [max(len(r[i]) for r in rows if i < len(r)) for i in range(max(map(len, rows)))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, width)).rstrip() for r in rows)
