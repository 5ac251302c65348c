"""The small device abstraction: which device, how much memory it has. Code elsewhere stays
device-agnostic (CUDA when present, CPU otherwise)."""

from __future__ import annotations

import os

import torch

from .config import ConfigError


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name} was requested but CUDA is not available on this machine.")
    return dev


def available_host_memory() -> int:
    """Bytes of host memory the kernel reports as available (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_memory_budget(device: torch.device, fraction: float | None) -> int:
    """Bytes the KV pool may take: on CUDA, ``fraction`` of the card minus what is already in
    use (weights); on CPU, ``fraction`` of available host memory (weights already loaded)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total * (fraction or 0.85) - (total - free))
    return int(available_host_memory() * (fraction or 0.10))
