"""The `hicache` command as a user runs it: JSON output, demo, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.cli import main

pytestmark = pytest.mark.engine

SRC = str(Path(__file__).resolve().parents[1] / "src")


def hicache(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "hicache.cli", *args], capture_output=True, text=True,
                          input=stdin, env=env, timeout=300)


def test_generate_json() -> None:
    out = hicache("generate", "--model", "random:tiny", "--dtype", "float32", "--max-total-tokens", "1024",
                  "--prompt", "hello", "--prompt", "hello there", "--max-new-tokens", "5", "--json")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["completion_tokens"] == 5 and len(row["output_ids"]) == 5
        assert set(row["cached_tokens_details"]) == {"device", "host", "storage"}
        assert row["ttft_s"] > 0 and isinstance(row["text"], str)


@pytest.mark.slow
def test_user_errors_are_one_line_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """One case as a user runs it (a process of its own), the rest through the same ``main`` in
    this process (a process each cost CI ~10 s of imports)."""
    cases = [
        ("generate", "--model", "random:tiny", "--prompt", "x", "--page-size", "0"),
        ("generate", "--model", "random:tiny", "--prompt", "x", "--temperature", "-2"),
        ("generate", "--model", "random:tiny", "--prompt-file", str(tmp_path / "missing.txt")),
        ("generate", "--model", str(tmp_path), "--prompt", "x"),
    ]
    outs = [(2, hicache("generate", "--model", "no-such-model", "--prompt", "x").stderr)]
    for args in cases:
        code = main(list(args))
        outs.append((code, capsys.readouterr().err))
    for args, (code, stderr) in zip([("no-such-model",), *cases], outs):
        assert code == 2, (args, stderr)
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, stderr)
        assert "Traceback" not in stderr


def test_demo_runs_a_multi_turn_session() -> None:
    out = hicache("demo", "--model", "random:tiny", "--dtype", "float32", "--max-total-tokens", "8192",
                  "--turns", "4", "--max-new-tokens", "8")
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(1, 1), (1, 2), (1, 3), (1, 4)]  # agent, turn
    inputs, cached = [int(r[2]) for r in rows], [int(r[3]) for r in rows]
    assert cached[0] == 0
    for turn in range(1, 4):  # each turn reuses at least the previous turn's prompt (whole pages)
        assert cached[turn] >= inputs[turn - 1] - 16
    assert "summary: hit rate" in out.stdout


def test_chat_reads_turns_from_stdin() -> None:
    out = hicache("chat", "--model", "random:tiny", "--dtype", "float32", "--max-total-tokens", "4096",
                  "--max-new-tokens", "4", stdin="hi\nhow are you\n/exit\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("assistant>") == 2
    assert "cached" in out.stderr


@pytest.mark.slow
def test_demo_with_agents_and_host_tier_shows_host_hits() -> None:
    out = hicache("demo", "--model", "random:tiny", "--dtype", "float32", "--max-total-tokens", "2048",
                  "--agents", "3", "--turns", "3", "--max-new-tokens", "8", "--enable-hierarchical-cache")
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 9
    assert sum(int(r[5]) for r in rows) > 0, out.stdout  # host-tier hits
    assert "host tier on" in out.stdout


@pytest.mark.parametrize("argv, level", [
    (["serve", "--log-level", "info"], "info"),  # before: "unrecognized arguments" (only `hicache --log-level info serve`)
    (["--log-level", "debug", "serve"], "debug"),
    (["--log-level", "debug", "generate", "--log-level", "error"], "error"),  # the subcommand's wins
    (["bench"], "warning"),
])
def test_log_level_is_taken_before_or_after_the_subcommand(argv: list[str], level: str) -> None:
    from hicache.cli import build_parser

    assert build_parser().parse_args(argv).log_level == level
