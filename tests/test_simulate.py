"""``hicache simulate`` (issue 17): the Mooncake conversation trace replayed through the cache
code on a virtual clock."""

from __future__ import annotations

import json

import pytest

from hicache.cli import main
from hicache.config import ConfigError
from hicache.sim.run import UNLIMITED, Capacities, SimConfig, simulate
from hicache.sim.trace import BLOCK_TOKENS, SHIPPED_TRACE, TraceError, largest_conversations, load_trace

pytestmark = pytest.mark.cache

SLICE = 1500  # requests: seconds to simulate, and plenty of reuse (conversations come back)


@pytest.fixture(scope="module")
def trace():
    return load_trace(SHIPPED_TRACE, SLICE)


def oracle_hit_ratio(path: str, limit: int) -> float:
    """Every block whose whole prefix chain was seen before is a hit (unlimited capacity),
    computed from the raw lines, without the simulator's code."""
    seen: set[int] = set()
    hit = total = 0
    with open(path, encoding="utf-8") as f:
        for line in list(f)[:limit]:
            req = json.loads(line)
            ids, n = req["hash_ids"], req["input_length"]
            for i, b in enumerate(ids):
                if b not in seen:
                    break
                hit += min(BLOCK_TOKENS, n - i * BLOCK_TOKENS)
            seen.update(ids)
            total += n
    return hit / total


def test_unlimited_capacity_hits_exactly_what_the_trace_allows(trace) -> None:
    got = simulate(trace, SimConfig()).to_json()
    assert got["hit_ratio"] == pytest.approx(oracle_hit_ratio(SHIPPED_TRACE, SLICE), abs=1e-12)
    assert got["hit_tokens"]["host"] == got["hit_tokens"]["storage"] == 0  # the device holds everything
    assert got["requests"] == SLICE


@pytest.mark.slow
def test_storage_recovers_what_small_device_and_host_tiers_lose(trace) -> None:
    """The seed's production note in kind: without external storage the hit ratio drops with the
    memory budget; with an unlimited store behind it, every reusable block hits again."""
    small = Capacities(device=256 * BLOCK_TOKENS, host=1024 * BLOCK_TOKENS)
    without = simulate(trace, SimConfig(small)).to_json()
    with_storage = simulate(trace, SimConfig(Capacities(small.device, small.host, UNLIMITED))).to_json()
    oracle = oracle_hit_ratio(SHIPPED_TRACE, SLICE)
    assert without["hit_ratio"] < 0.8 * oracle
    assert with_storage["hit_ratio"] == pytest.approx(oracle, abs=1e-12)
    hits = with_storage["hit_tokens"]
    assert hits["device"] > 0 and hits["host"] > 0 and hits["storage"] > 0
    assert with_storage["ttft_s"]["mean"] < without["ttft_s"]["mean"]  # fewer tokens to compute


def test_kv_sharding_moves_hits_from_host_to_device(trace) -> None:
    """Figure 1d in kind: N x the device (and host) capacity per engine; the combined ratio stays
    put when the host tier holds the working set either way."""
    caps = Capacities(device=256 * BLOCK_TOKENS, host=UNLIMITED)
    one, four = (simulate(trace, SimConfig(caps, kv_sharding=n)).to_json() for n in (1, 4))
    assert four["hit_tokens"]["device"] > one["hit_tokens"]["device"]
    assert four["hit_tokens"]["host"] < one["hit_tokens"]["host"]  # (host unlimited either way)
    assert four["hit_ratio"] == pytest.approx(one["hit_ratio"], abs=1e-12)


