"""The multi-turn workload the hybrid-pool tests share: ``agents`` conversations over one shared head
on ``random:gemma-small`` (5 layers attending an 8-token window, 1 full layer), run greedily."""

from __future__ import annotations

from hicache import Engine
from hicache.runtime.sampling import SamplingParams

MODEL = "random:gemma-small"
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
SYSTEM = [(7 * i + 3) % 200 + 20 for i in range(37)]  # a shared head, several windows long


def conversations(engine: Engine, agents: int = 3, turns: int = 3, together: bool = False,
                  keep: bool = False, final: list | None = None) -> tuple[list, list]:
    """``agents`` conversations of ``turns`` turns over SYSTEM, each turn its history + answer +
    a new message; returns every turn's output and cached tokens, in order (``final``, if given,
    receives each conversation's next prompt). The engine is shut down after, unless ``keep``."""
    histories = [SYSTEM + [(11 * a + i) % 200 + 20 for i in range(5 + 3 * a)] for a in range(agents)]
    outputs, cached = [], []
    try:
        for turn in range(turns):
            results = engine.generate(histories, GREEDY) if together else \
                [engine.generate([h], GREEDY)[0] for h in histories]
            for a, r in enumerate(results):
                outputs.append(r.output_ids)
                cached.append(r.cached_tokens)
                histories[a] = histories[a] + r.output_ids + [(13 * turn + a + i) % 200 + 20 for i in range(4 + turn)]
        if final is not None:
            final.extend(histories)
    finally:
        if not keep:
            engine.shutdown()
    return outputs, cached
