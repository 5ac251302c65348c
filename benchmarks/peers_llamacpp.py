"""llama.cpp side of ``bench_peers.py``: run by ``.venv-peers/bin/python`` (llama-cpp-python).

Reads one JSON job on stdin, prints one JSON result on stdout (nothing else goes to stdout).

Job (every part optional)::

    {"model": "/path/model.gguf", "n_ctx": 8192, "n_threads": 2, "ban": [0, 2],
     "warmup": [ids],
     "agent": {"systems": [[ids], ...],
               "conversations": [{"group": 0, "turns": [[ids], ...]}, ...],
               "order": [[conv, turn], ...], "output_len": 32},
     "cold": [[ids], ...],
     "decode": {"prompt": [ids], "tokens": 64},
     "lookup": {"prompts": [[ids], ...], "tokens": 160, "num_pred_tokens": 10}}

``ban``: token ids never sampled (logit bias -inf: the EOS tokens, so every request produces
exactly its max_tokens, as hicache's ``ignore_eos``). ``agent``: each request's prompt is the
conversation so far (system prompt, then per turn the user ids and the previous replies);
prompts are served with a ``LlamaRAMCache`` on the ``Llama`` object (plus llama.cpp's own reuse
of the KV it holds). ``cold``: each prompt with the cache off and the context reset, 1 output
token. ``decode``: tokens/s after the first token. ``lookup``: each prompt decoded greedily twice, plainly
and with prompt-lookup decoding (``LlamaPromptLookupDecoding``: drafts copied from the prompt and the
output so far); tokens/s after the first token and the output ids of each.

Result: {"version", "ggml", "system_info", "n_threads", "agent": [{"conv", "turn", "prompt_tokens",
"ttft_s", "output_ids"}], "cold": [{"prompt_tokens", "ttft_s"}], "decode": {"tokens", "tok_s"},
"lookup": [{"plain": {"tok_s", "output_ids"}, "lookup": {...}}]}.
"""

from __future__ import annotations

import json
import sys
import time


def stream_timed(llm, ids: list[int], max_tokens: int, ban: list[int]) -> tuple[float, float]:
    """(seconds to the first chunk with text, seconds to the end of the stream)."""
    bias = {int(t): float("-inf") for t in ban}
    t0 = time.perf_counter()
    first = None
    for chunk in llm.create_completion(prompt=ids, max_tokens=max_tokens, temperature=0.0, stream=True,
                                       logit_bias=bias or None):
        if first is None and chunk["choices"][0]["text"]:
            first = time.perf_counter() - t0
    end = time.perf_counter() - t0
    return (first if first is not None else end), end


def ggml_version(pkg_file: str) -> str:
    """The bundled ggml's version, from its shared library's name (lib/libggml.so.X.Y.Z)."""
    import glob
    import os

    names = glob.glob(os.path.join(os.path.dirname(pkg_file), "lib", "libggml.so.*.*"))
    return names[0].rsplit("libggml.so.", 1)[1] if names else "?"


def decode_timed(llm, ids: list[int], max_tokens: int) -> dict:
    """Greedy decode of ``ids`` (EOS allowed: the copy ends where the model ends it); tokens/s
    after the first token, and the output ids."""
    t0 = time.perf_counter()
    first, out = None, []
    for chunk in llm.create_completion(prompt=ids, max_tokens=max_tokens, temperature=0.0, stream=True):
        if first is None:
            first = time.perf_counter() - t0
        out.append(chunk["choices"][0]["text"])
    end = time.perf_counter() - t0
    output_ids = llm.tokenize("".join(out).encode(), add_bos=False, special=True)
    return {"tok_s": (len(output_ids) - 1) / max(end - first, 1e-9), "output_ids": output_ids}


def run_lookup(llm, job: dict, ban: list[int]) -> list[dict]:
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    lk = job["lookup"]
    n_threads = int(job["n_threads"])
    spec = llama_cpp.Llama(model_path=job["model"], n_ctx=int(job.get("n_ctx", 8192)), n_threads=n_threads,
                           n_threads_batch=n_threads, seed=0, verbose=False,
                           draft_model=LlamaPromptLookupDecoding(num_pred_tokens=int(lk.get("num_pred_tokens", 10))))
    records = []
    for ids in lk["prompts"]:
        row = {}
        for name, model in (("plain", llm), ("lookup", spec)):
            model.set_cache(None)
            model.reset()
            row[name] = decode_timed(model, ids, int(lk["tokens"]))
        records.append(row)
    return records


def main() -> None:
    job = json.load(sys.stdin)
    import llama_cpp

    n_threads = int(job["n_threads"])
    llm = llama_cpp.Llama(model_path=job["model"], n_ctx=int(job.get("n_ctx", 8192)), n_threads=n_threads,
                          n_threads_batch=n_threads, seed=0, verbose=False)
    ban = list(job.get("ban", []))
    out: dict = {"version": llama_cpp.__version__, "ggml": ggml_version(llama_cpp.__file__), "n_threads": n_threads,
                 "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}
    if job.get("warmup"):
        stream_timed(llm, job["warmup"], 2, ban)

    if job.get("agent"):
        a = job["agent"]
        cache = llama_cpp.LlamaRAMCache()
        llm.reset()
        llm.set_cache(cache)
        history = [list(a["systems"][c["group"]]) for c in a["conversations"]]
        records = []
        for conv, turn in a["order"]:
            history[conv] += a["conversations"][conv]["turns"][turn]
            prompt = list(history[conv])
            ttft, _ = stream_timed(llm, prompt, int(a["output_len"]), ban)
            # The cache's newest key is this request's prompt + completion tokens (exact ids).
            key = next(reversed(cache.cache_state))
            assert list(key[: len(prompt)]) == prompt
            output = list(key[len(prompt):])
            history[conv] += output
            records.append({"conv": conv, "turn": turn, "prompt_tokens": len(prompt), "ttft_s": ttft,
                            "output_ids": output})
        out["agent"] = records
        llm.set_cache(None)

    if job.get("cold"):
        llm.set_cache(None)
        out["cold"] = []
        for ids in job["cold"]:
            llm.reset()
            ttft, _ = stream_timed(llm, ids, 1, ban)
            out["cold"].append({"prompt_tokens": len(ids), "ttft_s": ttft})

    if job.get("decode"):
        d = job["decode"]
        llm.set_cache(None)
        llm.reset()
        n = int(d["tokens"])
        ttft, end = stream_timed(llm, d["prompt"], n, ban)
        out["decode"] = {"tokens": n, "tok_s": (n - 1) / (end - ttft)}

    if job.get("lookup"):
        out["lookup"] = run_lookup(llm, job, ban)

    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
