"""A stored conversation continued with ``previous_response_id`` against the same turn resent whole,
side by side in one run (the Responses API, issue 49).

    python benchmarks/bench_responses.py [--model smollm2] [--history-tokens 2048] [--repeats 3]

Turn 1: a ~``--history-tokens``-token input (paragraphs of this repository's docs), 32 output tokens,
stored. Turn 2, a short question, three ways, each timed to its first streamed text (TTFT) with the
prompt tokens the engine computed (``/stats`` ``prefill_computed_tokens``):
(a) ``previous_response_id`` (only the new turn sent; the prompt is the stored ids + the new turn);
(b) the whole history resent as input items, the prefix cache warm; (c) the same with the cache
flushed first (what a server without a prefix cache computes). Medians of ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import httpx  # noqa: E402
import openai  # noqa: E402

from hicache import Engine  # noqa: E402
from hicache.server.serve import ServerThread  # noqa: E402


def history_text(engine: Engine, tokens: int) -> str:
    text = ""
    for path in sorted((ROOT / "docs").glob("*.md")):
        text += path.read_text(encoding="utf-8") + "\n"
        if len(engine.tokenizer.encode(text)) >= tokens:
            break
    ids = engine.tokenizer.encode(text)[:tokens]
    return engine.tokenizer.decode(ids)


def computed(base: str, before: dict) -> int:
    """Prompt tokens the forward computed since ``before`` (``/stats`` prefill_computed_tokens)."""
    return httpx.get(base + "/stats").json()["prefill_computed_tokens"] - before["prefill_computed_tokens"]


def timed(client: openai.OpenAI, base: str, **kw) -> tuple[float, int]:
    before = httpx.get(base + "/stats").json()
    t0 = time.perf_counter()
    ttft = None
    for event in client.responses.create(stream=True, temperature=0, max_output_tokens=8, **kw):
        if ttft is None and event.type == "response.output_text.delta":
            ttft = time.perf_counter() - t0
    return (ttft if ttft is not None else time.perf_counter() - t0), computed(base, before)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--history-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    engine = Engine(args.model, max_total_tokens=32768)
    server = ServerThread(engine, served_model_name="m")
    base = server.start()
    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    try:
        history = history_text(engine, args.history_tokens)
        rows: dict[str, list[tuple[float, int]]] = {"continued": [], "resent (cache warm)": [], "resent (cold)": []}
        for r in range(args.repeats):
            first = client.responses.create(model="m", input=history, temperature=0, max_output_tokens=32)
            rows["continued"].append(timed(client, base, model="m", previous_response_id=first.id,
                                           input=f"Question {r}: in one sentence, what is this about?"))
            # another question for the resent turns: the continued turn's own prompt is not theirs to hit
            items = [{"role": "user", "content": history}, {"role": "assistant", "content": first.output_text},
                     {"role": "user", "content": f"Question {r}: who would read this, in one sentence?"}]
            rows["resent (cache warm)"].append(timed(client, base, model="m", input=items, store=False))
            httpx.post(base + "/flush_cache")
            rows["resent (cold)"].append(timed(client, base, model="m", input=items, store=False))
            httpx.post(base + "/flush_cache")
        print(f"{args.model}, history {args.history_tokens} tokens + 32 output, turn 2 a short question; "
              f"medians of {args.repeats}")
        cold = statistics.median(t for t, _ in rows["resent (cold)"])
        for name, samples in rows.items():
            ttft = statistics.median(t for t, _ in samples)
            tokens = statistics.median(c for _, c in samples)
            print(f"  {name:22s} TTFT {ttft * 1e3:7.1f} ms ({ttft / cold:4.2f}x cold)   computed {tokens:6.0f} tokens")
    finally:
        server.stop()
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
