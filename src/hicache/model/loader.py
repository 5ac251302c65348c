"""``load_model(name)``: the one entry point from a user's model name to a runnable model."""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any
from dataclasses import dataclass
from pathlib import Path

import torch

from hicache.config import PassPrecision
from hicache.kernels import unavailable_reason
from hicache.model.attention import NATIVE_HEAD_DIMS
from hicache.model.errors import ModelNotFoundError
from hicache.model.gguf_loader import is_gguf_file, load_gguf
from hicache.model.hf_loader import load_hf_dir
from hicache.model.llama import LlamaForCausalLM
from hicache.model.packaged import PACKAGED, packaged_model_path
from hicache.model.projection import DECODE_ACTIVATIONS, DECODE_WEIGHTS, PREFILL_WEIGHTS, dense_rows_invariant
from hicache.model.random_model import init_random_weights, parse_random_spec
from hicache.model.requantize import VARIANT, parse_variant, requantize_
from hicache.model.spec import ModelSpec, ModelSpecError
from hicache.model.tokenizer import Tokenizer, byte_tokenizer

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class LoadedModel:
    """A model ready to run. ``identity`` names weights + dtype stably across processes; the
    cache uses it to namespace KV keys, so two models never share cached K/V."""

    model: LlamaForCausalLM | None  # None when loaded without weights (a multi-rank frontend)
    tokenizer: Tokenizer
    spec: ModelSpec
    name: str
    identity: str


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _file_fingerprint(paths: list[Path]) -> str:
    """Cheap stand-in for a content hash: path, size and mtime of each file."""
    stats = [(p.resolve(), p.stat()) for p in sorted(paths)]
    return _digest("|".join(f"{p}:{st.st_size}:{st.st_mtime_ns}" for p, st in stats))


