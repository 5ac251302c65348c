"""Hostile peers on the P/D sockets (issue 26): a prefill server's bootstrap socket listens on
the network, and a decode server connects wherever an API client's ``bootstrap_host`` /
``bootstrap_port`` point. No frame stops either side's transfer thread, a peer's bytes and
open asks are bounded, failures that are certain are reported at once, and a dead transfer
thread makes the server unhealthy. Ends with a seeded fuzz campaign against a live pair."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest
import zmq

from hicache import Engine, SamplingParams
from hicache.config import ConfigError
from hicache.device import resident_bytes
from hicache.disagg import sender as sender_module
from hicache.disagg.bootstrap import Bootstrap
from hicache.errors import InvalidRequestError
from hicache.runtime.sampling import GrammarSpec
from hicache.server.serve import ServerThread

pytestmark = [pytest.mark.pd, pytest.mark.server]

MODEL = "random:small"
OPTS = dict(dtype="float32", page_size=16, max_total_tokens=1024)
TIMEOUT_S = 2.0  # --disaggregation-transfer-timeout of the pair
TEXT = "hello " * 40
ISSUE_FRAMES = [  # the reproductions in the issue: one of them killed the sender's thread
    b'{"room": Infinity, "askers": 1, "expires_in": 5, "heads": [0,1], "prompt_len": 3}',
    b'{"room": 1, "askers": 1, "expires_in": 1' + b"0" * 400 + b', "heads": [0,1], "prompt_len": 3}',
]


@dataclass
class Pair:
    prefill: Engine
    decode: Engine
    prefill_url: str
    decode_url: str
    port: int  # the prefill's bootstrap port
    servers: list = field(default_factory=list)


def start_pair(**extra) -> Pair:
    prefill = Engine(MODEL, disaggregation_mode="prefill", disaggregation_bootstrap_port=0,
                     disaggregation_transfer_timeout=TIMEOUT_S, **OPTS, **extra)
    decode = Engine(MODEL, disaggregation_mode="decode", disaggregation_transfer_timeout=TIMEOUT_S, **OPTS, **extra)
    port = prefill.stats()["disaggregation"]["bootstrap_port"]
    servers = [ServerThread(prefill, served_model_name="m"), ServerThread(decode, served_model_name="m")]
    urls = [s.start() for s in servers]
    return Pair(prefill, decode, urls[0], urls[1], port, servers)


def stop_pair(pair: Pair) -> None:
    for srv in pair.servers:
        srv.stop()
    pair.prefill.shutdown()
    pair.decode.shutdown()


@pytest.fixture(scope="module")
def pair():
    p = start_pair()
    yield p
    stop_pair(p)


def body(room: int, port: int, host: str = "127.0.0.1", **kw) -> dict:
    return {"model": "m", "prompt": TEXT, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room, **kw}


def pd_request(pair: Pair, room: int) -> tuple[httpx.Response, httpx.Response]:
    """What sglang-router does: the same request to both servers at once."""
    with ThreadPoolExecutor(2) as ex:
        p = ex.submit(httpx.post, f"{pair.prefill_url}/v1/completions", json=body(room, pair.port), timeout=60)
        d = ex.submit(httpx.post, f"{pair.decode_url}/v1/completions", json=body(room, pair.port), timeout=60)
        return p.result(), d.result()


def assert_pair_works(pair: Pair, room: int) -> None:
    """A real P/D request succeeds, both servers are healthy and hold only cached pages."""
    p, d = pd_request(pair, room)
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    assert d.json()["usage"]["completion_tokens"] == 4 and d.json()["usage"]["kv_transferred_tokens"] > 0
    for url in (pair.prefill_url, pair.decode_url):
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        deadline = time.monotonic() + 10
        while (pool := httpx.get(f"{url}/stats", timeout=10).json()["device_pool"])["request_pages"] \
                and time.monotonic() < deadline:  # a transfer still open (a hostile ask's room) ends by its timeout
            time.sleep(0.1)
        assert pool["request_pages"] == 0 and pool["locked_pages"] == 0, pool


def dealer(port: int) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def route_answered(port: int, timeout_s: float) -> bool:
    sock = dealer(port)
    try:
        sock.send(b'{"route": 1}')
        return bool(sock.poll(int(timeout_s * 1000))) and "route" in json.loads(sock.recv())
    finally:
        sock.close()


# ---- the prefill side: a hostile asker ------------------------------------------------------------
def test_a_mooncake_window_tail_lists_pages_per_sliding_group_and_a_known_group_per_layer() -> None:
    """A hybrid decode pool on shared blocks asks for the tail (tokens 8-18: 3 pages of 4) into each sliding
    group's pages, naming each window layer's group: lists of the tail's length, groups that exist."""
    from hicache.disagg.wire import Ask, WireError

    target = {"session": "127.0.0.1:1234", "page_size": 4, "row_heads": 1, "first_head": 0, "k": [1, 2, 3],
              "v": [4, 5, 6], "pages": [7, 8, 9], "window_pages": [[1, 2, 3], [4, 5, 6]], "window_groups": [1, 0]}
    ask = {"room": 1, "decode_prefix_len": 8, "prompt_len": 18, "heads": [0, 1], "askers": 1, "expires_in": 5,
           "window_start": 8, "window_layers": [0, 2], "mooncake": target}
    parsed = Ask.parse(ask, 3)
    window = parsed.mooncake.parts["window"]
    assert window.pages == [[1, 2, 3], [4, 5, 6]] and window.groups == [1, 0]
    assert Ask.parse(json.loads(json.dumps(parsed.to_wire())), 3) == parsed
    for bad in ({"window_groups": [2, 0]}, {"window_groups": [0]}, {"window_pages": [[1, 2], [4, 5, 6]]},
                {"window_pages": [[1, 2, 3]] * 3}, {"window_pages": []}, {"window_pages": [1, 2, 3]}):
        with pytest.raises(WireError):
            Ask.parse({**ask, "mooncake": {**target, **bad}}, 3)