def test_cache_aware_routing_keeps_conversations_on_their_engine(trace) -> None:
    rr, aware = (simulate(trace, SimConfig(engines=2, router=r)).to_json() for r in ("round-robin", "cache-aware"))
    assert aware["hit_ratio"] > rr["hit_ratio"] + 0.05
    assert [e["requests"] for e in rr["per_engine"]] == [SLICE // 2, SLICE - SLICE // 2]
    assert sum(e["requests"] for e in aware["per_engine"]) == SLICE


def test_cli_json_and_sweep(tmp_path, capsys) -> None:
    assert main(["simulate", "--max-requests", "200", "--device-tokens", "4e5", "--host-tokens", "2e6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"requests", "input_tokens", "hit_tokens", "hit_ratio", "ttft_s"}
    assert set(out["hit_tokens"]) == {"device", "host", "storage"} and set(out["ttft_s"]) == {"mean", "p50", "p99"}
    plot = tmp_path / "sweep.png"
    assert main(["simulate", "--max-requests", "200", "--sweep", "device", "--sweep-tokens", "2.5e5,1e6,4e6",
                 "--plot", str(plot)]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ratios = [float(line.split("hit ratio ")[1].split("%")[0]) for line in capsys.readouterr().out.splitlines()
              if "hit ratio" in line]
    assert ratios == sorted(ratios) and len(ratios) == 3  # more device memory never hits less here


def test_bad_input_is_refused_in_one_sentence(tmp_path, capsys) -> None:
    bad = tmp_path / "trace.jsonl"
    good = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
    bad.write_text(good + '{"timestamp": 3, "input_length": 600, "hash_ids": [1, 2]}\n')
    with pytest.raises(TraceError, match="line 2: missing output_length"):
        load_trace(str(bad))
    assert main(["simulate", "--trace", str(bad)]) == 2
    assert "trace.jsonl line 2" in capsys.readouterr().err
    bad.write_text(good + "not json\n")
    assert main(["simulate", "--trace", str(bad)]) == 2
    assert "line 2" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"smaller than one page \(512 tokens\)"):
        simulate(load_trace(SHIPPED_TRACE, 5), SimConfig(Capacities(device=100)))
    assert main(["simulate", "--max-requests", "5", "--host-tokens", "10"]) == 2
    assert "smaller than one page" in capsys.readouterr().err


# ---- the simulator agrees with a live engine -------------------------------------------------
@pytest.mark.server
@pytest.mark.slow
def test_simulated_hit_ratios_match_a_live_server_within_two_points(tmp_path) -> None:
    """The same requests (16 tokens per block: one page), the same capacities (device 64 pages,
    host 128), replayed on `hicache serve` one at a time and on the simulator: each tier's hit
    ratio agrees within 2 points. (The prompts are token ids, whole pages, and each answer one
    token: which pages hit does not depend on the model's weights, so a small random model
    serves them.)"""
    from hicache.bench.main import launch_server
    from hicache.processes import stop_process

    sliced = tmp_path / "slice.jsonl"  # real requests of the trace's eight largest conversations
    sliced.write_text("\n".join(largest_conversations(SHIPPED_TRACE, 8, 40, 40)) + "\n")
    pages, host_ratio = 64, 2
    proc, url = launch_server(f"--model random:small --page-size 16 --max-total-tokens {pages * 16} "
                              f"--enable-hierarchical-cache --hicache-ratio {host_ratio}", 300)
    report = tmp_path / "live.json"
    try:
        assert main(["bench", "--base-url", url, "--dataset", "mooncake", "--trace", str(sliced),
                     "--prompt-format", "token-ids", "--block-tokens", "16", "--max-output-tokens", "1",
                     "--time-scale", "1e-9", "--max-concurrency", "1", "--disable-tqdm",
                     "--output-file", str(report)]) == 0
    finally:
        stop_process(proc, 30)
    live = json.loads(report.read_text())["server_cache"]["hit_rate"]
    sim = simulate(load_trace(str(sliced)), SimConfig(Capacities(device=pages * BLOCK_TOKENS,
                                                                 host=pages * host_ratio * BLOCK_TOKENS))).to_json()
    predicted = {t: n / sim["input_tokens"] for t, n in sim["hit_tokens"].items()}
    assert predicted["host"] > 0.05 and predicted["device"] > 0.2  # both tiers matter here
    for tier in ("device", "host"):
        assert abs(live.get(tier, 0.0) - predicted[tier]) <= 0.02, (tier, live, predicted)


def test_mooncake_replay_prompts_share_text_where_the_trace_shares_blocks(tmp_path) -> None:
    from hicache.bench.workload import mooncake_requests

    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1024, "output_length": 64, "hash_ids": [1, 2]}\n'
                    '{"timestamp": 500, "input_length": 1300, "output_length": 0, "hash_ids": [1, 2, 3]}\n')
    first, second = mooncake_requests(str(path), 8)
    a, b = first.prompt.split(), second.prompt.split()
    assert len(a) == 2 * 8 + 2 and len(b) == 2 * 8 + 5 + 2  # the last block: ceil(8 x 276/512) words, + 2 own
    assert a[:16] == b[:16] and a[16:] != b[16:18]  # the shared blocks are the same words, the rest differs
    assert (first.max_tokens, second.max_tokens) == (1, 1) and second.timestamp == 0.5 and second.turn == 2
    ids = mooncake_requests(str(path), 8, token_ids=True)[1].prompt
    assert len(ids) == 23 and all(isinstance(i, int) for i in ids)
