"""NGRAM vs llama.cpp's prompt-lookup decoding on the copy-heavy workload, side by side in one run.

    python benchmarks/bench_peers_lookup.py [--peers-python .venv-peers/bin/python] [--repeats 3]
                                            [--max-new-tokens 160] [--num-pred-tokens 10]

The prompts of ``bench_spec.py``'s ``copy`` workload (a JSON config to return with one field
changed; a function to repeat with its bug fixed), as token ids from hicache's chat template, go
to both engines on the same GGUF file (the embedded SmolLM2): hicache plain and with
``--speculative-algorithm NGRAM`` (in process, default config), llama.cpp plain and with
``LlamaPromptLookupDecoding`` (llama-cpp-python in its own venv, ``make peers-setup``), greedy.
Printed: decode tokens/s after the first token (medians over repeats), each engine's speedup
from its lookup, hicache NGRAM / llama.cpp lookup, and whether the engines' outputs agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

from bench_spec import COPY_TASKS, cpu_flags  # noqa: E402

from hicache import Engine, SamplingParams  # noqa: E402
from hicache.model.packaged import packaged_model_path  # noqa: E402


def hicache_runs(prompts: list[list[int]], max_new: int, ngram: bool) -> list[dict]:
    engine = Engine("smollm2", **({"speculative_algorithm": "NGRAM"} if ngram else {}))
    try:
        out = []
        for ids in prompts:
            engine.flush_cache()
            res = engine.generate([ids], SamplingParams(max_new_tokens=max_new, temperature=0.0))[0]
            out.append({"tok_s": (res.completion_tokens - 1) / (res.e2e_s - res.ttft_s), "output_ids": res.output_ids,
                        "accept": res.spec_accept_length})
        return out
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers-python", default=os.path.join(HERE, "..", ".venv-peers", "bin", "python"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--num-pred-tokens", type=int, default=10, help="LlamaPromptLookupDecoding's draft length")
    args = ap.parse_args()
    if not os.path.exists(args.peers_python):
        raise SystemExit(f"error: {args.peers_python} is missing: run `make peers-setup` first")
    gguf = str(packaged_model_path("smollm2"))
    probe = Engine("smollm2")
    prompts = [probe.tokenizer.encode(probe.tokenizer.apply_chat_template([{"role": "user", "content": t}]))
               for t in COPY_TASKS]
    probe.shutdown()
    print(f"bench_peers_lookup: SmolLM2 ({os.path.basename(gguf)}), {os.cpu_count()} CPUs (flags: {cpu_flags()}), "
          f"copy-heavy prompts of {[len(p) for p in prompts]} tokens, up to {args.max_new_tokens} new tokens")
    runs: dict[str, list[list[dict]]] = {"hicache": [], "hicache NGRAM": [], "llama.cpp": [], "llama.cpp lookup": []}
    job = {"model": gguf, "n_ctx": 4096, "n_threads": os.cpu_count(),
           "lookup": {"prompts": prompts, "tokens": args.max_new_tokens, "num_pred_tokens": args.num_pred_tokens}}
    for _ in range(args.repeats):
        runs["hicache"].append(hicache_runs(prompts, args.max_new_tokens, ngram=False))
        runs["hicache NGRAM"].append(hicache_runs(prompts, args.max_new_tokens, ngram=True))
        proc = subprocess.run([args.peers_python, os.path.join(HERE, "peers_llamacpp.py")], input=json.dumps(job),
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"error: the llama.cpp worker failed:\n{proc.stderr[-3000:]}")
        rows = json.loads(proc.stdout.strip().splitlines()[-1])["lookup"]
        runs["llama.cpp"].append([r["plain"] for r in rows])
        runs["llama.cpp lookup"].append([r["lookup"] for r in rows])

    def tok_s(name: str, i: int) -> float:
        return statistics.median(rep[i]["tok_s"] for rep in runs[name])

    print(f"\n{'prompt':<8}" + "".join(f"{n:>18}" for n in runs) + f"{'NGRAM / lookup':>16}{'outputs agree':>15}")
    for i in range(len(prompts)):
        agree = runs["hicache NGRAM"][0][i]["output_ids"] == runs["llama.cpp lookup"][0][i]["output_ids"]
        print(f"{i:<8}" + "".join(f"{tok_s(n, i):>14.1f} t/s" for n in runs)
              + f"{tok_s('hicache NGRAM', i) / tok_s('llama.cpp lookup', i):>15.2f}x{str(agree):>15}")
        print(f"{'':<8}speedups: hicache NGRAM {tok_s('hicache NGRAM', i) / tok_s('hicache', i):.2f}x "
              f"(accept length {runs['hicache NGRAM'][0][i]['accept']:.2f}), llama.cpp lookup "
              f"{tok_s('llama.cpp lookup', i) / tok_s('llama.cpp', i):.2f}x")


if __name__ == "__main__":
    main()
