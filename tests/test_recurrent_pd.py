"""Prefill/decode disaggregation of a hybrid recurrent model (issue 59, step e): the attention rows
cross from ``decode_prefix_len`` on as for any model, and the recurrent layers' state crosses whole --
the state at the prompt's end (the decode side's running slot) and the snapshot at its checkpoint
``floor((P - 1) / S) * S`` (the decode side's tree takes it) -- never a state per page. Checked as a
user would: the pair gives one engine's greedy tokens and log-probabilities, a later request sharing a
prefix crosses only its suffix's rows and the states, the byte counts are exactly that, and a plain
request on the decode server hits the checkpoint it was sent."""

from __future__ import annotations

import random
import threading

import pytest

from hicache import Engine, SamplingParams
from hicache.disagg.bootstrap import Bootstrap
from hicache.disagg.fields import WireError
from hicache.disagg.state_tail import StateAsk
from transfer_engines import mooncake_transfer_engine_missing

pytestmark = pytest.mark.pd

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, logprobs=0)
OPTS = dict(dtype="float32", page_size=4, max_total_tokens=4096, chunked_prefill_size=64)
LOGPROB_ATOL = 1e-4  # float32: a chunk of another length is a GEMM of another shape


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 250) for _ in range(n)]


def serve(prefill: Engine, decode: Engine, prompt: list[int], room: int):
    """What a router does: the same request to both servers with one bootstrap; returns the decode
    server's result and the prefill server's (which carries what it sent)."""
    boot = Bootstrap("127.0.0.1", prefill.stats()["disaggregation"]["bootstrap_port"], room)
    sent = []
    side = threading.Thread(target=lambda: sent.append(prefill.generate([prompt], GREEDY, bootstrap=boot)[0]))
    side.start()
    got = decode.generate([prompt], GREEDY, bootstrap=boot)[0]
    side.join(timeout=60)
    return got, sent[0]


def assert_as_one_engine(got, sent, want) -> None:
    """The pair's tokens are one engine's; the first token's log-probability is the prefill side's, the
    others the decode side's, each within the tolerance of one engine's."""
    assert got.finish_reason == "length" and got.output_ids == want.output_ids
    assert abs(sent.logprobs[0].logprob - want.logprobs[0].logprob) < LOGPROB_ATOL
    assert max(abs(a.logprob - b.logprob) for a, b in zip(got.logprobs, want.logprobs[1:])) < LOGPROB_ATOL


def row_bytes(engine: Engine) -> int:
    """One token's attention KV over every attention layer (K and V) of ``engine``'s pool."""
    return sum(2 * k[0].numel() * k.element_size() for k in engine.cache.pool.k_buffers)


@pytest.mark.parametrize("model, backend", [("random:lfm2-tiny", "zmq"), ("random:gdn-tiny", "zmq"),
                                            ("random:lfm2-tiny", "mooncake")])
def test_a_pd_pair_sends_rows_after_the_hit_and_two_whole_states_and_decodes_as_one_engine(model, backend) -> None:
    if backend == "mooncake" and mooncake_transfer_engine_missing():
        pytest.skip(mooncake_transfer_engine_missing())
    first = ids(150, seed=1)
    turns = [first, first + ids(30, seed=2), first[:100] + ids(40, seed=3)]  # a next turn; a shared prefix only
    plain = Engine(model, **OPTS)
    want = [plain.generate([p], GREEDY, cache_salt=f"cold-{i}")[0] for i, p in enumerate(turns)]
    plain.shutdown()
    common = dict(disaggregation_transfer_backend=backend, **OPTS)
    prefill = Engine(model, disaggregation_mode="prefill", disaggregation_bootstrap_port=0, **common)
    decode = Engine(model, disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True,
                    enable_hierarchical_cache=True, **common)  # (its host tier copies the snapshots it is sent)
    try:
        pool = decode.stats()["device_pool"]["recurrent_state"]
        grid, slot, row = pool["grid_tokens"], pool["slot_bytes"], row_bytes(decode)
        checkpoints: set[tuple[int, ...]] = set()  # the prefixes the decode server's tree holds a snapshot at
        crossed = 0  # states
        for room, (prompt, one) in enumerate(zip(turns, want)):
            got, sent = serve(prefill, decode, prompt, room)
            assert_as_one_engine(got, sent, one)
            # the hit counts attention rows (the second turn: the first prompt's whole pages; the third:
            # the shared 100 tokens, though no snapshot ends there -- the states arrive whole)
            assert got.decode_prefix_len == [0, 148, 100][room]
            at = (len(prompt) - 1) // grid * grid
            states = 1 + (tuple(prompt[:at]) not in checkpoints)  # the end; the checkpoint unless the tree has it
            checkpoints.add(tuple(prompt[:at]))
            crossed += states
            rows = len(prompt) - got.decode_prefix_len
            assert got.kv_transferred_tokens == sent.kv_transferred_tokens == rows
            assert got.kv_transferred_bytes == sent.kv_transferred_bytes == rows * row + states * slot
        counts = decode.stats()["disaggregation"], prefill.stats()["disaggregation"]
        assert counts[0]["states"] == counts[1]["states"] == crossed <= 2 * len(turns)  # never one per page
        decode.cache.drain()
        assert decode.stats()["host_pool"]["recurrent_state"]["snapshots_cached"] == crossed - len(turns)
        # a decode server that lost its cache asks for the first prompt again: the prefill server hits its
        # checkpoint and sends that snapshot from its tree; a plain request on the decode server then hits it
        assert decode.flush_cache()
        got, sent = serve(prefill, decode, first, len(turns))
        assert_as_one_engine(got, sent, want[0])
        assert sent.cached_tokens == 148 // grid * grid and got.kv_transferred_bytes == len(first) * row + 2 * slot
        again = decode.generate([first], GREEDY)[0]
        assert again.cached_tokens == 148 // grid * grid and again.output_ids == want[0].output_ids
        decode.cache.tree.check_invariants()
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_failed_transfer_leaves_no_checkpoint_snapshot_in_the_decode_tree() -> None:
    """The decode tree holds a prompt's pages past its checkpoint but no snapshot there: the slot taken
    for the checkpoint's state is freed when the transfer fails, not given to the tree (it holds no
    state), so a later plain request of that prompt does not hit there and decodes as a cold run."""
    decode = Engine("random:lfm2-tiny", disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True,
                    disaggregation_transfer_timeout=0.5, **OPTS)
    try:
        seen = ids(45, seed=4)
        decode.generate([seen], GREEDY)  # pages 0-44 cached, a snapshot at its checkpoint 44 only
        prompt = seen[:41] + ids(1, seed=5)  # its checkpoint, 40, is inside them
        got = decode.generate([prompt], GREEDY, bootstrap=Bootstrap("127.0.0.1", 9, 5))[0]  # nobody there
        assert got.finish_reason == "error" and "prefill server" in got.error and got.decode_prefix_len == 40
        pool = decode.stats()["device_pool"]["recurrent_state"]
        assert pool["snapshots_cached"] == 1 and pool["running_slots_held"] == 0
        again = decode.generate([prompt], GREEDY)[0]
        assert again.cached_tokens == 0
        assert again.output_ids == decode.generate([prompt], GREEDY, cache_salt="cold")[0].output_ids
        decode.cache.tree.check_invariants()
    finally:
        decode.shutdown()


