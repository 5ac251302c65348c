"""The warm-up pass at engine start: one small forward through the runner before any request,
so the first request does not pay what a model's first calls cost (the native decode layer's
operands, built on the first decode step; a backend's first kernel launches and allocations).

Below the scheduler: the pass calls :meth:`ModelRunner.forward` directly, so it makes no
request and touches no counter (``/stats``, ``/metrics``, cache hits), no radix-tree node and no
page of the allocator. Its tokens' KV goes to slot 0 only -- the padding slot of the reserved
page 0 (cache/pools.py), never handed out, never holding a real token -- and slot 0 is zeroed
again after, so the pool is as built. Units: tokens.

One rank in this process only: the ranks of a TP / PP group run their forwards in lock-step
(all-reduces inside the model, hidden states between stages), so a pass a rank ran on its own
would desynchronise them; they start without one. A speculative draft model runs inside its mode
and is not warmed either (its first round pays its first calls).
"""

from __future__ import annotations

import logging
import time

import torch

from .runner import ModelRunner

logger = logging.getLogger(__name__)

PADDING_SLOT = 0  # cache/pools.py: page 0 is reserved, its slot 0 is what batches pad with
# The prompt's length: a short prompt pass, as a short prompt or a chunk after a cache hit takes
# (the prefill's arithmetic, whatever its length: issue 57); longer ones showed no first-call cost
# worth its time (SmolLM2, AVX-512 CPU: a 17-token prompt costs ~40 ms).
PROMPT_TOKENS = 4


def warm_up(runner: ModelRunner, token_id: int = 0) -> float:
    """A :data:`PROMPT_TOKENS`-token prefill of ``token_id`` and one decode step, batch 1, every
    token on :data:`PADDING_SLOT` (a recurrent layer's state in the zero state's slot 0), zeroed again
    after; returns the seconds it took."""
    t0 = time.perf_counter()
    n = PROMPT_TOKENS
    states = [(PADDING_SLOT, PADDING_SLOT)] if runner.kv.state_buffers else None  # (the zero state slot, written)
    runner.forward([[token_id] * n], [0], [torch.full((n,), PADDING_SLOT)], state_slots=states)
    runner.forward([[token_id]], [n], [torch.full((n + 1,), PADDING_SLOT)], generated=True, state_slots=states)
    with torch.inference_mode():
        for buffer in (*runner.kv.k_buffers, *runner.kv.v_buffers, *(t for layer in runner.kv.state_buffers
                                                                    for t in layer)):
            buffer[PADDING_SLOT].zero_()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    seconds = time.perf_counter() - t0
    logger.info("warm-up: a %d-token prefill and a decode step on the padding slot in %.1f ms", n, seconds * 1000)
    return seconds
