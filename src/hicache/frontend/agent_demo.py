"""``hicache agent-demo``: a three-step tool-using agent on SmolLM2, driven only through the
official ``openai`` SDK against ``hicache serve`` (a subprocess on 127.0.0.1, a free port), once
through each API: Chat Completions (``chat.completions.create``, the client resends the growing
history) and the Responses API (``responses.create``: the server keeps the conversation, each
turn sends only its new items with ``previous_response_id``).

The task has a known answer: read ``invoice.txt`` (one of three in-memory files), multiply its
quantity by its unit price with ``calculate``, then answer ``{"total": <number>}``. Each call step
names its function in ``tool_choice`` (a grammar-constrained call: the path is one of the files
that exist, the expression whole numbers and operators) and the answer step uses a
``json_schema`` ``response_format`` (Responses: ``text.format``); the model still picks the file,
writes the expression and the total itself, and the tools compute from what it wrote. Greedy
decoding, so a run is reproducible on one machine. The prefix cache is flushed between the two
runs, so each shows its own reuse. Exit status: 0 when every run's answer equals the invoice's
total, 1 when not.
Per turn: the call and its result, prompt tokens, cached tokens per tier (device / host /
storage: ``usage.prompt_tokens_details.cached_tokens_details``, Responses
``usage.hicache_cached_tokens``) and TTFT (the response's ``timing.ttft_s``), hicache extensions
the SDK keeps as extra fields.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from typing import IO, Any, Iterator, NamedTuple, Optional

from ..errors import HicacheError
from ..ports import free_port
from ..processes import stop_process

QUANTITY, UNIT_PRICE = 12, 7  # the invoice's figures; the expected total is computed from them
FILES = {
    "invoice.txt": f"Invoice 1042\nItem: notebook\nQuantity: {QUANTITY}\nUnit price: {UNIT_PRICE}\n",
    "notes.txt": "Remember to water the plants on Friday.\n",
    "todo.txt": "Call the bank on Monday.\n",
}
TASK = ("What is the total cost of invoice.txt? Read the file, then multiply the quantity by the unit price, "
        "then give the total.")
# whole numbers joined by spaced operators, at most five: what SmolLM2 writes for "12 times 7" in
# prose ("12 * 7"); a bounded pattern, so a forced call always ends well within max_tokens
EXPRESSION = r"^[0-9]{1,6}( [-+*/] [0-9]{1,6}){1,4}$"

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a text file from the workspace.",
        # only names that exist: a 135M model cannot misspell a path under the grammar
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "enum": sorted(FILES)}},
                       "required": ["path"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "calculate", "description": "Evaluate an arithmetic expression.",
        # an expression rather than {a, operation, b}: given an enum of operators, SmolLM2 takes the
        # first one listed whatever the task says; writing the expression, it picks * or + itself
        "parameters": {"type": "object", "properties": {"expression": {"type": "string", "pattern": EXPRESSION}},
                       "required": ["expression"], "additionalProperties": False}}},
]
ANSWER = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
    "type": "object", "properties": {"total": {"type": "number"}}, "required": ["total"],
    "additionalProperties": False}}}
STEPS = ("read_file", "calculate", None)  # the function each turn must call; None: the final answer
SYSTEM = "You are a careful assistant. Use the tools."
MAX_TOKENS = 64  # per turn: a call or the answer ends well within it on SmolLM2


def read_file(path: str) -> str:
    """The in-memory file's text, or an error line (never raises: the model sees the result)."""
    return FILES.get(path, f"error: no such file: {path}")


def evaluate(expression: str) -> float:
    """The value of an :data:`EXPRESSION` (``*`` and ``/`` before ``+`` and ``-``, left to right);
    ValueError for any other text, ZeroDivisionError for ``/ 0``. Parsed here, never eval'ed."""
    if not re.fullmatch(EXPRESSION, expression):
        raise ValueError(f"not an expression of whole numbers and + - * /: {expression!r}")
    tokens = expression.split(" ")
    terms = [float(tokens[0])]  # the running sum's terms; the last one takes * and /
    for op, number in zip(tokens[1::2], tokens[2::2]):
        x = float(number)
        if op == "*":
            terms[-1] *= x
        elif op == "/":
            terms[-1] /= x
        else:
            terms.append(x if op == "+" else -x)
    return sum(terms)


def calculate(expression: str) -> str:
    """The expression's value as text (an integral one without ``.0``), or an error line."""
    try:
        value = evaluate(expression)
    except (ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(value)) if value.is_integer() else f"{value:g}"


RUN = {"read_file": read_file, "calculate": calculate}  # what each tool's call runs, its arguments as keywords


