"""The model-file fuzz campaign (issue 56, S6): from a seed, hostile variants of the tiny model of
:mod:`hostile_models` -- GGUF metadata set to extremes of every type, header bytes
overwritten, tensor entries bent, files cut short, hostile chat templates, config.json values of
every JSON type (``Infinity`` and ``NaN`` included), checkpoints with other shapes or broken headers
-- each loaded in this process as ``hicache`` would load it. Every load must end, within
:data:`CASE_SECONDS`, either in a model that renders a chat and computes finite logits (or has
weights past :data:`ABSURD_WEIGHT`: finite, so loaded, and free to overflow), or in one
:class:`~hicache.errors.HicacheError` of one sentence (the CLI's single ``error:`` line); never
another exception (a traceback). :func:`run_campaign` prints what it tried and what came of it.
"""

from __future__ import annotations

import random
import resource
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hostile_models import (ARRAY, BOOL, CHATML, DOUBLING, F32, F64, HF_CONFIG, I32, I64, NESTED_RANGES,
                            STRING, U8, U32, U64, GGUFDoc, Raw, hf_tensors, tiny_gguf, write_hf_dir)

CASE_SECONDS = 10.0  # one load, chat render and forward pass (the tiny model takes ~0.1 s)
# A weight beyond this may overflow float32 activations however the file is read (1e18 * 1e18 in a
# norm): such a file loads (its values are finite) and its logits need not be.
ABSURD_WEIGHT = 1e4
KINDS = ("gguf field", "gguf header bytes", "gguf tensor", "gguf cut", "chat template", "hf config", "hf tensors")
GGUF_KEYS = ("general.alignment", "general.architecture", "llama.block_count", "llama.embedding_length",
             "llama.attention.head_count", "llama.attention.head_count_kv", "llama.feed_forward_length",
             "llama.context_length", "llama.vocab_size", "llama.rope.freq_base", "llama.rope.dimension_count",
             "llama.attention.layer_norm_rms_epsilon", "llama.rope.scaling.type", "llama.rope.scaling.factor",
             "llama.attention.key_length", "llama.expert_count", "tokenizer.ggml.model", "tokenizer.ggml.pre",
             "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
             "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token",
             "tokenizer.chat_template", "general.name")
INF, NAN = float("inf"), float("nan")
GGUF_VALUES: list[tuple[int, Any]] = [
    (U32, 0), (U32, 1), (U32, 7), (U32, 2**32 - 1), (U32, 10**9), (I32, -1), (U64, 2**63), (I64, -2**63),
    (F32, INF), (F32, NAN), (F32, 0.0), (F32, -1.0), (F64, 1e308), (BOOL, True), (STRING, ""), (STRING, "llama"),
    (STRING, "x" * (1 << 20)), (STRING, "yarn"), (ARRAY, (U8, [])), (ARRAY, (STRING, ["a"] * 1000)),
    (ARRAY, (I32, [-1] * 10)), (ARRAY, (ARRAY, [(U8, [1])])), (ARRAY, Raw(struct.pack("<IQ", STRING, 2**40))),
    (ARRAY, (STRING, ["a b", "ab", "\u0100" * 3000])), (ARRAY, (F32, [NAN] * 259)), (ARRAY, (U32, [10**9] * 259))]
JSON_VALUES: list[Any] = [None, True, -1, 0, 1, 64.5, "64", 2**31, 2**63, 10**400, 1e308, INF, -INF, NAN, "",
                          "x" * (1 << 20), [], [None], {}, [1.0, INF], {"rope_type": "yarn", "factor": INF},
                          {"rope_type": "llama3", "factor": NAN}, {"rope_type": "linear", "factor": -2.0},
                          ["full_attention"] * 3, ["LlamaForCausalLM"] * 2, ["x" * 5000], 10**9]
TEMPLATES = (NESTED_RANGES, DOUBLING, "{% for %}", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
             "{{ '%0999999999d' % 1 }}", "{{ raise_exception('no') }}", "{% if 1 %}" * 3000, "x" * (300 << 10),
             "{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(64) }}",
             "{{ messages[0]['content'].replace('', messages[0]['content'] * 1000) }}", CHATML)


@dataclass
class Campaign:
    """What a campaign tried and saw: kinds tried, outcomes ("loaded", "refused", or what went
    wrong), the slowest case in seconds, and each failure (kind, what, the exception or delay)."""

    tried: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    slowest_s: float = 0.0
    failures: list[str] = field(default_factory=list)


