"""Fault injection for tests: each rank's transfers and storage reads finish late, by amounts
that differ between ranks, so agreement is exercised rather than assumed.

Test-only; set ``HICACHE_FAULT_INJECTION`` to a JSON object before the ranks start::

    {"seed": 3, "max_delay_s": 0.02,                       # random per rank, per op
     "delays": {"PP0/TP0": {"backup": {"1": 1.5}}}}        # exact: this rank's 2nd backup

``max_delay_s``: each host<->device copy op and each storage read batch sleeps a uniform random
time in ``[0, max_delay_s]`` first (the generator is seeded by ``seed`` and the rank).
``delays``: per rank label, per kind (``backup``, ``load``, ``read``), per op ordinal of that
kind on that rank (0-based, submission order), a fixed delay in seconds instead.
"""

from __future__ import annotations

import json
import os
import random
import threading
from dataclasses import dataclass, field

from ..cache.manager import KVCacheManager

ENV_VAR = "HICACHE_FAULT_INJECTION"


@dataclass
class FaultPlan:
    seed: int = 0
    max_delay_s: float = 0.0
    delays: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)

    @classmethod
    def from_env(cls) -> "FaultPlan | None":
        text = os.environ.get(ENV_VAR)
        return cls(**json.loads(text)) if text else None

    def install(self, cache: KVCacheManager, label: str, rank: int) -> None:
        """Hook this rank's transfer controller and storage reader."""
        rng = random.Random(self.seed * 1009 + rank)
        fixed = self.delays.get(label, {})
        lock = threading.Lock()
        ordinals: dict[tuple[str, int], int] = {}  # (kind, op id) -> its place among this rank's ops of that kind
        last: dict[str, int] = {}  # the last ordinal given, per kind

        def delay(kind: str, op_id: int) -> float:
            with lock:
                key = (kind, op_id)
                if key not in ordinals:
                    ordinals[key] = last[kind] = last.get(kind, -1) + 1
                exact = fixed.get(kind, {}).get(str(ordinals[key]))
                return exact if exact is not None else rng.uniform(0.0, self.max_delay_s)

        if cache.controller is not None:
            # Called per layer; the op's delay is taken before its first layer only.
            cache.controller.delay_fn = lambda op, layer: delay(op.kind, op.op_id) if layer == 0 else 0.0
        if cache.storage is not None:
            cache.storage.read_delay_fn = lambda op: delay("read", op.op_id)