def load_model(name: str, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu", seed: int = 0,
               weights: bool = True, precision: PassPrecision = PassPrecision(),
               to_be_sharded: bool = False) -> LoadedModel:
    """Load ``name``: ``"smollm2"`` (the embedded GGUF) or ``"gemma3-270m"`` (packaged: model/packaged.py),
    a GGUF file, a local HF directory, or
    ``"random:<preset|JSON>"``; any of them followed by ``:int<bits>-g<group>`` (e.g.
    ``"smollm2:int4-g64"``) is a requantized copy (:mod:`~hicache.model.requantize`).

    ``seed`` only matters for random models. ``weights=False`` reads only the shape, the
    tokenizer and the identity (``model`` is None): what a process that only tokenizes needs.
    ``precision`` (:class:`~hicache.config.PassPrecision`): ``decode_weights``, what decode steps read (see :meth:`LlamaForCausalLM.set_weights`);
    a lossy dtype copy changes the KV they write, so it is part of the identity (exact blocks
    are the same weights and are not). ``prefill_weights``: what larger passes read ("same", or a
    dtype copy: lossy, so named in the identity too). ``decode_activations``: "int8" has decode
    passes multiply a GGUF file's blocks with 8-bit inputs (lossy: named in the identity of a
    GGUF model whose decode weights are "auto", on every parallel layout alike, so that engines
    that share KV by configuration keep sharing it). ``to_be_sharded``: :func:`~hicache.model.parallel.shard_model`
    follows, which fuses and packs the rank's slices; nothing is packed here for the whole model.
    ``deterministic``: every pass on one row-invariant path (:meth:`LlamaForCausalLM.set_deterministic`;
    other KV bits than the default paths, so named in the identity). Raises :class:`ModelNotFoundError` (a ConfigError) for names that resolve to nothing.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ModelSpecError(f"model dtype {dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16.")
    if dtype == torch.float16 and torch.device(device).type != "cuda":
        raise ModelSpecError("float16 runs ~100x slower than float32 on a CPU; use --dtype auto or float32 there.")
    for phase, allowed in (("decode_weights", DECODE_WEIGHTS), ("decode_activations", DECODE_ACTIVATIONS),
                           ("prefill_weights", PREFILL_WEIGHTS)):
        if getattr(precision, phase) not in allowed:
            raise ModelSpecError(f"{phase.replace('_', ' ')} {getattr(precision, phase)!r}: "
                                 f"expected one of {', '.join(allowed)}.")
    if torch.device(device).type != "cpu" and weights:  # every native kernel call is gated on a CPU tensor
        logger.info("native CPU kernels off (the model runs on %s): nothing built", torch.device(device).type)
    base, _, variant = name.rpartition(":")  # "smollm2:int4-g64": a requantized copy of "smollm2"
    base, variant = (base, variant) if base and VARIANT.match(variant) else (name, None)
    if variant is not None:
        try:
            bits, group = parse_variant(variant)
        except ValueError as e:
            raise ModelNotFoundError(f"unknown model {name!r}: {e}.") from None
    model, tokenizer, spec, identity = _load_base(name, base, dtype, device, weights, seed)
    if variant is not None:  # a requantized copy (e.g. the speculative draft): other weights, other KV
        if model is not None:
            requantize_(model, bits, group)
        identity += f":requant-{variant}"
    reads_file_blocks = identity.startswith("gguf:") and variant is None  # decode may multiply the file's blocks
    identity += _weight_copies(model, dtype, precision, to_be_sharded, reads_file_blocks)
    if precision.deterministic:
        _check_deterministic(spec, dtype, device, precision)
        if model is not None:
            model.set_deterministic(True)
        identity += ":deterministic"
    return LoadedModel(model, tokenizer, spec, name, identity)


def _load_base(name: str, base: str, dtype: torch.dtype, device: torch.device | str, weights: bool,
               seed: int) -> tuple[LlamaForCausalLM | None, Any, Any, str]:
    """``(model or None, tokenizer, spec, identity)`` of ``base`` (``name`` without its variant)."""
    dtype_name = str(dtype).removeprefix("torch.")
    if base in PACKAGED or base.endswith(".gguf") or is_gguf_file(Path(base).expanduser()):
        path = packaged_model_path(base) if base in PACKAGED else Path(base).expanduser()
        if not path.is_file():
            raise ModelNotFoundError(f"unknown model {name!r}: no GGUF file at {path}.")
        model, tokenizer, spec = load_gguf(path, dtype, device, weights)
        identity = f"gguf:{path.name}:{_file_fingerprint([path])}:{dtype_name}"
    elif base.startswith("random:"):
        spec = parse_random_spec(base.removeprefix("random:"))
        model = init_random_weights(LlamaForCausalLM(spec, dtype, device), seed) if weights else None
        tokenizer = byte_tokenizer()
        identity = f"random:{_digest(json.dumps(spec.to_dict(), sort_keys=True))}:seed={seed}:{dtype_name}"
        if torch.device(device).type != "cpu":  # drawn there: other values than the CPU's (init_random_weights)
            identity += f":drawn-on-{_generator_grid(torch.device(device))}"
    elif Path(base).expanduser().exists() or "/" in base or base.startswith("."):
        folder = Path(base).expanduser()
        model, tokenizer, spec = load_hf_dir(folder, dtype, device, weights)
        files = [p for p in folder.iterdir() if p.suffix in (".json", ".safetensors")]
        identity = f"hf:{folder.resolve().name}:{_file_fingerprint(files)}:{dtype_name}"
    else:
        raise ModelNotFoundError(f"unknown model {name!r}: expected {' or '.join(map(repr, PACKAGED))} (packaged), a "
                                 "GGUF file, a local Hugging Face directory or 'random:<preset or JSON>', optionally "
                                 "followed by ':int4-g64' (a requantized copy).")
    return model, tokenizer, spec, identity


def _generator_grid(device: torch.device) -> str:
    """What a device's random draws depend on besides the seed: a GPU's ``randn`` spreads a tensor
    over a grid sized by its multiprocessors (other GPUs, other values)."""
    if device.type != "cuda":
        return device.type
    props = torch.cuda.get_device_properties(device)
    return f"cuda-sm{props.multi_processor_count}x{getattr(props, 'max_threads_per_multi_processor', 0)}"


def _check_deterministic(spec: ModelSpec, dtype: torch.dtype, device: torch.device | str,
                         precision: PassPrecision) -> None:
    """Refuse (one sentence each) what deterministic inference does not cover."""
    why = None
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        why = "it runs on a CPU in float32 only (--dtype float32 or auto)"
    elif unavailable_reason() is not None:
        why = f"it needs the native CPU kernels ({unavailable_reason()})"
    elif spec.is_mla or spec.head_dim not in NATIVE_HEAD_DIMS:
        why = (f"the native decode attention takes GQA heads of {', '.join(map(str, NATIVE_HEAD_DIMS))} dimensions; "
               f"this model's {'are MLA latents' if spec.is_mla else f'are {spec.head_dim}'}")
    elif precision.prefill_weights != "same" or precision.decode_weights not in ("auto", "same"):
        why = "every pass reads one copy of the weights (--prefill-weight-dtype same, --decode-weight-dtype auto)"
    elif not dense_rows_invariant():
        why = "this CPU's BLAS gives a row other bits depending on how many rows share the GEMM"
    if why:
        raise ModelSpecError(f"--enable-deterministic-inference: {why}.")


def _weight_copies(model: LlamaForCausalLM | None, dtype: torch.dtype, precision: PassPrecision, to_be_sharded: bool,
                   file_blocks: bool) -> str:
    """Set what decode and prefill passes read; returns the identity suffix naming the lossy
    copies (a dtype copy changes the KV its passes write; exact blocks do not) and 8-bit decode
    inputs (``decode_activations``; only where ``file_blocks``: the model has a file's blocks for
    them to meet)."""
    decode_activations = precision.decode_activations if file_blocks else "float32"
    # v2: Q4_0/Q4_1/Q8_0 rows packed 16 at a time (kernels/gguf_x16.cpp)
    suffix = ":decode-int8v2" if decode_activations == "int8" and precision.decode_weights == "auto" else ""
    for phase, mode, lossless in (("decode", precision.decode_weights, ("auto", "same")),
                                  ("prefill", precision.prefill_weights, ("same",))):
        if mode not in lossless and getattr(torch, mode) != dtype:
            suffix += f":{phase}-{mode}"
    if model is not None:  # fuses and packs now (before the pool is sized), or in shard_model for a rank's slices
        model.set_weights(prepare=not to_be_sharded, decode_weights=precision.decode_weights,
                          decode_activations=decode_activations, prefill_weights=precision.prefill_weights)
    return suffix
