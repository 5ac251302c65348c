"""Reuse after an edit (issue 61): edit reuse vs prefix-only vs cold, side by side in one run, on the
four edit workloads of real text (src/hicache/bench/edit_workloads.py).

    .venv/bin/python benchmarks/bench_edit_reuse.py [--model smollm2 qwen2.5-coder-0.5b] [--prompts 200]
        [--size 4096] [--tokens 64] [--workloads claude_code ...] [--quick]
        [--edit-reuse-recompute-tokens 32] [--edit-reuse-max-deviation 0.35]

Three engines per model: cold (--disable-radix-cache), prefix-only (the default), edit reuse
(--enable-edit-reuse). For each (original, edited) pair, prefix-only and edit reuse are flushed,
warmed with the original prompt (one token), then sent the original extended by 48 tokens (an exact
prefix hit: its reply and TTFT with the feature on vs off), then the edited prompt; cold gets the
edited prompt alone. Each edited prompt gets ``--tokens`` greedy tokens, the first with its top
``--logprobs`` alternatives. Per workload: prompt tokens; tokens taken from the cache (prefix-only:
cached; edit reuse: cached + reused, and the recomputed ones); TTFT medians and ratios (wall, and
this process's CPU seconds to the first token, steadier on a shared machine); how often the
gate fell back to exact prefix reuse; quality vs cold (bench/edit_quality.py: position-wise greedy
agreement, first divergence, top-k KL of the first token, a lower bound), prefix-only's beside it as
the floor that exact reuse already gives; the worst reply. ``--quick``: smollm2, 1 pair per
workload, 1024-token prompts, 16 tokens (a few minutes on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from hicache import Engine, EngineConfig, GenerateResult, SamplingParams
from hicache.bench.edit_quality import agreement, first_divergence, topk_kl
from hicache.bench.edit_sources import checkout_root, doc_sections
from hicache.bench.edit_workloads import WORKLOADS, EditPair, edit_pairs

ONE = SamplingParams(max_new_tokens=1, temperature=0.0)
EXTENSION = 48  # tokens of real text after the original prompt: the exact-prefix-hit check
HAS_EDIT_REUSE = "enable_edit_reuse" in {f.name for f in dataclasses.fields(EngineConfig)}


@dataclass
class Arm:
    """One arm's result for one edited prompt."""

    ttft_s: float
    cpu_s: float  # this process's CPU seconds to the first token (all threads): steadier than wall time on a shared machine
    cached: int
    reused: int
    output: list[int]
    tops: list[tuple]  # each output token's top-k (token, logprob), most likely first
    text: str
    outcome: Any = None  # EditReuseOutcome or None (the request did not try edit reuse)

    @property
    def top(self) -> tuple:
        """The first token's top-k."""
        return self.tops[0] if self.tops else ()

    def margin(self, i: int) -> float:
        """Nats between the two likeliest tokens at output position ``i`` (a small one: a near tie)."""
        top = self.tops[i] if i < len(self.tops) else ()
        return top[0][1] - top[1][1] if len(top) > 1 else float("nan")


@dataclass
class PairRun:
    """The three arms on one pair, and the exact-prefix check (feature off, on)."""

    pair: EditPair
    arms: dict[str, Arm]
    exact: dict[str, Arm] = field(default_factory=dict)


def make_engines(model: str, k: int, edit_options: dict[str, Any]) -> dict[str, Engine]:
    """cold, prefix-only and (when this checkout has it) edit reuse with ``edit_options``."""
    engines = {"cold": Engine(model, disable_radix_cache=True, max_logprobs=k),
               "prefix": Engine(model, max_logprobs=k)}
    if HAS_EDIT_REUSE:
        engines["edit"] = Engine(model, max_logprobs=k, enable_edit_reuse=True, **edit_options)
    for e in engines.values():  # kernels warmed before anything is timed
        e.generate([list(range(100, 164))], ONE)
    return engines


