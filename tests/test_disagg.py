"""Prefill/decode disaggregation (issue 16, seed section 5): the decode server keeps its own
tiers, reports ``decode_prefix_len`` and receives only the suffix's KV."""

from __future__ import annotations

import threading

import pytest

from hicache import Engine, SamplingParams
from hicache.config import ConfigError
from hicache.disagg.bootstrap import Bootstrap
from transfer_engines import mooncake_transfer_engine_missing

pytestmark = pytest.mark.pd

MODEL = "random:small"
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
OPTS = dict(dtype="float32", page_size=16, max_total_tokens=1024)
SPAN = 64  # tokens: four pages
A, B, C = ([(i * 31 + 7 * k) % 250 + 3 for i in range(SPAN)] for k in (1, 2, 3))


@pytest.fixture(params=["zmq", "mooncake"])
def servers(request):
    """A prefill and a decode engine in this process, over either transfer backend."""
    if request.param == "mooncake" and mooncake_transfer_engine_missing():
        pytest.skip(mooncake_transfer_engine_missing())
    backend = dict(disaggregation_transfer_backend=request.param)
    prefill = Engine(MODEL, disaggregation_mode="prefill", disaggregation_bootstrap_port=0, **backend, **OPTS)
    decode = Engine(MODEL, disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True,
                    enable_hierarchical_cache=True, **backend, **OPTS)
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


def bootstrap_port(prefill: Engine) -> int:
    return prefill.stats()["disaggregation"]["bootstrap_port"]


def serve(prefill: Engine, decode: Engine, prompt: list[int], room: int):
    """What a router does: the same request to both servers with one bootstrap; the decode
    server's result is the answer (the prefill server's carries what it sent)."""
    boot = Bootstrap("127.0.0.1", bootstrap_port(prefill), room)
    sent = []
    side = threading.Thread(target=lambda: sent.append(prefill.generate(prompt, GREEDY, bootstrap=boot)[0]))
    side.start()
    got = decode.generate(prompt, GREEDY, bootstrap=boot)[0]
    side.join(timeout=60)
    return got, sent[0]


def test_figure5_only_the_missing_suffix_crosses(servers) -> None:
    """A on the decode device, B in its host memory, C new: decode_prefix_len = |A| + |B|,
    only C's KV crosses, and the answer equals the non-disaggregated engine's."""
    prefill, decode = servers
    plain = Engine(MODEL, **OPTS)
    expected = plain.generate(A + B + C, GREEDY)[0].output_ids
    plain.shutdown()
    serve(prefill, decode, A, room=1)
    serve(prefill, decode, A + B, room=2)
    decode.cache.drain()  # B's pages reach the host tier (write-through)...
    assert decode.cache.tree.evict(SPAN // 16) == SPAN // 16  # ...then leave the device: B is host-only
    # B's restore is slow (C arrives long before it): the answer still equals the plain run (DESIGN inv. 4:
    # the decode role waits for the restore, and attention waits per layer besides)
    decode.cache.controller.delay_fn = lambda op, layer: 0.05
    got, sent = serve(prefill, decode, A + B + C, room=3)
    assert got.output_ids == expected and got.finish_reason == "length"
    assert got.decode_prefix_len == 2 * SPAN
    assert got.cached_tokens_details == {"device": SPAN, "host": SPAN, "storage": 0}
    spec = decode.loaded.spec
    row = spec.num_kv_heads * spec.head_dim * 4  # float32
    assert got.kv_transferred_tokens == sent.kv_transferred_tokens == SPAN  # C only, not 3 * SPAN
    assert got.kv_transferred_bytes == sent.kv_transferred_bytes == SPAN * row * 2 * spec.num_layers
    assert sent.output_ids == expected[:1]  # prefill computed the first token and stopped


def test_without_decode_side_reuse_the_whole_prompt_crosses() -> None:
    prefill = Engine(MODEL, disaggregation_mode="prefill", disaggregation_bootstrap_port=0, **OPTS)
    decode = Engine(MODEL, disaggregation_mode="decode", **OPTS)
    try:
        serve(prefill, decode, A + B, room=7)
        got, _ = serve(prefill, decode, A + B + C, room=8)
        assert got.decode_prefix_len == 0 and got.kv_transferred_tokens == 3 * SPAN
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_prefill_server_that_never_answers_fails_the_request_and_frees_its_pages() -> None:
    decode = Engine(MODEL, disaggregation_mode="decode", disaggregation_transfer_timeout=0.5, **OPTS)
    try:
        free = decode.cache.allocator.available
        got = decode.generate(A, GREEDY, bootstrap=Bootstrap("127.0.0.1", 9, 5))[0]  # nobody listens there
        assert got.finish_reason == "error" and "prefill server" in got.error and got.output_ids == []
        assert decode.cache.allocator.available == free
    finally:
        decode.shutdown()


def test_disaggregation_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="runs with --tp-size on one machine"):
        Engine(MODEL, disaggregation_mode="decode", pp_size=2)
    with pytest.raises(ConfigError, match="add --disaggregation-decode-enable-radix-cache"):
        Engine(MODEL, disaggregation_mode="decode", enable_hierarchical_cache=True)
    with pytest.raises(ConfigError, match="--disaggregation-mode must be one of"):
        Engine(MODEL, disaggregation_mode="both")


