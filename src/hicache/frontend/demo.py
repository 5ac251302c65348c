"""The demo `make demo` runs: a scripted agent session that resends its growing history each
turn, the way agentic workloads do, and shows how much of it the cache serves."""

from __future__ import annotations

import random
import textwrap

from . import Engine, GenerateResult, SamplingParams

SYSTEM = """You are RepoBot, a careful coding agent working in a Python repository. You can call
tools by writing one line `CALL tool(args)`. Tools: list_files(path), read_file(path),
run_tests(selector), grep(pattern), apply_patch(diff). Rules: read before you edit; keep
patches small; run the tests after every change; explain each step in one short sentence;
never invent file contents; when the tests pass, summarise what changed and stop.
Coding style of the repository: type hints everywhere, dataclasses for state, small modules
with one job each, docstrings that state units and invariants, comments that explain why."""

TASK = "The test suite reports a failure in the page allocator. Find the cause and fix it."


def tool_output(turn: int, rng: random.Random) -> str:
    """A deterministic, realistic-looking tool result for this turn (file listings, logs, code)."""
    kinds = [
        lambda: "\n".join(f"src/hicache/{d}/{f}.py  {rng.randint(40, 400)} lines"
                          for d in ("cache", "engine", "model") for f in ("pools", "radix", "manager", "runner")),
        lambda: "\n".join(f"tests/test_pools.py::test_case_{i} {'FAILED' if i == 3 else 'PASSED'}" for i in range(12))
        + "\nE   AssertionError: allocator handed out page 0 (reserved)\nE   assert 0 != 0",
        lambda: "\n".join(f"{n:4d}  " + line for n, line in enumerate([
            "class PageAllocator:", "    def __init__(self, num_pages):", "        self.num_pages = num_pages",
            "        self._free = list(range(num_pages))  # includes page 0", "    def alloc(self, n):",
            "        if n > len(self._free):", "            return None", "        out = self._free[:n]",
            "        self._free = self._free[n:]", "        return out"], start=10)),
        lambda: "\n".join(f"src/hicache/cache/pools.py:{rng.randint(1, 90)}: page {rng.randint(0, 9)} reserved"
                          for _ in range(10)),
        lambda: "--- a/src/hicache/cache/pools.py\n+++ b/src/hicache/cache/pools.py\n@@ -13 +13 @@\n"
        "-        self._free = list(range(num_pages))\n+        self._free = list(range(1, num_pages))\n",
        lambda: "\n".join(f"tests/test_pools.py::test_case_{i} PASSED" for i in range(12)) + "\n12 passed in 0.31s",
    ]
    return kinds[turn % len(kinds)]()


