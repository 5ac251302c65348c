"""Shape of a Llama-family decoder, independent of where its weights come from."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from hicache.config import ConfigError
from hicache.model.errors import quoted


class ModelSpecError(ConfigError):
    """A model shape that cannot be built (inconsistent sizes, unsupported RoPE scaling)."""


# RoPE scaling kinds the model implements; "default" means none. "freq_factors": each rotary pair's
# frequency divided by its own factor (``rope_scaling["factors"]``, rope_dim / 2 of them): what a GGUF
# file's ``rope_freqs`` tensor holds for Llama 3.1+ (llama.cpp's converter computes them from the
# llama3 parameters).
# "yarn": YaRN (Qwen2.5 / Qwen3 long context): each pair's frequency blended between kept and divided by
# ``factor`` by its wavelength against ``original_max_position_embeddings``, cos/sin scaled by an attention factor.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "yarn")
ACTIVATIONS = ("silu", "gelu_tanh")  # the MLP's gate activation (SwiGLU; GeGLU with GELU's tanh form)


class LayerKind(str, Enum):
    """A layer attends every earlier position, or the last ``sliding_window``, or is a recurrent mixer
    that keeps a fixed-size state per sequence instead of KV (``conv``: LFM2's short convolution;
    ``gdn``: Qwen3.5's gated DeltaNet; ``mamba2``: Granite 4.0-H's Mamba2 mixer). A ``str``: equal
    to its value, printed and JSON-encoded as it (a spec's JSON and the random models' identities stay)."""

    FULL = "full"
    SLIDING = "sliding"
    CONV = "conv"
    GDN = "gdn"
    MAMBA2 = "mamba2"
    __str__ = str.__str__


SCAN_CHUNK = 64  # tokens a chunked scan (gated DeltaNet, Mamba2's SSD) treats as one block, on a grid from position 0
RECURRENT_KINDS = frozenset({LayerKind.CONV, LayerKind.GDN, LayerKind.MAMBA2})  # the kinds that keep a state, not KV
SCANNED_KINDS = frozenset({LayerKind.GDN, LayerKind.MAMBA2})  # recurrent kinds whose prefill scans chunks of SCAN_CHUNK


@dataclass
class ModelSpec:
    """Sizes of a Llama / Qwen2 / Mistral-style decoder.

    ``head_dim`` need not equal ``hidden_size // num_heads`` (q/o projections are
    ``num_heads * head_dim`` wide). ``num_heads`` must be a multiple of ``num_kv_heads`` (GQA).
    ``rope_scaling``: ``None`` or an HF-style dict with ``rope_type`` in :data:`SUPPORTED_ROPE_TYPES`.

    ``qk_norm``: q and k are RMS-normalized per head (weights ``[head_dim]``, shared by the heads)
    after their projection and before RoPE (Qwen3, Gemma 3).

    Gemma-style layers: ``hidden_act`` "gelu_tanh" (GeGLU); ``sandwich_norms``: four norms a layer,
    the attention's and the MLP's outputs normalized too before their residual add;
    ``embedding_scale``: embeddings multiplied by it (Gemma: sqrt(hidden), rounded to the weight
    dtype); ``attention_scale``: q.k multiplied by it instead of ``head_dim ** -0.5`` (Gemma:
    ``query_pre_attn_scalar ** -0.5``).

    Sliding-window attention: ``layer_kinds[i]`` "sliding" layers attend only the last
    ``sliding_window`` positions, their own included (query position p sees keys p - window + 1 .. p);
    every layer keeps all its KV in the pages (the window is a mask). ``local_rope_theta``: those
    layers' RoPE base, without scaling (Gemma 3: 10K); None: the model's own. ``layer_kinds`` empty:
    every layer full.

    Recurrent layers (``layer_kinds[i]`` "conv", LFM2): no KV; a state per sequence instead
    (:meth:`state_shapes`). ``conv_kernel``: taps of the short convolution (LFM2's ``conv_L_cache``;
    the state keeps the last ``conv_kernel - 1`` inputs per channel); ``conv_bias``: the conv layer's
    projections and taps have biases. The KV buffers hold the attention layers only, in order
    (:attr:`attention_layers`: a layer's *compact* index), the state buffers the recurrent ones
    (:attr:`recurrent_layers`).

    Gated DeltaNet layers (``layer_kinds[i]`` "gdn", Qwen3.5): ``gdn_key_heads`` key heads of
    ``gdn_key_dim`` (queries alike), ``gdn_value_heads`` value heads of ``gdn_value_dim`` (a multiple
    of the key heads: value head h reads key head ``h // (value heads / key heads)``), a depthwise
    conv of ``conv_kernel`` taps over the q|k|v channels. Its attention layers (Qwen3.5) have
    ``attn_output_gate``: q_proj emits each head's query then its gate, and the attention output is
    multiplied by ``sigmoid(gate)`` before o_proj. ``rotary_dim``: RoPE turns only the first
    ``rotary_dim`` dims of each q/k head (partial rotary); 0: all ``head_dim`` of them.

    Mamba2 layers (``layer_kinds[i]`` "mamba2", Granite 4.0-H): ``mamba_heads`` heads of
    ``mamba_head_dim`` channels (d_inner = their product), ``mamba_groups`` groups of B and C of
    ``mamba_state`` (N) each (head h reads group ``h // (heads / groups)``), a depthwise conv of
    ``conv_kernel`` taps over the x|B|C channels (its taps with a bias where ``conv_bias``), ``in_proj``
    and ``out_proj`` with biases where ``mamba_proj_bias``. The time step ``softplus(dt + dt_bias)``
    is clamped to ``[dt_min, dt_max]`` (``dt_max`` None: no upper bound, Granite's infinite
    ``time_step_limit``). Granite's multipliers: ``residual_scale``, each layer's mixer and MLP
    outputs multiplied by it before their residual add; ``logits_scale``, the logits DIVIDED by it;
    ``nope``: the attention layers have no positional embedding (no RoPE: Granite 4.0-H's "nope").

    MLA (DeepSeek-V2/V3 attention, ``kv_lora_rank > 0``): each token keeps one latent per layer,
    ``kv_lora_rank`` compressed KV + ``qk_rope_head_dim`` rotary key, stored in the KV pools as
    one "KV head" whose two halves sit in the K and V buffers (``num_kv_heads`` 1, ``head_dim`` =
    half the latent: set here), so pools, tiers, copies and storage move it unchanged.
    ``q_lora_rank`` 0: one q_proj; else q_a_proj -> norm -> q_b_proj. ``rope_interleave``: rotary
    pairs are adjacent dims (DeepSeek-V3), not halves.
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool = False
    rope_scaling: dict | None = None
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3), one weight per head dim
    hidden_act: str = "silu"
    sandwich_norms: bool = False
    embedding_scale: float = 1.0
    attention_scale: float | None = None
    sliding_window: int = 0
    layer_kinds: tuple[LayerKind, ...] = ()
    local_rope_theta: float | None = None
    conv_kernel: int = 0
    conv_bias: bool = False
    gdn_key_heads: int = 0
    gdn_value_heads: int = 0
    gdn_key_dim: int = 0
    gdn_value_dim: int = 0
    attn_output_gate: bool = False
    rotary_dim: int = 0
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 0
    mamba_state: int = 0
    mamba_proj_bias: bool = False
    dt_min: float = 0.0
    dt_max: float | None = None
    residual_scale: float = 1.0
    logits_scale: float = 1.0
    nope: bool = False

    def __post_init__(self) -> None:
        if self.kv_lora_rank:
            self.num_kv_heads = 1
            self.head_dim = (self.kv_lora_rank + self.qk_rope_head_dim) // 2
        self.validate()
        self.layer_kinds = tuple(map(LayerKind, self.layer_kinds))  # (valid; a JSON round trip gives strings)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def layer_window(self, layer: int) -> int:
        """Positions layer ``layer`` attends, its own included; 0: all of them (a full layer)."""
        return self.sliding_window if self.layer_kinds and self.layer_kinds[layer] == LayerKind.SLIDING else 0

    @property
    def has_sliding_layers(self) -> bool:
        return LayerKind.SLIDING in self.layer_kinds

    def is_recurrent(self, layer: int) -> bool:
        """Whether layer ``layer`` keeps a state per sequence instead of KV."""
        return bool(self.layer_kinds) and self.layer_kinds[layer] in RECURRENT_KINDS

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Global indices of the layers with KV (full or sliding), in order: a KV buffer's index is
        a layer's place in this tuple."""
        return tuple(i for i in range(self.num_layers) if not self.is_recurrent(i))

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """Global indices of the recurrent layers, in order: a state buffer's index is a layer's place here."""
        return tuple(i for i in range(self.num_layers) if self.is_recurrent(i))

    @property
    def scan_chunk(self) -> int:
        """Tokens a recurrent layer's prefill scans as one block, on a grid from position 0 (1: no
        blocks, LFM2's short convolution); a state snapshot for a prefix hit sits on this grid, so the
        hit's scan starts where the cold run's block did."""
        return SCAN_CHUNK if SCANNED_KINDS & set(self.layer_kinds) else 1

    def state_shapes(self, layer: int) -> tuple[tuple[int, ...], ...]:
        """The shape of each state tensor one sequence (one slot) of recurrent layer ``layer`` keeps,
        the conv's first (channels, the last ``conv_kernel - 1`` inputs in time order): LFM2's
        ``(hidden_size, K - 1)``; a gated DeltaNet's ``(conv_dim, K - 1)`` then its recurrent matrix
        ``(value heads, key dim, value dim)``; a Mamba2 layer's ``(conv_dim, K - 1)`` then its SSM state
        ``(heads, head dim, state)`` (the recurrent matrices kept in float32 by every pool)."""
        if not self.is_recurrent(layer):
            raise ValueError(f"layer {layer} is an attention layer: it keeps KV, not a state")
        kind = self.layer_kinds[layer]
        if kind == LayerKind.CONV:
            return ((self.hidden_size, self.conv_kernel - 1),)
        if kind == LayerKind.MAMBA2:
            return ((self.mamba_conv_dim, self.conv_kernel - 1),
                    (self.mamba_heads, self.mamba_head_dim, self.mamba_state))
        return ((self.gdn_conv_dim, self.conv_kernel - 1), (self.gdn_value_heads, self.gdn_key_dim, self.gdn_value_dim))

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of a gated DeltaNet layer's conv: q, k (key heads x key dim each), then v."""
        return 2 * self.gdn_key_heads * self.gdn_key_dim + self.gdn_value_heads * self.gdn_value_dim

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of a Mamba2 layer's conv: x (d_inner = heads x head dim), then B and C (groups x state each)."""
        return self.mamba_heads * self.mamba_head_dim + 2 * self.mamba_groups * self.mamba_state

    @property
    def rope_dim(self) -> int:
        """Dimensions each rotary embedding turns: a head's (its first ``rotary_dim`` under partial
        rotary), or MLA's rotary key part."""
        return self.qk_rope_head_dim if self.is_mla else self.rotary_dim or self.head_dim

    def validate(self) -> None:
        self._require_integers(("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                                "intermediate_size", "vocab_size", "max_position_embeddings"), least=1)
        if self.num_heads % self.num_kv_heads:
            raise ModelSpecError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                                 f"({self.num_kv_heads}).")
        if self.head_dim % 2:
            raise ModelSpecError(f"head_dim must be even for rotary embeddings, got {self.head_dim}.")
        self._validate_finite()
        if not (self.rope_theta > 0 and self.rms_norm_eps > 0):
            raise ModelSpecError("rope_theta and rms_norm_eps must be positive.")
        if self.is_mla:
            self._validate_mla()
        self._validate_layers()
        rope_type = rope_scaling_type(self.rope_scaling)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelSpecError(f"unsupported rope scaling type {rope_type!r}; supported: "
                                 f"{', '.join(SUPPORTED_ROPE_TYPES)}.")
        factor = (self.rope_scaling or {}).get("factor")
        if rope_type in ("linear", "llama3", "yarn") and not (isinstance(factor, (int, float)) and factor > 0):
            raise ModelSpecError(f"rope scaling {rope_type!r} needs a positive factor, got {factor!r}.")
        if rope_type == "freq_factors" and len(self.rope_scaling.get("factors", ())) != self.rope_dim // 2:
            raise ModelSpecError(f"rope frequency factors: expected {self.rope_dim // 2} (one per rotary pair), got "
                                 f"{len(self.rope_scaling.get('factors', ()))}.")

    def _require_integers(self, names: tuple[str, ...], least: int) -> None:
        """Each of the fields ``names`` an int (a bool is not one) of at least ``least`` (1: positive, 0: a
        size or count a model without such layers leaves at 0)."""
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ModelSpecError(f"model spec field {name} must be a {'positive' if least else 'non-negative'} "
                                     f"integer, got {value!r}.")

    def _validate_finite(self) -> None:
        """The floats the math divides by, raises to a power or multiplies with are finite (issue 56: an
        infinite eps made every norm 0 and the model printed NULs); the rope scaling's numbers too."""
        floats = [("rope_theta", self.rope_theta), ("rms_norm_eps", self.rms_norm_eps),
                  ("embedding_scale", self.embedding_scale), ("attention_scale", self.attention_scale),
                  ("local_rope_theta", self.local_rope_theta), ("dt_min", self.dt_min), ("dt_max", self.dt_max),
                  ("residual_scale", self.residual_scale), ("logits_scale", self.logits_scale)]
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ModelSpecError(f"rope scaling must be a dict of parameters, got {type(self.rope_scaling).__name__}.")
        for key, value in (self.rope_scaling or {}).items():
            values = value if key == "factors" and isinstance(value, (list, tuple)) else [value]
            floats += [(f"rope scaling {key}", v) for v in values if key == "factors" or isinstance(v, (int, float))]
        for name, value in floats:
            if value is not None and not (isinstance(value, (int, float)) and abs(value) <= sys.float_info.max):
                raise ModelSpecError(f"model spec field {name} must be a finite number, got {quoted(value, 40)}.")
        if self.rope_scaling and any(not f > 0 for f in self.rope_scaling.get("factors") or ()):
            raise ModelSpecError("rope frequency factors must be positive.")

    def _validate_layers(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ModelSpecError(f"hidden_act {self.hidden_act!r}: expected one of {', '.join(ACTIVATIONS)}.")
        if self.layer_kinds and (len(self.layer_kinds) != self.num_layers or set(self.layer_kinds) - set(LayerKind)):
            raise ModelSpecError(f"layer_kinds must give one of {', '.join(LayerKind)} for each of the "
                                 f"{self.num_layers} layers, got {list(self.layer_kinds)}.")
        if self.has_sliding_layers and not (isinstance(self.sliding_window, int) and self.sliding_window >= 1):
            raise ModelSpecError(f"sliding layers need a positive sliding_window, got {self.sliding_window!r}.")
        if not (self.embedding_scale > 0 and (self.attention_scale is None or self.attention_scale > 0)):
            raise ModelSpecError("embedding_scale and attention_scale must be positive.")
        if self.is_mla and (self.has_sliding_layers or self.sandwich_norms or self.qk_norm):
            raise ModelSpecError("MLA layers with sliding windows, sandwich norms or QK-norm are not supported.")
        self._require_integers(("conv_kernel",), least=0)
        recurrent = sorted(RECURRENT_KINDS & set(self.layer_kinds))
        if recurrent and (self.conv_kernel < 2 or self.is_mla):
            raise ModelSpecError(f"{' and '.join(recurrent)} layers need conv_kernel >= 2 and attention layers without "
                                 f"MLA, got conv_kernel {self.conv_kernel}{' with MLA' if self.is_mla else ''}.")
        self._validate_gdn()
        self._validate_mamba2()

    def _validate_gdn(self) -> None:
        """Gated DeltaNet sizes where there are such layers; partial rotary and the output gate."""
        sizes = ("gdn_key_heads", "gdn_value_heads", "gdn_key_dim", "gdn_value_dim")
        self._require_integers(sizes + ("rotary_dim",), least=0)
        if LayerKind.GDN in self.layer_kinds and (min(getattr(self, n) for n in sizes) < 1
                                                  or self.gdn_value_heads % self.gdn_key_heads):
            raise ModelSpecError(f"gdn layers need positive {', '.join(sizes)}, the value heads a multiple of the key "
                                 f"heads, got {[getattr(self, n) for n in sizes]}.")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim or (self.rotary_dim and self.is_mla):
            raise ModelSpecError(f"rotary_dim must be even, at most head_dim ({self.head_dim}) and unset for MLA, "
                                 f"got {self.rotary_dim}.")
        if self.attn_output_gate and self.is_mla:
            raise ModelSpecError("attn_output_gate is not supported with MLA layers.")

    def _validate_mamba2(self) -> None:
        """Mamba2 sizes where there are such layers; the time step's clamp; Granite's multipliers."""
        sizes = ("mamba_heads", "mamba_head_dim", "mamba_groups", "mamba_state")
        self._require_integers(sizes, least=0)
        if LayerKind.MAMBA2 in self.layer_kinds and (min(getattr(self, n) for n in sizes) < 1
                                                     or self.mamba_heads % self.mamba_groups):
            raise ModelSpecError(f"mamba2 layers need positive {', '.join(sizes)}, the heads a multiple of the groups, "
                                 f"got {[getattr(self, n) for n in sizes]}.")
        if not (self.dt_min >= 0 and (self.dt_max is None or self.dt_max > self.dt_min)):
            raise ModelSpecError(f"the time step's clamp needs 0 <= dt_min < dt_max (or no dt_max), got {self.dt_min} "
                                 f"and {self.dt_max}.")
        if not (self.residual_scale > 0 and self.logits_scale > 0):
            raise ModelSpecError("residual_scale and logits_scale must be positive.")

    def _validate_mla(self) -> None:
        for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ModelSpecError(f"an MLA model (kv_lora_rank {self.kv_lora_rank}) needs {name} >= 1.")
        if (self.kv_lora_rank + self.qk_rope_head_dim) % 2 or self.qk_rope_head_dim % 2:
            raise ModelSpecError("MLA needs an even qk_rope_head_dim and an even kv_lora_rank + qk_rope_head_dim.")
        if self.rope_scaling:
            raise ModelSpecError("MLA with rope scaling (yarn) is not supported; use a config without rope_scaling.")

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one token's K and V take over all attention layers at ``dtype`` (recurrent layers keep none)."""
        return 2 * len(self.attention_layers) * self.num_kv_heads * self.head_dim * dtype.itemsize

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict; the recurrent ones only where set, so the JSON of a spec without
        them -- hashed into a random model's identity -- is what it was before they existed."""
        out = dataclasses.asdict(self)
        for name, default in _UNHASHED_DEFAULTS.items():
            if out[name] == default:
                del out[name]
        return out


# Fields added after random models' identities were first hashed (ModelSpec.to_dict leaves them out at these values).
_UNHASHED_DEFAULTS: dict[str, Any] = {"conv_kernel": 0, "conv_bias": False, "gdn_key_heads": 0, "gdn_value_heads": 0,
                                      "gdn_key_dim": 0, "gdn_value_dim": 0, "attn_output_gate": False, "rotary_dim": 0,
                                      "mamba_heads": 0, "mamba_head_dim": 0, "mamba_groups": 0, "mamba_state": 0,
                                      "mamba_proj_bias": False, "dt_min": 0.0, "dt_max": None, "residual_scale": 1.0,
                                      "logits_scale": 1.0, "nope": False}


def rope_scaling_type(rope_scaling: dict | None) -> str:
    """The scaling kind of an HF ``rope_scaling`` dict (older configs spell the key ``type``)."""
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))
