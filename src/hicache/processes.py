"""Child processes this project starts (servers for tests, benchmarks and demos): stopping them,
and servers that do not outlive the process that started them (a test run killed by a timeout
left P/D servers running for hours)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading

PARENT_ENV = "HICACHE_DIE_WITH_PARENT"  # a child server's environment: the pid it must not outlive
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def child_env() -> dict[str, str]:
    """The environment for a child server that must not outlive this process. Only from the main
    thread: the kernel sends the parent-death signal when the *thread* that forked the child ends,
    so a child started from a worker thread would be stopped with that thread."""
    env = dict(os.environ)
    if threading.current_thread() is threading.main_thread():
        env[PARENT_ENV] = str(os.getpid())
    return env


def die_with_parent() -> None:
    """In a child started with :func:`child_env`: SIGTERM (an orderly stop) once its parent dies;
    at once if the parent died before this call. No-op elsewhere, and off Linux."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGTERM)


def stop_process(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    """SIGTERM, wait up to ``timeout`` seconds, then SIGKILL and reap; no-op once it has exited."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
