"""``hicache agent-demo`` (frontend/agent_demo.py): the three-step tool-using task through Chat
Completions and through the Responses API (``previous_response_id``). On a random model, each
API's turns run (a forced call, its result sent back, the history from the cache, TTFT reported);
on SmolLM2, the command as ``make demo`` runs it answers the invoice's total through both APIs."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

from hicache.frontend.agent_demo import (FILES, QUANTITY, UNIT_PRICE, ChatAgent, ResponsesAgent, final_total,
                                         flush_cache)
from live_server import serving

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.server

PAGE = 16


@pytest.fixture(scope="module")
def server():
    with serving("random:tiny", name="tiny", page_size=PAGE) as srv:
        yield srv


@pytest.fixture
def client(server):
    """The openai SDK on ``server``, its cache flushed: each test's first turn starts cold."""
    flush_cache(server.base_url + "/v1")
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("agent_class", [ChatAgent, ResponsesAgent])
def test_each_api_runs_the_turns_and_reports_them(client, agent_class) -> None:
    agent = agent_class(client, "tiny", max_tokens=512)  # (a random model's JSON may hold much whitespace)
    first = agent.turn("read_file")
    call = re.fullmatch(r"read_file\((.*)\) -> .*", first.summary)
    assert call is not None, first.summary  # one forced call, run here, its result shown
    assert json.loads(call.group(1))["path"] in FILES
    assert first.cached == 0 and first.prompt > 0 and math.isfinite(first.ttft_ms)  # TTFT: the timing extension
    second = agent.turn("calculate")
    # the history (the first prompt, the call, its result) comes from the cache, up to a partial page
    assert second.prompt > first.prompt and second.cached >= first.prompt - PAGE
    assert second.tiers["device"] == second.cached and math.isfinite(second.ttft_ms)
    answer = agent.turn(None)
    assert answer.summary.startswith("answer: ") and answer.cached >= second.prompt - PAGE
    if agent_class is ResponsesAgent:  # the server held the conversation: each turn sent only its new items
        assert agent.previous.startswith("resp_") and agent.input == []


@pytest.mark.slow
def test_the_demo_answers_through_chat_completions_and_the_responses_api() -> None:
    run = subprocess.run([sys.executable, "-m", "hicache.cli", "agent-demo"], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    chat, responses = run.stdout.split("\nchat.completions")[1].split("\nresponses")
    for section in (chat, responses):
        rows = [line.split() for line in section.splitlines() if re.match(r"\s+[123] ", line)]
        assert [int(r[0]) for r in rows] == [1, 2, 3], section
        assert int(rows[1][2]) > 0 and int(rows[2][2]) > 0  # turns 2 and 3: the history from the cache
        assert final_total(section.split("answer: ")[1].splitlines()[0]) == QUANTITY * UNIT_PRICE
    assert "previous_response_id" in responses.splitlines()[0]
    assert f"the final answer {QUANTITY * UNIT_PRICE} is the invoice's total" in run.stdout