def run_arm(engine: Engine, ids: list[int], sp: SamplingParams) -> Arm:
    """``engine.generate`` of one prompt, stepped here to read the CPU time at the first token."""
    engine.check_sampling(sp)
    req, sched = engine.make_request(ids, sp, None), engine.scheduler
    start, cpu = time.process_time(), 0.0
    sched.add(req)
    while sched.has_work():
        sched.step()
        if not cpu and req.first_token_time > 0:
            cpu = time.process_time() - start
    res = GenerateResult.from_request(req)
    return Arm(res.ttft_s, cpu, res.cached_tokens, getattr(res, "reused_tokens", 0), list(res.output_ids),
               [lp.top for lp in res.logprobs],
               res.text, getattr(res, "edit_reuse", None))


def run_pair(engines: dict[str, Engine], pair: EditPair, extension: list[int], sp: SamplingParams) -> PairRun:
    """Cold on the edited prompt; each cached arm: flush, warm with the original, the exact-prefix
    extension, then the edited prompt."""
    run = PairRun(pair, {"cold": run_arm(engines["cold"], pair.edited_ids, sp)})
    for arm in ("prefix", "edit"):
        if arm not in engines:
            continue
        engine = engines[arm]
        engine.flush_cache()
        engine.generate([pair.original_ids], ONE)
        run.exact[arm] = run_arm(engine, pair.original_ids + extension, sp)
        run.arms[arm] = run_arm(engine, pair.edited_ids, sp)
    return run


