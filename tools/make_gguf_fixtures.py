"""Make the tiny quantized GGUF test files in ``tests/data/gguf/`` with llama.cpp's own quantizer.

    .venv/bin/python tools/make_gguf_fixtures.py [--out-dir tests/data/gguf] [--peer-python .venv-peers/bin/python]

Steps (run from the repository root; the two virtual environments never mix: this script runs
in the project's ``.venv`` with the ``gguf`` package, and calls itself in ``.venv-peers``, which has
llama-cpp-python, through a subprocess for everything llama.cpp does):

1. Write a tiny random llama-architecture model in F32 with ``gguf.GGUFWriter`` into a temporary
   folder (5.4 MB, so it is not kept): hidden 256, 4 heads of 64, 2 KV heads, feed-forward 512,
   2 layers, context 512, RoPE base 10000, RMS eps 1e-5, vocabulary 320, a separate (untied)
   ``output.weight``. Tensor names and shapes are those llama.cpp's converter writes for a llama
   model; numpy shapes are ``[out, in]``, so GGUF dims are ``[in, out]`` (fastest first). The
   weights are random, so there is no HF checkpoint to permute from: the q/k rows of this file
   *are* in llama.cpp's order by definition (adjacent-pair RoPE), and a loader that converts
   GGUF q/k rows to the HF order (as hicache's does) must do so here too.
   Weights come from ``numpy.random.default_rng(SEED)`` in tensor order: N(0, 0.05) for
   ``token_embd`` and ``output``, N(0, 0.1) for ``attn_q``/``attn_k`` (so attention is not
   uniform and RoPE matters), N(0, 0.02) for the other matrices, 1 + N(0, 0.05) for norms.
   The tokenizer is byte-level BPE (``gpt2``, pre-tokenizer ``gpt-2``): ids 0-255 are the 256
   GPT-2 byte symbols in byte order, then the results of :data:`MERGES` in order, then
   ``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>`` (control tokens); BOS ``<|endoftext|>``,
   EOS ``<|im_end|>``, no BOS added, a ChatML chat template.
2. Check that hicache loads the F32 file and its tokenizer round-trips text.
3. Quantize it with ``llama_cpp.llama_model_quantize`` to each type in :data:`FTYPES`, into
   ``<out-dir>/tiny-llama-<TYPE>.gguf``.
4. Evaluate :func:`logit_ids` with ``llama_cpp.Llama(logits_all=True)`` on every quantized file
   and save all positions' logits (float32, ``[24, 320]``) under the type's name, plus the ids
   under ``token_ids``, in ``<out-dir>/llama_cpp_logits.npz`` (zip entries dated 1980 so the
   file's bytes are reproducible).
5. Print, per file, its size and its tensors per ggml type; then (unless ``--no-compare``)
   hicache's float32 logits on each file against llama.cpp's, and the two tokenizers on a few
   texts.

Deterministic given the seed; but the quantized files and the logits depend on llama.cpp's
version: these were made with llama-cpp-python 0.3.36 (the ``.venv-peers`` one).
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

SEED = 20240611
ROOT = Path(__file__).resolve().parent.parent

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, CONTEXT = 256, 4, 2, 512, 2, 512
HEAD_DIM = HIDDEN // HEADS
ROPE_BASE, RMS_EPS = 10000.0, 1e-5

# Merge rules in priority order; each result is a new token (ids 256..316). "Ġ" is the space.
MERGES = [
    "Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "Ġt he", "e r", "Ġ s", "a t", "Ġ w", "Ġ o", "e n",
    "Ġ c", "i t", "i s", "a n", "o r", "e s", "Ġ b", "e d", "Ġ f", "in g", "Ġ p", "o u", "Ġ m",
    "a r", "Ġ d", "l l", "a l", "l e", "Ġ h", "Ġt o", "Ġ in", "Ġ l", "Ġo f", "n d", "Ġa nd",
    "Ġ n", "he ll", "hell o", "Ġw or", "l d", "Ġwor ld", "Ġ e", "Ġ re", "i c", "o m", "Ġ g",
    "a s", "i on", "Ġ y", "o w", "Ġ I", "o t", "e l", "Ġs t", "Ġ u", "i m", "Ġ he", "c h",
]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Output name -> llama_ftype (llama.h's LLAMA_FTYPE_MOSTLY_*).
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
N_LOGIT_IDS = 24
TOKENIZER_TEXTS = [
    "hello world",
    "The theory of it is in the ring, and the world.",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "numbers 12345 and 3.14!",
    "  two  spaces\n\nnew lines\ttab",
    "h\u00e9llo w\u00f6rld \u65e5\u672c",
]


def vocabulary() -> tuple[list[str], list[int]]:
    """(tokens, token types): 256 byte symbols, the merges' results, the specials; 320 in all."""
    from hicache.model.tokenizer import bytes_to_unicode  # the same byte alphabet hicache reads

    alphabet = bytes_to_unicode()
    tokens = [alphabet[b] for b in range(256)]
    known = set(tokens)
    for merge in MERGES:
        left, right = merge.split(" ")
        assert left in known and right in known and left + right not in known, merge
        tokens.append(left + right)
        known.add(left + right)
    tokens += SPECIALS
    assert len(tokens) % 32 == 0, len(tokens)
    return tokens, [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)


