"""A decode step's layers as one native call (``decode_layers``, model/decode_stack.py) or one call
each (``decode_layer``, kernels/decode_layer.cpp) give the logits the Python layer gives, bit for
bit: float32 weights (with and without a q/k/v bias), exact 4-bit blocks, one sequence and a batch
of three, float32 or float16 KV, Llama's layer and Gemma 3's; passes they do not serve (prefill, bf16 KV) keep the Python layer; weights changed after
a step are the ones the next step reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hicache.config import PassPrecision
from hicache.kernels import unavailable_reason
from hicache.model import DenseKV, load_model, make_forward_batch
from hicache.model.decode_stack import DecodeStack
from hicache.model.llama import DecoderLayer

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(unavailable_reason() is not None, reason=f"no native kernels: {unavailable_reason()}")]

BIASED = "random:" + json.dumps({"preset": "small", "attention_bias": True})


def _decode(model, spec, batch_size: int, steps: int, kv_dtype=torch.float32) -> list[torch.Tensor]:
    """Greedy decode of ``batch_size`` prompts of different lengths; the logits of every step."""
    kv = DenseKV(spec, 1024, kv_dtype)
    prompts = [list(range(40 + 9 * b, 40 + 9 * b + 11 + 6 * b)) for b in range(batch_size)]
    slots = [torch.arange(1 + 200 * b, 1 + 200 * (b + 1)) for b in range(batch_size)]
    out = []
    with torch.inference_mode():
        logits = model(make_forward_batch(prompts, [0] * batch_size, [s[:len(p)] for s, p in zip(slots, prompts)]), kv)
        for _ in range(steps):
            lens = [len(p) for p in prompts]
            for p, token in zip(prompts, logits.argmax(-1).tolist()):
                p.append(token)
            batch = make_forward_batch([[p[-1]] for p in prompts], lens, [s[:n + 1] for s, n in zip(slots, lens)],
                                       generated=True)
            logits = model(batch, kv)
            out.append(logits)
    return out


def _counting(fn, calls: list):
    """``fn`` with its calls that ran a native pass (returned a tensor) recorded."""
    def wrapper(self, *args):
        out = fn(self, *args)
        if out is not None:
            calls.append(1)
        return out
    return wrapper


def _run(model, spec, batch_size, path: str, monkeypatch, kv_dtype=torch.float32):
    """Five decode steps through ``path``: "stack" (all layers in one native call, the default),
    "layer" (one native call a layer) or "python"; the logits and how many native calls ran."""
    calls = []
    with monkeypatch.context() as m:
        if path == "stack":
            m.setattr(DecodeStack, "forward", _counting(DecodeStack.forward, calls))
        else:
            m.setattr(DecodeStack, "forward", lambda self, *a: None)
        if path == "layer":
            m.setattr(DecoderLayer, "_fused_decode", _counting(DecoderLayer._fused_decode, calls))
        elif path == "python":
            m.setattr(DecoderLayer, "_fused_decode_ops", lambda self, x, batch, kv: None)
        return _decode(model, spec, batch_size, steps=5, kv_dtype=kv_dtype), len(calls)


@pytest.mark.parametrize("name,kv_dtype", [("random:small", torch.float32), (BIASED, torch.float32),
                                           ("random:small:int4-g32", torch.float32), ("random:small", torch.float16),
                                           ("random:gemma-small", torch.float32), ("random:gemma-small", torch.float16)])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_fused_decode_layer_equals_the_python_layer(name, kv_dtype, batch_size, monkeypatch):
    """float16 KV too (``--kv-cache-dtype``): the native layer rounds the new K/V as the Python
    layer's buffer write does, and the kernel reads them back exactly. Gemma's layer too: QK-norm,
    post norms, GeGLU, its attention scale, windowed layers (their slots and RoPE) beside a full one."""
    loaded = load_model(name, dtype=torch.float32, seed=3)
    model, spec = loaded.model, loaded.spec
    stack, stack_calls = _run(model, spec, batch_size, "stack", monkeypatch, kv_dtype)
    fused, calls = _run(model, spec, batch_size, "layer", monkeypatch, kv_dtype)
    python, _ = _run(model, spec, batch_size, "python", monkeypatch, kv_dtype)
    assert stack_calls == 5, "every decode step runs its layers in one native call"
    assert calls == 5 * spec.num_layers, "every layer of every decode step runs fused"
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(stack, fused, python))
    if name.endswith("int4-g32"):
        assert "q4" in model.decode_formats()  # layers mixing q4 blocks and float32 matrices


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K_M"])
def test_fused_decode_layer_with_int8_inputs_equals_the_python_layer(qtype, monkeypatch):
    """GGUF blocks times 8-bit inputs (``--decode-activations int8``): the same kernel either way."""
    path = Path(__file__).parent / "data" / "gguf" / f"tiny-llama-{qtype}.gguf"
    loaded = load_model(str(path), dtype=torch.float32, precision=PassPrecision(decode_activations="int8"))
    model, spec = loaded.model, loaded.spec
    assert all(kind.endswith("@int8") for kind in model.decode_formats())
    stack, stack_calls = _run(model, spec, 3, "stack", monkeypatch)
    fused, calls = _run(model, spec, 3, "layer", monkeypatch)
    python, _ = _run(model, spec, 3, "python", monkeypatch)
    assert (stack_calls, calls) == (5, 5 * spec.num_layers)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(stack, fused, python))


def test_the_stack_reads_weights_changed_after_a_step(monkeypatch):
    """The stack's operands are rebuilt when a projection's setting or a weight changes: a new norm
    weight, new decode activations -- the next step reads them, as the Python layer would."""
    path = Path(__file__).parent / "data" / "gguf" / "tiny-llama-Q4_1.gguf"
    loaded = load_model(str(path), dtype=torch.float32, precision=PassPrecision(decode_activations="int8"))
    model, spec = loaded.model, loaded.spec
    before, _ = _run(model, spec, 2, "stack", monkeypatch)
    norm = model.model.layers[1].post_attention_layernorm
    norm.weight = torch.nn.Parameter(norm.weight * 1.5, requires_grad=False)
    model.set_weights(decode_activations="float32")
    stack, calls = _run(model, spec, 2, "stack", monkeypatch)
    python, _ = _run(model, spec, 2, "python", monkeypatch)
    assert calls == 5 and not torch.equal(before[0], stack[0])
    assert all(torch.equal(a, b) for a, b in zip(stack, python))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K_M"])
@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_a_verify_pass_gives_each_row_the_logits_of_its_decode_step(qtype, activations, monkeypatch):
    """A speculative verify pass runs the last token and the drafts as rows of the fused decode
    layers (each over its own causal context): every row's logits are bit for bit those the decode
    step at its position gives -- the block GEMVs, the LM head and attention give a row the same
    bits whatever else is in the pass."""
    path = Path(__file__).parent / "data" / "gguf" / f"tiny-llama-{qtype}.gguf"
    loaded = load_model(str(path), dtype=torch.float32, precision=PassPrecision(decode_activations=activations))
    model, spec = loaded.model, loaded.spec
    calls = []
    monkeypatch.setattr(DecodeStack, "forward", _counting(DecodeStack.forward, calls))
    kv = DenseKV(spec, 512, torch.float32)
    slots = torch.randperm(500, generator=torch.Generator().manual_seed(0))[:300] + 1
    ids = [(7 * i + 3) % spec.vocab_size for i in range(300)]
    with torch.inference_mode():
        model(make_forward_batch([ids[:270]], [0], [slots[:270]]), kv)  # two full chunks of 128 and a part
        for n in (2, 5, 8):
            calls.clear()
            verify = model(make_forward_batch([ids[270:270 + n]], [270], [slots[:270 + n]], logits="all",
                                              generated=True), kv)
            assert len(calls) == 1, "the verify pass runs the fused decode layers"
            steps = [model(make_forward_batch([ids[270 + i:271 + i]], [270 + i], [slots[:271 + i]], generated=True), kv)
                     for i in range(n)]
            assert torch.equal(verify, torch.cat(steps)), f"{n} rows"


def test_passes_the_fused_layer_does_not_serve_keep_the_python_layer(monkeypatch):
    """Prefill passes and a bf16 KV cache (no native decode attention) never take it."""
    loaded = load_model("random:small", dtype=torch.float32, seed=3)
    _, stack_calls = _run(loaded.model, loaded.spec, 2, "stack", monkeypatch, kv_dtype=torch.bfloat16)
    _, calls = _run(loaded.model, loaded.spec, 2, "layer", monkeypatch, kv_dtype=torch.bfloat16)
    assert stack_calls == calls == 0


def test_fused_layer_waits_for_each_layers_kv_before_reading_it(monkeypatch):
    """Ready before read (DESIGN invariant 4): while a load-back is still in flight the layers run
    one call each, every one after its layer's wait; once every layer is in, one call runs all."""
    loaded = load_model("random:small", dtype=torch.float32, seed=3)
    events = []

    class Recording:  # the native ops, with the fused layers' reads recorded
        def __init__(self, ops):
            self.ops = ops

        def decode_layer(self, *args):
            events.append(("read", len([e for e in events if e[0] == "read"]) % loaded.spec.num_layers))
            return self.ops.decode_layer(*args)

        def decode_layers(self, *args):
            events.append(("read all", None))
            return self.ops.decode_layers(*args)

    fused_ops = DecoderLayer._fused_decode_ops
    monkeypatch.setattr(DecoderLayer, "_fused_decode_ops",
                        lambda self, *a: None if (ops := fused_ops(self, *a)) is None else Recording(ops))
    monkeypatch.setattr(DenseKV, "wait_layer", lambda self, layer: events.append(("wait", layer)))
    monkeypatch.setattr(DenseKV, "layer_ready", lambda self, layer: False)  # a load in flight
    _decode(loaded.model, loaded.spec, 1, steps=2)
    reads = [i for i, e in enumerate(events) if e[0] == "read"]
    assert len(reads) == 2 * loaded.spec.num_layers
    assert all(events[i - 1] == ("wait", events[i][1]) for i in reads)
    events.clear()
    monkeypatch.setattr(DenseKV, "layer_ready", lambda self, layer: True)  # every layer in
    _decode(loaded.model, loaded.spec, 1, steps=2)
    assert [e for e in events if e[0] != "wait"] == [("read all", None)] * 2