def pct(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole else "-"


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def reuse_row(workload: str, runs: list[PairRun]) -> str:
    """Prompt tokens, share of them taken from the cache per arm, recomputed, gate, TTFT."""
    prompt = sum(len(r.pair.edited_ids) for r in runs)
    cached = sum(r.arms["prefix"].cached for r in runs)
    ttft = {a: med([r.arms[a].ttft_s for r in runs if a in r.arms]) for a in ("cold", "prefix", "edit")}
    cpu = {a: med([r.arms[a].cpu_s for r in runs if a in r.arms]) for a in ("cold", "prefix", "edit")}
    line = f"{workload:<19} {prompt / len(runs):>7.0f} {pct(cached, prompt):>11}"
    if not all("edit" in r.arms for r in runs):
        return line + f" {'-':>11} {'-':>10} {'-':>6} {'-':>7} {ttft['cold'] * 1e3:>9.0f} {ttft['prefix'] * 1e3:>9.0f}"
    edit = [r.arms["edit"] for r in runs]
    taken = sum(a.cached + a.reused for a in edit)
    outcomes = [a.outcome for a in edit if a.outcome is not None]
    recomputed = sum(o.recomputed_tokens for o in outcomes)
    gated = sum(bool(o.gated) for o in outcomes)
    deviation = max((o.deviation for o in outcomes), default=0.0)
    return (line + f" {pct(taken, prompt):>11} {pct(recomputed, prompt):>10} {gated:>2}/{len(outcomes):<3} {deviation:>7.3f} "
            f"{ttft['cold'] * 1e3:>9.0f} {ttft['prefix'] * 1e3:>9.0f} {ttft['edit'] * 1e3:>9.0f} "
            f"{ttft['prefix'] / ttft['edit']:>8.2f}x {ttft['cold'] / ttft['edit']:>8.2f}x "
            f"{cpu['prefix'] / cpu['edit']:>8.2f}x {cpu['cold'] / cpu['edit']:>8.2f}x")


def quality(runs: list[PairRun], arm: str) -> Optional[tuple[float, float, float, int]]:
    """(mean agreement, mean KL, min agreement, pairs with a divergence) of ``arm`` vs cold."""
    done = [r for r in runs if arm in r.arms]
    if not done:
        return None
    agree = [agreement(r.arms["cold"].output, r.arms[arm].output) for r in done]
    kl = [topk_kl(r.arms["cold"].top, r.arms[arm].top) for r in done]
    diverged = sum(first_divergence(r.arms["cold"].output, r.arms[arm].output) is not None for r in done)
    return statistics.fmean(agree), statistics.fmean(kl), min(agree), diverged


def quality_row(workload: str, runs: list[PairRun]) -> str:
    cells = []
    for arm in ("edit", "prefix"):
        q = quality(runs, arm)
        cells.append(f"{'-':>8} {'-':>8} {'-':>10} {'-':>9}" if q is None else
                     f"{q[0]:>8.2%} {q[2]:>8.2%} {q[1]:>10.5f} {q[3]:>4}/{len(runs):<4}")
    return f"{workload:<19} " + "   ".join(cells)


def exact_row(workload: str, runs: list[PairRun]) -> str:
    """The exact prefix hit with the feature on vs off: equal replies, TTFT on / off."""
    both = [r for r in runs if "edit" in r.exact]
    if not both:
        return f"{workload:<19} (edit-reuse arm skipped)"
    equal = sum(r.exact["edit"].output == r.exact["prefix"].output for r in both)
    on, off = med([r.exact["edit"].ttft_s for r in both]), med([r.exact["prefix"].ttft_s for r in both])
    cpu_on, cpu_off = med([r.exact["edit"].cpu_s for r in both]), med([r.exact["prefix"].cpu_s for r in both])
    cached = sum(r.exact["edit"].cached for r in both) / len(both)
    return (f"{workload:<19} {equal:>3}/{len(both):<3} equal   TTFT on {on * 1e3:>6.0f} ms, off {off * 1e3:>6.0f} ms "
            f"({on / off:.2f}x; CPU {cpu_on / cpu_off:.2f}x)   {cached:.0f} cached")


def worst(runs: list[PairRun]) -> Optional[PairRun]:
    """The pair whose edit-reuse reply agrees least with cold (then: the highest first-token KL)."""
    done = [r for r in runs if "edit" in r.arms]
    return min(done, default=None, key=lambda r: (agreement(r.arms["cold"].output, r.arms["edit"].output),
                                                   -topk_kl(r.arms["cold"].top, r.arms["edit"].top)))


def print_report(model: str, by_workload: dict[str, list[PairRun]], engines: dict[str, Engine]) -> None:
    print(f"\n== {model}: reuse and TTFT (medians; edited prompts; % of the prompt tokens; max dev: the gate's "
          f"largest deviation; CPU: this process's CPU seconds to the first token) ==")
    print(f"{'workload':<19} {'prompt':>7} {'prefix-only':>11} {'edit reuse':>11} {'recomputed':>10} {'gated':>6} {'max dev':>7} "
          f"{'cold ms':>9} {'prefix ms':>9} {'edit ms':>9} {'prefix/edit':>9} {'cold/edit':>9} "
          f"{'CPU p/e':>9} {'CPU c/e':>9}")
    for w, runs in by_workload.items():
        print(reuse_row(w, runs))
    print(f"\n== {model}: quality vs cold (greedy, position-wise agreement; KL of the first token) ==")
    print(f"{'':<19} {'edit reuse: agree':>17} {'min':>8} {'KL nats':>10} {'diverged':>9}   "
          f"{'prefix-only: agree':>18} {'min':>8} {'KL nats':>10} {'diverged':>9}")
    for w, runs in by_workload.items():
        print(quality_row(w, runs))
    print(f"\n== {model}: exact prefix hits, edit reuse on vs off ==")
    for w, runs in by_workload.items():
        print(exact_row(w, runs))
    every = [r for runs in by_workload.values() for r in runs]
    bad = worst(every)
    if bad is not None:
        a = agreement(bad.arms["cold"].output, bad.arms["edit"].output)
        at = first_divergence(bad.arms["cold"].output, bad.arms["edit"].output)
        margin = "" if at is None else (f", where cold's two likeliest tokens are {bad.arms['cold'].margin(at):.3f} "
                                        f"nats apart, edit reuse's {bad.arms['edit'].margin(at):.3f}")
        print(f"\nworst edit-reuse reply ({bad.pair.workload} #{bad.pair.index}, {bad.pair.change}; agreement {a:.0%}, "
              f"first divergence at token {at}{margin}):")
        print(f"  edit reuse: {bad.arms['edit'].text!r}\n  cold:       {bad.arms['cold'].text!r}")
        print(f"engine stats edit_reuse: {engines['edit'].stats().get('edit_reuse')}")


def run_model(model: str, args: argparse.Namespace) -> None:
    started = time.perf_counter()
    edit_options = {k: v for k, v in (("edit_reuse_recompute_tokens", args.edit_reuse_recompute_tokens),
                                      ("edit_reuse_max_deviation", args.edit_reuse_max_deviation)) if v is not None}
    engines = make_engines(model, args.logprobs, edit_options)
    tok = engines["prefix"].tokenizer
    extension = tok.encode(doc_sections(checkout_root())[0].text)[:EXTENSION]
    sp = SamplingParams(max_new_tokens=args.tokens, temperature=0.0, logprobs=args.logprobs)
    print(f"\nmodel={model} dtype={engines['prefix'].config.dtype} page={engines['prefix'].config.page_size} "
          f"pairs/workload={args.prompts} target={args.size} tokens={args.tokens} top-k={args.logprobs} "
          f"edit reuse {edit_options or 'defaults'}", flush=True)
    by_workload: dict[str, list[PairRun]] = {}
    try:
        for w in args.workloads:
            by_workload[w] = []
            for pair in edit_pairs(w, tok, args.prompts, seed=args.seed, target_tokens=args.size):
                run = run_pair(engines, pair, extension, sp)
                by_workload[w].append(run)
                ttft = " ".join(f"{a} {x.ttft_s * 1e3:.0f}ms" for a, x in run.arms.items())
                edit = run.arms.get("edit")
                got = f"; reused {edit.reused}, {edit.outcome}" if edit is not None else ""
                print(f"  [{time.perf_counter() - started:6.0f}s] {w} #{pair.index}: {len(pair.edited_ids)} tokens, "
                      f"{pair.change}; TTFT {ttft}{got}", flush=True)
        print_report(model, by_workload, engines)
        print("load average (1, 5, 15 min; other processes share these CPUs): %.1f %.1f %.1f" % os.getloadavg())
    finally:
        for e in engines.values():
            e.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=None, help="default: smollm2 qwen2.5-coder-0.5b (--quick: smollm2)")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--prompts", type=int, default=None, help="pairs per workload (default 200; --quick: 1)")
    ap.add_argument("--size", type=int, default=None, help="target prompt tokens (default 4096; --quick: 1024)")
    ap.add_argument("--tokens", type=int, default=None, help="greedy tokens per reply (default 64; --quick: 16)")
    ap.add_argument("--logprobs", type=int, default=20, help="top-k of the first token's distribution (KL)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--edit-reuse-recompute-tokens", type=int, default=None, help="the engine flag (default: its)")
    ap.add_argument("--edit-reuse-max-deviation", type=float, default=None, help="the engine flag (default: its)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    quick = args.quick
    args.model = args.model or (["smollm2"] if quick else ["smollm2", "qwen2.5-coder-0.5b"])
    args.prompts = args.prompts or (1 if quick else 200)
    args.size = args.size or (1024 if quick else 4096)
    args.tokens = args.tokens or (16 if quick else 64)
    if not HAS_EDIT_REUSE:
        print("edit-reuse arm skipped: this checkout's Engine has no enable_edit_reuse option (issue 61's engine "
              "side not landed); running cold and prefix-only.")
    for model in args.model:
        run_model(model, args)


if __name__ == "__main__":
    main()
