"""Streaming OpenAI-compatible requests with client-side timing, and server probes.

Times are seconds from ``time.perf_counter``. TTFT is the arrival of the first chunk carrying
non-empty text; ITL the gaps between later text-carrying chunks.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import httpx


@dataclass
class RequestRecord:
    """What one request measured."""

    turn: int
    ok: bool = False
    error: str = ""
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    end_s: float = 0.0  # time.perf_counter() when the reply ended
    retention: Optional[dict[str, Any]] = None  # usage.hicache_retention: what the request's cache hints got
    cached_tiers: dict[str, int] = field(default_factory=dict)  # usage.hicache_cached_tokens: hits per tier


def error_message(body: bytes, status: int) -> str:
    try:
        return f"HTTP {status}: {json.loads(body)['error']['message']}"
    except Exception:
        return f"HTTP {status}: {body[:200].decode(errors='replace')}"


@dataclass(frozen=True)
class Endpoint:
    """Where a run's requests go: one HTTP client, the server's base URL, the served model's name."""

    client: httpx.AsyncClient
    base_url: str
    model: str


@dataclass(frozen=True)
class RequestOptions:
    """What every request of a run asks for besides its input and length: the sampling
    temperature, and whether to generate past EOS (so the workload's output lengths hold)."""

    temperature: float = 0.0
    ignore_eos: bool = True


async def stream_request(endpoint: Endpoint, rec: RequestRecord, options: RequestOptions, *, max_tokens: int,
                         messages: Optional[list[dict]] = None,
                         prompt: Optional[Union[str, list[int]]] = None,
                         extra: Optional[dict[str, Any]] = None) -> RequestRecord:
    """Send one streaming chat (``messages``) or completion (``prompt``) request, filling ``rec``;
    ``extra``: more body fields (e.g. ``prompt_cache_retention``)."""
    chat = messages is not None
    payload: dict[str, Any] = {"model": endpoint.model, "max_tokens": max_tokens, "temperature": options.temperature,
                               "stream": True, "stream_options": {"include_usage": True},
                               **({"messages": messages} if chat else {"prompt": prompt})}
    if options.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(extra or {})
    url = f"{endpoint.base_url}/v1/{'chat/completions' if chat else 'completions'}"
    parts: list[str] = []
    start = last = time.perf_counter()
    try:
        async with endpoint.client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                rec.error = error_message(await resp.aread(), resp.status_code)
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec.error = str(obj["error"].get("message", obj["error"]))
                    return rec
                if u := obj.get("usage"):  # the final chunk's
                    rec.prompt_tokens = u.get("prompt_tokens") or 0
                    rec.completion_tokens = u.get("completion_tokens") or 0
                    rec.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    rec.retention = u.get("hicache_retention")
                    rec.cached_tiers = u.get("hicache_cached_tokens") or {}
                for choice in obj.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if piece:
                        last = add_piece(rec, parts, piece, start, last)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    if not rec.completion_tokens:  # a server that does not report usage in the stream
        rec.completion_tokens = len(parts)
    return finish_record(rec, parts, start)


def add_piece(rec: RequestRecord, parts: list[str], piece: str, start: float, last: float) -> float:
    """A streamed piece of text arrived: its TTFT (the first) or inter-token gap; returns its time."""
    now = time.perf_counter()
    if parts:
        rec.itl_s.append(now - last)
    else:
        rec.ttft_s = now - start
    parts.append(piece)
    return now


def finish_record(rec: RequestRecord, parts: list[str], start: float) -> RequestRecord:
    """The stream ended well: its end, text and E2E (nothing visible came back: TTFT = the whole request)."""
    rec.end_s = time.perf_counter()
    rec.e2e_s = rec.end_s - start
    rec.text = "".join(parts)
    if not parts:
        rec.ttft_s = rec.e2e_s
    rec.ok = True
    return rec


async def server_info(client: httpx.AsyncClient, base_url: str) -> dict[str, Any]:
    """{"model": first served model id, "hicache": bool}."""
    resp = await client.get(f"{base_url}/v1/models")
    resp.raise_for_status()
    data = resp.json().get("data") or [{}]
    return {"model": data[0].get("id"), "hicache": data[0].get("owned_by") == "hicache"}


async def count_tokens(client: httpx.AsyncClient, base_url: str, texts: list[str]) -> list[int]:
    """Token counts with the server's tokenizer (hicache's ``/tokenize``)."""
    resp = await client.post(f"{base_url}/tokenize", json={"prompt": texts})
    resp.raise_for_status()
    return resp.json()["counts"]


_SAMPLE = re.compile(r'^(hicache_[a-z_]+)(?:\{([^}]*)\})?\s+(\S+)$')


async def scrape_metrics(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    """hicache counters from ``/metrics`` as {"name{labels}": value}; empty when unavailable."""
    try:
        resp = await client.get(f"{base_url}/metrics")
        if resp.status_code != 200:
            return {}
    except httpx.HTTPError:
        return {}
    samples = (_SAMPLE.match(line) for line in resp.text.splitlines())
    return {f"{m.group(1)}{{{m.group(2) or ''}}}": float(m.group(3)) for m in samples if m}


async def flush_cache(client: httpx.AsyncClient, base_url: str) -> bool:
    resp = await client.post(f"{base_url}/flush_cache", params={"timeout": 30})
    return resp.status_code == 200
