"""Sliding-window layers with buffers of their own (issue 48's window component, at the model's
contract): ``window_slots`` gives each context position's slot in those buffers, and only positions
some new token's window reaches are read. A ring of ``window + chunk`` slots per sequence then holds
all a window layer ever needs: the logits of chunked prefills, decode steps (native fused stack and
the Python layers) and a batch are those of the every-layer pool, bit for bit."""

from __future__ import annotations

import pytest
import torch

from hicache.model import DenseKV, load_model, make_forward_batch
from hicache.model.decode_stack import DecodeStack
from hicache.model.llama import DecoderLayer

pytestmark = pytest.mark.model

CHUNK = 16


def ring_kv(model, num_slots: int, ring_slots: int) -> DenseKV:
    """An every-layer pool whose sliding-window layers' buffers are replaced by ``ring_slots`` slots."""
    kv = DenseKV(model.spec, num_slots, torch.float32)
    for i in range(model.spec.num_layers):
        if model.spec.layer_window(i):
            shape = (ring_slots, *kv.k_buffers[i].shape[1:])
            kv.k_buffers[i], kv.v_buffers[i] = torch.zeros(shape), torch.zeros(shape)
    return kv


def run(model, prompts: list[list[int]], steps: int, ring: int | None) -> list[torch.Tensor]:
    """Chunked prefill of each prompt (CHUNK tokens a pass, sequences batched), then ``steps`` greedy
    decode steps of the batch; every pass's logits. ``ring``: the window layers' slots per sequence
    (position p of sequence b at 1 + b * ring + p % ring), else one slot space for all layers."""
    total = max(map(len, prompts)) + steps
    kv = ring_kv(model, 1 + len(prompts) * total, 1 + len(prompts) * ring) if ring else \
        DenseKV(model.spec, 1 + len(prompts) * total, torch.float32)
    slots = [torch.arange(1 + b * total, 1 + (b + 1) * total) for b in range(len(prompts))]

    def window_slots(b: int, n: int) -> torch.Tensor:
        return 1 + b * ring + torch.arange(n) % ring

    seqs, out = [list(p) for p in prompts], []
    done = [0] * len(prompts)
    with torch.inference_mode():
        while any(d < len(p) for d, p in zip(done, prompts)):
            live = [b for b in range(len(prompts)) if done[b] < len(prompts[b])]
            new = [prompts[b][done[b]:done[b] + CHUNK] for b in live]
            ends = [done[b] + len(n) for b, n in zip(live, new)]
            batch = make_forward_batch(new, [done[b] for b in live], [slots[b][:e] for b, e in zip(live, ends)],
                                       logits="all", window_slots=[window_slots(b, e) for b, e in zip(live, ends)]
                                       if ring else None)
            out.append(model(batch, kv))
            for b, e in zip(live, ends):
                done[b] = e
        nxt = [s[0] for s in seqs]  # the first decode step feeds each prompt's first token again
        for _ in range(steps):
            lens = [len(s) for s in seqs]
            for s, t in zip(seqs, nxt):
                s.append(t)
            batch = make_forward_batch([[s[-1]] for s in seqs], lens, [slots[b][:n + 1] for b, n in enumerate(lens)],
                                       window_slots=[window_slots(b, n + 1) for b, n in enumerate(lens)]
                                       if ring else None, generated=True)
            out.append(model(batch, kv))
            nxt = out[-1].argmax(-1).tolist()
    return out


@pytest.mark.parametrize("path", ["stack", "python"])
def test_window_layers_in_a_ring_of_their_own_give_the_same_logits(path, monkeypatch) -> None:
    loaded = load_model("random:gemma-small", dtype=torch.float32, seed=5)
    model, window = loaded.model, loaded.spec.sliding_window
    if path == "python":
        monkeypatch.setattr(DecoderLayer, "_fused_decode_ops", lambda self, x, batch, kv: None)
    calls = []
    stack = DecodeStack.forward
    monkeypatch.setattr(DecodeStack, "forward", lambda self, *a: calls.append(out := stack(self, *a)) or out)
    prompts = [[(7 * i + 3 * b) % 250 + 3 for i in range(40 + 11 * b)] for b in range(3)]
    want = run(model, prompts, steps=6, ring=None)
    got = run(model, prompts, steps=6, ring=window + CHUNK)  # 24 slots a sequence instead of 79
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert any(c is not None for c in calls) == (path == "stack")


def test_a_ring_too_small_for_the_window_changes_the_logits() -> None:
    """The check above can fail: a ring shorter than a window lets new keys overwrite ones still read."""
    loaded = load_model("random:gemma-small", dtype=torch.float32, seed=5)
    prompts = [[(7 * i) % 250 + 3 for i in range(40)]]
    want = run(loaded.model, prompts, steps=4, ring=None)
    got = run(loaded.model, prompts, steps=4, ring=loaded.spec.sliding_window - 2 + CHUNK)
    assert not all(torch.equal(a, b) for a, b in zip(got, want))
