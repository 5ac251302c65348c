"""What the recurrent families' parity tests share (issue 59): LFM2 (tests/test_recurrent_parity.py),
Qwen3.5's gated DeltaNet (test_gdn_parity.py) and Granite 4.0-H's Mamba2 (test_mamba2_parity.py), each
against transformers' own model. A family's file keeps what is its own -- its configs and random
draws, the spec fields it asserts, its refusals -- and calls these for the checks that are the same:
a random HF directory written and loaded, logits over 600 positions, a prompt in chunks then decode
steps against one pass, sequences of one batch against each alone, greedy tokens against
``generate``, a bfloat16 model's recurrence in float32, refusals in one sentence.

Units: token ids and positions. KV slot ``p + 1`` holds position ``p``; state slot 0 is the zero
state and a sequence's own state lives in slot 1 (tests/dense_forward.py's convention). A logit
error is max |ours - theirs| over the reference's spread (its max - min)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Sequence

import pytest
import torch
from dense_forward import greedy_paged, prefill_logits

from hicache.errors import ConfigError
from hicache.model import DenseKV, load_model, make_forward_batch
from hicache.model.hf_loader import spec_from_hf_config
from hicache.model.tokenizer import byte_tokenizer

# max logit error vs transformers in float32 (seen: LFM2 ~3e-7; Qwen3.5 ~1.4e-6 tiny, ~4e-7 at 0.8B's shapes;
# Granite ~5e-7 tiny, ~3e-7 at 4.0-H-micro's shapes)
SPREAD_TOL = 1e-4


def random_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def spread_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / (want.max() - want.min()))


def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits ``[len(ids), vocab]`` of one pass over ``ids``."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def run_pass(model, kv: DenseKV, ids: list[int], start: int, n: int, state: tuple[int, int],
             generated: bool = False) -> torch.Tensor:
    """Logits of tokens ``ids[start:start + n]`` after the first ``start`` (slots 1.., state slots ``state``)."""
    batch = make_forward_batch([ids[start:start + n]], [start], [torch.arange(1, start + n + 1)], logits="all",
                               generated=generated, state_slots=[state])
    return model(batch, kv)


def prompt_in_chunks(model, kv: DenseKV, ids: list[int], chunks: Sequence[int]) -> list[torch.Tensor]:
    """The logits of passes over ``ids`` in ``chunks`` tokens each, from the zero state into state slot 1."""
    rows, start = [], 0
    for n in chunks:
        rows.append(run_pass(model, kv, ids, start, n, (0 if start == 0 else 1, 1)))
        start += n
    return rows


def states(kv: DenseKV, slot: int) -> list[list[torch.Tensor]]:
    """Each recurrent layer's state buffers (the conv's inputs, then any recurrent matrix) at ``slot``, copied."""
    return [[buffer[slot].clone() for buffer in layer] for layer in kv.state_buffers]


def randomized(hf: torch.nn.Module, seed: int, norm_mean: Callable[[str], float],
               rest: Callable[[str], float]) -> torch.nn.Module:
    """Every parameter drawn, norms too, so a dropped or misplaced tensor shows: one N(0, 1) draw ``r`` a
    parameter, in ``named_parameters`` order from ``seed``; a norm's weight ``norm_mean(name) + 0.1 r``,
    embeddings ``r``, matrices ``r / sqrt(fan-in)``, the rest (conv taps, biases, decays) ``rest(name) * r``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(norm_mean(name) + 0.1 * r)
            elif "embed_tokens" in name:
                p.copy_(r)
            elif p.dim() == 2:
                p.copy_(r / p.shape[1] ** 0.5)
            else:
                p.copy_(rest(name) * r)
    return hf.eval()


def save_hf_dir(hf: torch.nn.Module, folder: Path) -> torch.nn.Module:
    """``hf`` saved in ``folder`` as safetensors with a byte tokenizer; returns ``hf``."""
    hf.save_pretrained(folder)
    byte_tokenizer().backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    return hf


def load_pair(write_hf_dir: Callable[[Path, str], torch.nn.Module], name: str, folder: Path) -> SimpleNamespace:
    """transformers' model of config ``name`` (as the family's ``write_hf_dir`` writes it in ``folder``)
    and ours loaded from that directory in float32."""
    hf = write_hf_dir(folder, name)
    return SimpleNamespace(name=name, hf=hf, folder=folder, ours=load_model(str(folder), dtype=torch.float32))


def check_logits_match(pair: SimpleNamespace) -> None:
    """600 random tokens in one pass: our logits within SPREAD_TOL of transformers'."""
    ids = random_ids(600, pair.ours.spec.vocab_size)
    assert spread_error(prefill_logits(pair.ours.model, ids), hf_logits(pair.hf, ids)) < SPREAD_TOL


def check_split_then_decode(model, chunks: Sequence[int], steps: int) -> tuple[list, list]:
    """A prompt of ``sum(chunks)`` random tokens in passes of ``chunks``, then ``steps`` decode steps: every
    row's logits within SPREAD_TOL of the one-pass prompt's. Returns the states after the chunks and those
    of one pass over the same prompt (``states``' layout), for the family to compare at its tolerances."""
    prompt = sum(chunks)
    ids = random_ids(prompt + steps, model.spec.vocab_size, seed=1)
    want = prefill_logits(model, ids)
    kv = DenseKV(model.spec, prompt + steps + 1, torch.float32)
    rows = prompt_in_chunks(model, kv, ids, chunks)
    split_states = states(kv, 1)
    rows += [run_pass(model, kv, ids, p, 1, (1, 1), generated=True) for p in range(prompt, prompt + steps)]
    assert spread_error(torch.cat(rows), want) < SPREAD_TOL
    one = DenseKV(model.spec, prompt + 1, torch.float32)
    run_pass(model, one, ids, 0, prompt, (0, 1))
    return split_states, states(one, 1)


