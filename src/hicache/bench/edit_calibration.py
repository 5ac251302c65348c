"""Calibrating edit reuse's quality gate for one model (issue 61): ``hicache calibrate-edit-reuse``.

For each edit pair of the benchmark's workloads (bench/edit_workloads.py: real text), the edited
prompt runs twice: cold (every token computed: the reference) and with edit reuse after its
original, the gate open (it measures, never refuses). Each pair gives the gate's deviation and the
quality against the reference, teacher-forced at a few positions of cold's reply (:data:`PROBES`):
the mean KL divergence of the next-token distributions (top-k lower bound, bench/edit_quality.py)
and the share whose most likely token is cold's. The threshold is the largest deviation at which the
pairs the gate would keep (deviation at or under it) hold the targets: top-1 agreement at least
:data:`TARGET_TOP1` over them, every pair's KL at most ``target_kl`` (a mean would let a few bad replies through: smollm2's reordered passages at 0.6-0.85
deviation read 0.006-0.036 nats, and their greedy replies part from cold within a few tokens). Written (``--write``) into the
table the engine reads when ``--edit-reuse-max-deviation`` is not given (runtime/edit_reuse.py).

Units: deviations are relative L2 (the gate's); KL in nats.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

from ..frontend.engine import Engine
from ..runtime.edit_reuse import CALIBRATION_FILE
from ..runtime.sampling import SamplingParams
from .edit_quality import agreement, topk_kl
from .edit_workloads import WORKLOADS, EditPair, edit_pairs

TARGET_TOP1 = 0.99  # the kept pairs' probes whose most likely token is cold's (the issue's top-1 agreement)
WORST_KL_FACTOR = 1.0  # no kept pair's KL over this many times the target: the target bounds every kept pair
OPEN_GATE = 1e9  # a threshold no deviation reaches: the gate measures and keeps every span
PROBES = (0, 8, 16, 24)  # positions of cold's reply where edit reuse's next-token distribution is compared


@dataclass(frozen=True)
class PairQuality:
    workload: str
    index: int
    deviation: float
    kl: float  # mean teacher-forced KL over the probes
    top1: float  # share of the probes whose most likely token is cold's
    agreement: float  # the greedy replies' position-wise agreement (free-running: reported, not a criterion)
    reused: int
    prompt: int


def probe_pair(cold: Engine, edit: Engine, pair: EditPair, sp: SamplingParams) -> PairQuality:
    """One pair: cold's greedy reply R, then edit reuse's distribution at each of :data:`PROBES`
    positions of R with R's tokens before it in the context (teacher-forced: the later probes are
    the edited prompt + R[:j], whose edited part hits the approximate KV the first one left)."""
    ref = cold.generate([pair.edited_ids], sp)[0]
    edit.flush_cache()
    edit.generate([pair.original_ids], SamplingParams(max_new_tokens=1))
    got = edit.generate([pair.edited_ids], sp)[0]
    probes = [j for j in PROBES if j < len(ref.output_ids)]
    one = SamplingParams(max_new_tokens=1, temperature=0, logprobs=sp.logprobs)
    tops = [got.logprobs[0]] + [edit.generate([pair.edited_ids + ref.output_ids[:j]], one)[0].logprobs[0]
                                for j in probes[1:]]
    kls = [topk_kl(ref.logprobs[j].top, top.top) for j, top in zip(probes, tops)]
    top1 = sum(top.top[0][0] == ref.output_ids[j] for j, top in zip(probes, tops)) / len(probes)
    tried = got.edit_reuse
    return PairQuality(pair.workload, pair.index, tried.deviation if tried else 0.0, sum(kls) / len(kls), top1,
                       agreement(ref.output_ids, got.output_ids), got.reused_tokens, got.prompt_tokens)


def measure(model: str, workloads: Sequence[str], pairs: int, target_tokens: int, new_tokens: int,
            top_k: int = 20) -> list[PairQuality]:
    """Every pair's deviation and quality (see the module docstring), printed as it goes."""
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0, logprobs=top_k)
    cold = Engine(model, disable_radix_cache=True, max_logprobs=top_k)
    edit = Engine(model, enable_edit_reuse=True, edit_reuse_max_deviation=OPEN_GATE, max_logprobs=top_k)
    out: list[PairQuality] = []
    try:
        for workload in workloads:
            for pair in edit_pairs(workload, edit.tokenizer, pairs, target_tokens=target_tokens):
                q = probe_pair(cold, edit, pair, sp)
                print(f"  {workload}[{pair.index}] deviation {q.deviation:.3f} KL {q.kl:.4f} top-1 {q.top1:.2f} "
                      f"free-running agreement {q.agreement:.2f} reused {q.reused}/{q.prompt}", flush=True)
                out.append(q)
    finally:
        cold.shutdown()
        edit.shutdown()
    return out


def threshold(pairs: Sequence[PairQuality], target_kl: float) -> Optional[float]:
    """The largest deviation whose kept pairs (deviation at or under it, only pairs that reused
    something) meet the targets; None when not even the least deviating pair does."""
    tried = sorted((p for p in pairs if p.reused), key=lambda p: p.deviation)
    best = None
    for i, p in enumerate(tried):
        kept = tried[: i + 1]
        mean = sum(k.kl for k in kept) / len(kept)
        if (mean <= target_kl and max(k.kl for k in kept) <= WORST_KL_FACTOR * target_kl
                and sum(k.top1 for k in kept) / len(kept) >= TARGET_TOP1):
            best = p.deviation
    return best


def write(model: str, value: float, pairs: Sequence[PairQuality], target_kl: float, path: Path = CALIBRATION_FILE) -> None:
    """Record ``value`` as ``model``'s threshold in the table the engine reads (other models kept)."""
    table = json.loads(path.read_text()) if path.exists() else {}
    kept = [p for p in pairs if p.reused and p.deviation <= value]
    table[model] = {"max_deviation": round(value, 4), "target_kl": target_kl, "pairs": len(pairs), "kept": len(kept),
                    "kept_mean_kl": round(sum(p.kl for p in kept) / max(len(kept), 1), 5),
                    "machine": platform.machine(), "measured": [asdict(p) for p in pairs]}
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def calibrate(model: str, pairs: int = 4, workloads: Sequence[str] = WORKLOADS, target_tokens: int = 2048,
              new_tokens: int = 32, target_kl: float = 0.02, save: bool = False) -> Optional[float]:
    """Measure, choose the threshold, print the outcome (and ``save`` it); the threshold or None."""
    print(f"calibrating edit reuse's gate for {model}: {pairs} pair(s) of {', '.join(workloads)}, "
          f"~{target_tokens} tokens; kept pairs: KL <= {target_kl} each, top-1 >= {TARGET_TOP1:.0%}", flush=True)
    measured = measure(model, workloads, pairs, target_tokens, new_tokens)
    value = threshold(measured, target_kl)
    if value is None:
        print("no threshold keeps any pair within the targets: leave edit reuse off for this model")
        return None
    kept = [p for p in measured if p.reused and p.deviation <= value]
    print(f"threshold {value:.4f}: keeps {len(kept)} of {sum(1 for p in measured if p.reused)} reusing pair(s), "
          f"mean KL {sum(p.kl for p in kept) / len(kept):.4f}")
    if save:
        write(model, value, measured, target_kl)
        print(f"written to {CALIBRATION_FILE}")
    return value