# ---- behind SGLang's own router ---------------------------------------------------------------
@pytest.mark.server
@pytest.mark.slow
def test_sglang_router_serves_a_multi_turn_chat_through_a_pd_pair() -> None:
    """sglang-router (PD mode) sends each turn to both servers with a bootstrap; the decode
    server answers, as the one-engine server would, and later turns cross only their suffix."""
    import httpx

    from hicache.launch.servers import pd_servers

    engine = Engine(MODEL, **OPTS)
    common = f"--model {MODEL} --dtype float32 --page-size 16 --max-total-tokens 2048"
    with pd_servers(common, decode_args="--disaggregation-decode-enable-radix-cache --enable-hierarchical-cache") as pd:
        messages = [{"role": "system", "content": "You plan trips. " * 8}]
        previous = 0  # the last turn's prompt tokens
        for turn, question in enumerate(("Lisbon in three days?", "And Porto?", "Which one in winter?")):
            messages.append({"role": "user", "content": question})
            body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
            got = httpx.post(f"{pd.url}/v1/chat/completions", json=body, timeout=60).json()
            answer = got["choices"][0]["message"]["content"]
            assert answer == engine.chat(messages, GREEDY).text, turn
            usage = got["usage"]
            assert usage["decode_prefix_len"] + usage["kv_transferred_tokens"] == usage["prompt_tokens"]
            if turn:  # the history is on the decode server: only the new turn crosses
                assert usage["decode_prefix_len"] >= previous // 16 * 16 - 16 > 0
            previous = usage["prompt_tokens"]
            messages.append({"role": "assistant", "content": answer})
        stats = httpx.get(f"{pd.decode_url}/stats", timeout=10).json()["disaggregation"]
        assert stats["mode"] == "decode" and stats["requests"] == 3 and stats["failed"] == 0
        assert "hicache_kv_transfer_total{field=\"bytes\"}" in httpx.get(f"{pd.decode_url}/metrics", timeout=10).text
    engine.shutdown()


