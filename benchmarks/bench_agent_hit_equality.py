"""Does a cache hit keep the cold greedy reply on the requests real agents send? (issue 57)

Three traces, served over HTTP by ``hicache serve``'s app with default flags:

- ``claude-code``: Claude Code 2.1.197's first two turns as captured (``tests/data/agents/``,
  ``POST /v1/messages``: ~19K prompt tokens on Qwen2.5);
- ``codex``: codex-cli 0.171.0's first two turns as captured (``POST /v1/responses``, ~9K);
- ``openai-agents``: the OpenAI Agents SDK (test extra) running a tool agent over three user turns
  on its default path, the Responses API; every request it sends is recorded on the way.

Every request is sent greedily (``temperature`` 0, a reply cap of ``--tokens``, not streamed, the
served model's name: the only fields changed). Each request after a trace's first is answered
three ways and the two hit replies compared with the cold one (text and tool calls, ids aside):

- **next turn**: right after the trace's previous request (the hit an agent's next turn gets);
- **near-full**: right after the same request capped at one token, so every full page of its
  prompt is cached and 1..page_size tokens are left to compute;
- **cold**: right after ``/flush_cache``.

    .venv/bin/python benchmarks/bench_agent_hit_equality.py [--model qwen2.5-coder-0.5b] [--tokens 48]
        [--traces claude-code,codex,openai-agents]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from hicache import Engine  # noqa: E402
from hicache.server.serve import ServerThread  # noqa: E402

AGENTS = ROOT / "tests" / "data" / "agents"
CAPTURED = {"claude-code": "claude_code_turn", "codex": "codex_turn"}
NAME = "agent"  # the served model name every request is sent with
CAP_FIELD = {"/v1/messages": "max_tokens", "/v1/responses": "max_output_tokens"}
Request = tuple[str, dict[str, Any]]  # (path, body)


def captured(prefix: str) -> list[Request]:
    """A captured client's turns, in order (the query string of ``/v1/messages?beta=true`` dropped)."""
    records = [json.loads(p.read_text()) for p in sorted(AGENTS.glob(f"{prefix}*.json"))]
    return [(r["path"].split("?")[0], r["body"]) for r in records]


def openai_agents_trace(base_url: str) -> list[Request]:
    """The requests the OpenAI Agents SDK sends running a tool agent for three user turns, recorded
    from its HTTP client (the agent runs greedily against ``base_url``, replies up to 256 tokens)."""
    import agents
    from openai import AsyncOpenAI

    sent: list[Request] = []

    async def record(request: httpx.Request) -> None:
        sent.append((request.url.path, json.loads(request.content)))

    @agents.function_tool
    def read_file(path: str) -> str:
        """The text of a file of the project."""
        return {"calc.py": "def add(a, b):\n    return a - b\n"}.get(path, f"no such file: {path}")

    async def run() -> None:
        http = httpx.AsyncClient(event_hooks={"request": [record]}, timeout=3600)
        client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, http_client=http)
        model = agents.OpenAIResponsesModel(model=NAME, openai_client=client)
        agent = agents.Agent(name="coder", instructions="You fix bugs in a small Python project. Use the tools.",
                             model=model, tools=[read_file],
                             model_settings=agents.ModelSettings(max_tokens=256, temperature=0))
        history: list[Any] = []
        for ask in ("Read calc.py.", "What is wrong with add?", "Write the fixed function."):
            result = await agents.Runner.run(agent, history + [{"role": "user", "content": ask}], max_turns=3)
            history = result.to_input_list()
        await http.aclose()

    agents.set_tracing_disabled(True)
    try:
        asyncio.run(run())
    except agents.exceptions.AgentsException as exc:  # a reply or turn cap reached: the requests so far count
        print(f"  openai-agents stopped early: {exc}", flush=True)
    return sent


def greedy(path: str, body: dict[str, Any], cap: int) -> dict[str, Any]:
    return {**body, "model": NAME, "stream": False, "temperature": 0, CAP_FIELD[path]: cap}


def reply_of(path: str, answer: dict[str, Any]) -> tuple[list[Any], int, int]:
    """(what the model said: text and calls without ids, prompt tokens, cached prompt tokens)."""
    usage = answer["usage"]
    if path == "/v1/messages":  # input_tokens: the computed part only, as Anthropic counts
        said = [b.get("text") or [b.get("name"), b.get("input")] for b in answer["content"]]
        cached = usage.get("cache_read_input_tokens") or 0
        return said, usage["input_tokens"] + cached, cached
    said = [[c.get("text") for c in o.get("content") or []] or [o.get("name"), o.get("arguments")]
            for o in answer["output"]]
    return said, usage["input_tokens"], (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0


def post(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post(path, json=body)
    if r.is_error:  # e.g. a prompt longer than the model's context: say so, no traceback
        raise SystemExit(f"POST {path}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def compare(http: httpx.Client, trace: list[Request], tokens: int) -> list[tuple[str, int, int, bool]]:
    """(way, prompt tokens, cached tokens, equal to cold) for every request after the first."""
    rows = []
    for (before_path, before), (path, body) in zip(trace, trace[1:]):
        ask = greedy(path, body, tokens)
        http.post("/flush_cache").raise_for_status()
        cold, _, _ = reply_of(path, post(http, path, ask))
        for way, primer in (("next turn", (before_path, greedy(before_path, before, tokens))),
                            ("near-full", (path, greedy(path, body, 1)))):
            http.post("/flush_cache").raise_for_status()
            post(http, *primer)
            said, prompt, cached = reply_of(path, post(http, path, ask))
            rows.append((way, prompt, cached, said == cold))
            diff = "" if said == cold else f" (cold {json.dumps(cold)[:80]}, hit {json.dumps(said)[:80]})"
            print(f"  {way:<9} {prompt:>6} prompt tokens, {cached:>6} cached: "
                  f"{'equal' if said == cold else 'DIFFERENT'}{diff}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=48, help="reply cap of every request (greedy)")
    ap.add_argument("--traces", default="claude-code,codex,openai-agents",
                    help="comma-separated: claude-code, codex (captured turns), openai-agents (a live SDK run)")
    args = ap.parse_args()
    unknown = set(args.traces.split(",")) - {*CAPTURED, "openai-agents"}
    if unknown:
        ap.error(f"unknown trace(s) {', '.join(sorted(unknown))}: choose from claude-code, codex, openai-agents")
    if "openai-agents" in args.traces.split(",") and importlib.util.find_spec("agents") is None:
        ap.error("the openai-agents trace needs the openai-agents package (the test extra `make setup` installs)")
    engine = Engine(args.model)
    srv = ServerThread(engine, served_model_name=NAME)
    results = {}
    try:
        url = srv.start()
        with httpx.Client(base_url=url, timeout=7200) as http:
            for name in args.traces.split(","):
                trace = openai_agents_trace(url) if name == "openai-agents" else captured(CAPTURED[name])
                print(f"{name}: {len(trace)} requests", flush=True)
                results[name] = compare(http, trace, args.tokens)
    finally:
        srv.stop()
        engine.shutdown()
    print(f"{args.model} (default flags): greedy replies of up to {args.tokens} tokens with a cache hit, "
          f"equal to the cold reply (text and tool calls)")
    for name, rows in results.items():
        for way in ("next turn", "near-full"):
            sel = [r for r in rows if r[0] == way]
            left = [r[1] - r[2] for r in sel] or [0]
            print(f"{name:<14} {way:<9} {sum(r[3] for r in sel)}/{len(sel)} equal; "
                  f"{min(left)}-{max(left)} tokens left to compute")


if __name__ == "__main__":
    main()