def test_no_frame_stops_the_senders_thread(pair) -> None:
    """The issue's frames (a room of Infinity, an expiry of 10**400) and others in their spirit:
    each is dropped with a log line; the next transfer works."""
    frames = ISSUE_FRAMES + [
        b'{"room": NaN, "askers": 1, "expires_in": 5, "heads": [0, 1], "prompt_len": 3}',
        b'{"room": 1, "askers": 1, "expires_in": -Infinity, "heads": [0, 1], "prompt_len": 3}',
        b'{"room": 1, "askers": 1' + b"0" * 5000 + b', "expires_in": 5, "heads": [0, 1], "prompt_len": 3}',
        b'{"room": 1, "askers": true, "expires_in": 5, "heads": [1e300, 2], "prompt_len": 3}',
        b'{"room": 1, "askers": 1, "expires_in": 5, "heads": [0, 1], "prompt_len": 3, "mooncake": [1]}',
        b"[" * 100000 + b"]" * 100000,  # deeper than json's recursion limit
        b'{"route": 1, "x": ' + b"[" * 50000 + b"]" * 50000 + b"}",
        b"\xff\xfe", b"", b'"just a string"',
    ]
    sock = dealer(pair.port)
    try:
        for frame in frames:
            sock.send(frame)
        sock.send_multipart([b"{}"] * 10000)  # one message of ten thousand frames
    finally:
        sock.close()
    time.sleep(0.3)
    pair.prefill.check_alive()
    assert_pair_works(pair, room=1001)