def copy_turn(engine: Engine, messages: list[dict], max_new_tokens: int) -> None:
    """A copy-heavy turn: the agent repeats code it has seen with a fix, which NGRAM drafts from
    the conversation and the cache (its accept length and decode rate next to the session's)."""
    ask = messages + [{"role": "user", "content": "Show the PageAllocator class from the tool output again, "
                                                  "with the page 0 fix applied, as one code block."}]
    res = engine.chat(ask, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
    rate = (res.completion_tokens - 1) / max(res.e2e_s - res.ttft_s, 1e-9)
    print(f"\ncopy-heavy turn (NGRAM): {res.completion_tokens} tokens at {rate:.1f} tok/s after the first, accept "
          f"length {res.spec_accept_length:.2f} over {res.spec_verify_steps} verify passes: "
          f"{textwrap.shorten(res.text.replace(chr(10), ' '), 90, placeholder='...')}")


def print_window_pool(engine: Engine) -> None:
    """A hybrid model: what its window pool holds after the run (docs/hybrid_kv.md); nothing otherwise."""
    pool = engine.stats()["device_pool"].get("window")
    if pool is not None:
        print(f"window pool: {pool['cached_tokens']} of {pool['capacity_tokens']} tokens hold cached windows "
              f"(checkpoints at turn ends), {pool['evicted_pages'] * engine.config.page_size} tokens' windows "
              f"tombstoned; the full layers keep every cached page")


def print_header(engine: Engine, agents: int, turns: int, spec: bool) -> None:
    """The run's setup in one line, then the per-turn table's column names."""
    host = "on" if engine.config.enable_hierarchical_cache else "off"
    window = engine.backend.component_pages.get("window", 0) * engine.config.page_size
    print(f"hicache demo: {agents} agent(s) x {turns} turns on {engine.config.model} "
          f"({engine.device}, {engine.config.dtype}, KV {engine.config.kv_cache_dtype}, "
          f"page {engine.config.page_size}, device pool {engine.capacity_pages * engine.config.page_size} tokens"
          f"{f' + a window pool of {window} tokens for the sliding-window layers' if window else ''}, host tier {host})\n")
    print(f"{'agent':>5} {'turn':>4} {'input':>6} {'cached':>6} {'device':>6} {'host':>5} {'storage':>7} "
          f"{'TTFT ms':>8}{'  accept' if spec else ''}  reply")


def print_summary(results: list[GenerateResult], agents: int, versus: str) -> None:
    """Hit rate per tier over every turn, and the cold first turns' TTFT against the later ones'."""
    prompt = sum(r.prompt_tokens for r in results)
    tiers = {t: sum(r.cached_tokens_details[t] for r in results) for t in ("device", "host", "storage")}
    later = results[agents:]
    print(f"\nsummary: hit rate {sum(tiers.values()) / prompt:.1%} of {prompt} prompt tokens "
          f"(device {tiers['device'] / prompt:.1%}, host {tiers['host'] / prompt:.1%}, "
          f"storage {tiers['storage'] / prompt:.1%}); TTFT first turn(s) (cold) "
          f"{sum(r.ttft_s for r in results[:agents]) / agents * 1000:.0f} ms, later turns mean "
          f"{sum(r.ttft_s for r in later) / max(len(later), 1) * 1000:.0f} ms{versus}")


def print_mode_stats(engine: Engine) -> None:
    """Speculative decoding's accept length and context parallelism's gathers, where they ran."""
    if engine.config.speculative_steps > 0:
        s = engine.stats()["speculative"]
        print(f"speculative decoding: {s['num_steps']} draft tokens per verify pass, accept length "
              f"{s['accept_length']:.2f} tokens per request per pass ({s['request_verify_steps']} request-passes)")
    sharding = engine.stats().get("kv_sharding")
    if sharding is not None:
        gathers = sharding["per_rank"][0]
        how = f"page-sharded over {sharding['shards']} ranks" if sharding["shards"] > 1 else "replicated on every rank"
        print(f"context parallel KV: {how}; pages held per CP rank {sharding['owned_pages']}; "
              f"rank 0 ran {gathers['gathers']} prefix gathers ({gathers['gathered_bytes'] / 2**20:.1f} MiB, "
              f"{gathers['gather_time_s'] * 1e3:.0f} ms, {gathers['gather_wait_s'] * 1e3:.0f} ms of it waited for)")


def run_demo(engine: Engine, turns: int = 8, max_new_tokens: int = 40, agents: int = 1, cold_rerun: bool = True) -> int:
    """``agents`` sessions take turns round-robin; with a small device pool and the host tier
    on, each agent's history leaves the device between its turns and comes back from L2.
    ``cold_rerun``: the summary compares the last turn's TTFT with the same prompt run cold."""
    rng = random.Random(0)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    sessions = [[{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": f"{TASK} (workspace {a + 1})"}] for a in range(agents)]
    spec = engine.config.speculative_steps > 0  # then each turn's acceptance length too
    print_header(engine, agents, turns, spec)
    results = []
    for turn in range(turns):
        for a, messages in enumerate(sessions):
            res = engine.chat(messages, sampling)
            results.append(res)
            d = res.cached_tokens_details
            reply = textwrap.shorten(res.text.replace("\n", " "), 50, placeholder="...")
            accept = f"{res.spec_accept_length:>8.2f}" if spec else ""
            print(f"{a + 1:>5} {turn + 1:>4} {res.prompt_tokens:>6} {res.cached_tokens:>6} {d['device']:>6} "
                  f"{d['host']:>5} {d['storage']:>7} {res.ttft_s * 1000:>8.1f}{accept}  {reply}")
            messages.append({"role": "assistant", "content": res.text})
            messages.append({"role": "user", "content": f"Tool output:\n{tool_output(turn, rng)}\nWhat next?"})

    # The final turn's prompt again, for a like-for-like TTFT: a fresh cache_salt is a namespace
    # no tier has seen, so it runs cold everywhere (storage included).
    warm = results[-1]
    versus = ""
    if cold_rerun:
        cold = engine.chat(sessions[-1][:-2], sampling, cache_salt=f"demo-cold-{random.random()}")
        versus = (f"; last turn ({warm.prompt_tokens} tokens) warm {warm.ttft_s * 1000:.0f} ms vs cold "
                  f"{cold.ttft_s * 1000:.0f} ms ({cold.ttft_s / warm.ttft_s:.1f}x faster with the cache)")
    print_summary(results, agents, versus)
    print_window_pool(engine)
    if engine.config.speculative_algorithm == "NGRAM":
        copy_turn(engine, sessions[-1], max(max_new_tokens, 96))
    print_mode_stats(engine)
    return 0
