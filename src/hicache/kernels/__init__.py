"""Native CPU kernels, compiled once per machine and instruction set with torch's C++ extension
builder.

One build per instruction set (:data:`ISAS`): ``avx512`` where the CPU has AVX-512 F/BW/VL/DQ
(torch's own "AVX512" capability), else ``avx2`` (AVX2 + FMA + F16C); ``HICACHE_KERNEL_ISA=avx2``
forces the AVX2 build on an AVX-512 machine (to measure both on one), and asking for ``avx512``
where the CPU lacks it is refused with the reason. ``make setup`` builds this machine's
(``python -m hicache.kernels``); a process that finds its build missing makes it on first use
(~20 s) in a cache folder keyed by the source, the instruction set's compiler flags and the
torch version, so a changed source, a new torch or a checkout moved to a CPU without the
instructions never loads a library it cannot run (``HICACHE_KERNEL_CACHE`` moves the folder;
default ``~/.cache/hicache/kernels``). Where they cannot run (no AVX2/FMA, no compiler, not x86)
:func:`cpu_kernels` says why once and returns None; callers keep their torch path.
``HICACHE_KERNELS=0`` turns them off.
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

# Every C++ source and header beside this file (a change to any of them is a new build: build_dir).
SOURCES, HEADERS = (sorted(Path(__file__).parent.glob(pattern)) for pattern in ("*.cpp", "*.h"))
# Compiler flags per instruction set; the avx512 build also compiles the blocks' 16-lane paths.
ISAS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
               "-DHICACHE_AVX512"],
}
ISA_ENV = "HICACHE_KERNEL_ISA"


def kernel_isa() -> str:
    """The instruction set the kernels are built for here: ``$HICACHE_KERNEL_ISA`` if set (an
    ``avx512`` this CPU cannot run is refused by :func:`unavailable_reason`), else the best
    the CPU has."""
    return os.environ.get(ISA_ENV, "").lower() or (
        "avx512" if torch.backends.cpu.get_cpu_capability() == "AVX512" else "avx2")


def cflags(isa: str) -> list[str]:
    """The compiler's flags for ``isa`` here: the avx512 build adds VNNI (one instruction per int8
    dot, ``kernels/gguf_int8.h``) where the CPU has it, so its folder differs from a VNNI-less one's."""
    vnni = ["-mavx512vnni"] if isa == "avx512" and "avx512_vnni" in cpu_flags() else []
    return ["-O3", *ISAS[isa], *vnni, "-fopenmp"]


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (``/proc/cpuinfo``); empty where unreadable."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def build_dir(isa: Optional[str] = None) -> Path:
    """Where the library for this source (its text and its place: two checkouts never rebuild
    each other's library under a running process), this instruction set's flags and this torch
    lives."""
    key = hashlib.sha256()
    for src in [*SOURCES, *HEADERS]:
        key.update(str(src.resolve()).encode())
        key.update(src.read_bytes())
    key.update(" ".join(cflags(isa or kernel_isa())).encode())
    key.update(torch.__version__.encode())
    root = Path(os.environ.get("HICACHE_KERNEL_CACHE", Path.home() / ".cache" / "hicache" / "kernels"))
    return root / key.hexdigest()[:16]


def unavailable_reason() -> Optional[str]:
    """Why these kernels cannot run here (None: they can)."""
    if os.environ.get("HICACHE_KERNELS", "1") == "0":
        return "HICACHE_KERNELS=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    caps = torch.backends.cpu.get_cpu_capability()
    if caps not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2 (torch sees {caps})"
    isa = kernel_isa()
    if isa not in ISAS:
        return f"{ISA_ENV}={isa} is not one of {', '.join(ISAS)}"
    if isa == "avx512" and caps != "AVX512":
        return f"{ISA_ENV}=avx512 but the CPU lacks AVX-512 F/BW/VL/DQ (torch sees {caps})"
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


def loaded_isa() -> Optional[str]:
    """The instruction set of the kernels this process runs, or None when they are off."""
    return kernel_isa() if cpu_kernels() is not None else None


def _load() -> object:
    from torch.utils import cpp_extension

    isa = kernel_isa()
    folder = build_dir(isa)
    folder.mkdir(parents=True, exist_ok=True)
    fresh = not (folder / "hicache_kernels.so").exists()
    _clear_stale_lock(folder / "lock")
    start = time.perf_counter()
    # ninja may live beside this interpreter (the venv's `ninja` package), not on PATH.
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    # Also when built: it takes the folder's lock, so a rank never loads a half-linked library.
    cpp_extension.load(name=f"hicache_kernels_{isa}", sources=[str(s) for s in SOURCES], extra_cflags=cflags(isa),
                       build_directory=str(folder), is_python_module=False, verbose=False)
    if fresh:
        logger.info("built native CPU kernels (%s) in %.1f s: %s", isa, time.perf_counter() - start, folder)
    else:
        logger.info("native CPU kernels (%s): %s", isa, folder)
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
