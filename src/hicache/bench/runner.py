"""Drive a workload against a server: concurrency limit, arrival rate, progress bar."""

from __future__ import annotations

import asyncio
import random
from itertools import accumulate
from typing import Any, Callable

from .client import Endpoint, RequestOptions, RequestRecord, stream_request
from .workload import Conversation, TraceRequest


def _arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Start offsets (s) of ``n`` arrivals: Poisson at ``rate``/s, all at 0 when rate is inf."""
    if rate == float("inf") or rate <= 0:
        return [0.0] * n
    rng = random.Random(seed)
    return list(accumulate((rng.expovariate(rate) for _ in range(n)), initial=0.0))[:n]


async def run_conversations(endpoint: Endpoint, convs: list[Conversation], options: RequestOptions, *, output_len: int,
                            max_concurrency: int | None, request_rate: float, seed: int,
                            on_done: Callable[[], Any]) -> list[RequestRecord]:
    """Each conversation starts at its arrival time (``request_rate`` conversations/s) and sends its
    turns one after another, each resending the history (system, questions, previous answers).
    At most ``max_concurrency`` requests are in flight."""
    sem = asyncio.Semaphore(max_concurrency or 1 << 30)
    records: list[RequestRecord] = []

    async def one(conv: Conversation, delay: float) -> None:
        await asyncio.sleep(delay)
        messages = [{"role": "system", "content": conv.system}]
        for turn, question in enumerate(conv.questions, 1):
            messages.append({"role": "user", "content": question})
            rec = RequestRecord(turn=turn)
            async with sem:
                await stream_request(endpoint, rec, options, messages=list(messages), max_tokens=output_len)
            records.append(rec)
            on_done()
            if not rec.ok:  # the rest of this conversation cannot be built
                for t in range(turn + 1, len(conv.questions) + 1):
                    records.append(RequestRecord(turn=t, error="skipped: an earlier turn failed"))
                    on_done()
                return
            messages.append({"role": "assistant", "content": rec.text})

    starts = _arrivals(len(convs), request_rate, seed)
    await asyncio.gather(*(one(c, d) for c, d in zip(convs, starts)))
    return records


async def run_trace(endpoint: Endpoint, reqs: list[TraceRequest], options: RequestOptions, *, speed: float,
                    max_concurrency: int | None, on_done: Callable[[], Any]) -> list[RequestRecord]:
    """Send each trace request at its timestamp (relative to the first, divided by ``speed``)."""
    sem = asyncio.Semaphore(max_concurrency or 1 << 30)
    t0 = reqs[0].timestamp if reqs else 0.0

    async def one(r: TraceRequest) -> RequestRecord:
        await asyncio.sleep((r.timestamp - t0) / speed)
        rec = RequestRecord(turn=r.turn)
        async with sem:
            await stream_request(endpoint, rec, options, messages=r.messages, prompt=r.prompt, max_tokens=r.max_tokens)
        on_done()
        return rec

    return list(await asyncio.gather(*(one(r) for r in reqs)))
