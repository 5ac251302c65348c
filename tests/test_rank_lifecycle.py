"""Multi-rank process lifecycle: a dead rank, a killed frontend or leader, SIGTERM, an engine
dropped without shutdown, a script without a main guard and ranks on two nodes all end in a
clear error or an orderly stop, never a hang or a leftover process; ranks listen on loopback."""

from __future__ import annotations

import fcntl
import gc
import json
import multiprocessing
import os
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from hicache import Engine, SamplingParams
from hicache.bench.main import launch_server
from hicache.cli import main as cli_main
from hicache.config import ConfigError
from hicache.errors import HicacheError
from rank_workloads import BASE, MODEL

pytestmark = pytest.mark.parallel  # and multirank on each test that starts ranks


@pytest.mark.multirank
def test_a_dead_rank_stops_the_engine_with_its_name() -> None:
    engine = Engine(MODEL, tp_size=2, max_total_tokens=512, **BASE)
    try:
        os.kill(engine.group.procs[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10  # the watchdog stops the other ranks while nobody calls
        while any(p.is_alive() for p in engine.group.procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(p.is_alive() for p in engine.group.procs)
        with pytest.raises(HicacheError, match="rank PP0/TP1 .* was killed by signal 9"):
            engine.generate([[5] * 30], SamplingParams(max_new_tokens=4, temperature=0.0))
    finally:
        engine.shutdown()


def _alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (a zombie waiting to be reaped has ended)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(pid)
        except FileNotFoundError:
            pass
    return out


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return out


def _wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _alive(pids)


def _shm_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("hicache-tp-")} if os.path.isdir("/dev/shm") else set()


_FRONTEND_SCRIPT = """
import sys, time
from hicache import Engine
if __name__ == "__main__":
    engine = Engine("random:small", tp_size=2, dtype="float32", page_size=4, max_total_tokens=512)
    print("RANKS", *[p.pid for p in engine.group.procs], flush=True)
    time.sleep(600)
"""


@pytest.mark.multirank
def test_ranks_exit_when_the_frontend_is_killed(tmp_path: Path) -> None:
    """SIGKILL of the user's process (OOM killer, kill -9): the ranks notice and exit; no
    shared-memory segment is left behind."""
    script = tmp_path / "frontend.py"
    script.write_text(_FRONTEND_SCRIPT)
    before = _shm_segments()
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("RANKS"), line
        ranks = [int(x) for x in line.split()[1:]]
        assert len(_alive(ranks)) == 2
        assert _shm_segments() == before  # the all-reduce segment's name is dropped once mapped
    finally:
        proc.kill()
        proc.wait()
    assert _wait_gone(ranks) == []


@pytest.mark.server
def test_a_server_a_script_started_stops_when_the_script_is_killed() -> None:
    """A test run or benchmark killed by a timeout (SIGKILL: no cleanup runs) does not leave the
    `hicache serve` it started running (two P/D servers once ran 1.5 h after their test)."""
    script = ("import time; from hicache.bench.main import launch_server\n"
              "proc, url = launch_server('--model random:tiny --max-total-tokens 512', timeout=120)\n"
              "print(proc.pid, flush=True); time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        server = int(parent.stdout.readline())
        assert _alive([server]) == [server]
    finally:
        parent.kill()
        parent.wait()
    assert _wait_gone([server], timeout=30) == []


@pytest.mark.multirank
@pytest.mark.server
def test_serve_stops_its_ranks_in_order_on_sigterm() -> None:
    """`docker stop` / systemd / k8s send SIGTERM: the server stops the engine (ranks exit 0)."""
    proc, url = launch_server("--model random:small --tp-size 2 --dtype float32 --page-size 4 "
                              "--max-total-tokens 512", timeout=180)
    ranks = _children(proc.pid)
    try:
        assert httpx.get(url + "/health").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _wait_gone(ranks, timeout=10) == []


@pytest.mark.multirank
def test_a_leader_killed_mid_message_is_an_error_not_a_hang() -> None:
    """The leader dies while the frontend lags behind its updates (a message half-written in a
    full pipe): the frontend's next read raises, naming the rank, instead of waiting forever."""
    engine = Engine(MODEL, tp_size=2, max_total_tokens=16384, max_running_requests=256, **BASE)
    group = engine.group
    try:
        sampling = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
        for i in range(256):  # queued to the leader; nobody reads its updates meanwhile
            engine.scheduler.add(engine.make_request([5 + i % 200, 7, 9, 11], sampling, None))
        # The pipe is full once its unread bytes stop growing (where exactly depends on the
        # messages' sizes): a step's updates for 256 requests are a message of several pipe
        # pages, so the leader's writer is now blocked inside one.
        deadline, seen = time.monotonic() + 30, -1
        while time.monotonic() < deadline and not (seen == _unread_bytes(group.outbox) and seen > 32_000):
            seen = _unread_bytes(group.outbox)
            time.sleep(0.5)
        os.kill(group.procs[0].pid, signal.SIGKILL)
        raised: list[BaseException] = []

        def drive() -> None:
            try:
                while engine.scheduler.has_work():
                    engine.scheduler.step()
            except BaseException as e:
                raised.append(e)

        driver = threading.Thread(target=drive, daemon=True)
        driver.start()
        driver.join(timeout=30)
        assert not driver.is_alive(), "the frontend is stuck reading from a dead leader"
        assert raised and isinstance(raised[0], HicacheError)
        assert "rank PP0/TP0" in str(raised[0]) and "killed by signal 9" in str(raised[0])
    finally:
        engine.shutdown()


def _unread_bytes(q) -> int:
    """Bytes waiting in a multiprocessing queue's pipe (test instrumentation)."""
    buf = fcntl.ioctl(q._reader.fileno(), termios.FIONREAD, b"\0\0\0\0")
    return struct.unpack("i", buf)[0]


def _listening(pids: list[int]) -> list[tuple[int, str, int]]:
    """``(pid, address, port)`` of every TCP socket these processes listen on."""
    return [(pid, c.laddr.ip, c.laddr.port) for pid in pids
            for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]


@pytest.mark.multirank
def test_ranks_listen_on_loopback_only_and_an_engine_dropped_without_shutdown_stops_them() -> None:
    """One machine: rank 0's rendezvous store and every rank's gloo sockets listen on
    127.0.0.1, nothing on a wildcard (torch's own tcp:// rendezvous listens on ``*:port``).
    Then the engine is dropped without a shutdown: its ranks stop all the same."""
    def start() -> tuple[list[int], list[tuple[int, str, int]]]:
        engine = Engine(MODEL, tp_size=2, max_total_tokens=512, **BASE)
        engine.generate([[5] * 12], SamplingParams(max_new_tokens=2, temperature=0.0))
        ranks = [p.pid for p in engine.group.procs]
        return ranks, _listening(ranks)

    ranks, listening = start()  # the engine is garbage now
    gc.collect()
    assert _wait_gone(ranks) == []
    assert multiprocessing.active_children() == []
    assert len(listening) >= 2 and {ip for _, ip, _ in listening} == {"127.0.0.1"}, listening


def test_bad_parallel_layout_is_one_clear_error() -> None:
    with pytest.raises(HicacheError, match="exceeds the model's 4 attention heads"):
        Engine(MODEL, tp_size=5, **BASE)
    with pytest.raises(HicacheError, match="exceeds the model's 4 layers"):
        Engine(MODEL, pp_size=5, **BASE)


_UNGUARDED_SCRIPT = """
import json
from hicache import Engine, SamplingParams
with open({marker!r}, "a") as marker:  # one line per run of this top level
    marker.write("ran\\n")
engine = Engine("random:tiny", dtype="float32", tp_size=2, max_total_tokens=1024)
result = engine.generate([{prompt!r}], SamplingParams(max_new_tokens=6, temperature=0.0))[0]
print("OUTPUT", json.dumps(result.output_ids), flush=True)
engine.shutdown()
"""


@pytest.mark.multirank
def test_a_script_without_main_guard_runs_once_and_gets_one_ranks_tokens(tmp_path: Path) -> None:
    """The rank processes never re-run the user's script: a plain script with no
    ``if __name__ == "__main__":`` guard starts a TP2 engine and gets one rank's greedy tokens."""
    prompt = [5, 17, 42, 99, 3, 250, 7, 61, 12, 33]
    marker = tmp_path / "ran.txt"
    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED_SCRIPT.format(marker=str(marker), prompt=prompt))
    src = Path(__file__).resolve().parents[1] / "src"
    done = subprocess.run([sys.executable, str(script)], env=dict(os.environ, PYTHONPATH=str(src)),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    assert marker.read_text().splitlines() == ["ran"]  # the ranks did not import it again
    outputs = [line.split(maxsplit=1)[1] for line in done.stdout.splitlines() if line.startswith("OUTPUT ")]
    plain = Engine("random:tiny", dtype="float32", max_total_tokens=1024)
    try:
        want = plain.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0))[0].output_ids
    finally:
        plain.shutdown()
    assert [json.loads(o) for o in outputs] == [want]


def _two_turns(engine: Engine) -> tuple[list[list[int]], int]:
    """Two prompts, then a second turn of the first (its prompt + output + a new message):
    the greedy tokens of all three, and how many tokens the second turn found cached."""
    sampling = SamplingParams(max_new_tokens=5, temperature=0.0)
    first = engine.generate([[5, 17, 42, 99] * 5, [7, 8, 9] * 7], sampling)
    second = engine.generate([[5, 17, 42, 99] * 5 + first[0].output_ids + [11, 12, 13]], sampling)[0]
    return [r.output_ids for r in first] + [second.output_ids], second.cached_tokens


@pytest.mark.multirank
def test_ranks_on_two_nodes_match_one_rank(tmp_path: Path) -> None:
    """``--nnodes 2`` on loopback: node 1 (``hicache node``, another process tree) runs PP0/TP1,
    node 0 (this process) runs the frontend and PP0/TP0. The tokens equal one rank's, the
    second turn hits the cache, and node 0's shutdown stops node 1 in order (exit 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    flags = ["--model", MODEL, "--dtype", "float32", "--page-size", "4", "--max-total-tokens", "512",
             "--tp-size", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr]
    src = Path(__file__).resolve().parents[1] / "src"
    log = tmp_path / "node1.log"
    with open(log, "w") as err:
        node = subprocess.Popen([sys.executable, "-m", "hicache.cli", "node", *flags], stderr=err,
                                env=dict(os.environ, PYTHONPATH=str(src)))
    try:
        engine = Engine(MODEL, tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr, max_total_tokens=512, **BASE)
        try:
            assert len(engine.group.procs) == 1  # only node 0's rank runs here
            ranks = [engine.group.procs[0].pid] + [c.pid for c in psutil.Process(node.pid).children()]
            assert {ip for _, ip, _ in _listening(ranks)} == {"127.0.0.1"}  # both nodes: the route's address
            got, cached = _two_turns(engine)
        finally:
            engine.shutdown()
        assert node.wait(timeout=30) == 0, log.read_text()[-4000:]
        assert [p.exitcode for p in engine.group.procs] == [0]
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
    assert "ranks stopped in order" in log.read_text()
    assert cached >= 20  # the first prompt's 5 pages (its reply's KV is not cached by default)
    single = Engine(MODEL, max_total_tokens=512, **BASE)
    try:
        assert got == _two_turns(single)[0]
    finally:
        single.shutdown()
    assert multiprocessing.active_children() == []


def test_bad_node_flags_are_one_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"needs --dist-init-addr HOST:PORT"):
        Engine(MODEL, tp_size=2, nnodes=2, **BASE)
    with pytest.raises(ConfigError, match=r"\(3\) must be divisible by --nnodes 2"):
        Engine(MODEL, tp_size=3, nnodes=2, dist_init_addr="127.0.0.1:29500", **BASE)
    with pytest.raises(ConfigError, match=r"--node-rank must be in \[0, 2\)"):
        Engine(MODEL, tp_size=2, nnodes=2, node_rank=2, dist_init_addr="127.0.0.1:29500", **BASE)
    with pytest.raises(ConfigError, match=r"node 1 of 2 serves nothing: start its ranks with `hicache node"):
        Engine(MODEL, tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:29500", **BASE)
    # `hicache node` for node 0 (or one node): one `error:` line, status 2, nothing started.
    assert cli_main(["node", "--model", MODEL, "--tp-size", "2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: `hicache node` runs the ranks of a node other than 0")
    assert multiprocessing.active_children() == []
