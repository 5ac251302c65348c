"""Grammar bombs against a live ``hicache serve``: what a plain client feels while they run.

    python benchmarks/bench_grammar_bombs.py [--model smollm2] [--seconds 30] [--bombs NAME,NAME]
                                             [--n 32] [--src PATH]

A probe client sends a plain 8-token chat (short prompt) every 0.2 s, first alone (``--seconds``
/ 3: the baseline), then while two hostile clients send every grammar bomb of
``BOMBS`` of tests/hostile_requests.py (each a new variant every time, half of them with ``n`` choices)
for ``--seconds`` (back to back, or ``--pace`` seconds apart). Prints the probe's latency (median, p99, worst) in both phases side by side,
each bomb's answers, and the resident memory of the server process and of its grammar checker
before and after. ``--src`` serves another checkout's ``src`` (e.g. the commit before the
contained grammar checker; give it ``--bombs "counted repetition"``: the others kill that server).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import httpx
import psutil

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [os.path.join(ROOT, "src"), os.path.join(ROOT, "tests")]

from hicache.bench.main import launch_server  # noqa: E402
from hostile_requests import BOMBS  # noqa: E402


def rss_mib(proc: psutil.Process) -> dict[str, float]:
    """The server's RSS and its children's (the grammar checker), MiB."""
    out = {"server": proc.memory_info().rss / 2**20}
    for child in proc.children(recursive=True):
        try:
            out[f"child {child.pid}"] = child.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            pass
    return out


def probe(url: str, stop: threading.Event, out: list[float], failures: list[str],
          started: list[float] | None = None) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=300) as c:
        while not stop.is_set():
            t0 = time.monotonic()
            if started is not None:
                started.append(t0)
            try:
                r = c.post("/v1/chat/completions", json=body)
                if r.status_code != 200:
                    failures.append(f"{r.status_code} {r.text[:200]}")
            except httpx.HTTPError as e:
                failures.append(f"{type(e).__name__}: {e}")
            out.append(time.monotonic() - t0)
            stop.wait(max(0.0, 0.2 - out[-1]))


def hostile(url: str, names: list[str], stop: threading.Event, first: int, n: int,
            answers: dict[str, dict[str, int]], pace: float) -> None:
    k = first
    with httpx.Client(base_url=url, timeout=300) as c:
        while not stop.is_set():
            name = names[k % len(names)]
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64,
                    **BOMBS[name](k), **({"n": n} if k % 2 else {})}
            k += 2
            try:
                r = c.post("/v1/chat/completions", json=body)
                status = str(r.status_code)
            except httpx.HTTPError as e:
                status = type(e).__name__
            per = answers.setdefault(name, {})
            per[status] = per.get(status, 0) + 1
            stop.wait(pace)


def summary(xs: list[float]) -> str:
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
    return f"n={len(xs):3d}  median {statistics.median(xs) * 1e3:6.0f} ms  p99 {p99 * 1e3:6.0f} ms  worst {xs[-1] * 1e3:6.0f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--bombs", default=",".join(BOMBS), help="comma-separated names from BOMBS in tests/hostile_requests.py")
    ap.add_argument("--n", type=int, default=32, help="choices of every other bomb request")
    ap.add_argument("--pace", type=float, default=0.0,
                    help="seconds each hostile client waits after an answer (0: back to back, a flood of 400s)")
    ap.add_argument("--src", default=None, help="serve this checkout's src instead of this one's")
    ap.add_argument("--server-args", default="")
    ap.add_argument("--url", default=None, help="a server already running (its model named 'm'), instead of launching one")
    args = ap.parse_args()
    names = [b.strip() for b in args.bombs.split(",") if b.strip()]
    if args.src:
        os.environ["PYTHONPATH"] = os.path.abspath(args.src)
    if args.url:
        server, url = None, args.url
        proc = next(p for p in psutil.process_iter(["cmdline"]) if "serve" in (p.info["cmdline"] or []) and
                    args.url.rsplit(":", 1)[1] in (p.info["cmdline"] or []))
    else:
        server, url = launch_server(f"--model {args.model} --served-model-name m {args.server_args}", 300)
        proc = psutil.Process(server.pid)
    try:
        rss_before = rss_mib(proc)
        quiet, failures = [], []
        stop = threading.Event()
        t = threading.Thread(target=probe, args=(url, stop, quiet, failures))
        t.start()
        time.sleep(args.seconds / 3)
        stop.set()
        t.join()
        loud: list[float] = []
        loud_at: list[float] = []
        answers: dict[str, dict[str, int]] = {}
        stop = threading.Event()
        t_loud = time.monotonic()
        threads = [threading.Thread(target=probe, args=(url, stop, loud, failures, loud_at))] + [
            threading.Thread(target=hostile, args=(url, names, stop, i, args.n, answers, args.pace)) for i in range(2)]
        for t in threads:
            t.start()
        time.sleep(args.seconds)
        stop.set()
        for t in threads:
            t.join(600)
        alive = proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        rss_after = rss_mib(proc) if alive else {}
        print(f"\nplain 8-token chat every 0.2 s, {args.model}, server {'alive' if alive else 'DEAD'}")
        print(f"  alone:          {summary(quiet)}")
        if loud:
            print(f"  under bombs:    {summary(loud)}   worst {max(loud) / max(quiet):.1f}x alone's")
            worst = sorted(zip(loud, loud_at), reverse=True)[:3]
            print("  slowest probes: " + ", ".join(f"{d * 1e3:.0f} ms at +{at - t_loud:.1f} s" for d, at in worst))
        print(f"  probe failures: {len(failures)} {failures[:3]}")
        for name in names:
            print(f"  bomb {name!r}: {answers.get(name, {})}")
        print(f"  RSS MiB before: {({k: round(v) for k, v in rss_before.items()})}")
        print(f"  RSS MiB after:  {({k: round(v) for k, v in rss_after.items()})}")
    finally:
        if server is not None and server.poll() is None:
            server.terminate()
            server.wait(60)


if __name__ == "__main__":
    main()
