"""How closely hicache follows transformers and llama.cpp on one GGUF file (default: the packaged
Gemma 3 270M): tokenization and teacher-forced next-token choices, side by side in one run.

    python benchmarks/bench_model_agreement.py [--model gemma3-270m | PATH.gguf] [--prompts 20]
                                               [--peers-python .venv-peers/bin/python]

Tokenization: a fixed corpus (unicode, digits, whitespace runs, code, chat markup) and the prompts,
encoded by hicache (its tokenizer built from the GGUF metadata), by transformers' GGUF conversion of
the same file, and by llama.cpp (``Llama.tokenize``, special tokens parsed); the share of texts each
encodes exactly as hicache does. Next tokens: the prompts are paragraphs of this repository's docs
(real prose, up to ``--max-tokens`` tokens each, as hicache tokenizes them); every position's argmax
of hicache's float32 logits against transformers' (``from_pretrained(gguf_file=...)``: its own
dequantization, float32) and llama.cpp's (``logits_all``, the file's blocks), the same ids fed to all
three. The issue-47 targets: >= 98% with transformers, >= 95% with llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]  # tests/dense_forward.py: the reference prefill

import torch  # noqa: E402
from dense_forward import prefill_logits  # noqa: E402

from hicache.bench.corpus import TOKENIZER_CORPUS  # noqa: E402
from hicache.config import PassPrecision  # noqa: E402
from hicache.model import load_model  # noqa: E402
from hicache.model.packaged import PACKAGED, packaged_model_path  # noqa: E402



def doc_paragraphs(n: int, min_chars: int = 300) -> list[str]:
    """The first ``n`` prose paragraphs (>= min_chars, no code fences or tables) of docs/*.md."""
    out = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        for para in path.read_text(encoding="utf-8").split("\n\n"):
            if len(para) >= min_chars and not para.lstrip().startswith(("```", "|", "#", "-")):
                out.append(para.strip())
                if len(out) == n:
                    return out
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m", help="A packaged model name or a GGUF file.")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=256, help="Tokens of each prompt (teacher-forced).")
    ap.add_argument("--peers-python", default=str(ROOT / ".venv-peers" / "bin" / "python"))
    ap.add_argument("--json", default=None, help="Write the figures here.")
    ap.add_argument("--int8", action="store_true",
                    help="hicache multiplies the file's blocks with 8-bit inputs at every position (its decode "
                         "arithmetic, as llama.cpp's; deterministic inference puts every row on that path), "
                         "instead of float32 weights.")
    args = ap.parse_args()
    path = packaged_model_path(args.model) if args.model in PACKAGED else Path(args.model)
    texts = doc_paragraphs(args.prompts)

    t0 = time.perf_counter()
    ours = load_model(str(path), dtype=torch.float32,
                      precision=PassPrecision(decode_activations="int8" if args.int8 else "float32", deterministic=args.int8))
    tok = ours.tokenizer
    prompts = [tok.encode(t)[: args.max_tokens] for t in texts]
    mine = [prefill_logits(ours.model, ids).argmax(-1).tolist() for ids in prompts]
    print(f"hicache: {path.name}, {len(prompts)} prompts, {sum(map(len, prompts))} positions "
          f"({time.perf_counter() - t0:.0f} s)")
    report: dict = {"model": path.name, "positions": sum(map(len, prompts))}

    import transformers

    t0 = time.perf_counter()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    encoded = list(TOKENIZER_CORPUS) + texts
    same = [tok.encode(t) == hf_tok(t).input_ids for t in encoded]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = [hf(torch.tensor([ids])).logits[0].argmax(-1).tolist() for ids in prompts]
    report["transformers"] = _agreement(mine, theirs, same)
    _print("transformers", report["transformers"], time.perf_counter() - t0)
    del hf

    if Path(args.peers_python).exists():
        t0 = time.perf_counter()
        job = {"model": str(path), "n_ctx": max(map(len, prompts)) + 8, "n_threads": os.cpu_count(),
               "texts": encoded, "prompts": prompts}
        out = subprocess.run([args.peers_python, str(ROOT / "benchmarks" / "peers_logits.py")], input=json.dumps(job),
                             capture_output=True, text=True, check=True)
        peer = json.loads(out.stdout)
        report["llama.cpp"] = _agreement(mine, peer["top1"], [tok.encode(t) == ids for t, ids in
                                                             zip(encoded, peer["tokens"])])
        _print("llama.cpp", report["llama.cpp"], time.perf_counter() - t0)
    else:
        print(f"llama.cpp: skipped ({args.peers_python} not found: `make peers-setup` builds it)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _agreement(mine: list[list[int]], theirs: list[list[int]], same_tokens: list[bool]) -> dict:
    pairs = [(a, b) for m, t in zip(mine, theirs) for a, b in zip(m, t)]
    return {"top1_agreement": sum(a == b for a, b in pairs) / len(pairs),
            "texts_tokenized_alike": f"{sum(same_tokens)}/{len(same_tokens)}"}


def _print(name: str, figures: dict, seconds: float) -> None:
    print(f"{name}: next-token top-1 agreement {figures['top1_agreement']:.2%}, texts tokenized alike "
          f"{figures['texts_tokenized_alike']} ({seconds:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