def logit_ids() -> list[int]:
    """The 24 token ids whose logits are recorded: normal (non-special) tokens, seeded."""
    tokens, _ = vocabulary()
    rng = np.random.default_rng(SEED + 1)
    return [int(i) for i in rng.integers(0, len(tokens) - len(SPECIALS), N_LOGIT_IDS)]


def random_tensors() -> dict[str, np.ndarray]:
    """GGUF name -> float32 array of numpy shape [out, in] (norms: [n])."""
    vocab = len(vocabulary()[0])
    rng = np.random.default_rng(SEED)

    def normal(shape, std):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm(n):
        return (1.0 + normal((n,), 0.05)).astype(np.float32)

    out = {"token_embd.weight": normal((vocab, HIDDEN), 0.05)}
    for i in range(LAYERS):
        p = f"blk.{i}."
        out[p + "attn_norm.weight"] = norm(HIDDEN)
        out[p + "attn_q.weight"] = normal((HEADS * HEAD_DIM, HIDDEN), 0.1)
        out[p + "attn_k.weight"] = normal((KV_HEADS * HEAD_DIM, HIDDEN), 0.1)
        out[p + "attn_v.weight"] = normal((KV_HEADS * HEAD_DIM, HIDDEN), 0.02)
        out[p + "attn_output.weight"] = normal((HIDDEN, HEADS * HEAD_DIM), 0.02)
        out[p + "ffn_norm.weight"] = norm(HIDDEN)
        out[p + "ffn_gate.weight"] = normal((FFN, HIDDEN), 0.02)
        out[p + "ffn_up.weight"] = normal((FFN, HIDDEN), 0.02)
        out[p + "ffn_down.weight"] = normal((HIDDEN, FFN), 0.02)
    out["output_norm.weight"] = norm(HIDDEN)
    out["output.weight"] = normal((vocab, HIDDEN), 0.05)
    return out


