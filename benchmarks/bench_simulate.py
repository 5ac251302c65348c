"""The Mooncake conversation trace under realistic budgets, simulated side by side
(``hicache simulate``'s engine; the figures in docs/simulation.md).

    python benchmarks/bench_simulate.py [--max-requests N] [--engines 4] [--plot docs/images/simulation.png]

Budgets (a 70B-class model, Llama-3-70B's KV: 80 layers x 8 KV heads x 128 x K/V x bf16 =
320 KiB per token; one engine = 8 H100s at TP8): device 1.2M tokens per engine (~390 GB of
the 640 GB left after weights and activations), host 1 TB per engine (3.05M tokens), storage
one unlimited store all engines share. Three groups of runs, every one over the whole trace:

1. tiers: device only / + host / + host + storage (cache-aware routing over ``--engines``);
2. the same with 4-way page-sharded KV (``--kv-sharding 4``: a CP4 group's device and host
   tiers hold 4x the pages, each rank its share), the seed's Figure 1d in kind;
3. routing: round-robin vs cache-aware, with and without the shared store.

Printed: hit ratio per tier and TTFT (the gpu cost profile, hicache/sim/costs.py) per run,
and the simulator's own time; the PNG stacks the hit shares per run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from hicache.sim.run import TIERS, UNLIMITED, Capacities, SimConfig, simulate  # noqa: E402
from hicache.sim.trace import SHIPPED_TRACE, load_trace  # noqa: E402

DEVICE = 1.2e6  # tokens per engine
HOST = 1e12 / 327_680  # 1 TB per engine
KV_BYTES = 327_680


def runs(engines: int) -> list[tuple[str, str, SimConfig]]:
    tiers = {"device": Capacities(DEVICE), "device + host": Capacities(DEVICE, HOST),
             "device + host + storage": Capacities(DEVICE, HOST, UNLIMITED)}
    out = []
    for sharding in (1, 4):
        group = "tiers" if sharding == 1 else "tiers, KV sharded 4-way"
        for name, caps in tiers.items():
            out.append((group, name, SimConfig(caps, engines=engines, router="cache-aware", kv_sharding=sharding)))
    for storage in (False, True):
        caps = tiers["device + host + storage" if storage else "device + host"]
        # (engines see only their own device and host tiers: what routing decides)
        for router in ("round-robin", "cache-aware"):
            label = f"{router}{', shared store' if storage else ''}"
            out.append(("routing", label, SimConfig(caps, engines=engines, router=router)))
    return out


def plot(rows: list[tuple[str, str, dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.8))
    labels = [f"{name}\n({group})" if group != "tiers" else name for group, name, _ in rows]
    bottom = [0.0] * len(rows)
    for tier, color in zip(TIERS, ("#3b7", "#37b", "#b73")):
        share = [100 * r["hit_tokens"][tier] / r["input_tokens"] for _, _, r in rows]
        ax.bar(range(len(rows)), share, bottom=bottom, color=color, label=tier)
        bottom = [b + s for b, s in zip(bottom, share)]
    for i, b in enumerate(bottom):
        ax.text(i, b + 1, f"{b:.1f}%", ha="center", fontsize=8)
    ax.set_xticks(range(len(rows)), labels, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("% of input tokens hit")
    ax.set_title("Mooncake conversation trace, 70B-class KV: hit share per tier")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-requests", type=int, default=None)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--plot", default=None, help="Write the stacked hit shares here (PNG).")
    args = ap.parse_args()
    trace = load_trace(SHIPPED_TRACE, args.max_requests)
    print(f"bench_simulate: {len(trace)} requests, {sum(r.input_length for r in trace) / 1e6:.1f}M input tokens; "
          f"{args.engines} engines; device {DEVICE / 1e6:.2f}M, host {HOST / 1e6:.2f}M tokens per engine "
          f"({KV_BYTES} B/token)", flush=True)
    print(f"\n{'group':<26}{'run':<34}{'device':>8}{'host':>8}{'storage':>9}{'total':>8}"
          f"{'TTFT mean':>11}{'p50':>8}{'p99':>8}{'sim s':>7}")
    rows = []
    for group, name, cfg in runs(args.engines):
        t0 = time.perf_counter()
        r = simulate(trace, cfg).to_json()
        shares = [r["hit_tokens"][t] / r["input_tokens"] for t in TIERS]
        print(f"{group:<26}{name:<34}" + "".join(f"{s:>8.1%}" for s in shares[:2]) + f"{shares[2]:>9.1%}"
              f"{r['hit_ratio']:>8.1%}{r['ttft_s']['mean']:>10.2f}s{r['ttft_s']['p50']:>7.2f}s"
              f"{r['ttft_s']['p99']:>7.2f}s{time.perf_counter() - t0:>7.1f}", flush=True)
        rows.append((group, name, r))
    if args.plot:
        plot(rows, args.plot)
        print(f"\nwrote {args.plot}")


if __name__ == "__main__":
    main()