def assert_states_close(got: list, want: list, tolerances: Sequence[tuple[float, float]]) -> None:
    """Each layer's state buffers (``states``' layout) as ``want``'s within ``tolerances[i]`` = (atol, rtol)
    for its buffer i; (0, 0) asks for the same bits."""
    assert len(got) == len(want) > 0
    for layer, whole in zip(got, want):
        assert len(layer) == len(whole) == len(tolerances)
        for a, b, (atol, rtol) in zip(layer, whole, tolerances):
            torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def check_batch_keeps_states(model, lengths: Sequence[int], cuts: Sequence[tuple[int, int]],
                             third: tuple[int, int] = (1, 1)) -> None:
    """Sequences of ``lengths`` random tokens (each seeded by its length) in three batched passes -- the
    prompt up to ``cut[0]``, the chunk to ``cut[1]`` from its own state, one generated token -- give each
    sequence's logits as it gets alone (atol 1e-5). Alone, the generated token reads state slot ``third[0]``
    and writes ``third[1]``; where they differ (a hit's first forward) the source is checked untouched."""
    spec = model.spec
    seqs = [random_ids(n, 256, seed=n) for n in lengths]
    spans = [[(0, p), (p, c), (c, c + 1)] for p, c in cuts]  # each sequence's three passes
    stride = 1 << max(lengths).bit_length()  # each sequence's KV slots a block of their own
    slots = [torch.arange(1 + stride * b, 1 + stride * b + len(ids)) for b, ids in enumerate(seqs)]
    kv = DenseKV(spec, stride * len(seqs), torch.float32, state_slots=len(seqs) + 1)
    together = []
    for i in range(3):
        parts = [span[i] for span in spans]
        batch = make_forward_batch([ids[a:e] for ids, (a, e) in zip(seqs, parts)], [a for a, _ in parts],
                                   [s[:e] for s, (_, e) in zip(slots, parts)], logits="all", generated=i == 2,
                                   state_slots=[(0 if i == 0 else b + 1, b + 1) for b in range(len(seqs))])
        together.append(model(batch, kv).split([e - a for a, e in parts]))
    for b, ids in enumerate(seqs):
        alone = DenseKV(spec, stride, torch.float32, state_slots=max(third) + 1)
        (_, prompt), (_, chunk), _ = spans[b]
        first = run_pass(model, alone, ids, 0, prompt, (0, 1))
        second = run_pass(model, alone, ids, prompt, chunk - prompt, (1, 1))
        before = states(alone, third[0])
        third_rows = run_pass(model, alone, ids, chunk, 1, third, generated=True)
        if third[0] != third[1]:
            assert_states_close(states(alone, third[0]), before, [(0.0, 0.0)] * len(before[0]))
        for i, want in enumerate((first, second, third_rows)):
            torch.testing.assert_close(together[i][b], want, atol=1e-5, rtol=0)


def check_greedy_equals_generate(model_class: type, config, ours, hf_tensor: Callable[[dict, str], torch.Tensor],
                                 text: str) -> None:
    """``ours``' weights in transformers' ``model_class(config)`` (each of its tensors ``hf_tensor(our
    parameters, its name)``; no special tokens, so nothing stops early): 16 greedy tokens of ``text``
    through our prefill and decode steps equal ``generate``'s."""
    config.eos_token_id = config.bos_token_id = config.pad_token_id = None
    hf = model_class(config).eval()
    params = dict(ours.model.named_parameters())
    hf.load_state_dict({name: hf_tensor(params, name) for name in hf.state_dict()})
    ids = ours.tokenizer.encode(text)
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(ids):]
    assert greedy_paged(ours.model, ids, steps=16) == want.tolist()


def check_bfloat16_recurrence(preset: str) -> None:
    """Random model ``preset`` in bfloat16: its recurrent matrices (state buffer 1) stay float32 through a
    prefill and 40 decode steps, and its logits stay within 3% of the float32 model's spread."""
    ids = random_ids(140, 256, seed=6)
    want = prefill_logits(load_model(f"random:{preset}", dtype=torch.float32).model, ids)
    model = load_model(f"random:{preset}", dtype=torch.bfloat16).model
    kv = DenseKV(model.spec, 141, torch.bfloat16)
    rows = [run_pass(model, kv, ids, 0, 100, (0, 1))] + [run_pass(model, kv, ids, p, 1, (1, 1), generated=True)
                                                         for p in range(100, 140)]
    assert all(layer[1].dtype == torch.float32 and layer[1][1].abs().sum() > 0 for layer in kv.state_buffers)
    assert spread_error(torch.cat(rows), want) < 0.03


def one_sentence(message: str) -> bool:
    return "\n" not in message and message.endswith(".") and ". " not in message


def assert_refused(config: dict, says: str, error: type[ConfigError] = ConfigError) -> None:
    """``config`` refused by the HF loader with ``error`` matching ``says``, in one sentence."""
    with pytest.raises(error, match=says) as caught:
        spec_from_hf_config(config)
    assert one_sentence(str(caught.value)), str(caught.value)
