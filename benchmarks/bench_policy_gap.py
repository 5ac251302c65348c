"""The distance to the optimal policy (issue 60 item 5): LRU and LRU + hints against Belady's
offline optimal (``hicache simulate --policy belady``), on the agentic trace and the shipped
Mooncake conversation trace, at three capacities each; then the L3 each writes, every host copy
(write_through) or only retained and hit-twice prefixes (selective).

    python benchmarks/bench_policy_gap.py [--max-requests 2000] [--json out.json]

Capacities are fractions of each trace's live set (:func:`hicache.sim.agentic.live_set_tokens`:
the real tokens of the distinct blocks alive at the peak), device = live / f, host = 2 x device:
f = 6, 3, 1.5 for Mooncake; f = 3, 2, 1.5 for the agentic trace, each raised to the trace's
longest prompt where it is less (the agentic lead's last turn is ~2/5 of its live set). The
agentic trace is ``hicache bench --dataset agentic``'s default (seed 1, the claude-code client).
The L3 runs take the middle capacity and a store of twice the live set (a store no larger than
the host tier adds nothing under write_through: it holds a subset of what the host holds). One
engine; bytes at the gpu cost profile's 320 KiB per token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from hicache.sim.agentic import agentic_trace, live_set_tokens  # noqa: E402
from hicache.sim.compare import compare, format_rows  # noqa: E402
from hicache.sim.run import TIERS, Capacities, SimConfig, min_device_tokens  # noqa: E402
from hicache.sim.trace import SHIPPED_TRACE, load_trace  # noqa: E402

FRACTIONS = {"agentic": (3, 2, 1.5), "mooncake": (6, 3, 1.5)}
POLICIES = ("lru", "lru+hints", "belady")


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _row(trace: str, caps: str, name: str, out: dict) -> list[str]:
    g, n = out["gap_to_belady"], max(out["input_tokens"], 1)
    lead = out.get("per_class", {}).get("lead")
    return [trace, caps, name, *(_pct(out["hit_tokens"][t] / n) for t in TIERS[:2]), _pct(out["hit_ratio"]),
            f"{g['points']:.1f}", _pct(g["share_of_optimal"]), _pct(lead["hit_ratio"]) if lead else ""]


def memory_runs(traces: dict[str, list]) -> tuple[list[list[str]], dict]:
    rows = [["trace", "device / host (tokens)", "policy", "device", "host", "total", "gap (points)", "of optimal",
             "lead"]]
    raw = {}
    for name, trace in traces.items():
        live, least = live_set_tokens(trace), min_device_tokens(trace, SimConfig())
        for f in FRACTIONS[name]:
            device = max(live / f, least)
            caps = f"live/{live / device:.2g}: {device / 1e3:,.0f}K / {2 * device / 1e3:,.0f}K"
            results = compare(trace, SimConfig(Capacities(device, 2 * device)), POLICIES)
            raw[f"{name} {caps}"] = results
            rows += [_row(name, caps, p, out) for p, out in results.items()]
            print(f"{name} {caps} done", file=sys.stderr, flush=True)
    return rows, raw


def storage_runs(traces: dict[str, list]) -> tuple[list[list[str]], dict]:
    rows = [["trace", "policy, L3 writes", "device", "host", "storage", "total", "gap (points)", "L3 written (GB)"]]
    raw = {}
    for name, trace in traces.items():
        live = live_set_tokens(trace)
        device = max(live / FRACTIONS[name][1], min_device_tokens(trace, SimConfig()))
        results = compare(trace, SimConfig(Capacities(device, 2 * device, 2 * live)), POLICIES,
                          ["write_through", "selective"])
        raw[name] = results
        for p, out in results.items():
            n = max(out["input_tokens"], 1)
            rows.append([name, p, *(_pct(out["hit_tokens"][t] / n) for t in TIERS), _pct(out["hit_ratio"]),
                         f"{out['gap_to_belady']['points']:.1f}", f"{out['storage_written_bytes'] / 1e9:,.0f}"])
        print(f"{name} with L3 done", file=sys.stderr, flush=True)
    return rows, raw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-requests", type=int, default=2000, help="The Mooncake trace's first N requests.")
    ap.add_argument("--json", default=None, help="Also write every run's result here.")
    args = ap.parse_args()
    traces = {"agentic": agentic_trace(seed=1), "mooncake": load_trace(SHIPPED_TRACE, args.max_requests)}
    t0 = time.perf_counter()
    mem, mem_raw = memory_runs(traces)
    l3, l3_raw = storage_runs(traces)
    print(format_rows(mem))
    print()
    print(format_rows(l3))
    print(f"\n{time.perf_counter() - t0:.0f} s ({len(traces['agentic'])} agentic requests, "
          f"{len(traces['mooncake'])} Mooncake requests)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"memory": mem_raw, "storage": l3_raw}, f)


if __name__ == "__main__":
    main()
