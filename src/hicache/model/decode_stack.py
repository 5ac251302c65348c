"""A decode step's whole layer stack in one native call (``decode_layers``, kernels/decode_layer.cpp).

Each layer can run a decode pass as one native call of its own (``DecoderLayer._fused_decode``);
at batch 1 the Python around those 30 calls -- module calls, the checks that a layer still
qualifies, each projection's "are my weights still the fused ones" key -- was ~4 ms of a ~22 ms
step (2-core AVX2 VM: 22.0 -> 17.8 ms a token with the stack, same tokens). Here the checks run
once a step for the stack: a fingerprint of every projection's settings and every part's weight
storage (what each projection's own key is made of, read in one pass), and the operands of all
layers are rebuilt only when it changes. The output is the per-layer
path's, bit for bit: the same kernels in the same order (tests/test_decode_layer.py).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from hicache.model.batch import ForwardBatch, KVView, window_group
from hicache.model.layers import RMSNorm


class DecodeStack:
    """The layers of one model (or pipeline stage: ``decoder.layers``, whatever they are now) as
    one ``decode_layers`` call, when every layer would take its fused decode path for this pass."""

    def __init__(self, decoder: nn.Module) -> None:
        self.decoder = decoder
        self._layers: Optional[nn.ModuleList] = None  # decoder.layers when the operands were built
        self._projections: list = []
        self._params: list = []
        self._kv_layers: list[int] = []  # each layer's index into the KV buffers
        self._fingerprint: Optional[tuple] = None
        self._operands: Optional[tuple] = None
        self._local: list[int] = []  # stack positions of the sliding-window layers
        self._window = 0

    def _current_fingerprint(self) -> tuple:
        """What every projection's own key is made of (its settings, its parts' weight storage) and
        the norms' weights, read in one pass: it changes whenever some layer's operands would."""
        return (tuple([p.settings() for p in self._projections]),
                tuple([d["weight"].data_ptr() for d in self._params]))

    def operands(self) -> Optional[tuple]:
        """``decode_layers``' weight arguments (norms, part counts, kinds, qtypes, weights, qkv
        biases, QK norms, post norms), or None when some layer has no native decode form."""
        if self._layers is not self.decoder.layers or self._current_fingerprint() != self._fingerprint:
            self._rebuild()
        return self._operands

    def _rebuild(self) -> None:
        layers = self.decoder.layers
        per_layer = [layer._decode_operands() for layer in layers]  # prepares (re-fuses) as needed
        native = bool(per_layer) and all(one is not None for one in per_layer)
        biases = [one[4] for one in per_layer] if native else []
        self._operands = None
        styles = [layer.style() for layer in layers]
        alike = len({(len(qk), len(post)) for qk, post in styles}) == 1  # every layer has them, or none
        if native and alike and (all(b is None for b in biases) or all(b is not None for b in biases)):
            self._operands = (
                [layer.input_layernorm.weight for layer in layers],
                [layer.pre_mlp_norm().weight for layer in layers],
                *([x for one in per_layer for x in one[i]] for i in range(4)),  # part counts, kinds, qtypes, weights
                [] if biases[0] is None else biases,
                [w for qk, _ in styles for w in qk], [w for _, post in styles for w in post],
            )
        # Sliding-window layers read their own view (windowed slots, their own RoPE where they have one).
        self._local = [i for i, layer in enumerate(layers) if layer.self_attn.window]
        self._window = max((layer.self_attn.window for layer in layers), default=0)  # a model has one window
        # Read after preparing: fusing moves the parts' weights into the fused matrix.
        self._projections = [p for layer in layers for p in (layer.self_attn.qkv, layer.self_attn.out,
                                                             layer.mlp.gate_up, layer.mlp.down)]
        self._params = [part._parameters for p in self._projections for part in p.parts] + [
            norm._parameters for layer in layers for norm in layer.modules() if isinstance(norm, RMSNorm)]
        self._kv_layers = [layer.self_attn.layer for layer in layers]
        self._layers, self._fingerprint = layers, self._current_fingerprint()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                kv: KVView, local: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> Optional[torch.Tensor]:
        """The stack's output for this pass, or None when not every layer would run it as a fused
        decode call (the caller then runs the layers one by one). ``local``: the cos / sin of layers
        with a RoPE of their own (sliding-window layers), where the model has them."""
        layers = self.decoder.layers
        ops = layers[0]._fused_decode_ops(x, batch, kv) if layers else None
        # What qualifies a layer is the pass (shared by all) and the layer's shape and TP role (the
        # same for every layer of a model); the KV buffers' dtype is checked at both ends.
        if ops is None or layers[-1]._fused_decode_ops(x, batch, kv) is None:
            return None
        # Loads run layer after layer: when the last layer is in, all are (nothing left to overlap).
        operands = self.operands() if kv.layer_ready(layers[-1].self_attn.layer) else None
        if operands is None:
            return None
        attn, layout, indices = layers[0].self_attn, batch.attn.decode, self._kv_layers
        groups = [window_group(kv, indices[i]) for i in self._local]  # a shared hybrid pool's sliding groups
        view: tuple = (None,) * 5
        if self._local:  # one layout for every sliding group: a row of slots per group in a shared pool
            local_layout = batch.attn.window_decode(self._window)  # type: ignore[attr-defined]
            view = (*(local or (cos, sin)), local_layout.out_slots, local_layout.kv_slots, local_layout.lengths)
        return ops.decode_layers(x, operands[0], operands[1], layers[0].input_layernorm.eps, *operands[2:7], cos, sin,
                                 attn.num_heads, attn.num_kv_heads, [kv.k_buffers[i] for i in indices],
                                 [kv.v_buffers[i] for i in indices], layout.out_slots, layout.kv_slots, layout.lengths,
                                 *operands[7:], layers[0].mlp.gelu, attn.q_scale or 1.0, self._local, *view,
                                 groups if self._local and view[2].dim() == 2 else [])
