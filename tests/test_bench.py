"""`hicache bench` against a live in-process server on a tiny random model: a complete report
(JSON and PNG) for the multi-turn shared-prefix workload and for trace replay."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache import Engine
from hicache.cli import main
from hicache.server.serve import ServerThread

pytestmark = pytest.mark.server

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module")
def base_url():
    srv = ServerThread(Engine("random:tiny", dtype="float32", max_total_tokens=16384), served_model_name="tiny")
    yield srv.start()
    srv.stop()


def test_bench_generated_shared_prefix_report(base_url: str, tmp_path: Path, capsys) -> None:
    out, png = tmp_path / "report.json", tmp_path / "report.png"
    rc = main(["bench", "--base-url", base_url, "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3",
               "--gsp-system-prompt-len", "200", "--gsp-question-len", "24", "--gsp-output-len", "8",
               "--gsp-num-turns", "3", "--max-concurrency", "4", "--seed", "3", "--flush-cache",
               "--output-file", str(out), "--plot", str(png), "--disable-tqdm"])
    assert rc == 0
    printed = capsys.readouterr().out
    for label in ("Request throughput", "Mean:", "P99:", "Inter-Token Latency", "Server /metrics hit rate, device",
                  "By turn", "Client CPU"):
        assert label in printed
    rep = json.loads(out.read_text())
    assert rep["completed"] == 18 and rep["failed"] == 0
    assert rep["total_output_tokens"] == 18 * 8
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        assert set(rep[key]) == {"mean", "median", "p90", "p99"} and rep[key]["mean"] > 0
    assert rep["request_throughput"] > 0 and rep["output_throughput"] > 0
    assert set(rep["by_turn"]) == {"1", "2", "3"}
    assert rep["by_turn"]["3"]["hit_rate"] > rep["by_turn"]["1"]["hit_rate"]
    sc = rep["server_cache"]
    assert set(sc["hit_rate"]) >= {"device", "host", "storage"}
    # The server's counters and the responses' usage agree on the run.
    assert sc["prompt_tokens"] == rep["total_input_tokens"]
    assert sc["cached_tokens"]["device"] == rep["total_cached_tokens"] > 0
    assert abs(rep["workload"]["measured_system_prompt_len"] - 200) < 20  # measured with the server's tokenizer
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_bench_trace_replay(base_url: str, tmp_path: Path, capsys) -> None:
    trace = tmp_path / "trace.jsonl"
    system = {"role": "system", "content": "shared system prompt " * 20}
    lines = [
        {"timestamp": 100.0, "messages": [system, {"role": "user", "content": "first"}], "max_tokens": 4, "turn": 1},
        {"timestamp": 100.1, "messages": [system, {"role": "user", "content": "second"}], "max_tokens": 4, "turn": 1},
        {"timestamp": 100.3, "prompt": "plain completion", "max_tokens": 5, "turn": 2},
    ]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "trace.json"
    assert main(["bench", "--base-url", base_url, "--dataset-name", "trace", "--trace-file", str(trace),
                 "--trace-speed", "2", "--output-file", str(out), "--disable-tqdm"]) == 0
    rep = json.loads(out.read_text())
    assert rep["completed"] == 3 and rep["total_output_tokens"] == 13 and rep["duration_s"] >= 0.15
    assert set(rep["by_turn"]) == {"1", "2"}
    capsys.readouterr()


def test_bench_errors_are_one_line(tmp_path: Path, capsys) -> None:
    rc = main(["bench", "--base-url", "http://127.0.0.1:9", "--disable-tqdm"])
    assert rc == 2 and capsys.readouterr().err.startswith("error: cannot reach http://127.0.0.1:9/v1/models")


def test_the_parser_and_the_bench_client_do_not_import_torch() -> None:
    """`hicache bench` runs beside the server, and every command builds the parser (a refused
    flag is answered before torch's ~2 s import)."""
    code = ("import sys; from hicache.cli import build_parser; build_parser(); import hicache.bench.main, "
            "hicache.bench.client, hicache.bench.report, hicache.bench.runner; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    env = dict(os.environ, PYTHONPATH=SRC)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
