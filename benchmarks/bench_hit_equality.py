"""Does a cache hit keep the cold greedy reply? On a real model with default flags, agent-like
multi-turn prompts (``make demo``'s coding-agent session, scripted so every run sends the same
tokens), side by side in one run:

- **prefix hits**: each prompt's cold greedy reply, then -- on a flushed cache primed with its first
  P tokens (a prompt of P tokens, one token generated, so the cache holds prompt KV only) -- the
  same prompt again, for several P: the last page boundary before its end (1..16 tokens left to
  compute), one page before that (17..32), the previous turn's prompt (what an agent's next turn
  hits) and half the prompt;
- **turn by turn**: the session as an agent runs it, each turn's prompt holding the model's own
  earlier replies, each reply against the same prompt run cold (a fresh ``cache_salt``): these hits
  include KV that decode steps wrote (the earlier replies' tokens).

Prints per scenario how many replies equal the cold one (token ids), those with fewer than 24
tokens left to compute apart.

    .venv/bin/python benchmarks/bench_hit_equality.py [--model smollm2] [--prompts 10] [--tokens 64] [--agents 2]
"""

from __future__ import annotations

import argparse
import random
import uuid

from hicache import Engine
from hicache.frontend.demo import SYSTEM, TASK, tool_output
from hicache.runtime.sampling import SamplingParams

# What the scripted agent "said" each turn (the real session appends the model's replies).
CALLS = ["CALL list_files(src/hicache)", "CALL run_tests(tests/test_pools.py)", "CALL read_file(src/hicache/cache/pools.py)",
         "CALL grep(reserved)", "CALL apply_patch(pools.py: start the free list at page 1)", "CALL run_tests(tests/)"]
SHORT_LEFT = 24  # hits leaving fewer tokens than this to compute: the case issue 57 found broken


def scripted_sessions(prompts: int) -> list[list[list[dict]]]:
    """``prompts`` conversation states: agent a's session after t turns, for a few agents and turns
    (each state's message list; the previous state of the same agent is its earlier turn)."""
    agents = max(1, (prompts + 4) // 5)
    sessions = []
    for a in range(agents):
        rng = random.Random(a)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{TASK} (workspace {a + 1})"}]
        states = [list(messages)]
        for turn in range(4):
            messages += [{"role": "assistant", "content": CALLS[(turn + a) % len(CALLS)]},
                         {"role": "user", "content": f"Tool output:\n{tool_output(turn + a, rng)}\nWhat next?"}]
            states.append(list(messages))
        sessions.append(states)
    return sessions


def encode(engine: Engine, messages: list[dict]) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def reply(engine: Engine, ids: list[int], sampling: SamplingParams) -> tuple[tuple[int, ...], int]:
    res = engine.generate([ids], sampling)[0]
    return tuple(res.output_ids), res.cached_tokens


def prefix_hits(engine: Engine, prompts: int, sampling: SamplingParams) -> list[tuple[int, int, bool]]:
    """(prompt tokens, cached tokens, equal to cold) for every prompt and hit length."""
    page = engine.config.page_size
    rows = []
    states = [(s[t - 1] if t else None, s[t]) for s in scripted_sessions(prompts) for t in range(len(s))][:prompts]
    for before, messages in states:
        ids = encode(engine, messages)
        engine.flush_cache()
        cold, _ = reply(engine, ids, sampling)
        last = (len(ids) - 1) // page * page
        hits = {last, last - page, len(ids) // 2 // page * page}
        if before is not None:
            hits.add(len(encode(engine, before)) // page * page)
        for p in sorted(h for h in hits if h >= page):
            engine.flush_cache()
            engine.generate([ids[:p]], SamplingParams(max_new_tokens=1, temperature=0.0))  # the cache holds p tokens
            got, cached = reply(engine, ids, sampling)
            rows.append((len(ids), cached, got == cold))
            print(f"  prefix hit: {len(ids):>4} prompt tokens, {cached:>4} cached, {len(ids) - cached:>3} computed: "
                  f"{'equal' if got == cold else 'DIFFERENT'}", flush=True)
    return rows


def turn_by_turn(engine: Engine, agents: int, sampling: SamplingParams) -> list[tuple[int, int, bool]]:
    """(prompt tokens, cached tokens, equal to cold) for each turn of ``agents`` live sessions."""
    rows = []
    engine.flush_cache()
    for a in range(agents):
        rng = random.Random(a)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{TASK} (workspace {a + 1})"}]
        for turn in range(5):
            ids = encode(engine, messages)
            res = engine.generate([ids], sampling)[0]
            cold = tuple(engine.generate([ids], sampling, cache_salt=uuid.uuid4().hex)[0].output_ids)
            if turn:  # the first turn hits nothing
                rows.append((res.prompt_tokens, res.cached_tokens, tuple(res.output_ids) == cold))
                print(f"  turn {turn + 1}: {res.prompt_tokens:>4} prompt tokens, {res.cached_tokens:>4} cached: "
                      f"{'equal' if rows[-1][2] else 'DIFFERENT'}", flush=True)
            messages += [{"role": "assistant", "content": res.text},
                         {"role": "user", "content": f"Tool output:\n{tool_output(turn + a, rng)}\nWhat next?"}]
    return rows


def summary(name: str, rows: list[tuple[int, int, bool]]) -> str:
    short = [r for r in rows if r[0] - r[1] < SHORT_LEFT]
    equal = sum(r[2] for r in rows)
    return (f"{name:<14} {equal:>3}/{len(rows):<3} equal ({equal / max(len(rows), 1):.0%}); "
            f"< {SHORT_LEFT} tokens left: {sum(r[2] for r in short)}/{len(short)}; "
            f"prompts {min(r[0] for r in rows)}-{max(r[0] for r in rows)} tokens, "
            f"hits {min(r[1] for r in rows)}-{max(r[1] for r in rows)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--agents", type=int, default=2, help="live sessions of the turn-by-turn part (0: skip it)")
    args = ap.parse_args()
    sampling = SamplingParams(max_new_tokens=args.tokens, temperature=0.0)
    engine = Engine(args.model)
    try:
        prefix = prefix_hits(engine, args.prompts, sampling)
        turns = turn_by_turn(engine, args.agents, sampling)
    finally:
        engine.shutdown()
    print(f"{args.model} (default flags): greedy replies of up to {args.tokens} tokens with a cache hit, "
          f"equal to the cold reply (token ids)")
    for line, rows in (("prefix hits", prefix), ("turn by turn", turns)):
        if rows:
            print(summary(line, rows))


if __name__ == "__main__":
    main()