@contextlib.contextmanager
def serving(model: str, server_args: list[str], timeout: float = 300.0) -> Iterator[str]:
    """``hicache serve --model model`` on 127.0.0.1 and a free port; yields the API's base URL
    once it answers; stopped (SIGTERM, then killed) on exit, whatever happened."""
    port = free_port()
    cmd = [sys.executable, "-m", "hicache.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", model, "--served-model-name", model, *server_args]
    with tempfile.TemporaryFile("w+") as log:  # its stderr: the last line says why it exited
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        try:
            url = f"http://127.0.0.1:{port}/v1"
            wait_ready(proc, url, log, timeout)
            yield url
        finally:
            stop_process(proc, 15)


def wait_ready(proc: subprocess.Popen, url: str, log: IO[str], timeout: float) -> None:
    """Poll ``GET /v1/models`` through the SDK every 0.5 s; HicacheError if the server exits
    first (with its last log line) or is not up within ``timeout`` seconds."""
    import openai

    probe = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=2.0)
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        with contextlib.suppress(openai.APIConnectionError, openai.APIStatusError):
            probe.models.list()
            return
        if time.monotonic() > deadline:
            raise HicacheError(f"hicache serve was not ready within {timeout:.0f} s.")
        time.sleep(0.5)
    log.seek(0)
    last = (log.read().strip().splitlines() or ["no output"])[-1]
    raise HicacheError(f"hicache serve exited with status {proc.returncode}: {last}")


class Turn(NamedTuple):
    """What one request did, as a table row shows it (token counts are prompt tokens)."""

    prompt: int
    cached: int  # of ``prompt``, served by the prefix cache (every tier)
    tiers: dict[str, int]  # cached tokens per tier: device / host / storage
    ttft_ms: float  # server-side time to first token (nan when the response has none)
    summary: str  # the calls and their results, or the answer
    content: Optional[str]  # the reply's text (the answer turn: its JSON)


def _run_calls(calls: list[tuple[str, str]]) -> tuple[list[str], str]:
    """Each call ``(name, arguments: a JSON object as text)`` run: (its results, one summary of calls and results)."""
    results = [RUN[name](**json.loads(arguments)) for name, arguments in calls]
    return results, "; ".join(f"{n}({a}) -> {r.strip()!r}" for (n, a), r in zip(calls, results))


def _turn(resp: Any, counts: tuple[int, int, dict[str, int]], function: Optional[str], summary: str,
          text: Optional[str]) -> Turn:
    """The row of a turn: ``counts`` its prompt, cached and per-tier cached tokens; ``summary`` its calls and their
    results (the answer turn, ``function`` None: the answer), the TTFT its response's ``timing`` says."""
    ttft_ms = (resp.model_extra or {}).get("timing", {}).get("ttft_s", float("nan")) * 1000
    return Turn(*counts, ttft_ms, f"answer: {text}" if function is None else summary or f"no call: {text!r}", text)


class Agent:
    """The task through one API, a :meth:`turn` per step. ``input``: what the next request sends (the
    whole history, or only a turn's new items)."""

    api = how = ""

    def __init__(self, client: Any, model: str, max_tokens: int = MAX_TOKENS) -> None:
        self.client, self.model, self.max_tokens = client, model, max_tokens
        self.input: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]


class ChatAgent(Agent):
    """The task through ``chat.completions.create``: the client holds the history and resends it."""

    api, how = "chat.completions", "the client resends the history"

    def turn(self, function: Optional[str]) -> Turn:
        """A forced call of ``function`` (run here, its result appended as a ``tool`` message) or, for
        None, the final answer under the JSON schema."""
        # tools stay listed on the answer turn too ("auto"): the prompt then extends the last one,
        # so its prefix comes from the cache; the schema keeps the reply to one JSON object
        extra = ({"tool_choice": {"type": "function", "function": {"name": function}}, "parallel_tool_calls": False}
                 if function else {"tool_choice": "auto", "response_format": ANSWER})
        resp = self.client.chat.completions.create(model=self.model, messages=self.input, tools=TOOLS, temperature=0,
                                                   max_tokens=self.max_tokens, **extra)
        message = resp.choices[0].message
        self.input.append(message.model_dump(exclude_none=True))
        calls = message.tool_calls or []
        results, summary = _run_calls([(c.function.name, c.function.arguments) for c in calls])
        self.input += [{"role": "tool", "tool_call_id": c.id, "content": r} for c, r in zip(calls, results)]
        details = resp.usage.prompt_tokens_details
        tiers = (details.model_extra or {}).get("cached_tokens_details", {})
        return _turn(resp, (resp.usage.prompt_tokens, details.cached_tokens, tiers), function, summary, message.content)