# ---- faults: every page comes back ----------------------------------------------------------
@pytest.mark.server
@pytest.mark.slow
def test_a_killed_prefill_server_fails_the_decode_request_at_once_and_frees_its_pages() -> None:
    """The decode server asks a prefill server that died (SIGKILL, no goodbye): its refused
    connection is a certain failure, so the request ends with 503 kv_transfer_failed at once,
    not after the 60-second transfer timeout (a router retrying 3 times made it ~4 minutes),
    and the decode server's pool is as before."""
    import signal
    import time

    import httpx

    from hicache.bench.main import launch_server
    from hicache.ports import free_port

    common = f"--model {MODEL} --dtype float32 --page-size 16 --disaggregation-transfer-timeout 60"
    port = free_port()
    prefill, prefill_url = launch_server(f"{common} --disaggregation-mode prefill --disaggregation-bootstrap-port "
                                         f"{port}", 60)
    decode, decode_url = launch_server(f"{common} --disaggregation-mode decode", 60)
    try:
        free = httpx.get(f"{decode_url}/stats", timeout=10).json()["device_pool"]["free_pages"]
        prefill.send_signal(signal.SIGKILL)
        prefill.wait()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 4,
                "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 42}
        t0 = time.monotonic()
        r = httpx.post(f"{decode_url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "kv_transfer_failed"
        assert time.monotonic() - t0 < 5 and "refused the connection" in r.json()["error"]["message"]
        stats = httpx.get(f"{decode_url}/stats", timeout=10).json()
        assert stats["device_pool"]["free_pages"] == free and stats["disaggregation"]["failed"] == 1
        assert httpx.get(f"{decode_url}/health", timeout=10).status_code == 200  # the server itself is fine
    finally:
        for proc in (prefill, decode):
            proc.terminate()
            proc.wait(timeout=30)


def test_a_prefill_whose_decode_server_never_asks_frees_its_kv_after_the_timeout() -> None:
    prefill = Engine(MODEL, disaggregation_mode="prefill", disaggregation_bootstrap_port=0,
                     disaggregation_transfer_timeout=0.5, **OPTS)
    try:
        free = prefill.cache.allocator.available
        sent = prefill.generate(A, GREEDY, bootstrap=Bootstrap("127.0.0.1", bootstrap_port(prefill), 11))[0]
        assert sent.output_ids and sent.kv_transferred_tokens == 0  # computed, never sent
        assert prefill.stats()["disaggregation"]["failed"] == 1
        assert prefill.cache.allocator.available + prefill.cache.usage()["cached_pages"] == free  # KV went to the tree
    finally:
        prefill.shutdown()


def test_an_aborted_decode_request_keeps_its_pages_until_its_transfer_ends() -> None:
    """Its receive could still write into the reserved pages: they come back only when the
    transfer has ended (here: timed out), never while it may still land."""
    decode = Engine(MODEL, disaggregation_mode="decode", disaggregation_transfer_timeout=1.0, **OPTS)
    try:
        sched, free = decode.scheduler, decode.cache.allocator.available
        req = decode.make_request(A, GREEDY, None, Bootstrap("127.0.0.1", 9, 12))
        sched.add(req)
        while req.status.value != "receiving":
            sched.step()
        assert sched.abort(req.rid) and req.finish_reason == "abort"
        assert decode.cache.allocator.available < free  # still held: the transfer is open
        while sched.has_work():
            sched.step()
        assert decode.cache.allocator.available == free
    finally:
        decode.shutdown()


def test_servers_with_different_transfer_backends_fail_the_request_clearly() -> None:
    if mooncake_transfer_engine_missing():
        pytest.skip(mooncake_transfer_engine_missing())
    prefill = Engine(MODEL, disaggregation_mode="prefill", disaggregation_bootstrap_port=0, **OPTS)
    decode = Engine(MODEL, disaggregation_mode="decode", disaggregation_transfer_backend="mooncake", **OPTS)
    try:
        got, sent = serve(prefill, decode, A, room=21)
        assert got.finish_reason == "error" and "different --disaggregation-transfer-backend" in got.error
        assert sent.kv_transferred_tokens == 0
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.storage
def test_a_decode_server_extends_its_prefix_from_storage(tmp_path) -> None:
    """The decode server's L3: a restarted decode server finds the session in storage; the span
    counts toward decode_prefix_len (its prefetch was accepted before admission), so only the
    new turn's KV crosses."""
    storage = dict(enable_hierarchical_cache=True, disaggregation_decode_enable_radix_cache=True,
                   hicache_storage_backend="file", hicache_storage_backend_extra_config=f'{{"path": "{tmp_path}"}}',
                   hicache_storage_prefetch_threshold=16, hicache_storage_prefetch_policy="wait_complete")
    prefill = Engine(MODEL, disaggregation_mode="prefill", disaggregation_bootstrap_port=0, **OPTS)
    try:
        first = Engine(MODEL, disaggregation_mode="decode", **storage, **OPTS)
        serve(prefill, first, A + B, room=31)
        first.shutdown()  # its pages reach the store
        restarted = Engine(MODEL, disaggregation_mode="decode", **storage, **OPTS)
        got, sent = serve(prefill, restarted, A + B + C, room=32)
        restarted.shutdown()
    finally:
        prefill.shutdown()
    plain = Engine(MODEL, **OPTS)
    assert got.output_ids == plain.generate(A + B + C, GREEDY)[0].output_ids
    plain.shutdown()
    assert got.cached_tokens_details["storage"] == 2 * SPAN and got.decode_prefix_len == 2 * SPAN
    assert got.kv_transferred_tokens == sent.kv_transferred_tokens == SPAN


@pytest.mark.server
@pytest.mark.slow
def test_a_client_that_leaves_the_router_cancels_the_decode_side() -> None:
    """The client gives up mid-answer: sglang-router drops its upstream requests, the decode
    server aborts its request, and both servers hold nothing but cached pages afterwards."""
    import time

    import httpx

    from hicache.launch.servers import pd_servers

    common = f"--model {MODEL} --dtype float32 --page-size 16 --disaggregation-transfer-timeout 5"
    with pd_servers(common, decode_args="--disaggregation-decode-enable-radix-cache") as pd:
        urls = (pd.prefill_url, pd.decode_url)
        pools = {u: httpx.get(f"{u}/stats", timeout=10).json()["device_pool"] for u in urls}
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 300}], "max_tokens": 3000,
                "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{pd.url}/v1/chat/completions", json=body, timeout=1.5)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            stats = {u: httpx.get(f"{u}/stats", timeout=10).json() for u in urls}
            if all(s["running_requests"] == 0 and s["disaggregation"]["open"] == 0 for s in stats.values()):
                break
            time.sleep(0.2)
        for u in urls:
            pool = stats[u]["device_pool"]
            assert stats[u]["running_requests"] == 0 and pool["request_pages"] == 0
            assert pool["free_pages"] + pool["cached_pages"] == pools[u]["free_pages"]
        assert stats[pd.decode_url]["disaggregation"]["requests"] == 1  # its KV arrived; then the abort ended it
        metrics = httpx.get(f"{pd.decode_url}/metrics", timeout=10).text
        assert 'hicache_requests_total{finish_reason="abort"} 1.0' in metrics


