"""`hicache bench --dataset agentic` (issue 60 item 4): the agentic trace as its clients send it
(Anthropic cache_control, OpenAI prompt_cache_retention), replayed live with hints on and off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache import Engine
from hicache.bench.agentic import agentic_call, anchors
from hicache.bench.agentic_report import agentic_summary
from hicache.bench.client import RequestRecord
from hicache.cli import main
from hicache.server.serve import ServerThread
from hicache.sim.agentic import agentic_trace

pytestmark = pytest.mark.server

SMALL = ["--block-tokens", "8", "--agentic-lead-turns", "4", "--agentic-flood-sessions", "3",
         "--agentic-time-factor", "0.002", "--max-output-tokens", "8", "--seed", "2", "--disable-tqdm"]


def test_claude_code_marks_the_prefix_and_the_last_message():
    trace = agentic_trace(seed=1, block_tokens=16, lead_turns=4, flood_sessions=2)
    lead = [r for r in trace if r.session == "lead"]
    calls = [agentic_call(r, "claude-code", True, 16, 8) for r in lead]
    for c in calls:
        assert c.api == "messages" and len(c.system) == 1
        assert c.system[0]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}
        assert c.messages[-1]["role"] == "user"
        assert c.messages[-1]["content"][-1]["cache_control"] == {"type": "ephemeral", "ttl": "5m"}
        assert all("cache_control" not in m["content"][0] for m in c.messages[:-1])
        assert [m["role"] for m in c.messages] == ["user", "assistant"] * (len(c.messages) // 2) + ["user"]
    # Each turn resends the previous one's messages unchanged (text), then the reply and a tool result.
    for a, b in zip(calls, calls[1:]):
        assert [m["content"][0]["text"] for m in b.messages[: len(a.messages)]] == \
            [m["content"][0]["text"] for m in a.messages]
    off = agentic_call(lead[1], "claude-code", False, 16, 8)
    assert "cache_control" not in json.dumps([off.system, off.messages])
    assert [m["content"][0]["text"] for m in off.messages] == [m["content"][0]["text"] for m in calls[1].messages]
    flood = next(r for r in trace if r.cls == "flood")
    assert "cache_control" not in json.dumps(agentic_call(flood, "claude-code", True, 16, 8).messages)


def test_codex_asks_24h_retention_on_chat():
    trace = agentic_trace(seed=1, block_tokens=16, lead_turns=3, flood_sessions=2, client="codex")
    c = agentic_call(trace[0], "codex", True, 16, 8)
    assert c.api == "chat" and c.extra == {"prompt_cache_retention": "24h"} and c.messages[0]["role"] == "system"
    assert agentic_call(trace[0], "codex", False, 16, 8).extra == {}


def test_summary_counts_the_prefix_in_whole_pages():
    trace = [r for r in agentic_trace(seed=1, block_tokens=16, lead_turns=3, flood_sessions=0)
             if r.session == "lead"]
    recs = [RequestRecord(turn=r.turn, ok=True, prompt_tokens=p, cached_tokens=c, ttft_s=t)
            for r, p, c, t in zip(trace, (100, 150, 210), (0, 96, 120), (1.0, 0.5, 0.6))]
    s = agentic_summary(trace, recs, page_size=16)
    lead = s["classes"]["lead"]
    # turn 2 shares 96 tokens (100 cut to pages of 16) and got 96; turn 3 shares 144, got 120.
    assert lead["prefix_hit_ratio"] == pytest.approx((96 + 120) / (96 + 144))
    assert lead["hit_ratio"] == pytest.approx(216 / 460)


def test_subagents_follow_the_spawning_turn_and_the_flood_the_lead_pauses():
    trace = agentic_trace(seed=4, lead_turns=9, flood_sessions=12)
    placed = anchors(trace)
    lead = [r for r in trace if r.cls == "lead"]
    firsts = [i for i, r in enumerate(trace) if r.turn == 1 and r.cls != "lead"]
    assert sorted(placed) == firsts
    for i in firsts:
        a, offset = placed[i]
        assert trace[a].cls == "lead" and offset >= 0
        if trace[i].cls == "subagent":
            assert trace[a].turn == 3 and offset <= 0.5  # spawned by the lead's turn 9 // 3
        else:  # inside the pause after lead turn a, and no later than its end
            after = lead[trace[a].turn]
            assert after.after_pause and offset <= after.pause_s


@pytest.fixture(scope="module")
def base_url():
    # random:small: head size 32, which deterministic inference takes (greedy bits independent of the batch)
    engine = Engine("random:small", dtype="float32", page_size=16, max_total_tokens=4096,
                    enable_deterministic_inference=True)
    srv = ServerThread(engine, served_model_name="tiny")
    yield srv.start()
    srv.stop()


@pytest.mark.parametrize("client", ["claude-code", "codex"])
def test_replay_hints_on_and_off_same_greedy_outputs(base_url: str, tmp_path: Path, capsys, client: str) -> None:
    reports = {}
    for hints in ("on", "off"):
        out, saved = tmp_path / f"{hints}.json", tmp_path / f"{hints}.jsonl"
        assert main(["bench", "--base-url", base_url, "--dataset", "agentic", "--agentic-client", client,
                     "--agentic-hints", hints, "--flush-cache", "--output-file", str(out), "--save-outputs",
                     str(saved), *SMALL]) == 0
        reports[hints] = json.loads(out.read_text())
        assert [json.loads(line) for line in saved.read_text().splitlines()] == reports[hints]["outputs"]
    printed = capsys.readouterr().out
    assert "Agentic trace, by class" in printed and "lead prefix hit ratio" in printed
    on = reports["on"]
    n = len(agentic_trace(2, 0.002, 8, 4, 4, 3, client))
    assert on["completed"] == n and on["failed"] == 0
    classes = on["agentic"]["classes"]
    assert classes["lead"]["requests"] == 4 and classes["subagent"]["requests"] >= 4
    assert classes["lead"]["prefix_hit_ratio"] > 0.5  # a cache big enough for everything
    assert on["agentic"]["show"]["subagents"] == 4
    texts = [o["text"] for o in on["outputs"]]
    assert len(set(texts)) > 1  # replies differ by prompt: the comparison below can tell runs apart
    assert texts == [o["text"] for o in reports["off"]["outputs"]]
    assert all(o["ok"] for o in on["outputs"])


def test_a_trace_without_roles_is_refused_in_one_line(base_url: str, capsys) -> None:
    from hicache.sim.trace import SHIPPED_TRACE

    rc = main(["bench", "--base-url", base_url, "--dataset", "agentic", "--trace-file", SHIPPED_TRACE,
               "--disable-tqdm"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: cannot replay the trace:") and "no roles" in err


def test_replay_is_closed_loop(monkeypatch) -> None:
    """Causal order, whatever the replies take: a turn leaves its pause after the previous reply,
    subagents after the lead's spawning turn, the lead's next turn after the last subagent."""
    import asyncio
    import time

    import hicache.bench.agentic as agentic
    from hicache.bench.client import RequestOptions

    trace = agentic_trace(seed=3, time_factor=0.002, block_tokens=8, lead_turns=6, flood_sessions=4)
    calls = [agentic_call(r, "claude-code", True, 8, 2) for r in trace]
    sent: dict[int, float] = {}

    async def fake_send(endpoint, call, options):
        sent[id(call)] = time.perf_counter()
        await asyncio.sleep(0.002 * (1 + call.req.turn % 3))
        return RequestRecord(turn=call.req.turn, ok=True, end_s=time.perf_counter())

    monkeypatch.setattr(agentic, "send", fake_send)
    records = asyncio.run(agentic.run_agentic(None, calls, RequestOptions(), speed=1.0, on_done=lambda: None))
    end = {id(c): r.end_s for c, r in zip(calls, records)}
    by_session: dict[str, list] = {}
    for c in calls:
        by_session.setdefault(c.req.session, []).append(c)
    for turns in by_session.values():
        for a, b in zip(turns, turns[1:]):
            assert sent[id(b)] >= end[id(a)] + b.req.pause_s
    lead = by_session["lead"]
    subs = [c for c in calls if c.req.cls == "subagent"]
    spawn = lead[1]  # lead_turns // 3 = 2
    assert all(sent[id(c)] >= end[id(spawn)] for c in subs if c.req.turn == 1)
    assert sent[id(lead[2])] >= max(end[id(c)] for c in subs)
    for i, (a, _) in anchors(trace).items():  # the flood too starts after the lead's turn it follows
        assert sent[id(calls[i])] >= end[id(calls[a])]
