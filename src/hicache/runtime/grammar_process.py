"""The grammar checker's worker process as the engine sees it: started, asked, timed, stopped.

The worker (:mod:`.grammar_worker`, run as a script) speaks messages of a 4-byte big-endian
length and UTF-8 JSON both ways. Units: a check's budget is CPU seconds of the worker
(``/proc/<pid>/stat`` utime + stime, clock ticks), with a wall-clock backstop of
:data:`WALL_FACTOR` times it for a worker that cannot run at all; a wait polls every
:data:`POLL_S` wall-clock seconds. At most one worker lives per :class:`WorkerProcess`; a dead or
stopped one is replaced by the next :meth:`WorkerProcess.start`.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from .grammar_worker import read_message, write_message

logger = logging.getLogger(__name__)

WORKER = Path(__file__).with_name("grammar_worker.py")
STARTUP_TIMEOUT_S = 60.0
WALL_FACTOR = 4.0  # a check's wall-clock backstop: this many times its CPU-time limit
POLL_S = 0.05  # how often a wait checks the worker's CPU time and whether anyone still waits
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class CheckerDown(Exception):
    """The worker process could not be started (a verdict on the server, not on the grammar)."""


class WorkerProcess:
    """One grammar worker at a time, configured by ``config`` (its first message)."""

    def __init__(self, config: dict) -> None:
        self.config = config
        self.proc: Optional[subprocess.Popen] = None
        self._stderr = tempfile.TemporaryFile()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """A fresh worker, ready for jobs; CheckerDown if it does not answer ready."""
        env = {**os.environ, "MALLOC_ARENA_MAX": "2", "PYTHONHASHSEED": "0"}
        self.proc = subprocess.Popen([sys.executable, "-I", str(WORKER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, env=env)
        start = time.monotonic()
        try:
            ready = self.ask(self.config, lambda: time.monotonic() - start > STARTUP_TIMEOUT_S)
        except TimeoutError:
            ready = None
        if not ready:
            code = self.proc.poll()
            self.stop()
            said = self.said().strip()
            logger.warning("grammar check: the worker did not start (%s); %s", "no answer" if code is None else
                           status(code), said.splitlines()[-1] if said else "no message")
            raise CheckerDown("the grammar could not be checked: the grammar checker did not start; retry later.")
        logger.info("grammar check: worker pid=%d ready", self.proc.pid)

    def ask(self, message: dict, expired: Callable[[], bool]) -> Optional[dict]:
        """Send ``message`` and read the answer; None if the worker exited meanwhile; TimeoutError
        once ``expired()`` (checked whenever :data:`POLL_S` passes without a byte)."""
        assert self.proc is not None
        try:
            write_message(self.proc.stdin, message)
        except BrokenPipeError:
            return None  # it died
        fd = self.proc.stdout.fileno()
        return read_message(lambda n: _read_exact(fd, n, expired))

    def stop(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def said(self) -> str:
        """The last words on the worker's stderr (its tail), cleared for the next one."""
        self._stderr.seek(0)
        said = self._stderr.read()[-2000:].decode(errors="replace")
        self._stderr.seek(0)
        self._stderr.truncate()
        return said

    def close(self) -> None:
        self.stop()
        self._stderr.close()


class CpuBudget:
    """A check's limit in CPU seconds of the worker (so a verdict does not depend on how busy the
    machine is: the worker runs at the lowest priority), with a wall-clock backstop of
    :data:`WALL_FACTOR` times it for a worker that cannot run at all (then the server is at fault)."""

    def __init__(self, pid: int, seconds: float) -> None:
        self.pid, self.seconds, self.t0 = pid, seconds, time.monotonic()
        self.cpu0 = self._cpu()

    def _cpu(self) -> float:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime
        except (OSError, IndexError, ValueError):  # not Linux, or gone: wall-clock alone
            return time.monotonic() - self.t0

    def cpu_s(self) -> float:
        """CPU seconds the worker spent since this budget began."""
        return self._cpu() - self.cpu0

    def wall_s(self) -> float:
        return time.monotonic() - self.t0

    def spent(self) -> bool:
        return self.cpu_s() > self.seconds or self.wall_s() > WALL_FACTOR * self.seconds


def status(code: int) -> str:
    """An exit status in words: ``SIGKILL``, ``exit status 1``."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def _read_exact(fd: int, n: int, expired: Callable[[], bool]) -> Optional[bytes]:
    buf = bytearray()
    while len(buf) < n:
        if not select.select([fd], [], [], POLL_S)[0]:
            if expired():
                raise TimeoutError
            continue
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)
