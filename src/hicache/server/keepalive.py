"""Keep-alives on streams while nothing else is sent: a long prompt prefilling (a 19K-token
coding-agent prompt takes minutes on a CPU), a queue, a grammar being compiled.

Coding agents drop a stream that stays silent for a while (Claude Code and Codex after 300 s)
and retry it. Every streaming endpoint therefore writes a keep-alive whenever
:data:`KEEPALIVE_INTERVAL_S` seconds pass without an event: Anthropic's own ``ping`` event on the
Messages stream; on the Responses stream ``response.in_progress`` again (an event of the API that
changes nothing: Codex's watchdog counts events, and an SSE parser skips comments before it sees
them -- with comments Codex dropped an 8.8K-token prefill at 300 s); an SSE comment line
(``: keep-alive``) on chat, completions and ``/generate`` streams, whose chunks have no such
neutral event. Times are seconds.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Optional, TypeVar

T = TypeVar("T")

# At most this long between two writes on a stream (Anthropic's API pings about every 10-15 s;
# the agents' watchdogs wait 300 s). A module constant so tests can shorten it.
KEEPALIVE_INTERVAL_S = 10.0

SSE_KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: parsers skip it, proxies and watchdogs see bytes
ANTHROPIC_PING = 'event: ping\ndata: {"type": "ping"}\n\n'


async def with_keepalives(items: AsyncIterator[T]) -> AsyncIterator[Optional[T]]:
    """``items`` as they come, with a None between two of them each time :data:`KEEPALIVE_INTERVAL_S`
    passes without one (the caller writes its API's keep-alive for it). The pending read is never
    cancelled while waiting (that would break the generator ``items``), only when the caller stops."""
    it = items.__aiter__()
    pending: asyncio.Future = asyncio.ensure_future(it.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE_INTERVAL_S)
            if not done:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
            pending = asyncio.ensure_future(it.__anext__())
    finally:
        if not pending.done():
            pending.cancel()
