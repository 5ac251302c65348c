"""Rank agreement overhead with tensor / pipeline parallelism, measured side by side in one run.

    python benchmarks/bench_parallel.py [--model smollm2] [--turns 4] [--prefix 512] [--repeats 50]
                                        [--sessions 3] [--tp N] [--skip-micro] [--skip-engine]

1. Micro: the cost of one agreement with ``ParallelGroups`` in spawned processes (gloo on
   127.0.0.1): TP2 ``tp_min`` of an 8-int vector; PP2 one ``pp_sync`` hop (a StageMessage with
   8 counts and no hidden states, one way = ping-pong round trip / 2, and the receiver's
   ``perf_counter() - sent_at`` stamp); TP2xPP2 (world of 4) ``tp_min`` on both stages at once.
   Target: agreement <= 2 ms per scheduling step.
2. Engine: TTFT of a cached multi-turn session (``--prefix``-token system prefix, each turn
   appends the previous answer and 32 new user tokens, max_new_tokens=8, greedy) at TP1 vs TP
   (``--tp``, default the smallest size > 1 ``check_parallel`` accepts for the model; its
   all-reduces through shared memory, and through gloo for comparison) vs PP2, plus the
   leader's ``stats()["agreement"]`` (tp_min ms per step). Per-turn figures are the median
   of ``--sessions`` conversations (different prefixes, the same for every configuration).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from hicache import Engine, SamplingParams  # noqa: E402
from hicache.config import ConfigError  # noqa: E402
from hicache.model.parallel import check_parallel  # noqa: E402

TARGET_MS = 2.0
COUNTS = 8  # length of the agreed event-count vector
USER_TOKENS = 32
WARMUP = 10


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def med_p90(xs: list[float]) -> tuple[float, float]:
    return statistics.median(xs), float(np.percentile(xs, 90))


# ---- 1. micro: ParallelGroups directly ----------------------------------------------------------
def micro_rank(rank: int, tp: int, pp: int, init: str, repeats: int, out) -> None:
    """One rank of the micro benchmark (spawned). Puts (rank, {name: [seconds, ...]}) on ``out``."""
    import torch
    import torch.distributed as dist

    from hicache.parallel.groups import ParallelGroups, RankInfo
    from hicache.parallel.messages import StageMessage
    from hicache.runtime.step import Intake
    from hicache.runtime.events import StepEvents

    torch.set_num_threads(1)
    info = RankInfo(rank, tp, pp)
    groups = ParallelGroups(info, init, torch.device("cpu"))
    res: dict[str, list[float]] = {}
    if tp > 1:  # every stage MIN-reduces on its own TP group at the same time
        counts = [rank + i for i in range(COUNTS)]
        times = []
        for i in range(WARMUP + repeats):
            t = time.perf_counter()
            groups.tp_min(counts)
            if i >= WARMUP:
                times.append(time.perf_counter() - t)
        res["tp_min"] = times
    if pp > 1 and tp == 1:  # stage 0 <-> stage 1 ping-pong of a StageMessage
        rtt, stamped = [], []
        events = StepEvents.from_list(list(range(COUNTS)))  # 4 queue counts + 2 open prefetches
        for i in range(WARMUP + repeats):
            if info.pp_rank == 0:
                t = time.perf_counter()
                groups.send(1, StageMessage(Intake(), [], events, None, None, time.perf_counter()))
                groups.recv(1)
                if i >= WARMUP:
                    rtt.append(time.perf_counter() - t)
            else:
                msg = groups.recv(0)
                if i >= WARMUP:
                    stamped.append(time.perf_counter() - msg.sent_at)
                groups.send(0, StageMessage(msg.inputs, [], msg.events, None, None, time.perf_counter()))
        if info.pp_rank == 0:
            res["hop_rtt"] = rtt
        else:
            res["hop_stamped"] = stamped
    groups.close()
    dist.barrier()
    dist.destroy_process_group()
    out.put((rank, res))


def run_micro(tp: int, pp: int, repeats: int) -> dict[int, dict[str, list[float]]]:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=micro_rank, args=(r, tp, pp, init, repeats, out), daemon=True)
             for r in range(tp * pp)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        if p.exitcode != 0:
            raise RuntimeError(f"micro rank exited with code {p.exitcode}")
    return results


def bench_micro(repeats: int) -> float:
    """Prints the micro table; returns the worst median agreement figure in ms."""
    log(f"micro: TP2 tp_min x{repeats}")
    tp2 = run_micro(2, 1, repeats)
    log(f"micro: PP2 pp_sync hop x{repeats}")
    pp2 = run_micro(1, 2, repeats)
    log(f"micro: TP2xPP2 tp_min on both stages x{repeats}")
    tp2pp2 = run_micro(2, 2, repeats)

    rows = [
        ("TP2  tp_min (PP0/TP0)", tp2[0]["tp_min"]),
        ("TP2  tp_min (PP0/TP1)", tp2[1]["tp_min"]),
        ("PP2  pp_sync hop, round trip / 2", [t / 2 for t in pp2[0]["hop_rtt"]]),
        ("PP2  pp_sync hop, sent_at stamp", pp2[1]["hop_stamped"]),
        ("TP2xPP2 tp_min stage 0 (PP0/TP0)", tp2pp2[0]["tp_min"]),
        ("TP2xPP2 tp_min stage 1 (PP1/TP0)", tp2pp2[2]["tp_min"]),
    ]
    base = statistics.median(tp2[0]["tp_min"])
    print(f"\nagreement micro-benchmark (gloo, 127.0.0.1, {COUNTS}-int vectors, {repeats} after {WARMUP} warm-up)")
    print(f"{'operation':<36}{'median ms':>10}{'p90 ms':>9}{'vs TP2':>8}")
    for name, xs in rows:
        m, p = med_p90(xs)
        print(f"{name:<36}{m * 1e3:>10.3f}{p * 1e3:>9.3f}{m / base:>7.2f}x")
    # One scheduling step of stage 0 pays tp_min; with PP>1 a later stage also waits one hop.
    tp_ms = max(statistics.median(tp2[0]["tp_min"]), statistics.median(tp2pp2[0]["tp_min"]),
                statistics.median(tp2pp2[2]["tp_min"])) * 1e3
    hop_ms = statistics.median(pp2[0]["hop_rtt"]) / 2 * 1e3
    worst = tp_ms + hop_ms
    print(f"per scheduling step (until the last stage holds the agreed counts): tp_min {tp_ms:.3f} ms "
          f"+ pp_sync hop {hop_ms:.3f} ms = {worst:.3f} ms "
          f"-> target <= {TARGET_MS:.0f} ms: {'met' if worst <= TARGET_MS else 'not met'}")
    return worst


# ---- 2. engine: cached multi-turn session ------------------------------------------------------
def sessions(engine: Engine, args: argparse.Namespace) -> list[float]:
    """TTFT of each turn (turn 1 cold, later turns on the cached prefix), median over
    ``--sessions`` conversations with different prefixes (the same ones for every configuration)."""
    vocab = engine.loaded.spec.vocab_size
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    engine.generate([np.random.default_rng(99).integers(100, vocab, 16).tolist()], sp)  # first-forward costs
    per_turn: list[list[float]] = [[] for _ in range(args.turns)]
    for k in range(args.sessions):
        rng = np.random.default_rng(k)
        history = rng.integers(100, vocab, args.prefix).tolist()
        for turn in range(args.turns):
            history += rng.integers(100, vocab, USER_TOKENS).tolist()
            res = engine.generate([history], sp)[0]
            if turn:
                assert res.cached_tokens >= len(history) - USER_TOKENS - 8 - 2 * engine.config.page_size, \
                    res.cached_tokens_details
            per_turn[turn].append(res.ttft_s)
            history += res.output_ids
    return [statistics.median(t) for t in per_turn]


def pick_tp(spec) -> int:
    for tp in range(2, spec.num_heads + 1):
        try:
            check_parallel(spec, tp, 1)
            return tp
        except ConfigError:
            continue
    raise SystemExit(f"no TP size > 1 splits {spec.num_heads} heads / {spec.num_kv_heads} KV heads")


def bench_engine(args: argparse.Namespace, micro_ms: float | None) -> None:
    opts = dict(max_total_tokens=8192, page_size=16)
    runs: list[tuple[str, list[float], dict]] = []
    log(f"engine: TP1 ({args.model})")
    engine = Engine(args.model, **opts)
    dtype, spec = engine.config.dtype, engine.loaded.spec
    tp = args.tp or pick_tp(spec)
    check_parallel(spec, tp, 1)
    runs.append(("TP1", sessions(engine, args), {}))
    engine.shutdown()
    # TP's partial sums go through shared memory on CPU; the "gloo" run shows what that saves.
    configs = ((f"TP{tp}", {"tp_size": tp}, "shm"), (f"TP{tp}gloo", {"tp_size": tp}, "gloo"),
               ("PP2", {"pp_size": 2}, "shm"))
    for name, kw, reduce in configs:
        log(f"engine: {name} ({args.model}, {tp if 'tp_size' in kw else 2} rank processes, TP all-reduce {reduce})")
        os.environ["HICACHE_TP_ALLREDUCE"] = reduce  # read by the rank processes at start-up
        engine = Engine(args.model, **opts, **kw)
        ttft = sessions(engine, args)
        runs.append((name, ttft, engine.stats().get("agreement", {})))
        engine.shutdown()
    os.environ.pop("HICACHE_TP_ALLREDUCE")

    print(f"\nTTFT (median of {args.sessions} sessions) of a {args.turns}-turn session on {args.model} ({dtype}; {spec.num_heads} heads / "
          f"{spec.num_kv_heads} KV heads, TP{tp}): {args.prefix}-token prefix, "
          f"+{USER_TOKENS} user tokens and the previous answer per turn, max_new_tokens=8, greedy")
    print(f"{'turn':<14}" + "".join(f"{name + ' ms':>11}" for name, _, _ in runs)
          + "".join(f"{name + '/TP1':>13}" for name, _, _ in runs[1:]))
    base = runs[0][1]
    for i in range(args.turns):
        label = "1 (cold)" if i == 0 else f"{i + 1} (cached)"
        print(f"{label:<14}" + "".join(f"{t[i] * 1e3:>11.1f}" for _, t, _ in runs)
              + "".join(f"{t[i] / base[i]:>12.2f}x" for _, t, _ in runs[1:]))
    if args.turns > 1:
        means = [statistics.mean(t[1:]) for _, t, _ in runs]
        print(f"{'mean cached':<14}" + "".join(f"{m * 1e3:>11.1f}" for m in means)
              + "".join(f"{m / means[0]:>12.2f}x" for m in means[1:]))
        meds = [statistics.median(t[1:]) for _, t, _ in runs]
        print(f"{'median cached':<14}" + "".join(f"{m * 1e3:>11.1f}" for m in meds)
              + "".join(f"{m / meds[0]:>12.2f}x" for m in meds[1:]))
    print("\nleader's stats()['agreement'] (stage 0 tp_min per scheduling step, idle polls included; "
          "includes waiting for the slowest TP rank):")
    for name, _, agr in runs[1:]:
        if agr:
            ms = agr["tp_min_ms_per_step"]
            note = " (TP1 per stage: no collective)" if name.startswith("PP") else \
                f" -> target <= {TARGET_MS:.0f} ms: {'met' if ms <= TARGET_MS else 'not met'}"
            print(f"  {name:<8} steps {agr['steps']:>5}   tp_min {ms:.3f} ms/step{note}")
    ncpu = os.cpu_count() or 1
    print(f"\nnote: this machine has {ncpu} CPU cores; the {tp} (TP) and 2 (PP) rank processes share them "
          f"(TP1 uses all of them in one process). TP{tp}gloo: the model's all-reduces through gloo instead of "
          f"shared memory (HICACHE_TP_ALLREDUCE=gloo).")
    if micro_ms is not None:
        print(f"micro agreement per step: {micro_ms:.3f} ms (target <= {TARGET_MS:.0f} ms)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--tp", type=int, default=0, help="TP size of the TP run (default: the smallest > 1 the model allows)")
    ap.add_argument("--skip-micro", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    micro_ms = None if args.skip_micro else bench_micro(args.repeats)
    if not args.skip_engine:
        bench_engine(args, micro_ms)
    log(f"done in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
