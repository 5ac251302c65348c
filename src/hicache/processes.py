"""Stopping child processes this project starts (servers for tests, benchmarks and demos)."""

from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    """SIGTERM, wait up to ``timeout`` seconds, then SIGKILL and reap; no-op once it has exited."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