class ResponsesAgent(Agent):
    """The task through ``responses.create``: the server stores each response (``store``, its
    default), so a turn sends only its new items -- the call results -- with
    ``previous_response_id``. The system prompt is the first input message, not ``instructions``:
    instructions are not carried over to the next turn (OpenAI's rule), an input message is."""

    api, how = "responses", "the server holds the conversation: previous_response_id"
    TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's flat shape
    FORMAT = {"type": "json_schema", **ANSWER["json_schema"]}  # text.format: name, strict, schema
    previous: Optional[str] = None  # the last response's id

    def turn(self, function: Optional[str]) -> Turn:
        """As :meth:`ChatAgent.turn`, continuing the stored conversation."""
        extra = ({"tool_choice": {"type": "function", "name": function}, "parallel_tool_calls": False} if function
                 else {"tool_choice": "auto", "text": {"format": self.FORMAT}})
        resp = self.client.responses.create(model=self.model, input=self.input, tools=self.TOOLS, temperature=0,
                                            max_output_tokens=self.max_tokens, previous_response_id=self.previous,
                                            **extra)
        self.previous = resp.id
        calls = [o for o in resp.output if o.type == "function_call"]
        results, summary = _run_calls([(c.name, c.arguments) for c in calls])
        self.input = [{"type": "function_call_output", "call_id": c.call_id, "output": r}
                      for c, r in zip(calls, results)]
        usage = resp.usage
        tiers = (usage.model_extra or {}).get("hicache_cached_tokens", {})
        return _turn(resp, (usage.input_tokens, usage.input_tokens_details.cached_tokens, tiers), function, summary,
                     resp.output_text)


def turn_row(number: int, turn: Turn) -> str:
    """One table row: prompt tokens, cached tokens per tier, TTFT (ms), then what the turn did."""
    tiers = turn.tiers
    return (f"{number:>4} {turn.prompt:>6} {turn.cached:>6} {tiers.get('device', 0):>6} {tiers.get('host', 0):>5} "
            f"{tiers.get('storage', 0):>7} {turn.ttft_ms:>8.1f}  {turn.summary}")


def final_total(content: str | None) -> float | None:
    """The ``total`` of the answer's JSON object, or None when it has none."""
    try:
        total = json.loads(content or "").get("total")
    except (json.JSONDecodeError, AttributeError):
        return None
    return total if isinstance(total, (int, float)) else None


AGENTS: dict[str, tuple[type[Agent], ...]] = {"chat": (ChatAgent,), "responses": (ResponsesAgent,),
                                              "both": (ChatAgent, ResponsesAgent)}  # --api


def run_task(agent: Agent) -> Optional[float]:
    """The three turns through ``agent``, a table row each and a summary; returns the answer's total."""
    import openai

    print(f"{'turn':>4} {'input':>6} {'cached':>6} {'device':>6} {'host':>5} {'storage':>7} {'TTFT ms':>8}  "
          "call -> result")
    t0, prompt, cached, turn = time.monotonic(), 0, 0, None
    for number, function in enumerate(STEPS, start=1):
        try:
            turn = agent.turn(function)
        except openai.APIError as e:  # one line, not a traceback (status 2, as user errors)
            raise HicacheError(f"{agent.api}: turn {number} failed: {e}") from None
        prompt, cached = prompt + turn.prompt, cached + turn.cached
        print(turn_row(number, turn))
    print(f"{len(STEPS)} turns in {time.monotonic() - t0:.1f} s; {cached} of {prompt} prompt tokens came from the "
          f"cache ({cached / max(prompt, 1):.0%})")
    return final_total(turn.content if turn is not None else None)


def flush_cache(url: str) -> None:
    """Empty the server's prefix cache (``url``: the API's base, ``.../v1``), so the next run starts cold."""
    import httpx

    httpx.post(url.removesuffix("/v1") + "/flush_cache", params={"timeout": 10}, timeout=30.0).raise_for_status()


def run_agent_demo(model: str = "smollm2", server_args: str = "", api: str = "both") -> int:
    """Start the server (``server_args``: more ``hicache serve`` flags, shell-quoted), run the task
    through ``api`` ("chat", "responses" or "both", one after the other on a flushed cache), check
    each answer; 0 when every one is right, 1 when one is wrong."""
    import openai

    t0, expected, wrong = time.monotonic(), QUANTITY * UNIT_PRICE, []
    with serving(model, shlex.split(server_args)) as url:
        print(f"hicache agent-demo: {model} behind `hicache serve` at {url} (ready in {time.monotonic() - t0:.1f} s), "
              "driven through the openai SDK, greedy\ntask: " + TASK)
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120.0)
        for i, agent_class in enumerate(AGENTS[api]):
            if i:
                flush_cache(url)
            agent = agent_class(client, model)
            print(f"\n{agent.api} ({agent.how})")
            answer = run_task(agent)
            if answer != expected:
                wrong.append(f"{agent.api}: the final answer is {answer}")
    if wrong:
        print(f"agent-demo FAILED: {'; '.join(wrong)}; the invoice's total is {expected}", file=sys.stderr)
        return 1
    print(f"\nagent-demo OK: the final answer {expected} is the invoice's total ({QUANTITY} x {UNIT_PRICE}) "
          f"through {' and '.join(a.api for a in AGENTS[api])}")
    return 0
