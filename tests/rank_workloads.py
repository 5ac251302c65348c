"""The multi-rank tests' model and workload (test_parallel, test_context_parallel); its
single-rank cache-off reference is the ``multi_turn_reference`` fixture in conftest.py."""

from __future__ import annotations

import random

from hicache import Engine, SamplingParams

MODEL = "random:small"  # 4 layers, 4 heads, 2 KV heads: TP2, PP2 and TP2 x PP2 all fit
BASE = dict(dtype="float32", page_size=4)


def multi_turn(engine: Engine, seed: int, storage_round: bool) -> list[list[int]]:
    """Three agents take turns (one batch per round); each prompt is the agent's whole history
    plus a new message. Then, with ``storage_round``, the cache is flushed and every agent's
    first turn is asked again: only storage can serve it."""
    rng = random.Random(seed)
    system = [rng.randrange(5, 250) for _ in range(24)]
    history = [system + [100 + a] * 3 for a in range(3)]
    first_prompts: list[list[int]] = []
    outputs = []
    for turn in range(4):
        prompts = [h + [rng.randrange(5, 250) for _ in range(rng.randrange(6, 20))] for h in history]
        if turn == 0:
            first_prompts = prompts
        sampling = [SamplingParams(max_new_tokens=rng.randrange(3, 9), temperature=0.0) for _ in prompts]
        results = engine.generate(prompts, sampling)
        outputs += [r.output_ids for r in results]
        history = [p + r.output_ids for p, r in zip(prompts, results)]
    if storage_round:
        assert engine.flush_cache()
        outputs += [r.output_ids for r in engine.generate(first_prompts, SamplingParams(max_new_tokens=4, temperature=0.0))]
    return outputs
