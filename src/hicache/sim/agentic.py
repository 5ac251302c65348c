"""A seeded agentic trace in the Mooncake format (:mod:`hicache.sim.trace`), issue 60 item 4.

Shape: a lead agent of ``lead_turns`` turns and ``subagents`` subagents of 1-3 turns, all
opening with one system+tools prefix of 4-8 blocks (2-4K tokens at 512 per block); between a
session's turns either a heavy-tailed tool pause (2-30 s: ``after_pause``) or a quick tool
(0.2-1 s); an unrelated flood of short sessions, each with a prefix of its own, starting during
the lead's pauses. The lead spawns the subagents a third of the way in and waits for them.

Units: the shape is in blocks; ``block_tokens`` real tokens each (512 as in Mooncake for the
simulator; the live bench scales a trace down with fewer). ``timestamp_ms`` is arrival, ms;
pauses are seconds, already multiplied by ``time_factor``. A turn's prompt is its session's
previous prompt (whole blocks), then one block of the previous reply, then 1-2 blocks of tool
results (``roles``: one letter per block, "s" system+tools, "u" user or tool result, "a" the
assistant's reply, so a client can rebuild the messages; every prompt ends in a user block); a subagent's first prompt ends in a partial block (its short task), so four subagents
sharing the prefix compute little beyond one. Hints are breakpoints in whole blocks from the
prompt start (``blocks``: None is the whole prompt and reply), what the client would send:
"claude-code" marks the prefix (1 h) and the last message (5 min); "codex" asks
``prompt_cache_retention="24h"``; flood requests send none. Hint seconds are the client's
literal ttl, not scaled.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .trace import BLOCK_TOKENS, TraceRequest

CLIENTS = ("claude-code", "codex")
PAUSE_S = (2.0, 30.0)  # a tool pause's range, before time_factor
QUICK_S = (0.2, 1.0)  # a quick tool's gap (a file read), before time_factor
PAUSE_ALPHA = 1.2  # the pauses' Pareto tail
# The flood: other users' sessions, half of them one request. Sized so the flood, not the lead,
# makes most of the live set (4-6x the lead's longest prompt at the defaults): pools sized from
# the live set then hold the lead, and LRU loses it to the flood in a long pause.
FLOOD_SYSTEM_BLOCKS = (2, 8)
FLOOD_ONE_OFF = 0.5  # the fraction of flood sessions that are one request
FLOOD_TURNS = (2, 6)  # the others' turns
DECODE_TOKENS_PER_S = 50.0  # the nominal reply speed placing a session's next arrival (512-token blocks)


@dataclass(frozen=True)
class AgenticRequest(TraceRequest):
    """One request of the trace: a :class:`TraceRequest` whose agentic fields are set."""

    def to_json(self) -> dict:
        """The trace line (Mooncake's fields, then the agentic ones)."""
        out = {"timestamp": round(self.timestamp_ms, 3), "input_length": self.input_length,
               "output_length": self.output_length, "hash_ids": list(self.hash_ids)}
        if self.block_tokens != BLOCK_TOKENS:
            out["block_tokens"] = self.block_tokens
        out.update({"class": self.cls, "session": self.session, "turn": self.turn, "after_pause": self.after_pause,
                    "pause_s": round(self.pause_s, 4), "hints": [dict(h) for h in self.hints], "roles": self.roles})
        return out


@dataclass
class _Session:
    """A session being built: its blocks so far, its next arrival (seconds) and the pause
    before it."""

    cls: str
    name: str
    prompt: list[int]
    roles: str
    t: float
    pause: float = 0.0
    after_pause: bool = False
    reply: float = 0.0  # the last reply's length, in blocks
    turns: list[AgenticRequest] = field(default_factory=list)


class _Builder:
    def __init__(self, seed: int, time_factor: float, block_tokens: int, client: str) -> None:
        if client not in CLIENTS:
            raise ValueError(f"client must be one of {', '.join(CLIENTS)}, got {client!r}")
        if not time_factor > 0 or block_tokens < 2:
            raise ValueError("time_factor must be > 0 and block_tokens at least 2")
        self.rng, self.tf, self.bt, self.client = random.Random(seed), time_factor, block_tokens, client
        self.next_id = 1
        self.prefix_blocks = 0

    def blocks(self, n: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    def pause(self) -> float:
        """A tool pause in seconds (truncated Pareto on ``PAUSE_S``), times the time factor."""
        lo, hi = PAUSE_S
        u = self.rng.random() * (1 - (lo / hi) ** PAUSE_ALPHA)
        return lo / (1 - u) ** (1 / PAUSE_ALPHA) * self.tf

    def tokens(self, lo: float, hi: float) -> int:
        """Real tokens: a uniform fraction of a block (the draw does not depend on the block size,
        so traces of one seed differ only in tokens per block)."""
        return max(1, round(self.rng.uniform(lo, hi) * self.bt))

    def reply_s(self, s: _Session) -> float:
        """The nominal time of ``s``'s last reply, in seconds at the 512-token scale."""
        return (0.2 + s.reply * BLOCK_TOKENS / DECODE_TOKENS_PER_S) * self.tf

    def quick(self) -> float:
        return self.rng.uniform(*QUICK_S) * self.tf

    def hints(self, cls: str, blocks: int) -> tuple[dict, ...]:
        if cls == "flood":
            return ()
        if self.client == "codex":
            return ({"blocks": None, "seconds": 86400.0, "ttl": "24h"},)
        return ({"blocks": self.prefix_blocks, "seconds": 3600.0, "ttl": "1h"},
                {"blocks": blocks, "seconds": 300.0, "ttl": "5m"})

    def turn(self, s: _Session, tail_tokens: int = 0) -> None:
        """Send ``s.prompt`` (then a partial block of ``tail_tokens``: a short task) at ``s.t``;
        the next prompt holds that block whole (a new id: its content grew) and the reply's."""
        ids, roles = s.prompt + (self.blocks(1) if tail_tokens else []), s.roles + ("u" if tail_tokens else "")
        s.reply = self.rng.uniform(0.25, 1.0)
        out = max(1, round(s.reply * self.bt))
        s.turns.append(AgenticRequest(s.t * 1000, len(s.prompt) * self.bt + tail_tokens, out, tuple(ids), self.bt,
                                      s.cls, s.name, len(s.turns) + 1, s.after_pause, s.pause,
                                      self.hints(s.cls, len(ids)), roles))
        s.prompt, s.roles = s.prompt + self.blocks(2 if tail_tokens else 1), s.roles + ("ua" if tail_tokens else "a")

    def wait(self, s: _Session, paused: bool, tools: int) -> None:
        """After ``s``'s last turn: its nominal reply time, then a tool pause (``paused``) or a
        quick tool, whose result adds ``tools`` blocks."""
        s.pause, s.after_pause = (self.pause() if paused else self.quick()), paused
        s.t += self.reply_s(s) + s.pause
        s.prompt, s.roles = s.prompt + self.blocks(tools), s.roles + "u" * tools

    def done_at(self, s: _Session) -> float:
        return s.t + self.reply_s(s)


def _lead(b: _Builder, prefix: list[int], lead_turns: int, subagents: int) -> tuple[list[_Session], list[tuple]]:
    """The lead and its subagents; returns them and the lead's pause windows (start, end), s."""
    task = b.rng.randint(1, 2)
    lead = _Session("lead", "lead", prefix + b.blocks(task), "s" * len(prefix) + "u" * task, 0.0)
    spawn = max(1, lead_turns // 3)
    paused = set(b.rng.sample(range(2, lead_turns + 1), (lead_turns - 1) // 2)) | {spawn + 1}
    sessions, windows = [lead], []
    for k in range(1, lead_turns + 1):
        b.turn(lead)
        if k == lead_turns:
            break
        start = b.done_at(lead)
        b.wait(lead, k + 1 in paused, 1)
        if k == spawn:  # the subagents run during this pause; the lead resumes after the last
            subs = _subagents(b, prefix, subagents, start)
            sessions += subs
            end = max([lead.t] + [b.done_at(s) + 0.2 * b.tf for s in subs])
            lead.pause, lead.t = lead.pause + end - lead.t, end
        if lead.after_pause:
            windows.append((start, lead.t))
    return sessions, windows


def _subagents(b: _Builder, prefix: list[int], n: int, start: float) -> list[_Session]:
    subs = []
    for i in range(n):
        s = _Session("subagent", f"sub{i + 1}", list(prefix), "s" * len(prefix), start + b.rng.uniform(0, 0.5) * b.tf)
        turns = b.rng.randint(1, 3)
        b.turn(s, tail_tokens=b.tokens(0.125, 0.5))
        for _ in range(turns - 1):
            b.wait(s, True, b.rng.randint(1, 2))
            b.turn(s)
        subs.append(s)
    return subs


def _flood(b: _Builder, sessions: int, windows: Sequence[tuple]) -> list[_Session]:
    """Short sessions with prompts of their own (2-8 blocks of system, one of user), each starting
    in one of the lead's pauses; half are one request, the rest 2-6 turns apart by a quick tool or
    a pause."""
    out = []
    for i in range(sessions):
        lo, hi = b.rng.choice(windows) if windows else (0.0, 1.0)
        system = b.rng.randint(*FLOOD_SYSTEM_BLOCKS)
        s = _Session("flood", f"flood{i + 1}", b.blocks(system + 1), "s" * system + "u", b.rng.uniform(lo, hi))
        turns = 1 if b.rng.random() < FLOOD_ONE_OFF else b.rng.randint(*FLOOD_TURNS)
        b.turn(s)
        for _ in range(turns - 1):
            b.wait(s, b.rng.random() < 0.5, b.rng.randint(1, 2))
            b.turn(s)
        out.append(s)
    return out


def agentic_trace(seed: int = 0, time_factor: float = 1.0, block_tokens: int = BLOCK_TOKENS, lead_turns: int = 24,
                  subagents: int = 4, flood_sessions: int = 200, client: str = "claude-code") -> list[AgenticRequest]:
    """The trace's requests in arrival order (equal seeds and arguments: equal traces)."""
    if lead_turns < 2 or subagents < 0 or flood_sessions < 0:
        raise ValueError("lead_turns must be at least 2, subagents and flood_sessions at least 0")
    b = _Builder(seed, time_factor, block_tokens, client)
    b.prefix_blocks = b.rng.randint(4, 8)
    prefix = b.blocks(b.prefix_blocks)
    sessions, windows = _lead(b, prefix, lead_turns, subagents)
    sessions += _flood(b, flood_sessions, windows)
    return sorted((r for s in sessions for r in s.turns), key=lambda r: r.timestamp_ms)


def write_trace(path: str, reqs: Iterable[AgenticRequest]) -> None:
    """``reqs`` as JSON Lines (:func:`hicache.sim.trace.load_trace` reads them back)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in reqs:
            f.write(json.dumps(r.to_json()) + "\n")


def live_set_tokens(reqs: Sequence[TraceRequest]) -> int:
    """Real tokens of the distinct blocks alive at the peak: a block is alive from the arrival of
    its first request to that of its last (a one-off block only at its own); the peak is over
    arrivals. Size pools from it: L1 ~ live / 3, L2 ~ live / 1.5."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    size: dict[int, int] = {}
    for r in reqs:
        for b, n in zip(r.hash_ids, r.block_lengths()):
            first.setdefault(b, r.timestamp_ms)
            last[b] = r.timestamp_ms
            size[b] = max(size.get(b, 0), n)
    # Sweep: +size at a block's first arrival, -size just after its last (births sort first).
    events = Counter()
    for b, n in size.items():
        events[(first[b], 0)] += n
        events[(last[b], 1)] -= n
    live = peak = 0
    for _, delta in sorted(events.items()):
        live += delta
        peak = max(peak, live)
    return peak