class ModelFileFuzzer:
    """Seeded hostile model files: ``next(folder)`` writes one under ``folder`` and returns
    ``(kind, what it changed, the path to load)``."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self._n = 0

    def next(self, folder: Path) -> tuple[str, str, Path]:
        self._n += 1
        kind = self.rng.choice(KINDS)
        if kind.startswith("hf"):
            path = folder / f"case{self._n}"
            return kind, (self._hf_config if kind == "hf config" else self._hf_tensors)(path), path
        path = folder / f"case{self._n}.gguf"
        doc = tiny_gguf(self._n % 3)
        what = {"gguf field": self._gguf_field, "gguf tensor": self._gguf_tensor, "chat template": self._template,
                "gguf header bytes": lambda d: "", "gguf cut": lambda d: ""}[kind](doc)
        data = doc.to_bytes()
        if kind == "gguf header bytes":
            what, data = self._overwrite(data, len(data) - sum(len(t[3]) for t in doc.tensors))
        elif kind == "gguf cut":
            at = self.rng.randrange(len(data))
            what, data = f"cut at byte {at} of {len(data)}", data[:at]
        path.write_bytes(data)
        return kind, what, path

    def _gguf_field(self, doc: GGUFDoc) -> str:
        changes = []
        for _ in range(self.rng.choice((1, 1, 2, 3))):
            key, (kind, value) = self.rng.choice(GGUF_KEYS), self.rng.choice(GGUF_VALUES)
            doc.set(key, kind, value)
            changes.append(f"{key} = {_short(value)}")
        return ", ".join(changes)

    def _gguf_tensor(self, doc: GGUFDoc) -> str:
        rng, i = self.rng, self.rng.randrange(len(doc.tensors))
        name, dims, kind, data = doc.tensors[i]
        choice = rng.randrange(7)
        if choice == 0:
            dims = tuple(rng.choice((0, 1, 2, 2**40, d * 2, d // 2 or 1)) if rng.random() < 0.5 else d for d in dims)
        elif choice == 1:
            kind = rng.choice((1, 2, 8, 12, 14, 30, 39, 99, 2**31))
        elif choice == 2:
            name = rng.choice(("blk.7.attn_q.weight", "blk.-1.ffn_up.weight", "x" * 2000, doc.tensors[0][0],
                               "blk.0.attn_qkv.weight", "rope_freqs.weight", "output.weight"))
        elif choice == 3:
            del doc.tensors[i]
            return f"dropped {name}"
        elif choice == 4:
            dims = (*dims, rng.choice((1, 3)))[:rng.choice((1, 4, 5))] or (1,)
        else:
            offsets = doc.packed_offsets()
            offsets[i] = rng.choice((offsets[i] + 1, offsets[i] + 32, 2**62, offsets[i - 1], 0))
            doc.offsets = offsets
            return f"{name} at offset {offsets[i]}"
        doc.tensors[i] = (name, dims, kind, data)
        return f"tensor {i} -> {_short(name)} {dims} type {kind}"

    def _template(self, doc: GGUFDoc) -> str:
        template = self.rng.choice(TEMPLATES)
        doc.set("tokenizer.chat_template", STRING, template)
        return f"template {_short(template)}"

    def _overwrite(self, data: bytes, header: int) -> tuple[str, bytes]:
        at = self.rng.randrange(header)
        value = self.rng.choice((b"\xff" * 8, b"\x00" * 8, struct.pack("<Q", 2**63), struct.pack("<I", 9),
                                 struct.pack("<Q", 1 << 32), bytes([self.rng.randrange(256)])))
        return f"bytes {value.hex()} at {at} of a {header}-byte header", data[:at] + value + data[at + len(value):]

    def _hf_config(self, folder: Path) -> str:
        rng, config = self.rng, dict(HF_CONFIG)
        if rng.random() < 0.15:
            text = rng.choice(("[]", "nul", "[" * 100_000 + "]" * 100_000, '{"a": 1', "\"\\ud800\""))
            write_hf_dir(folder, config_text=text)
            return f"config.json = {_short(text)}"
        changes = []
        for _ in range(rng.choice((1, 1, 2))):
            key = rng.choice((*HF_CONFIG, "head_dim", "rope_scaling", "rope_parameters", "layer_types",
                              "sliding_window", "query_pre_attn_scalar", "bos_token_id", "eos_token_id",
                              "time_step_limit", "attention_bias", "use_sliding_window"))
            config[key] = rng.choice(JSON_VALUES)
            changes.append(f"{key} = {_short(config[key])}")
        if rng.random() < 0.2:
            key = rng.choice(tuple(HF_CONFIG))
            del config[key]
            changes.append(f"no {key}")
        write_hf_dir(folder, config=config, tensors=hf_tensors(config) if _sizes_kept(config) else {})
        return ", ".join(changes)

    def _hf_tensors(self, folder: Path) -> str:
        rng, tensors = self.rng, hf_tensors()
        name = rng.choice(sorted(tensors))
        choice = rng.randrange(4)
        if choice == 0:
            del tensors[name]
        elif choice == 1:
            tensors[name] = tensors[name].T.copy() if tensors[name].ndim == 2 else tensors[name][:-1].copy()
        elif choice == 2:
            tensors["model.layers.2.input_layernorm.weight"] = tensors["model.norm.weight"]
        write_hf_dir(folder, tensors=tensors)
        if choice == 3:  # the safetensors header itself
            path = folder / "model.safetensors"
            data = path.read_bytes()
            what, data = self._overwrite(data, 8 + struct.unpack("<Q", data[:8])[0])
            path.write_bytes(data)
            return what
        return f"{['dropped', 'reshaped', 'a third layer in', ''][choice]} {name}"


def _sizes_kept(config: dict[str, Any]) -> bool:
    """Whether hf_tensors can still make tensors for ``config`` (else the checkpoint is left empty)."""
    return all(type(config.get(k)) is int and 0 < config[k] < 512
               for k in ("hidden_size", "vocab_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"))


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, Raw) else f"raw {value.data[:16].hex()}"
    return text if len(text) <= 60 else f"{text[:50]}... ({len(text)} chars)"


def one_sentence(message: str) -> bool:
    """What the CLI prints after ``error:``: one line ending in a period, values cut (at most 1,000 characters)."""
    return message.endswith(".") and "\n" not in message and len(message) <= 1000


def try_load(path: Path) -> str:
    """Load ``path`` as ``hicache`` would, render a chat and compute logits: "loaded" (finite
    logits), "refused" (one HicacheError sentence); anything else raises AssertionError naming it."""
    import torch
    from dense_forward import prefill_logits

    from hicache.errors import HicacheError
    from hicache.model import load_model
    from hicache.model.chat_render import render_limit_chars

    try:
        loaded = load_model(str(path), dtype=torch.float32)
        tokenizer = loaded.tokenizer.with_render_limit(render_limit_chars(loaded.spec.max_position_embeddings))
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        except HicacheError as e:  # a model may load and refuse chats (a template that does not compile)
            assert one_sentence(str(e)), f"a chat refusal of more than one sentence: {str(e)[:300]!r}"
        logits = prefill_logits(loaded.model, [1, 2, 3])
    except HicacheError as e:
        assert one_sentence(str(e)), f"a refusal of more than one sentence: {str(e)[:300]!r}"
        return "refused"
    if bool(torch.isfinite(logits).all()):
        return "loaded"
    largest = max(float(p.abs().max()) for p in loaded.model.parameters())
    assert largest > ABSURD_WEIGHT, f"loaded, and its logits are not finite (largest weight {largest:g})"
    return "loaded, absurd weights"  # finite, but past what float32 activations hold (a type read wrongly)


def run_campaign(seconds: float, seed: int, folder: Path, log: Callable[[str], None] = print) -> Campaign:
    """Fuzz for ``seconds`` from ``seed``, writing files under ``folder`` (each removed after its
    case); prints (``log``) the summary line and returns what was seen."""
    import shutil

    import hicache.model  # noqa: F401 (imported before the baseline: torch's own memory is not the campaign's)

    fuzzer, seen = ModelFileFuzzer(seed), Campaign()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
    start = time.monotonic()
    while time.monotonic() < start + seconds:
        kind, what, path = fuzzer.next(folder)
        seen.tried[kind] = seen.tried.get(kind, 0) + 1
        t0 = time.monotonic()
        try:
            outcome = try_load(path)
        except AssertionError as e:
            outcome = "wrong"
            seen.failures.append(f"{kind} ({what}): {e}")
        except Exception as e:  # what the user would see as a traceback
            outcome = f"traceback {type(e).__name__}"
            seen.failures.append(f"{kind} ({what}): {type(e).__name__}: {str(e)[:300]}")
        took = time.monotonic() - t0
        if took > CASE_SECONDS:
            seen.failures.append(f"{kind} ({what}): took {took:.1f} s")
        seen.slowest_s = max(seen.slowest_s, took)
        seen.outcomes[outcome] = seen.outcomes.get(outcome, 0) + 1
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
    log(f"model-file fuzz: {time.monotonic() - start:.0f} s, seed {seed}: tried {dict(sorted(seen.tried.items()))}; "
        f"outcomes {dict(sorted(seen.outcomes.items()))}; slowest {seen.slowest_s:.2f} s; peak RSS {rss_before} -> "
        f"{rss_after} MiB; {len(seen.failures)} failures")
    return seen
