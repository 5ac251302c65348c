"""The small device abstraction: which device, which dtype, how much memory it has. Code
elsewhere stays device-agnostic (CUDA when present, CPU otherwise)."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import platform

import dataclasses

import torch

from .config import ConfigError, EngineConfig

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name} was requested but CUDA is not available on this machine.")
    return dev


def resident_bytes() -> int:
    """This process's resident memory in bytes (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


HOST_MEMORY_ENV = "HICACHE_HOST_MEMORY"
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def available_host_memory() -> int:
    """Bytes of host memory the kernel reports as available (MemAvailable), or ``$HICACHE_HOST_MEMORY``
    (bytes, or with a K/M/G/T suffix: ``120G``) where MemAvailable understates what the machine will
    have (a VM whose memory balloon grows as it is used)."""
    override = os.environ.get(HOST_MEMORY_ENV, "").strip().upper().removesuffix("B")
    if override:
        unit = override[-1] if override[-1] in _UNITS else ""
        try:
            return int(float(override[: len(override) - len(unit)]) * _UNITS[unit])
        except ValueError:
            raise ConfigError(f"{HOST_MEMORY_ENV}={os.environ[HOST_MEMORY_ENV]!r}: expected bytes, or a number "
                              "with K, M, G or T (e.g. 120G).") from None
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_memory_budget(device: torch.device, fraction: float | None) -> int:
    """Bytes the KV pool may take: on CUDA, ``fraction`` of the card minus what is already in
    use (weights); on CPU, ``fraction`` of available host memory (weights already loaded)."""
    if device.type == "cuda":
        # Memory torch's caching allocator holds but no tensor uses (the load's temporaries, an
        # earlier engine's pool) counts as used in mem_get_info: hand it back first.
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return int(total * (fraction or 0.85) - (total - free))
    return int(available_host_memory() * (fraction or 0.10))


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls in hardware (AVX512-BF16 or AMX); elsewhere torch
    emulates bf16, several times slower than float32."""
    cpu = torch.cpu
    return bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
                or getattr(cpu, "_is_amx_tile_supported", lambda: False)())


def cpu_description() -> str:
    """``cpu: <model> | flags: <the SIMD flags speed depends on> | cores: N``, for benchmark
    headers: every CPU figure depends on them."""
    model, flags = platform.processor() or "?", []
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name") and model in ("?", "", platform.processor()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = [x for x in line.split(":", 1)[1].split()
                         if x in ("avx", "avx2", "fma", "f16c") or x.startswith(("avx512", "amx"))]
                break
    return f"cpu: {model} | flags: {' '.join(flags) or 'no avx'} | cores: {os.cpu_count()}"


def resolve_dtype(name: str, device: torch.device) -> tuple[str, str]:
    """``(dtype name, why)`` for ``--dtype`` (weights, activations and KV): ``auto`` is bf16 on
    CUDA with bf16 support, else fp16 there, and float32 on a CPU -- where decode, bound by
    weight bytes, reads exact 4/8-bit blocks through the native kernels, which take float32
    activations (a CPU with native bf16 prefills from a bf16 copy instead:
    :func:`resolve_prefill_weights`). An explicit name is kept."""
    if name != "auto":
        return name, "requested"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bfloat16", "CUDA device with bf16 support"
        return "float16", "CUDA device without bf16 support"
    caps = torch.backends.cpu.get_cpu_capability()
    if cpu_has_native_bf16():
        return "float32", f"CPU ({caps}, native bf16): decode from float32 and exact blocks"
    return "float32", f"CPU without native bf16 ({caps}; bf16 would be emulated, several times slower)"


def resolve_prefill_weights(name: str, dtype_requested: str, dtype: str, device: torch.device) -> tuple[str, str]:
    """``(what prefill passes read, why)`` for ``--prefill-weight-dtype``: ``auto`` is a bf16
    copy when ``--dtype auto`` chose float32 on a CPU that multiplies bf16 natively (prefill is
    compute-bound, and there bf16 GEMMs are ~1.5x faster), else the loaded weights ("same"). An
    explicit dtype equal to the model's is "same"."""
    if name == "auto":
        if dtype_requested == "auto" and dtype == "float32" and device.type == "cpu" and cpu_has_native_bf16():
            return "bfloat16", "CPU with native bf16 (AVX512-BF16 or AMX)"
        return "same", "the loaded weights"
    return ("same" if name == dtype else name), "requested"