def write_f32(path: Path) -> None:
    import gguf

    tokens, types = vocabulary()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama-random")
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    w.add_vocab_size(len(tokens))
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(ROPE_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, array in random_tensors().items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """``np.savez`` with fixed zip timestamps, so the same arrays give the same bytes."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for key, array in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(array), allow_pickle=False)
            z.writestr(zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0)), buf.getvalue())


def tensor_types(path: Path) -> dict[str, int]:
    import gguf

    return dict(sorted(collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors).items()))


def check_hicache_f32(path: Path) -> None:
    """hicache builds the model and a tokenizer that round-trips text (raises otherwise)."""
    import torch

    sys.path.insert(0, str(ROOT / "src"))
    from hicache.model.gguf_loader import load_gguf

    model, tok, spec = load_gguf(path, torch.float32, "cpu")
    assert (spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (HIDDEN, HEADS, KV_HEADS, HEAD_DIM)
    assert not spec.tie_word_embeddings and spec.vocab_size == len(vocabulary()[0])
    for text in TOKENIZER_TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text, (text, ids)
    print(f"hicache loads the F32 file; 'hello world' -> {tok.encode('hello world')}")


def run_peer(peer_python: str, job: dict) -> dict:
    proc = subprocess.run([peer_python, str(Path(__file__).resolve()), "--peer"], input=json.dumps(job),
                          capture_output=True, text=True, env={**os.environ, "PYTHONNOUSERSITE": "1"})
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-8000:])
        raise SystemExit(f"the llama.cpp step failed (exit {proc.returncode})")
    return json.loads(proc.stdout)


def peer_main() -> None:
    """The llama.cpp side, in .venv-peers: quantize, record logits, tokenize. JSON in, JSON out."""
    import llama_cpp

    job = json.load(sys.stdin)
    result: dict = {"version": llama_cpp.__version__, "tokenize": {}}
    for name, ftype in job["quantize"].items():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        params.nthread = 2
        rc = llama_cpp.llama_model_quantize(job["f32"].encode(), job["files"][name].encode(), params)
        if rc != 0:
            raise SystemExit(f"llama_model_quantize to {name} failed: {rc}")
    logits = {}
    for name, path in job["files"].items():
        llm = llama_cpp.Llama(model_path=path, logits_all=True, n_ctx=64, n_threads=2, verbose=False)
        llm.eval(job["ids"])
        logits[name] = np.array(llm.scores[: len(job["ids"])], dtype=np.float32)
        if name == "F32":
            for text in job["texts"]:
                result["tokenize"][text] = llm.tokenize(text.encode(), add_bos=False, special=True)
        llm.close()
    save_npz(Path(job["logits"]), logits)
    json.dump(result, sys.stdout)


def compare(files: dict[str, Path], ids: list[int], cpp: dict[str, np.ndarray], cpp_tokens: dict) -> None:
    """hicache's float32 logits on each file vs llama.cpp's; the two tokenizers on a few texts."""
    import torch

    sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]  # tests/dense_forward.py: the reference prefill
    from dense_forward import prefill_logits

    from hicache.model.gguf_loader import load_gguf

    torch.set_num_threads(2)
    ours = {}
    print("\nhicache (float32, load_gguf + prefill_logits) vs llama.cpp on the same file; "
          "diffs in units of llama.cpp's logit std:")
    print(f"{'file':>7} {'std':>6} {'max|d|':>8} {'max/std':>8} {'mean/std':>8} {'argmax=':>7} "
          f"{'cpp vs cpp-F32 max/std':>22} {'ours vs ours-F32 max/std':>24}")
    for name, path in files.items():
        try:
            model, _, _ = load_gguf(path, torch.float32, "cpu")
            with torch.no_grad():
                ours[name] = prefill_logits(model, ids).float().numpy()
        except Exception as e:  # report, do not stop: this checks hicache, not the fixtures
            print(f"{name:>7} hicache cannot load it: {type(e).__name__}: {e}")
            continue
        ref = cpp[name]
        std = float(ref.std())
        d = np.abs(ours[name] - ref)
        agree = int((ours[name].argmax(-1) == ref.argmax(-1)).sum())
        q_cpp = np.abs(ref - cpp["F32"]).max() / std
        q_ours = np.abs(ours[name] - ours["F32"]).max() / std if "F32" in ours else float("nan")
        print(f"{name:>7} {std:>6.3f} {d.max():>8.5f} {d.max() / std:>8.4f} {d.mean() / std:>8.4f} "
              f"{agree:>4}/{len(ids)} {q_cpp:>22.4f} {q_ours:>24.4f}")
    f32 = cpp["F32"]
    print(f"llama.cpp F32 logits: std {f32.std():.3f}, top token per position {f32.argmax(-1).tolist()}")
    tok = load_gguf(files["F32"], torch.float32, "cpu", weights=False)[1]
    print("\ntokenizers (hicache vs llama.cpp, special tokens parsed):")
    for text, theirs in cpp_tokens.items():
        mine = tok.encode(text)
        print(f"  {'same' if mine == theirs else 'DIFFERENT'}: {text!r} -> {mine}" + ("" if mine == theirs else f" vs {theirs}"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=str(ROOT / "tests" / "data" / "gguf"))
    ap.add_argument("--peer-python", default=str(ROOT / ".venv-peers" / "bin" / "python"))
    ap.add_argument("--no-compare", action="store_true", help="skip the hicache vs llama.cpp comparison")
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)  # internal: the llama.cpp side
    args = ap.parse_args()
    if args.peer:
        peer_main()
        return
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = logit_ids()
    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "tiny-llama-F32.gguf"
        write_f32(f32)
        check_hicache_f32(f32)
        files = {name: out_dir / f"tiny-llama-{name}.gguf" for name in FTYPES}
        job = {"f32": str(f32), "quantize": FTYPES, "files": {"F32": str(f32), **{k: str(v) for k, v in files.items()}},
               "ids": ids, "texts": TOKENIZER_TEXTS, "logits": str(Path(tmp) / "logits.npz")}
        result = run_peer(args.peer_python, job)
        with np.load(job["logits"]) as z:
            cpp = {k: z[k] for k in z.files}
        save_npz(out_dir / "llama_cpp_logits.npz",
                 {"token_ids": np.array(ids, dtype=np.int32), **{k: cpp[k] for k in FTYPES}})
        print(f"llama-cpp-python {result['version']}; logit token ids: {ids}")
        print(f"\n{'file':<26} {'bytes':>9}  tensors per ggml type")
        total = 0
        for name, path in {"F32 (temporary)": f32, **files}.items():
            size = path.stat().st_size
            total += size if path.parent == out_dir else 0
            counts = ", ".join(f"{t} {n}" for t, n in tensor_types(path).items())
            print(f"{path.name if path.parent == out_dir else name:<26} {size:>9}  {counts}")
        npz_size = (out_dir / "llama_cpp_logits.npz").stat().st_size
        print(f"{'llama_cpp_logits.npz':<26} {npz_size:>9}\ncommitted total: {total + npz_size} bytes")
        if not args.no_compare:
            compare({"F32": f32, **files}, ids, cpp, result["tokenize"])


if __name__ == "__main__":
    main()
