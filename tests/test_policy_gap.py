"""The offline-optimal eviction order (``hicache simulate --policy belady``) as a yardstick:
its next-use oracle, and each policy's gap to it (issue 60 item 5)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hicache.cache.tree_node import TreeNode
from hicache.cli import main
from hicache.cache_hints import RetentionHint
from hicache.sim.agentic import agentic_trace, live_set_tokens
from hicache.sim.compare import compare
from hicache.sim.oracle import NEVER, NextUse
from hicache.sim.run import UNLIMITED, Capacities, SimConfig, min_device_tokens, sim_hints, simulate
from hicache.sim.trace import BLOCK_TOKENS, SHIPPED_TRACE, TraceRequest, load_trace

pytestmark = pytest.mark.cache


def request(t: float, *blocks: int) -> TraceRequest:
    return TraceRequest(t, len(blocks) * BLOCK_TOKENS, 1, blocks)


def test_next_use_is_the_next_request_using_the_nodes_first_block() -> None:
    oracle = NextUse([(0, 1), (0, 2), (3,), (0, 1, 4)], block_tokens=2)
    oracle.now = 1
    assert [oracle.next_use(b) for b in range(5)] == [1, 3, 1, 2, 3]
    oracle.now = 2
    assert [oracle.next_use(b) for b in range(5)] == [3, 3, NEVER, 2, 3]
    # a node holding blocks 1 and 4 (tokens 3, 4, 9, 10) is next used when block 1 is
    node = TreeNode(7, "sim", np.array([3, 4, 9, 10], dtype=np.int32), None)
    assert oracle.key(node) == (-3, 7)
    gone = TreeNode(8, "sim", np.array([5, 6], dtype=np.int32), None)  # block 2: never again
    assert oracle.key(gone) < oracle.key(node)  # evicted first


def test_belady_wins_a_cyclic_scan_one_block_larger_than_the_cache() -> None:
    """Six one-block prompts in a loop through a device that keeps five of them beside the
    running request: LRU evicts each block just before it comes back (no hit at all); the optimal
    misses once per four after the first round (Belady on a cycle of n through k slots: k-1 hits
    per n-1 requests), 24 hits of 36."""
    trace = [request(i * 1000.0, i % 6) for i in range(36)]
    caps = Capacities(device=6 * BLOCK_TOKENS)  # a page per block
    lru, belady = (simulate(trace, SimConfig(caps, policy=p)).to_json() for p in ("lru", "belady"))
    assert lru["hit_ratio"] == 0.0
    assert belady["hit_ratio"] == pytest.approx(24 / 36)
    seven = simulate(trace, SimConfig(Capacities(device=7 * BLOCK_TOKENS))).to_json()
    assert seven["hit_ratio"] == pytest.approx(30 / 36)  # room for all six: LRU hits all but the first round


def test_belady_hits_nothing_on_a_trace_without_reuse() -> None:
    trace = [request(i * 1000.0, 2 * i, 2 * i + 1) for i in range(20)]
    out = simulate(trace, SimConfig(Capacities(device=8 * BLOCK_TOKENS), policy="belady")).to_json()
    assert out["hit_ratio"] == 0.0 and out["requests"] == 20


def test_belady_is_at_least_lru_per_capacity_on_the_mooncake_trace() -> None:
    trace = load_trace(SHIPPED_TRACE, 400)
    for caps in (Capacities(device=256 * BLOCK_TOKENS), Capacities(256 * BLOCK_TOKENS, 512 * BLOCK_TOKENS),
                 Capacities(256 * BLOCK_TOKENS, 512 * BLOCK_TOKENS, 1024 * BLOCK_TOKENS)):
        results = compare(trace, SimConfig(caps), ["lru", "belady"])
        lru, belady = results["lru"], results["belady"]
        assert belady["hit_ratio"] >= lru["hit_ratio"]
        assert lru["gap_to_belady"]["points"] == pytest.approx(100 * (belady["hit_ratio"] - lru["hit_ratio"]))
        assert belady["gap_to_belady"] == {"points": 0.0, "share_of_optimal": 1.0}


def test_cli_runs_policies_side_by_side(tmp_path, capsys) -> None:
    path = tmp_path / "scan.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i * 1000, "input_length": BLOCK_TOKENS, "output_length": 1,
                                        "hash_ids": [i % 4]}) + "\n" for i in range(20)))
    args = ["simulate", "--trace", str(path), "--device-tokens", str(4 * BLOCK_TOKENS)]  # 3 of the 4 blocks
    assert main([*args, "--policy", "lru,belady", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["policies"]
    assert set(got) == {"lru", "belady"}
    assert got["lru"]["hit_ratio"] == 0.0 and got["belady"]["hit_ratio"] > 0
    assert got["lru"]["gap_to_belady"]["share_of_optimal"] == 0.0
    assert main([*args, "--policy", "lru,belady"]) == 0
    table = capsys.readouterr().out
    assert "belady" in table and "gap (points)" in table


def test_bad_policies_are_refused_in_one_sentence(capsys) -> None:
    base = ["simulate", "--max-requests", "5"]
    assert main([*base, "--policy", "lru,fifo"]) != 0
    assert "--policy takes lru, lru+hints, belady" in capsys.readouterr().err
    assert main([*base, "--policy", "belady", "--engines", "2"]) != 0
    assert "--policy belady needs --engines 1" in capsys.readouterr().err
    assert main(["simulate", "--trace", "agentic", "--agentic-time-factor", "0"]) != 0
    assert "--trace agentic: time_factor must be > 0" in capsys.readouterr().err


def test_a_bounded_store_under_belady_keeps_what_comes_back() -> None:
    """The store under the oracle: a cyclic scan of six two-block prompts through a store of
    eight pages (four prompts) behind small memory tiers. LRU's store has evicted each prompt
    before it returns; the optimal's keeps most of them (20 of 36 prompts hit in storage; an
    unlimited store, 30: all but the first round)."""
    trace = [request(i * 1000.0, 2 * (i % 6), 2 * (i % 6) + 1) for i in range(36)]
    caps = Capacities(3 * BLOCK_TOKENS, 6 * BLOCK_TOKENS, 8 * BLOCK_TOKENS)
    lru, belady = (simulate(trace, SimConfig(caps, policy=p)).to_json() for p in ("lru", "belady"))
    assert lru["hit_ratio"] == 0.0
    assert belady["hit_tokens"]["storage"] > 0.5 * belady["input_tokens"]
    assert belady["hit_ratio"] <= 30 / 36  # never above the trace's ceiling


@pytest.fixture(scope="module")
def agentic():
    """The agentic trace at a third of its live set in L1 (or its longest prompt, if more) and
    twice that in L2 (issue 60's sizing)."""
    trace = agentic_trace(seed=0)
    device = max(live_set_tokens(trace) / 3, min_device_tokens(trace, SimConfig()))
    return trace, Capacities(device, 2 * device)


def test_hints_keep_the_lead_agents_history_through_the_flood(agentic) -> None:
    trace, caps = agentic
    results = compare(trace, SimConfig(caps), ["lru", "lru+hints", "belady"])
    assert set(results["lru"]["per_class"]) == {"lead", "subagent", "flood"}
    lead = {p: out["per_class"]["lead"]["hit_ratio"] for p, out in results.items()}
    assert lead["lru+hints"] > lead["lru"] + 0.3  # the flood flushes the lead's history under plain LRU
    for p in ("lru", "lru+hints"):
        assert results[p]["hit_ratio"] <= results["belady"]["hit_ratio"]
        assert results[p]["gap_to_belady"]["points"] > 0


def test_a_hint_becomes_a_retention_hint_in_the_replays_tokens() -> None:
    req = TraceRequest(0.0, 3 * BLOCK_TOKENS, 1, (1, 2, 3), hints=(
        {"blocks": 2, "seconds": 3600.0, "ttl": "1h"}, {"blocks": None, "seconds": 86400.0, "ttl": "24h"}))
    cfg = SimConfig(block_tokens=4, policy="lru+hints")
    assert sim_hints(req, cfg) == (RetentionHint(8, 3600.0, 0, "1h"), RetentionHint(None, 86400.0, 0, "24h"))
    assert sim_hints(req, SimConfig(block_tokens=4)) == ()  # plain lru ignores them


def test_selective_storage_writes_fewer_bytes(agentic) -> None:
    trace, caps = agentic
    caps = Capacities(caps.device, caps.host, storage=UNLIMITED)
    results = compare(trace, SimConfig(caps), ["lru+hints"], ["write_through", "selective"])
    full, selective = results["lru+hints, write_through"], results["lru+hints, selective"]
    assert 0 < selective["storage_written_bytes"] < full["storage_written_bytes"]
    assert full["storage_written_bytes"] == full["storage_written_tokens"] * SimConfig().cost.kv_bytes_per_token
    assert selective["hit_tokens"]["storage"] <= full["hit_tokens"]["storage"]


def test_cli_agentic_trace_reports_each_class(capsys) -> None:
    assert main(["simulate", "--trace", "agentic", "--max-requests", "120", "--device-tokens", "3e4",
                 "--host-tokens", "6e4", "--policy", "lru+hints", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["policies"]["lru+hints"]
    assert got["requests"] == 120
    assert sum(c["requests"] for c in got["per_class"].values()) == 120