def test_mooncake_writes_merge_pages_that_follow_each_other_on_both_sides() -> None:
    import torch

    from hicache.disagg.mooncake_writes import _runs

    ps = 4
    slots = torch.tensor([40, 41, 42, 43, 44, 45, 46, 47, 8, 9, 10, 11, 12, 13])  # pages 10, 11, 2, 3 (half)
    # tokens 0-13 into decode pages 5, 6, 7, 8: both sides consecutive for the first two pages,
    # then the source jumps; the last page is partial
    assert _runs(slots, [5, 6, 7, 8], 0, 14, ps) == [(40, 20, 8), (8, 28, 6)]
    assert _runs(slots, [5, 9, 10], 4, 14, ps) == [(44, 20, 4), (8, 36, 6)]


# ---- heterogeneous tensor parallelism ------------------------------------------------------------
# Three KV heads: at TP2 the ranks hold heads 0-1 and 1-2 (head 1's query group straddles them).
THREE_HEADS = 'random:{"preset": "small", "num_heads": 6, "num_kv_heads": 3, "head_dim": 32}'


@pytest.mark.multirank
@pytest.mark.parametrize("prefill_tp, decode_tp, backend", [(2, 1, "zmq"), (1, 2, "mooncake")])
def test_prefill_and_decode_with_different_tp_sizes_resplit_the_kv_heads(prefill_tp, decode_tp, backend,
                                                                         monkeypatch) -> None:
    """Prefill TP2 -> decode TP1: each head comes from the lowest prefill rank holding it (head 1
    once, not twice); prefill TP1 -> decode TP2: each decode rank receives its own heads (head 1
    by both). Decoding on the re-split heads gives the one-engine answer, and the second turn
    crosses only its suffix. The rank consensus checker is on: the ranks of each server act on a
    transfer's end at the same step (DESIGN invariant 3), or the run fails naming the rank."""
    if backend == "mooncake" and mooncake_transfer_engine_missing():
        pytest.skip(mooncake_transfer_engine_missing())
    monkeypatch.setenv("HICACHE_RANK_CONSENSUS_CHECKER", "1")
    plain = Engine(THREE_HEADS, **OPTS)
    expected = plain.generate(A + B + C, GREEDY)[0].output_ids
    spec = plain.loaded.spec
    plain.shutdown()
    common = dict(disaggregation_transfer_backend=backend, **OPTS)
    prefill = Engine(THREE_HEADS, tp_size=prefill_tp, disaggregation_mode="prefill", disaggregation_bootstrap_port=0,
                     **common)
    decode = Engine(THREE_HEADS, tp_size=decode_tp, disaggregation_mode="decode",
                    disaggregation_decode_enable_radix_cache=True, **common)
    try:
        serve(prefill, decode, A + B, room=41)
        got, sent = serve(prefill, decode, A + B + C, room=42)
        decode_stats, prefill_stats = decode.stats()["disaggregation"], prefill.stats()["disaggregation"]
    finally:
        prefill.shutdown()
        decode.shutdown()
    assert got.output_ids == expected and got.decode_prefix_len == 2 * SPAN
    assert got.kv_transferred_tokens == sent.kv_transferred_tokens == SPAN
    heads_crossed = 3 if decode_tp == 1 else 4  # decode TP2 needs head 1 on both of its ranks
    row = spec.head_dim * 4 * 2 * spec.num_layers  # one head of one token, K and V of every layer (float32)
    assert got.kv_transferred_bytes == sent.kv_transferred_bytes == SPAN * heads_crossed * row
    assert decode_stats["bytes"] == prefill_stats["bytes"] == 3 * SPAN * heads_crossed * row  # A+B, then C


def test_garbage_on_the_bootstrap_socket_is_dropped_and_transfers_go_on() -> None:
    """The bootstrap port listens on the network: a stray peer's messages (not JSON, wrong
    fields, extra frames) are logged and dropped, never the end of the sender's thread."""
    import zmq

    prefill = Engine(MODEL, disaggregation_mode="prefill", disaggregation_bootstrap_port=0, **OPTS)
    decode = Engine(MODEL, disaggregation_mode="decode", **OPTS)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{bootstrap_port(prefill)}")
        for frames in ([b"not json"], [b'{"room": "x"}'], [b'{"room": 1, "askers": 1}', b"extra"], [b"[]"]):
            sock.send_multipart(frames)
        got, sent = serve(prefill, decode, A + B, room=51)
        assert got.finish_reason == "length" and got.kv_transferred_tokens == sent.kv_transferred_tokens == 2 * SPAN
    finally:
        sock.close()
        prefill.shutdown()
        decode.shutdown()
