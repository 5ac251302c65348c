"""``hicache bench --dataset agentic``: the agentic trace (:mod:`hicache.sim.agentic`) replayed live,
each request carrying its hints the way its client sends them.

Prompts: each trace block becomes ``block_tokens`` tokens of words seeded by its id (equal blocks,
equal text; a partial block cut in proportion); a request's blocks become messages by their
``roles`` (a run of "s" the system prompt, runs of "u" / "a" user and assistant messages), so a
turn's rendered prompt extends its session's previous one token for token. Hints ride the real
client path: "claude-code" sends the Anthropic Messages API with ``cache_control`` on the
message that ends at each hint's block (``{"blocks": k}``: the system prompt for k = the prefix,
the last message for the whole prompt), "codex" sends Chat Completions with
``prompt_cache_retention="24h"``. Positions are exact at message boundaries, which is where a
client puts them; with hints off the same requests go without them.

Replay, closed loop (an agent waits for its tool; live replies take what they take): each later
turn of a session leaves its pause after the previous reply ended; a subagent or flood session
starts as long after the end of the lead's turn before it as the trace puts it after that turn's
nominal end (so the subagents follow the turn that spawns them and the flood fills the pauses);
the lead's turns wait for every subagent request before them. Times are divided by ``speed``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import httpx

from ..sim.trace import TraceRequest
from .client import (Endpoint, RequestOptions, RequestRecord, add_piece, error_message, finish_record,
                     stream_request)
from .workload import WORDS

CLIENT_APIS = {"claude-code": "messages", "codex": "chat"}
ROLES = {"s": "system", "u": "user", "a": "assistant"}


@dataclass
class AgenticCall:
    """One trace request as its client sends it: ``system`` and ``messages`` (Anthropic blocks
    or chat messages), ``extra`` body fields (the codex client's retention)."""

    req: TraceRequest
    api: str  # "messages" | "chat"
    system: Any
    messages: list[dict]
    extra: dict[str, Any]
    max_tokens: int


def _segments(req: TraceRequest, words_per_block: int) -> list[tuple[str, str, int]]:
    """(role letter, text, block index after its end) of each run of equal roles."""
    if len(req.roles) != len(req.hash_ids):
        raise ValueError(f"the trace request at {req.timestamp_ms:.0f} ms has no roles (not an agentic trace)")
    out: list[tuple[str, list[str], int]] = []
    for i, (b, role, length) in enumerate(zip(req.hash_ids, req.roles, req.block_lengths())):
        words = random.Random(b).choices(WORDS, k=words_per_block)[: max(1, -(-words_per_block * length //
                                                                           req.block_tokens))]
        if out and out[-1][0] == role:
            out[-1][1].extend(words)
            out[-1] = (role, out[-1][1], i + 1)
        else:
            out.append((role, words, i + 1))
    return [(role, " ".join(words), end) for role, words, end in out]


def agentic_call(req: TraceRequest, client: str, hints: bool, words_per_block: int, max_tokens: int) -> AgenticCall:
    """``req`` as ``client`` sends it (with its hints when ``hints``); ValueError if a hint does
    not fall at a message boundary."""
    segs = _segments(req, words_per_block)
    ends = {end: n for n, (_, _, end) in enumerate(segs)}
    marks: dict[int, str] = {}  # segment index -> ttl of the cache_control it carries
    for h in req.hints if hints else ():
        at = len(req.hash_ids) if h.get("blocks") is None else h["blocks"]
        if at not in ends:
            raise ValueError(f"a hint at block {at} of session {req.session} turn {req.turn} is not a message end")
        marks[ends[at]] = h.get("ttl") if h.get("ttl") in ("5m", "1h") else "1h"
    api = CLIENT_APIS[client]
    max_tokens = max(1, max_tokens)
    if api == "chat":
        msgs = [{"role": ROLES[r], "content": text} for r, text, _ in segs]
        extra = {"prompt_cache_retention": "24h"} if marks else {}
        return AgenticCall(req, api, None, msgs, extra, max_tokens)

    def block(n: int, text: str) -> dict:
        b: dict[str, Any] = {"type": "text", "text": text}
        if n in marks:
            b["cache_control"] = {"type": "ephemeral", "ttl": marks[n]}
        return b

    system = [block(n, t) for n, (r, t, _) in enumerate(segs) if r == "s"]
    msgs = [{"role": ROLES[r], "content": [block(n, t)]} for n, (r, t, _) in enumerate(segs) if r != "s"]
    return AgenticCall(req, api, system, msgs, {}, max_tokens)


async def stream_messages(endpoint: Endpoint, rec: RequestRecord, options: RequestOptions,
                          call: AgenticCall) -> RequestRecord:
    """One streaming Anthropic Messages request, filling ``rec`` (TTFT: the first text delta;
    prompt tokens: input + cache read + cache creation, Anthropic's identity)."""
    payload = {"model": endpoint.model, "max_tokens": call.max_tokens, "temperature": options.temperature,
               "stream": True, "system": call.system, "messages": call.messages}
    parts: list[str] = []
    start = last = time.perf_counter()
    try:
        async with endpoint.client.stream("POST", f"{endpoint.base_url}/v1/messages", json=payload) as resp:
            if resp.status_code != 200:
                rec.error = error_message(await resp.aread(), resp.status_code)
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                obj = json.loads(line[5:])
                kind = obj.get("type")
                if kind == "error":
                    rec.error = str(obj.get("error", {}).get("message", obj))
                    return rec
                if kind == "message_delta":
                    _messages_usage(rec, obj.get("usage") or {})
                piece = (obj.get("delta") or {}).get("text") if kind == "content_block_delta" else None
                if piece:
                    last = add_piece(rec, parts, piece, start, last)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    return finish_record(rec, parts, start)


def _messages_usage(rec: RequestRecord, u: dict) -> None:
    read = u.get("cache_read_input_tokens") or 0
    rec.prompt_tokens = (u.get("input_tokens") or 0) + read + (u.get("cache_creation_input_tokens") or 0)
    rec.cached_tokens = read
    rec.completion_tokens = u.get("output_tokens") or 0
    rec.retention = u.get("hicache_retention")
    rec.cached_tiers = u.get("hicache_cached_tokens") or {}


async def send(endpoint: Endpoint, call: AgenticCall, options: RequestOptions) -> RequestRecord:
    rec = RequestRecord(turn=call.req.turn)
    if call.api == "messages":
        return await stream_messages(endpoint, rec, options, call)
    return await stream_request(endpoint, rec, options, messages=call.messages, max_tokens=call.max_tokens,
                                extra=call.extra)


def anchors(reqs: Sequence[TraceRequest]) -> dict[int, tuple[int, float]]:
    """For each session's first request but the lead's: (index of the lead's turn it follows, seconds
    after that turn's nominal end). The nominal end of lead turn L is the next lead turn's arrival
    less its pause (how the trace placed it); after the lead's last turn, L's arrival."""
    lead = [i for i, r in enumerate(reqs) if r.cls == "lead"]
    ends = {a: reqs[b].timestamp_ms - reqs[b].pause_s * 1000 for a, b in zip(lead, lead[1:])}
    out, seen, k = {}, set(), -1
    for i, r in enumerate(reqs):
        while k + 1 < len(lead) and lead[k + 1] <= i:
            k += 1
        if r.session not in seen and r.cls != "lead" and k >= 0:
            a = lead[k]
            out[i] = (a, max(0.0, r.timestamp_ms - ends.get(a, reqs[a].timestamp_ms)) / 1000)
        seen.add(r.session)
    return out


async def run_agentic(endpoint: Endpoint, calls: Sequence[AgenticCall], options: RequestOptions, *, speed: float,
                      on_done: Callable[[], Any]) -> list[RequestRecord]:
    """Replay ``calls`` (arrival order) session by session, closed loop (the module's docstring);
    the records in the order of ``calls``."""
    t0 = time.perf_counter()
    reqs = [c.req for c in calls]
    first = reqs[0].timestamp_ms if reqs else 0.0
    done = [asyncio.Event() for _ in calls]
    records: list[Optional[RequestRecord]] = [None] * len(calls)
    by_session: dict[str, list[int]] = {}
    for i, r in enumerate(reqs):
        by_session.setdefault(r.session, []).append(i)
    subagents = [i for i, r in enumerate(reqs) if r.cls == "subagent"]
    anchor = anchors(reqs)

    async def when(i: int, ready: float) -> float:
        """When request ``i`` may leave: ``ready``, or after the lead's turn it follows; the lead
        waits for the subagents it spawned."""
        if i in anchor:
            a, offset = anchor[i]
            await done[a].wait()
            ready = records[a].end_s + offset / speed  # type: ignore[union-attr]
        if reqs[i].cls == "lead":
            for j in subagents:
                if reqs[j].timestamp_ms < reqs[i].timestamp_ms:
                    await done[j].wait()
                    ready = max(ready, records[j].end_s)  # type: ignore[union-attr]
        return ready

    async def session(idx: list[int]) -> None:
        ready = t0 + (reqs[idx[0]].timestamp_ms - first) / 1000 / speed
        for n, i in enumerate(idx):
            ready = await when(i, ready)
            await asyncio.sleep(max(0.0, ready - time.perf_counter()))
            rec = records[i] = await send(endpoint, calls[i], options)
            done[i].set()
            on_done()
            if not rec.ok:  # the session cannot go on: its later turns fail too
                for j in idx[n + 1:]:
                    records[j] = RequestRecord(turn=reqs[j].turn, error="skipped: an earlier turn failed")
                    done[j].set()
                    on_done()
                return
            if n + 1 < len(idx):
                ready = rec.end_s + reqs[idx[n + 1]].pause_s / speed

    await asyncio.gather(*(session(idx) for idx in by_session.values()))
    return [r for r in records if r is not None]
