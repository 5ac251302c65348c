"""Write a served model's tokenizer as a Hugging Face tokenizer directory, for clients that
count tokens themselves (SGLang's ``bench_serving`` and ``bench_multiturn.py``, ``--tokenizer DIR``):

    .venv/bin/python tools/export_tokenizer.py OUT_DIR [--model smollm2] [--sharegpt FILE]

``OUT_DIR`` gets ``tokenizer.json`` (the same tokenizer hicache encodes with: the same ids for
any text) and ``tokenizer_config.json`` (BOS / EOS tokens, whether BOS is prepended, the chat
template). ``--sharegpt FILE`` also writes a small ShareGPT-format file of generated
conversations, so ``bench_serving --dataset-name random --dataset-path FILE`` needs no download
(its random dataset cuts ShareGPT prompts to length). Nothing is fetched: the embedded model's
tokenizer is read from its GGUF file.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from hicache.model.loader import load_model

TOPICS = ("caching", "rivers", "compilers", "gardening", "trains", "music theory", "databases", "bread",
          "astronomy", "chess", "networking", "volcanoes", "poetry", "sailing", "operating systems", "bees")


def export(tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(out / "tokenizer.json"))
    name = tokenizer.backend.id_to_token
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              "bos_token": name(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None else None,
              "eos_token": name(min(tokenizer.eos_token_ids)) if tokenizer.eos_token_ids else None,
              "add_bos_token": tokenizer.add_bos, "chat_template": tokenizer.chat_template}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def sharegpt(path: Path, rows: int = 64, seed: int = 0) -> None:
    rng = random.Random(seed)
    data = []
    for i in range(rows):
        topic = rng.choice(TOPICS)
        question = (f"Question {i}: explain {topic} to a curious student, with three concrete examples, a short "
                    f"history, and the most common misconception about {topic}. ") * rng.randint(1, 3)
        answer = f"Here is an explanation of {topic}. " * rng.randint(2, 6)
        data.append({"id": str(i), "conversations": [{"from": "human", "value": question},
                                                      {"from": "gpt", "value": answer}]})
    path.write_text(json.dumps(data))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--model", default="smollm2", help="what `hicache serve --model` takes")
    ap.add_argument("--sharegpt", type=Path, help="also write a ShareGPT-format file of generated conversations")
    args = ap.parse_args()
    tokenizer = load_model(args.model, weights=False).tokenizer
    export(tokenizer, args.out_dir)
    print(f"wrote {args.out_dir}/tokenizer.json and tokenizer_config.json ({tokenizer.vocab_size} tokens)")
    if args.sharegpt:
        sharegpt(args.sharegpt)
        print(f"wrote {args.sharegpt}")


if __name__ == "__main__":
    main()