def test_an_ask_for_states_is_checked_on_the_wire() -> None:
    ask = StateAsk((40, 36), 1024, (1 << 40, 2 << 40), (3, 70))
    assert StateAsk.parse(ask.to_wire(), prompt_len=40) == ask
    assert StateAsk.parse({"room": 1}, prompt_len=40) is None  # a model without recurrent layers asks none
    for bad in ({"state_at": [36, 40]}, {"state_at": [40, 40]}, {"state_at": [40, 0]}, {"state_at": [40, 36, 32]},
                {"state_at": [40], "state_bytes": 0}, {"state_at": [40], "state_bytes": True},
                {**ask.to_wire(), "state_slots": [3]}, {**ask.to_wire(), "state_buffers": [-1]}):
        with pytest.raises(WireError):
            StateAsk.parse({"state_bytes": 1024, **bad}, prompt_len=40)


@pytest.mark.multirank
@pytest.mark.slow
def test_tp2_servers_move_each_ranks_state_shard_and_unequal_tp_sizes_fail_in_one_sentence(monkeypatch) -> None:
    """Each prefill rank sends its shard of the states (gdn-tiny at TP2: half the key and value heads) to the
    decode rank of its index, and the pair decodes as one engine; a decode server of another TP size cannot
    take the shards and fails the request at the route, in one sentence. The rank consensus checker is on:
    the ranks of each server agree on the states that arrived (DESIGN invariant 3)."""
    monkeypatch.setenv("HICACHE_RANK_CONSENSUS_CHECKER", "1")
    model, prompt = "random:gdn-tiny", ids(150, seed=6)
    plain = Engine(model, **OPTS)
    want = plain.generate([prompt], GREEDY)[0]
    row, slot = row_bytes(plain), plain.stats()["device_pool"]["recurrent_state"]["slot_bytes"]
    plain.shutdown()
    prefill = Engine(model, tp_size=2, disaggregation_mode="prefill", disaggregation_bootstrap_port=0, **OPTS)
    decode = Engine(model, tp_size=2, disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True,
                    **OPTS)
    other = Engine(model, disaggregation_mode="decode", **OPTS)
    try:
        got, sent = serve(prefill, decode, prompt, room=1)
        port = prefill.stats()["disaggregation"]["bootstrap_port"]  # (the route alone refuses it: no prefill asked)
        refused = other.generate([prompt], GREEDY, bootstrap=Bootstrap("127.0.0.1", port, 2))[0]
    finally:
        for engine in (prefill, decode, other):
            engine.shutdown()
    assert got.output_ids == want.output_ids  # (a TP decode server returns no log-probabilities here)
    assert got.kv_transferred_bytes == sent.kv_transferred_bytes == len(prompt) * row + 2 * slot  # both ranks' shards
    assert refused.finish_reason == "error" and "--tp-size" in refused.error and refused.error.count(". ") == 0
