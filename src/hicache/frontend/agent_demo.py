"""``hicache agent-demo``: a three-step tool-using agent on SmolLM2, driven only through the
official ``openai`` SDK against ``hicache serve`` (a subprocess on 127.0.0.1, a free port).

The task has a known answer: read ``invoice.txt`` (one of three in-memory files), multiply its
quantity by its unit price with ``calculate``, then answer ``{"total": <number>}``. Each call step
names its function in ``tool_choice`` (a grammar-constrained call: the path is one of the files
that exist, the expression whole numbers and operators) and the answer step uses a
``json_schema`` ``response_format``; the model still picks the file, writes the expression and
the total itself, and the tools compute from what it wrote. Greedy decoding, so a run is reproducible on
one machine. Exit status: 0 when the answer equals the invoice's total, 1 when not.
Per turn: the call and its result, prompt tokens, cached tokens per tier (device / host /
storage, from ``usage.prompt_tokens_details.cached_tokens_details``) and TTFT (the response's
``timing.ttft_s`` extension), both hicache extensions the SDK keeps as extra fields.
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
from typing import IO, Any, Iterator

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


def run_tool(name: str, arguments: str) -> str:
    """Run one call the model made (arguments: a JSON object as text)."""
    args = json.loads(arguments)
    return read_file(**args) if name == "read_file" else calculate(**args)


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


def turn_row(turn: int, resp: Any, step: str) -> str:
    """One table row: prompt tokens, cached tokens per tier, TTFT (ms), then what the turn did."""
    usage = resp.usage
    tiers = (usage.prompt_tokens_details.model_extra or {}).get("cached_tokens_details", {})
    ttft_ms = (resp.model_extra or {}).get("timing", {}).get("ttft_s", float("nan")) * 1000
    return (f"{turn:>4} {usage.prompt_tokens:>6} {usage.prompt_tokens_details.cached_tokens:>6} "
            f"{tiers.get('device', 0):>6} {tiers.get('host', 0):>5} {tiers.get('storage', 0):>7} "
            f"{ttft_ms:>8.1f}  {step}")


def agent_turn(client: Any, model: str, messages: list[dict[str, Any]], function: str | None) -> tuple[Any, str]:
    """One request: a forced call of ``function`` (run here, its result appended as a ``tool``
    message) or, for None, the final answer under the JSON schema. Returns (response, summary)."""
    # tools stay listed on the answer turn too ("auto"): the prompt then extends the last one,
    # so its prefix comes from the cache; the schema keeps the reply to one JSON object
    choice = {"type": "function", "function": {"name": function}} if function else "auto"
    extra = {"parallel_tool_calls": False} if function else {"response_format": ANSWER}
    resp = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=choice,
                                          temperature=0, max_tokens=64, **extra)
    message = resp.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    if function is None:
        return resp, f"answer: {message.content}"
    lines = []
    for call in message.tool_calls or []:
        result = run_tool(call.function.name, call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        lines.append(f"{call.function.name}({call.function.arguments}) -> {result.strip()!r}")
    return resp, "; ".join(lines) or f"no call: {message.content!r}"


def final_total(content: str | None) -> float | None:
    """The ``total`` of the answer's JSON object, or None when it has none."""
    try:
        total = json.loads(content or "").get("total")
    except (json.JSONDecodeError, AttributeError):
        return None
    return total if isinstance(total, (int, float)) else None


def run_agent_demo(model: str = "smollm2", server_args: str = "") -> int:
    """Start the server (``server_args``: more ``hicache serve`` flags, shell-quoted), run the
    three turns, check the answer; 0 when right, 1 when wrong."""
    import openai

    t0 = time.monotonic()
    with serving(model, shlex.split(server_args)) as url:
        print(f"hicache agent-demo: {model} behind `hicache serve` at {url} (ready in {time.monotonic() - t0:.1f} s), "
              "driven through the openai SDK, greedy\ntask: " + TASK + "\n")
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120.0)
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful assistant. Use the tools."},
                                          {"role": "user", "content": TASK}]
        print(f"{'turn':>4} {'input':>6} {'cached':>6} {'device':>6} {'host':>5} {'storage':>7} {'TTFT ms':>8}  "
              "call -> result")
        t1, prompt, cached = time.monotonic(), 0, 0
        for turn, function in enumerate(STEPS, start=1):
            try:
                resp, summary = agent_turn(client, model, messages, function)
            except openai.APIError as e:  # one line, not a traceback (status 2, as user errors)
                raise HicacheError(f"turn {turn} failed: {e}") from None
            prompt += resp.usage.prompt_tokens
            cached += resp.usage.prompt_tokens_details.cached_tokens
            print(turn_row(turn, resp, summary))
        answer = final_total(messages[-1].get("content"))
    expected = QUANTITY * UNIT_PRICE
    print(f"\n{len(STEPS)} turns in {time.monotonic() - t1:.1f} s; {cached} of {prompt} prompt tokens came from the "
          f"cache ({cached / max(prompt, 1):.0%})")
    if answer != expected:
        print(f"agent-demo FAILED: the final answer is {answer}, the invoice's total is {expected}", file=sys.stderr)
        return 1
    print(f"agent-demo OK: the final answer {answer:g} is the invoice's total ({QUANTITY} x {UNIT_PRICE})")
    return 0