def test_a_frame_over_the_limit_is_refused_before_it_is_buffered(pair) -> None:
    """ZeroMQ's MAXMSGSIZE disconnects a peer whose frame is larger than an ask can be, before
    its bytes are kept: a 600 MB frame from another process does not grow this one."""
    before = resident_bytes()
    code = ("import sys, time, zmq\n"
            "s = zmq.Context.instance().socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 5000)\n"
            f"s.connect('tcp://127.0.0.1:{pair.port}'); s.send(bytearray(600 << 20), copy=False)\n"
            "time.sleep(2); s.close()\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert resident_bytes() - before < 100 << 20
    assert route_answered(pair.port, 5)
    assert_pair_works(pair, room=1002)


def test_an_ask_waits_no_longer_than_the_servers_own_timeout(pair) -> None:
    """An ask for a room the prefill has not admitted yet waits (the router posts to both
    servers at once) but never longer than the prefill's transfer timeout, whatever
    ``expires_in`` the asker claims: after it, the room's KV goes to nobody."""
    sock = dealer(pair.port)
    try:
        ask = {"room": 1003, "decode_prefix_len": 0, "prompt_len": 41, "heads": [0, 2], "askers": 1,
               "expires_in": 1e9}
        sock.send(json.dumps(ask).encode())
        time.sleep(TIMEOUT_S + 0.5)
        assert sock.poll(1000) and "in time" in json.loads(sock.recv())["error"]  # told so when it expired
        r = httpx.post(f"{pair.prefill_url}/v1/completions", json=body(1003, pair.port), timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["kv_transferred_tokens"] == 0
        assert not sock.poll(200)  # no KV reached the asker
    finally:
        sock.close()


def test_open_asks_are_bounded_per_peer_and_a_flood_does_not_delay_others(pair, monkeypatch) -> None:
    """Asks for rooms that never come: past the per-peer bound each is refused at once; the
    rest wait, found by room and expired from a heap, so a route ask is still answered at once
    (before: 10,000 asks took minutes of a core and delayed a route ask by 25 s)."""
    monkeypatch.setattr(sender_module, "MAX_ASKS_PER_PEER", 500)
    peers = [dealer(pair.port) for _ in range(3)]
    try:
        for i, sock in enumerate(peers):
            for n in range(3000):
                sock.send(json.dumps({"room": 10**6 + i * 10**4 + n, "decode_prefix_len": 0, "prompt_len": 41,
                                      "heads": [0, 2], "askers": 1, "expires_in": 1e9}).encode())
        assert route_answered(pair.port, 5)
        refused = 0
        while peers[0].poll(2000) and refused < 2500:
            refused += "too many open asks" in json.loads(peers[0].recv())["error"]
        assert refused == 2500
    finally:
        for sock in peers:
            sock.close()
    assert_pair_works(pair, room=1004)


# ---- the decode side: a hostile "prefill" ----------------------------------------------------------
class FakePrefill:
    """A ROUTER on loopback posing as a prefill server: ``route(msg)`` and ``answer(ask)``
    return the frames it answers with (None: no answer)."""

    def __init__(self, route=None, answer=None) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.route = route or (lambda: [json.dumps(route_of(self.port)).encode()])
        self.answer = answer or (lambda ask: None)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            peer, raw = self.sock.recv_multipart()[:2]
            msg = json.loads(raw)
            frames = self.route() if "route" in msg else self.answer(msg)
            if frames is not None:
                self.sock.send_multipart([peer, *frames])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def kv_shape() -> tuple[int, int, int]:
    """(layers, KV heads, bytes per head) of MODEL in float32."""
    from hicache.model.random_model import parse_random_spec

    spec = parse_random_spec(MODEL.removeprefix("random:"))
    return spec.num_layers, spec.num_kv_heads, spec.head_dim * 4


def route_of(port: int) -> dict:
    """A valid route answer: one prefill rank at ``port`` holding every KV head of MODEL."""
    layers, heads, head_bytes = kv_shape()
    return {"route": [["127.0.0.1", port, 0, heads]], "layers": layers, "head_bytes": head_bytes,
            "dtype": "torch.float32"}


def header(ask: dict, **fields) -> bytes:
    """A valid answer header for ``ask`` (``fields`` replace some)."""
    layers, _, head_bytes = kv_shape()
    return json.dumps({"room": ask["room"], "first_token": 5, "start": ask["decode_prefix_len"],
                       "end": ask["prompt_len"], "layers": layers, "heads": ask["heads"], "head_bytes": head_bytes,
                       **fields}).encode()


HOSTILE_PREFILLS = {
    # route answers
    "a route to a wildcard host": dict(route=lambda: [b'{"route": [["*", 5, 0, 3]], "layers": 4, "head_bytes": 128, '
                                                      b'"dtype": "torch.float32"}']),
    "a route of port 10**400": dict(route=lambda: [b'{"route": [["127.0.0.1", 1' + b"0" * 400 + b', 0, 3]], '
                                                   b'"layers": 4, "head_bytes": 128, "dtype": "torch.float32"}']),
    "a route nested past the recursion limit": dict(route=lambda: [b'{"route": ' + b"[" * 100000 + b"]" * 100000 + b"}"]),
    # answers to the ask
    "a first token outside the vocabulary": dict(answer=lambda ask: [header(ask, first_token=10**9)]),
    "row frames of the wrong size": dict(answer=lambda ask: [header(ask)] + [b"x" * 7] * (2 * kv_shape()[0])),
    "ten thousand frames": dict(answer=lambda ask: [header(ask)] + [b""] * 10000),
    "an error of a megabyte": dict(answer=lambda ask: [json.dumps({"room": ask["room"], "error": "e" * (1 << 20)})
                                                       .encode()]),
    "a header of Infinity": dict(answer=lambda ask: [header(ask).replace(b'"first_token": 5', b'"first_token": Infinity')]),
}


@pytest.mark.parametrize("kind", list(HOSTILE_PREFILLS))
def test_a_hostile_prefill_fails_its_request_at_once_and_nothing_else(pair, kind) -> None:
    """The decode server checks every answer: the request pointed at the fake prefill fails at
    once (not at the transfer timeout) with 503 kv_transfer_failed, the server stays healthy,
    and a real transfer works afterwards."""
    fake = FakePrefill(**HOSTILE_PREFILLS[kind])
    try:
        t0 = time.monotonic()
        r = httpx.post(f"{pair.decode_url}/v1/completions", json=body(2000 + len(kind), fake.port), timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "kv_transfer_failed", r.text
        assert time.monotonic() - t0 < TIMEOUT_S
        assert len(r.json()["error"]["message"]) < 2000
    finally:
        fake.close()
    pair.decode.check_alive()
    assert_pair_works(pair, room=3000 + len(kind))


# ---- the receiver alone (no model): a peer that stops reading, a route of many ranks ----------------
def tiny_receiver():
    import types

    import torch

    from hicache.disagg.receiver import KVReceiver

    pool = types.SimpleNamespace(k_buffers=[torch.zeros(64, 2, 8)], v_buffers=[torch.zeros(64, 2, 8)], page_size=16)
    return KVReceiver(pool, range(2), vocab_size=100)


def lying_router(route: dict, answer=None) -> tuple[zmq.Socket, threading.Event]:
    """A ROUTER on loopback that answers route asks with ``route`` and KV asks with ``answer(ask)``."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            if sock.poll(20):
                peer, msg = sock.recv_multipart()[:2]
                ask = json.loads(msg)
                frames = [json.dumps(route(port)).encode()] if "route" in ask else (answer(ask) if answer else None)
                if frames:
                    sock.send_multipart([peer, *frames])
        sock.close()

    threading.Thread(target=run, daemon=True).start()
    return port, stop


def test_a_rank_that_never_reads_cannot_block_the_receiver() -> None:
    """The route sends every ask to a TCP listener that accepts and never reads: once its queue
    is full a send would block; it fails that request instead, and every request ends by its
    deadline (before: 1,100 requests blocked the thread for good)."""
    import socket

    import torch

    from hicache.disagg.transfer import Receive

    silent = socket.create_server(("127.0.0.1", 0))
    held = []
    threading.Thread(target=lambda: held.append(silent.accept()), daemon=True).start()
    port, stop = lying_router(lambda _: {"route": [["127.0.0.1", silent.getsockname()[1], 0, 2]], "layers": 1,
                                         "head_bytes": 32, "dtype": "torch.float32"})
    rx = tiny_receiver()
    try:
        jobs = [Receive(i, f"tcp://127.0.0.1:{port}", 0, torch.arange(3), time.perf_counter() + 2.0)
                for i in range(1500)]
        for job in jobs:
            rx.submit(job)
        assert all(job.done.wait(max(0.0, job.deadline + 3 - time.perf_counter())) for job in jobs)
        assert sum("Again" in job.error for job in jobs) > 0 and rx.failure is None
    finally:
        rx.close()
        stop.set()
        silent.close()


def test_sockets_to_prefill_endpoints_are_bounded_and_idle_ones_closed(monkeypatch) -> None:
    """A route of many ranks (each a socket) cannot use up the decode rank's sockets: past
    MAX_PEERS the request fails, idle sockets are closed, and the next real prefill works."""
    import torch

    from hicache.disagg import receiver as receiver_module
    from hicache.disagg.transfer import Receive

    monkeypatch.setattr(receiver_module, "MAX_PEERS", 8)
    port, stop = lying_router(lambda p: {"route": [["127.0.0.1", p, 0, 2]] + [[f"127.0.0.{i + 2}", p, 0, 0]
                                                                               for i in range(20)],
                                         "layers": 1, "head_bytes": 32, "dtype": "torch.float32"})
    good, good_stop = lying_router(
        lambda p: {"route": [["127.0.0.1", p, 0, 2]], "layers": 1, "head_bytes": 32, "dtype": "torch.float32"},
        lambda ask: [json.dumps({"room": ask["room"], "first_token": 5, "start": 0, "end": 3, "layers": 1,
                                 "heads": [0, 2]}).encode(), b"\0" * 192, b"\0" * 192])
    rx = tiny_receiver()
    try:
        hostile = Receive(1, f"tcp://127.0.0.1:{port}", 0, torch.arange(3), time.perf_counter() + 1.0)
        rx.submit(hostile)
        assert hostile.done.wait(5) and "TooManyPeers" in hostile.error
        fine = Receive(2, f"tcp://127.0.0.1:{good}", 0, torch.arange(3), time.perf_counter() + 5.0)
        rx.submit(fine)
        assert fine.done.wait(5) and not fine.error and fine.first_token == 5
        assert len(rx._socks) <= 8
    finally:
        rx.close()
        stop.set()
        good_stop.set()


@pytest.mark.parametrize("field_, value", [("bootstrap_port", 0), ("bootstrap_host", ""), ("bootstrap_host", "*"),
                                           ("bootstrap_host", "0.0.0.0"),
                                           ("bootstrap_host", "tcp://x:1"), ("bootstrap_room", 2**70),
                                           ("bootstrap_room", -1)])
def test_bootstrap_fields_that_cannot_work_are_a_400(pair, field_, value) -> None:
    r = httpx.post(f"{pair.decode_url}/v1/completions", json={**body(7, pair.port), field_: value}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == field_, r.text
    with pytest.raises(ValueError, match=field_):
        Bootstrap(**{"host": "127.0.0.1", "port": 5, "room": 1, field_.removeprefix("bootstrap_"): value})


# ---- round 3 (issue 46): a decode server's admission, handshake and allow-list --------------------
def test_a_silent_prefill_fails_at_the_handshake_and_holds_at_most_half_the_slots() -> None:
    """Before: requests naming a socket that reads the ask and never answers held every running
    slot for the 60 s transfer timeout (a plain request waited 55 s). Now each fails when the
    handshake timeout passes without a route, at most half of --max-running-requests wait for
    KV at once (the rest queue unadmitted), and a plain request passes them by."""
    decode = Engine(MODEL, disaggregation_mode="decode", disaggregation_transfer_timeout=30,
                    disaggregation_handshake_timeout=1.0, max_running_requests=4, **OPTS)
    fake = FakePrefill(route=lambda: None)  # reads every message, answers none
    free = decode.cache.allocator.available
    try:
        assert decode.stats()["disaggregation"]["max_receiving"] == 2
        prompts = [[5 + i] * 40 for i in range(5)]
        boots = [Bootstrap("127.0.0.1", fake.port, 100 + i) for i in range(4)] + [None]
        t0 = time.monotonic()
        results = decode.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True),
                                  bootstrap=boots)
        elapsed = time.monotonic() - t0
        held, plain = results[:4], results[4]
        for r in held:
            assert r.finish_reason == "error" and r.error_code == "kv_transfer_failed" and "handshake" in r.error, r
        assert plain.finish_reason == "length" and plain.e2e_s < 1.0  # not queued behind the silent peer
        queued = sorted(r.queue_time_s for r in held)
        assert queued[1] < 0.5 <= 0.9 < queued[2]  # two waited for KV; two waited their turn (1 s handshake)
        assert elapsed < 5  # two handshake rounds, not the 30 s transfer timeout
        assert decode.cache.allocator.available == free
    finally:
        fake.close()
        decode.shutdown()


def test_a_decode_server_takes_kv_only_from_allowed_prefill_servers() -> None:
    with pytest.raises(ConfigError, match="host:port"):
        Engine(MODEL, disaggregation_mode="decode", disaggregation_prefill_allowlist="127.0.0.1", **OPTS)
    decode = Engine(MODEL, disaggregation_mode="decode", disaggregation_prefill_allowlist="127.0.0.1:1, [::1]:2",
                    **OPTS)
    with pytest.raises(InvalidRequestError, match="--disaggregation-prefill-allowlist") as e:
        decode.generate([5] * 40, SamplingParams(max_new_tokens=2), bootstrap=Bootstrap("127.0.0.1", 9, 1))
    assert e.value.param == "bootstrap_host"
    srv = ServerThread(decode, served_model_name="m")
    url = srv.start()
    try:
        r = httpx.post(f"{url}/v1/completions", json=body(3, 9), timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_host", r.text
        r = httpx.post(f"{url}/v1/completions", json=body(4, 1), timeout=10)  # allowed (nobody listens there)
        assert r.status_code == 503 and r.json()["error"]["code"] == "kv_transfer_failed", r.text
    finally:
        srv.stop()
        decode.shutdown()


def test_the_decode_side_checks_the_prefill_servers_first_token_against_its_grammar() -> None:
    """The router sends both servers the same request: the prefill server samples the first token
    under the grammar and the answer keeps it. A prefill server that did not (here: sent the
    request without its grammar) gives a first token the decode side refuses: the request ends
    with grammar_failed and the broken token is never part of the answer."""
    prefill = Engine(MODEL, disaggregation_mode="prefill", disaggregation_bootstrap_port=0, **OPTS)
    decode = Engine(MODEL, disaggregation_mode="decode", **OPTS)
    plain = SamplingParams(max_new_tokens=6, temperature=0)
    try:
        prompt = [7] * 40
        unconstrained = prefill.generate(prompt, plain)[0].text[:1]  # (no bootstrap: an ordinary request)
        regex = ("y" if unconstrained == "z" else "z") + "[a-z]{1,4}"
        constrained = dataclasses.replace(plain, grammar=GrammarSpec("regex", regex))
        for room, prefill_sampling in ((1, constrained), (2, plain)):
            boot = Bootstrap("127.0.0.1", prefill.stats()["disaggregation"]["bootstrap_port"], room)
            side = threading.Thread(target=prefill.generate, args=(prompt, prefill_sampling), kwargs={"bootstrap": boot})
            side.start()
            got = decode.generate(prompt, constrained, bootstrap=boot)[0]
            side.join(timeout=30)
            if room == 1:
                assert re.fullmatch(regex, got.text) and got.finish_reason == "stop", got
            else:
                assert got.finish_reason == "error" and got.error_code == "grammar_failed", got
                assert "first token" in got.error and got.output_ids == []
    finally:
        prefill.shutdown()
        decode.shutdown()


# ---- a dead transfer thread is an engine failure ---------------------------------------------------
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_a_dead_transfer_thread_makes_the_server_unhealthy(mode) -> None:
    """Should the thread ever die (here: a job it cannot read, standing in for a bug), the
    engine is dead: /health says 503 and the server's on_death runs (``hicache serve`` exits 1)."""
    engine = Engine(MODEL, disaggregation_mode=mode, disaggregation_bootstrap_port=0, **OPTS)
    deaths: list[BaseException] = []
    srv = ServerThread(engine, served_model_name="m", on_death=deaths.append)
    url = srv.start()
    try:
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        role = next(m for m in engine.scheduler.runtime.modes if m.name == "disaggregation")
        io = role.io
        io._jobs.put(object())
        deadline = time.monotonic() + 5
        while httpx.get(f"{url}/health", timeout=10).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        r = httpx.get(f"{url}/health", timeout=10)
        assert r.status_code == 503 and "transfer thread" in r.json()["error"]["message"]
        assert len(deaths) == 1
    finally:
        srv.stop()
        engine.shutdown()


# ---- the fuzz campaign ----------------------------------------------------------------------------
FUZZ_SECONDS = min(float(os.environ.get("HICACHE_PD_FUZZ_SECONDS", "4")), 60.0)
FUZZ_SEED = int(os.environ.get("HICACHE_PD_FUZZ_SEED", "26"))
EXTREMES = [float("inf"), float("-inf"), float("nan"), -1, 0, 2**63, 2**70, 10**300, 1e308, -1e308, True, None,
            "x", "é" * 5000, [], {}, [1] * 1000, [[[]]], {"a": {"b": {}}}]
KINDS = ("field", "field", "drop", "type", "nest", "bytes", "huge", "frames", "empty", "digits")  # field: twice as often


class Fuzzer:
    """Seeded mutations of valid messages; counts what it tried, by kind."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.tried: dict[str, int] = {}

    def frames(self, template: dict) -> list[bytes]:
        rng = self.rng
        kind = rng.choice(KINDS)
        self.tried[kind] = self.tried.get(kind, 0) + 1
        msg = dict(template)
        if kind == "field":
            for key in rng.sample(sorted(msg), rng.randint(1, min(2, len(msg)))):
                msg[key] = rng.choice(EXTREMES)
        elif kind == "drop":
            del msg[rng.choice(sorted(msg))]
        elif kind == "type":
            return [json.dumps(rng.choice([[msg], "s", 1.5, None, list(msg.values())])).encode()]
        elif kind == "nest":
            depth = rng.choice([10, 1000, 100000])
            return [b"[" * depth + b"]" * depth]
        elif kind == "bytes":
            return [rng.randbytes(rng.randint(1, 4096))]
        elif kind == "huge":
            return [b"[" + b"1," * (rng.randint(1, 4) << 20) + b"1]"]
        elif kind == "frames":
            return [json.dumps(msg).encode()] * rng.randint(2, 3000)
        elif kind == "empty":
            return [b""]
        elif kind == "digits":
            return [json.dumps(msg).encode().replace(b": ", b": 9" + b"9" * rng.choice([20, 400, 5000]), 1)]
        return [json.dumps(msg).encode()]


@pytest.mark.slow
def test_pd_sockets_survive_a_seeded_fuzz_campaign() -> None:
    """For FUZZ_SECONDS (HICACHE_PD_FUZZ_SECONDS, at most 60), and on until each of them has sent
    every kind of mutation (at most 60 s in all), from FUZZ_SEED: a hostile asker
    floods the prefill's bootstrap socket with mutated route asks and KV asks (some for rooms
    real requests use), while a hostile "prefill" answers a decode server's asks with mutated
    routes and answers. Then both servers are healthy, a real P/D request succeeds and both
    pools hold only cached pages."""
    pair = start_pair()
    asker, liar = Fuzzer(FUZZ_SEED), Fuzzer(FUZZ_SEED + 1)
    stop = threading.Event()

    def lie_route() -> list[bytes]:
        template = route_of(fake.port)
        return liar.frames(template) if liar.rng.random() < 0.7 else [json.dumps(template).encode()]

    fake = FakePrefill(route=lie_route, answer=lambda ask: liar.frames(json.loads(header(ask))))
    real_rooms = [5000 + n for n in range(4)]

    def hostile_asker() -> None:
        ask = {"room": 0, "decode_prefix_len": 0, "prompt_len": 41, "heads": [0, 2], "askers": 1, "expires_in": 1.0}
        sock = dealer(pair.port)
        while not stop.is_set():
            template = {"route": 1} if asker.rng.random() < 0.1 else \
                {**ask, "room": asker.rng.choice(real_rooms + list(range(50)))}
            try:
                sock.send_multipart(asker.frames(template), zmq.NOBLOCK)
            except zmq.Again:  # our queue is full (the server disconnected us for a frame too big): reconnect
                sock.close()
                sock = dealer(pair.port)
            time.sleep(0.002)
        sock.close()

    unexpected: list[str] = []

    def hostile_clients(first_room: int) -> None:
        with httpx.Client(timeout=30) as c:
            for room in range(first_room, first_room + 10**6):
                if stop.is_set():
                    break
                r = c.post(f"{pair.decode_url}/v1/completions", json=body(room, fake.port))
                liar.tried["decode requests"] = liar.tried.get("decode requests", 0) + 1
                if r.status_code != 503 or r.json()["error"]["code"] != "kv_transfer_failed":
                    unexpected.append(r.text)

    threads = [threading.Thread(target=hostile_asker),
               *(threading.Thread(target=hostile_clients, args=(10**7 * (i + 1),)) for i in range(2))]
    try:
        for t in threads:
            t.start()
        t_start = time.monotonic()
        n_real = 0

        def every_kind_sent() -> bool:
            return all(k in f.tried for f in (asker, liar) for k in KINDS)

        while (time.monotonic() < t_start + FUZZ_SECONDS or not every_kind_sent()) \
                and time.monotonic() < t_start + 60:  # real transfers meanwhile (their rooms may be stolen by the fuzzer)
            pd_request(pair, real_rooms[n_real % len(real_rooms)] + 100 * n_real)
            n_real += 1
        stop.set()
        for t in threads:
            t.join(30)
        print(f"\nP/D fuzz: {time.monotonic() - t_start:.0f} s, seed {FUZZ_SEED}; asker tried {dict(sorted(asker.tried.items()))}; "
              f"the fake prefill answered {dict(sorted(liar.tried.items()))}; {n_real} real requests meanwhile")
        assert sum(asker.tried.values()) > 100 and liar.tried["decode requests"] > 10 and not unexpected, unexpected
        assert every_kind_sent(), (asker.tried, liar.tried)
        pair.prefill.check_alive()
        pair.decode.check_alive()
        assert_pair_works(pair, room=10**12)
    finally:
        stop.set()
        fake.close()
        stop_pair(pair)
