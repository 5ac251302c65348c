"""llama.cpp side of ``bench_model_agreement.py``: run by ``.venv-peers/bin/python`` (llama-cpp-python).

Reads one JSON job on stdin, prints one JSON result on stdout::

    {"model": "/path/model.gguf", "n_ctx": 4096, "n_threads": 2, "texts": [str, ...], "prompts": [[ids], ...]}
    -> {"tokens": [[ids of each text, BOS as the file says, special tokens parsed]],
        "top1": [[the argmax of each position's logits, teacher-forced over each prompt]]}
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    job = json.load(sys.stdin)
    from llama_cpp import Llama

    llm = Llama(model_path=job["model"], n_ctx=job.get("n_ctx", 4096), n_threads=job.get("n_threads"),
                logits_all=True, verbose=False)
    tokens = [llm.tokenize(t.encode("utf-8"), add_bos=True, special=True) for t in job.get("texts", [])]
    top1 = []
    for ids in job.get("prompts", []):
        llm.reset()
        llm.eval(ids)
        top1.append([int(row.argmax()) for row in llm.scores[: len(ids)]])
    json.dump({"tokens": tokens, "top1": top1}, sys.stdout)


if __name__ == "__main__":
    main()
