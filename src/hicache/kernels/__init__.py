"""Native CPU kernels, compiled once per machine with torch's C++ extension builder.

``make setup`` builds them (``python -m hicache.kernels``); a process that finds them missing
builds them on first use (~20 s) into a cache folder keyed by the source, the compiler flags and
the torch version, so a changed source or a new torch never loads a stale library
(``HICACHE_KERNEL_CACHE`` moves the folder; default ``~/.cache/hicache/kernels``). Where they
cannot run (no AVX2/FMA, no compiler, not x86) :func:`cpu_kernels` says why once and returns
None; callers keep their torch path. ``HICACHE_KERNELS=0`` turns them off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name) for name in ("block_quant.cpp", "layer_ops.cpp", "decode_attention.cpp")]
HEADERS = [Path(__file__).with_name("simd.h")]
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]


def build_dir() -> Path:
    """Where the library for this source (its text and its place: two checkouts never rebuild
    each other's library under a running process), these flags and this torch lives."""
    key = hashlib.sha256()
    for src in [*SOURCES, *HEADERS]:
        key.update(str(src.resolve()).encode())
        key.update(src.read_bytes())
    key.update(" ".join(CFLAGS).encode())
    key.update(torch.__version__.encode())
    root = Path(os.environ.get("HICACHE_KERNEL_CACHE", Path.home() / ".cache" / "hicache" / "kernels"))
    return root / key.hexdigest()[:16]


def unavailable_reason() -> Optional[str]:
    """Why these kernels cannot run here (None: they can)."""
    if os.environ.get("HICACHE_KERNELS", "1") == "0":
        return "HICACHE_KERNELS=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2 (torch sees {torch.backends.cpu.get_cpu_capability()})"
    return None


@functools.lru_cache(maxsize=1)
def cpu_kernels() -> Optional[object]:
    """``torch.ops.hicache`` with the native kernels loaded, or None (logged once, with why)."""
    reason = unavailable_reason()
    if reason is None:
        try:
            return _load()
        except Exception as exc:  # a missing compiler or ninja: the torch path still works
            reason = f"build failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__}"
    logger.info("native CPU kernels off (%s): decode matmuls use torch's kernels", reason)
    return None


def _load() -> object:
    from torch.utils import cpp_extension

    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    fresh = not (folder / "hicache_kernels.so").exists()
    _clear_stale_lock(folder / "lock")
    start = time.perf_counter()
    # ninja may live beside this interpreter (the venv's `ninja` package), not on PATH.
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    # Also when built: it takes the folder's lock, so a rank never loads a half-linked library.
    cpp_extension.load(name="hicache_kernels", sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS,
                       build_directory=str(folder), is_python_module=False, verbose=False)
    if fresh:
        logger.info("built native CPU kernels in %.1f s: %s", time.perf_counter() - start, folder)
    return torch.ops.hicache


STALE_LOCK_S = 600  # a build takes ~20 s (a few minutes on a busy machine)


def _clear_stale_lock(lock: Path) -> None:
    """torch's builder waits forever on a lock file left by a process killed mid-build."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logger.warning("removing a kernel build lock %.0f s old (a build was killed?): %s", age, lock)
        lock.unlink(missing_ok=True)