def _native_kernels_missing(dtype_requested: str, dtype: str, device: torch.device) -> str | None:
    """None when ``--dtype auto`` chose float32 on a CPU where the native kernels run (the
    ``auto`` choices that need them apply), else why not."""
    if not (dtype_requested == "auto" and dtype == "float32" and device.type == "cpu"):
        return "exact" if dtype_requested != "auto" else f"{dtype} weights"
    from .kernels import unavailable_reason  # no build: a reason, or None

    reason = unavailable_reason()
    return None if reason is None else f"no native kernels: {reason}"


def resolve_decode_activations(name: str, dtype_requested: str, dtype: str, device: torch.device) -> tuple[str, str]:
    """``(what decode passes multiply GGUF blocks with, why)`` for ``--decode-activations``:
    ``auto`` is int8 (the inputs quantized per 32, as llama.cpp does: lossy, and 1.1-1.9x faster
    GEMVs on AVX2 and AVX-512 alike, ``kernels/gguf_int8.cpp``) when ``--dtype auto`` chose
    float32 on a CPU with the native kernels, else float32 (exact)."""
    if name != "auto":
        return name, "requested"
    why_not = _native_kernels_missing(dtype_requested, dtype, device)
    if why_not is None:
        return "int8", "native kernels (GGUF blocks x 8-bit inputs, as llama.cpp)"
    return "float32", why_not


def resolve_kv_cache_dtype(name: str, dtype_requested: str, dtype: str, device: torch.device) -> tuple[str, str]:
    """``(what the KV cache stores, why)`` for ``--kv-cache-dtype``: ``auto`` is float16 when
    ``--dtype auto`` chose float32 on a CPU with the native kernels (decode attention, bound by
    reading KV, reads float16 rows and widens them exactly: ``kernels/decode_attention.cpp``), else
    the model's dtype. Attention computes in the model's dtype either way."""
    if name != "auto":
        return name, "requested"
    why_not = _native_kernels_missing(dtype_requested, dtype, device)
    if why_not is None:
        return "float16", "native decode attention reads float16 KV (half the bytes)"
    return dtype, f"the model's dtype ({why_not})"


def choose_precision(cfg: EngineConfig, device: torch.device) -> EngineConfig:
    """``cfg`` with ``--dtype``, ``--kv-cache-dtype``, ``--prefill-weight-dtype`` and
    ``--decode-activations`` resolved (:func:`resolve_dtype`, :func:`resolve_kv_cache_dtype`,
    :func:`resolve_prefill_weights`, :func:`resolve_decode_activations`); one log line when any
    was ``auto``."""
    chosen, why = resolve_dtype(cfg.dtype, device)
    kv, kv_why = resolve_kv_cache_dtype(cfg.kv_cache_dtype, cfg.dtype, chosen, device)
    prefill, prefill_why = resolve_prefill_weights(cfg.prefill_weight_dtype, cfg.dtype, chosen, device)
    if cfg.enable_deterministic_inference and cfg.prefill_weight_dtype == "auto":
        prefill, prefill_why = "same", "deterministic inference: one path for every pass"
    activations, act_why = resolve_decode_activations(cfg.decode_activations, cfg.dtype, chosen, device)
    if "auto" in (cfg.dtype, cfg.kv_cache_dtype, cfg.prefill_weight_dtype, cfg.decode_activations):
        logger.info("precision: dtype %s -> %s (%s); KV cache %s -> %s (%s); prefill weights %s -> %s (%s); "
                    "decode activations %s -> %s (%s)", cfg.dtype, chosen, why, cfg.kv_cache_dtype, kv, kv_why,
                    cfg.prefill_weight_dtype, prefill, prefill_why, cfg.decode_activations, activations, act_why)
    return dataclasses.replace(cfg, dtype=chosen, kv_cache_dtype=kv, prefill_weight_dtype=prefill,
                               decode_activations=activations)
