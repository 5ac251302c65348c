"""A fault campaign against a live server (issue 10): a seeded random mix of valid and invalid
requests, disconnects, client time-outs, flushes and storage stalls / errors / corruption /
outages, from three concurrent clients, for a bounded number of steps. Afterwards the server is
healthy, device pages and host slots balance, the tree's invariants hold, and every greedy
answer given during the campaign equals a clean cache-off run's."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from pathlib import Path

from faulty_backend import FaultyBackend
import httpx
import pytest

from hicache import Engine, SamplingParams
from hicache.server.serve import ServerThread

pytestmark = [pytest.mark.server, pytest.mark.storage]

SEED = 20261130
CLIENTS = 3
STEPS_PER_CLIENT = 45
MODEL = "tiny"
MAX_BODY = 64 * 1024
PAGE = 16
GREEDY_NEW = 6

# Conversations: a long first turn (storage is asked from 64 uncached tokens on), then turns of
# 24 tokens each; a greedy request sends one conversation's prefix up to some turn.
_conv_rng = random.Random(SEED)
CONVERSATIONS = [[_conv_rng.randrange(5, 250) for _ in range(200 + 16 * c + 24 * 5)] for c in range(5)]


def greedy_prompt(rng: random.Random) -> list[int]:
    conv = rng.randrange(len(CONVERSATIONS))
    turn = rng.randrange(6)
    return CONVERSATIONS[conv][: 200 + 16 * conv + 24 * turn]


INVALID = [  # (raw body, statuses a correct server may answer)
    (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', {400}),
    (b'{"model": "tiny", "prompt": "x", "x": ' + b"[" * 3000 + b"]" * 3000 + b"}", {400}),
    (b'{"model": "tiny", "prompt": "\\ud800abc"}', {400}),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": "3"}', {400}),
    (b'{"model": "tiny", "prompt": "x", "stream": "yes"}', {400}),
    (b'{"model": "tiny", "prompt": "x", "seed": 1180591620717411303424}', {400}),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 1000000}', {400}),
    (b'{"model": "tiny", "prompt": "x", "cache_salt": ""}', {400}),
    (b'{"model": "tiny", "prompt": [1, 2, 99999999]}', {400}),
    (b'{"model": "nope", "prompt": "x"}', {404}),
    (b'{"model": "tiny", "prompt": "' + b"z" * (MAX_BODY + 10) + b'"}', {413}),
    (b'{"model": "tiny", "prompt": "x", "tools": [{"type": "function"}]}', {400}),
    (b'[1, 2, 3]', {400}),
    (b'{"model": "tiny", "prompt": ', {400}),
]
STORAGE_MODES = ("ok", "stall", "ok", "errors", "ok", "corrupt", "ok", "down")  # taken in turn
ACTIONS = {"greedy": 40, "sampled": 8, "invalid": 16, "disconnect": 8, "client_timeout": 4, "flush": 4,
           "storage": 12, "observe": 8}


class Campaign:
    """What the clients did and saw; shared by the client threads."""

    def __init__(self, url: str, faulty: FaultyBackend) -> None:
        self.url, self.faulty = url, faulty
        self.tried: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.greedy: list[tuple[tuple[int, ...], str]] = []
        self.problems: list[str] = []
        self.lock = threading.Lock()

    def note(self, action: str, outcome: str) -> None:
        with self.lock:
            self.tried[action] += 1
            self.outcomes[f"{action}:{outcome}"] += 1

    def problem(self, what: str) -> None:
        with self.lock:
            self.problems.append(what)

    # ---- actions -------------------------------------------------------------------------
    def greedy_request(self, c: httpx.Client, rng: random.Random) -> None:
        prompt = greedy_prompt(rng)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": GREEDY_NEW, "temperature": 0, "ignore_eos": True}
        if rng.random() < 0.4:
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                events = [json.loads(x[5:]) for x in r.iter_lines() if x.startswith("data: {")]
            text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
            ok = r.status_code == 200 and not any("error" in e for e in events)
        else:
            r = c.post("/v1/completions", json=body)
            ok = r.status_code == 200
            text = r.json()["choices"][0]["text"] if ok else ""
        if not ok:
            self.problem(f"greedy request failed: {r.status_code}")
        else:
            with self.lock:
                self.greedy.append((tuple(prompt), text))
        self.note("greedy", str(r.status_code))

    def sampled_request(self, c: httpx.Client, rng: random.Random) -> None:
        body = {"model": MODEL, "prompt": greedy_prompt(rng), "max_tokens": 4, "temperature": rng.choice([0.3, 1.0, 1e-9]),
                "top_p": rng.choice([1.0, 0.5, 1e-40]), "top_k": rng.choice([-1, 1, 7]), "seed": rng.randrange(-5, 2**40)}
        r = c.post("/v1/completions", json=body)
        if r.status_code != 200:
            self.problem(f"sampled request failed: {r.status_code} {r.text[:200]}")
        self.note("sampled", str(r.status_code))

    def invalid_request(self, c: httpx.Client, rng: random.Random) -> None:
        raw, allowed = rng.choice(INVALID)
        r = c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        if r.status_code not in allowed or set(r.json().get("error", {})) != {"message", "type", "param", "code"}:
            self.problem(f"invalid body {raw[:60]!r} answered {r.status_code} {r.text[:200]}")
        self.note("invalid", str(r.status_code))

    def disconnect(self, c: httpx.Client, rng: random.Random) -> None:
        body = {"model": MODEL, "prompt": greedy_prompt(rng), "max_tokens": 400, "stream": True, "ignore_eos": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break  # leaving the block closes the connection mid-stream
        self.note("disconnect", str(r.status_code))

    def client_timeout(self, c: httpx.Client, rng: random.Random) -> None:
        body = {"model": MODEL, "prompt": greedy_prompt(rng), "max_tokens": 400, "ignore_eos": True}
        try:
            r = httpx.post(self.url + "/v1/completions", json=body, timeout=0.05)
            self.note("client_timeout", f"answered {r.status_code}")
        except httpx.TimeoutException:
            self.note("client_timeout", "gave up")

    def flush(self, c: httpx.Client, rng: random.Random) -> None:
        r = c.post("/flush_cache", params={"timeout": rng.choice([0, 1])})  # later turns then come from L3
        if r.status_code not in (200, 400):
            self.problem(f"flush answered {r.status_code}")
        self.note("flush", str(r.status_code))

    def storage(self, c: httpx.Client, rng: random.Random) -> None:
        with self.lock:  # every mode comes up: the modes take turns
            mode = STORAGE_MODES[self.tried["storage"] % len(STORAGE_MODES)]
        f = self.faulty.faults
        f.fail_get = f.fail_set = mode == "errors"
        f.corrupt_get = mode == "corrupt"
        f.down = mode == "down"
        if mode == "stall":
            self.faulty.arm_hang(1.0)
        else:
            self.faulty.release()
        self.note("storage", mode)

    def observe(self, c: httpx.Client, rng: random.Random) -> None:
        for path in ("/stats", "/metrics", "/health"):
            r = c.get(path)
            if r.status_code != 200:
                self.problem(f"{path} answered {r.status_code}")
        self.note("observe", "200")

    def client(self, index: int) -> None:
        rng = random.Random(SEED * 100 + index)
        names, weights = zip(*ACTIONS.items())
        with httpx.Client(base_url=self.url, timeout=60) as c:
            for _ in range(STEPS_PER_CLIENT):
                action = rng.choices(names, weights)[0]
                try:
                    getattr(self, {"greedy": "greedy_request", "sampled": "sampled_request",
                                   "invalid": "invalid_request"}.get(action, action))(c, rng)
                except httpx.HTTPError as e:
                    self.problem(f"{action}: {type(e).__name__}: {e}")


def wait_until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_fault_campaign(tmp_path: Path, capsys) -> None:
    engine = Engine("random:tiny", dtype="float32", page_size=PAGE, max_total_tokens=1536,
                    enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_storage_backend="file",
                    hicache_storage_backend_extra_config=json.dumps({"path": str(tmp_path / "kv")}),
                    hicache_storage_prefetch_threshold=64, hicache_storage_op_timeout=0.5)
    storage = engine.cache.storage
    faulty = FaultyBackend(storage.backend)
    storage.backend = faulty  # behind the deadline and breaker guard
    storage.guard.cooldown_s, storage.guard.max_cooldown_s = 0.3, 1.0
    srv = ServerThread(engine, served_model_name=MODEL, max_request_bytes=MAX_BODY)
    url = srv.start()
    campaign = Campaign(url, faulty)
    try:
        threads = [threading.Thread(target=campaign.client, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads), "a client is stuck"
        faulty.faults.fail_get = faulty.faults.fail_set = faulty.faults.corrupt_get = faulty.faults.down = False
        faulty.release()

        # Healthy, idle and balanced once the last writes have landed.
        assert httpx.get(url + "/health").json() == {"status": "ok"}

        def balanced() -> dict | None:
            s = httpx.get(url + "/stats").json()
            dev, host = s["device_pool"], s["host_pool"]
            ok = (s["inflight_requests"] == 0 and dev["request_pages"] == 0 and dev["locked_pages"] == 0
                  and dev["free_pages"] + dev["cached_pages"] == dev["capacity_pages"]
                  and host["free_pages"] + host["cached_pages"] == host["capacity_pages"])
            return s if ok else None

        final = wait_until(balanced, 30, "pages and host slots to balance")
        srv.loop.call(lambda: engine.cache.tree.check_invariants()).result(10)

        # Every greedy answer equals the clean run's.
        clean = Engine("random:tiny", dtype="float32", page_size=PAGE, max_total_tokens=4096, disable_radix_cache=True)
        prompts = sorted({p for p, _ in campaign.greedy})
        want = {p: r.text for p, r in zip(prompts, clean.generate([list(p) for p in prompts],
                                                                   SamplingParams(max_new_tokens=GREEDY_NEW,
                                                                                  temperature=0, ignore_eos=True)))}
        clean.shutdown()
        wrong = [p for p, text in campaign.greedy if text != want[p]]
        with capsys.disabled():
            print(f"\nfault campaign (seed {SEED}, {CLIENTS} clients x {STEPS_PER_CLIENT} steps): "
                  f"tried {dict(sorted(campaign.tried.items()))}; outcomes {dict(sorted(campaign.outcomes.items()))}; "
                  f"{len(campaign.greedy)} greedy answers over {len(prompts)} prompts; hits {final['hit_tokens']}; "
                  f"storage failures {final['storage']['failures']}; breaker opens {final['storage']['breaker']['opens']}")
        assert campaign.problems == []
        assert wrong == []
        assert sum(campaign.tried.values()) == CLIENTS * STEPS_PER_CLIENT
        assert campaign.tried["greedy"] > 20 and campaign.tried["invalid"] > 5 and campaign.tried["storage"] > 3
    finally:
        faulty.release()
        srv.stop()
        engine.shutdown()
