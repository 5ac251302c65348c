"""hicache vs. llama.cpp (native: llama-bench / llama-server; and llama-cpp-python) vs. transformers
on the same GGUF file and the same token ids, measured side by side in one run. ``make bench-peers``
builds the peers and runs it.

    python benchmarks/bench_peers.py [--parts a,b,c,d] [--quick] [--json out/bench-peers.json]
                                     [--peers llama.cpp,llama.cpp-native,transformers]
                                     [--peers-python .venv-peers/bin/python] [--llama-bin .venv-peers/bin]
                                     [--gguf PATH | --quantize Q4_K_M]

Peers: ``llama.cpp`` is llama-cpp-python (the Python binding, its own older llama.cpp);
``llama.cpp-native`` is llama.cpp's own ``llama-bench`` (parts b, c) and ``llama-server`` (part d),
built by ``make peers-setup`` into ``--llama-bin`` (``benchmarks/peers_llamacpp_native.py``; skipped
with a note where the binaries are not there); ``transformers`` runs parts a-c only.

Every engine runs the same file: the embedded SmolLM2 (Q4_1) unless ``--gguf`` names another;
``--quantize TYPE`` first makes a TYPE copy of it with llama.cpp's own quantizer (a Q4_K_M
SmolLM2 has Q5_0, Q4_K, Q6_K and Q8_0 tensors: its 576-wide rows fall back from K-quants).

(a) multi-turn agent workload, in-process: 2 groups x 2 conversations, each group sharing a
    1,024-token system prompt; 4 turns, each appending 64 user token ids (seeded random ordinary
    vocabulary ids) to the conversation so far, which holds the previous turns' 32 greedy output
    tokens; one request at a time, round-robin over the 4 conversations (groups interleaved).
    Mean TTFT and mean TTFT per turn. hicache: ``Engine(<the file>)``, default config, TTFT = the
    result's ``ttft_s`` (request arrival to first token).
    llama.cpp: ``Llama`` with a ``LlamaRAMCache`` (n_ctx 8192, one thread per core), TTFT = the
    first streamed chunk of ``create_completion``. transformers: the GGUF file loaded with
    ``from_pretrained(gguf_file=...)`` (dequantized, float32), every turn a full-prompt prefill
    (no KV reuse across turns), TTFT = the first token out of ``generate``. Each engine appends
    its own greedy output to its conversations (EOS banned or ignored: always 32 tokens), so the
    prompts have the same lengths and the same system / user ids everywhere.
(b) cold prefill of 1K and 4K random tokens, one output token (caches flushed / reset).
    llama.cpp-native: ``llama-bench -p 1024,4096 -n 0 -r <repeats>`` (random ids into a fresh
    context; no sampling), every sample kept.
(c) decode tokens/s at batch 1: 64 tokens after a 32-token prompt. llama.cpp-native: ``llama-bench
    -p 0 -n 64 -d 32 -r <repeats>`` (the model step alone, no sampling), median of the repetitions.
(d) the workload of (a) over HTTP: ``hicache bench`` (generated-shared-prefix, the same flags)
    against ``hicache serve``, llama.cpp's own ``llama-server -np <concurrency> -c 8192*<concurrency>
    --cache-reuse 256`` (continuous batching over that many slots, per-slot prompt caching, its RAM
    prompt cache; it takes the client's ``ignore_eos`` as is) and llama-cpp-python's OpenAI server
    (``python -m llama_cpp.server --cache true``: one request at a time, through
    ``peers_llamacpp_server.py``, which maps ``ignore_eos`` to the server's ``min_tokens``), at max
    concurrency 1 and 4; mean TTFT, median ITL.

The llama.cpp side runs in ``--peers-python`` (its own venv) through
``benchmarks/peers_llamacpp.py`` (JSON job on stdin, JSON result on stdout).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

# No progress bars (transformers' GGUF conversion): tqdm reads this when it is first imported.
os.environ.setdefault("TQDM_DISABLE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))

from hicache import Engine, SamplingParams  # noqa: E402
from hicache.config import EngineConfig  # noqa: E402
from hicache.device import cpu_description  # noqa: E402
from hicache.model.packaged import packaged_model_path  # noqa: E402

if HERE not in sys.path:
    sys.path.insert(1, HERE)
import peers_llamacpp_native as native  # noqa: E402

BAN = [0, 2]  # <|endoftext|>, <|im_end|>: the EOS tokens llama.cpp stops at; banned so every turn has its length
PEERS = ("llama.cpp", "llama.cpp-native", "transformers")
SERVED = ("llama.cpp-native", "llama.cpp")  # the peers part (d) serves, in column order


# ---- machine --------------------------------------------------------------------------
def machine_header(hicache_dtype: str, llama_version: str) -> str:
    import torch
    import transformers

    return (f"{cpu_description()} | torch {torch.__version__} ({torch.get_num_threads()} threads) | "
            f"transformers {transformers.__version__} | hicache dtype: {hicache_dtype} | "
            f"llama-cpp-python {llama_version}")


def cpu_busy(seconds: float = 2.0) -> float:
    """Fraction of all cores busy over ``seconds`` (from /proc/stat); -1 when unreadable."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat", encoding="utf-8") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + (v[4] if len(v) > 4 else 0)  # total, idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return -1.0
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


def wait_idle(limit_s: float) -> float:
    """Wait (at most ``limit_s``) until other processes leave the CPU (< 10% busy); the last reading."""
    deadline = time.monotonic() + limit_s
    busy = cpu_busy()
    while busy > 0.10 and time.monotonic() < deadline:
        print(f"waiting for an idle CPU ({busy:.0%} busy) ...", file=sys.stderr, flush=True)
        time.sleep(10)
        busy = cpu_busy()
    return busy


def hicache_revision() -> str:
    """The commit the hicache figures come from, and whether src/ differs from it."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown revision"
    return f"commit {rev}" + (" + uncommitted changes in src/" if dirty else "")


# ---- workload -------------------------------------------------------------------------
def make_workload(args: argparse.Namespace, vocab: int) -> dict:
    """Token ids for all parts, from one seed."""
    rng = np.random.default_rng(args.seed)

    def ids(n: int) -> list[int]:
        return rng.integers(100, vocab, n).tolist()

    systems = [ids(args.system_len) for _ in range(args.groups)]
    convs = [{"group": g, "turns": [ids(args.question_len) for _ in range(args.turns)]}
             for _ in range(args.per_group) for g in range(args.groups)]  # groups interleaved
    order = [[c, t] for t in range(args.turns) for c in range(len(convs))]
    cold = [ids(n) for n in args.cold_sizes for _ in range(args.repeats)]
    return {"warmup": ids(64), "ban": BAN,
            "agent": {"systems": systems, "conversations": convs, "order": order, "output_len": args.output_len},
            "cold": cold, "decode": {"prompt": ids(32), "tokens": args.decode_tokens}}


def run_agent(generate, wl: dict) -> list[dict]:
    """Drive the agent workload through ``generate(prompt_ids, n) -> (ttft_s, output_ids, cached)``."""
    a = wl["agent"]
    history = [list(a["systems"][c["group"]]) for c in a["conversations"]]
    out = []
    for conv, turn in a["order"]:
        history[conv] += a["conversations"][conv]["turns"][turn]
        prompt = list(history[conv])
        ttft, output, cached = generate(prompt, a["output_len"])
        history[conv] += output
        out.append({"conv": conv, "turn": turn, "prompt_tokens": len(prompt), "ttft_s": ttft,
                    "output_ids": output, "cached_tokens": cached})
    return out


# ---- hicache, in-process --------------------------------------------------------------
def engine_options(flags: str) -> dict:
    """Engine keyword options from CLI flags (``--hicache-args "--decode-weight-dtype bfloat16"``)."""
    parser = argparse.ArgumentParser(prog="--hicache-args")
    EngineConfig.add_cli_args(parser)
    cfg = EngineConfig.from_cli_args(parser.parse_args(shlex.split(flags)))
    default = EngineConfig()
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if getattr(cfg, f.name) != getattr(default, f.name) and f.name != "model"}


def run_hicache(wl: dict, parts: set[str], flags: str, gguf: str) -> dict:
    engine = Engine(gguf, **engine_options(flags))
    res: dict = {"dtype": f"{engine.config.dtype}, KV {engine.config.kv_cache_dtype}"}

    def gen(ids: list[int], n: int):
        return engine.generate([ids], SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))[0]

    gen(wl["warmup"], 2)
    if "a" in parts:
        engine.flush_cache()

        def agent_gen(ids, n):
            r = gen(ids, n)
            return r.ttft_s, list(r.output_ids), r.cached_tokens

        res["agent"] = run_agent(agent_gen, wl)
    if "b" in parts:
        res["cold"] = []
        for ids in wl["cold"]:
            engine.flush_cache()
            res["cold"].append({"prompt_tokens": len(ids), "ttft_s": gen(ids, 1).ttft_s})
    if "c" in parts:
        engine.flush_cache()
        n = wl["decode"]["tokens"]
        r = gen(wl["decode"]["prompt"], n)
        res["decode"] = {"tokens": n, "tok_s": (r.completion_tokens - 1) / (r.e2e_s - r.ttft_s)}
    engine.shutdown()
    return res


def llamacpp_quantize(peers_python: str, src: str, qtype: str) -> str:
    """``src`` requantized to ``qtype`` by llama.cpp's ``llama_model_quantize`` (in the peers venv),
    as ``out/<name>.<qtype>.gguf``; an existing file is reused."""
    dst = os.path.join(ROOT, "out", f"{os.path.basename(src).split('.')[0]}.{qtype}.gguf")
    if not os.path.exists(dst):
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        code = ("import sys, llama_cpp as l\n"
                "p = l.llama_model_quantize_default_params()\n"
                "p.ftype = getattr(l, 'LLAMA_FTYPE_MOSTLY_' + sys.argv[3]); p.allow_requantize = True; p.nthread = 2\n"
                "sys.exit(l.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))")
        print(f"requantizing {os.path.basename(src)} to {qtype} with llama.cpp ...", file=sys.stderr, flush=True)
        subprocess.run([peers_python, "-c", code, src, dst, qtype.upper()], check=True, capture_output=True)
    return dst


# ---- llama.cpp, through the peers venv ------------------------------------------------
def run_llamacpp(wl: dict, parts: set[str], peers_python: str, gguf: str) -> dict:
    job = {"model": gguf, "n_ctx": 8192, "n_threads": os.cpu_count(), "ban": wl["ban"], "warmup": wl["warmup"]}
    if "a" in parts:
        job["agent"] = wl["agent"]
    if "b" in parts:
        job["cold"] = wl["cold"]
    if "c" in parts:
        job["decode"] = wl["decode"]
    proc = subprocess.run([peers_python, os.path.join(HERE, "peers_llamacpp.py")], input=json.dumps(job),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: the llama.cpp worker failed (status {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def llamacpp_version(peers_python: str) -> str:
    try:
        return subprocess.run([peers_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "not installed"


# ---- transformers, in-process ---------------------------------------------------------
def run_transformers(wl: dict, parts: set[str], gguf: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                 dtype=torch.float32)
    model.eval()
    res: dict = {"load_s": time.perf_counter() - t, "dtype": "float32"}

    class Times(BaseStreamer):
        """Wall time of each generated token (the first put() is the prompt)."""

        def __init__(self) -> None:
            self.calls, self.times = 0, []

        def put(self, value) -> None:
            self.calls += 1
            if self.calls > 1:
                self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    @torch.inference_mode()
    def gen(ids: list[int], n: int) -> tuple[float, list[float], list[int]]:
        x = torch.tensor([ids])
        st = Times()
        t0 = time.perf_counter()
        # min_new_tokens bans EOS until n tokens are out (as hicache's ignore_eos / llama.cpp's bias)
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, streamer=st, pad_token_id=2)
        return st.times[0] - t0, [s - t0 for s in st.times], out[0, len(ids):].tolist()

    gen(wl["warmup"], 2)
    if "a" in parts:
        def agent_gen(ids, n):
            ttft, _, output = gen(ids, n)
            return ttft, output, 0

        res["agent"] = run_agent(agent_gen, wl)
    if "b" in parts:
        res["cold"] = [{"prompt_tokens": len(ids), "ttft_s": gen(ids, 1)[0]} for ids in wl["cold"]]
    if "c" in parts:
        n = wl["decode"]["tokens"]
        _, times, _ = gen(wl["decode"]["prompt"], n)
        res["decode"] = {"tokens": n, "tok_s": (len(times) - 1) / (times[-1] - times[0])}
    return res


# ---- (d) HTTP: hicache bench against both servers -------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 5.0) -> int:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()
        return r.status


def start_server(cmd: list[str], url: str, log, timeout: float = 600.0) -> subprocess.Popen:
    """Start a server, wait for /v1/models, send one tiny warm-up completion."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"error: the server exited with status {proc.returncode}: {' '.join(cmd)}")
        try:
            if http(f"{url}/v1/models") == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.terminate()
            raise SystemExit(f"error: the server was not ready within {timeout:.0f} s: {' '.join(cmd)}")
        time.sleep(0.5)
    http(f"{url}/v1/completions", {"model": "smollm2", "prompt": "Hello there", "max_tokens": 2, "temperature": 0},
         timeout=300)
    return proc


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_http(args: argparse.Namespace, peers: set[str], gguf: str, logdir: str) -> dict:
    n = str(os.cpu_count())
    hicache = [sys.executable, "-m", "hicache.cli", "serve", "--host", "127.0.0.1", "--model", gguf,
               "--served-model-name", "smollm2", *shlex.split(args.hicache_args)]
    # `python -m llama_cpp.server` plus ignore_eos -> min_tokens (peers_llamacpp_server.py).
    # logits_all false: the default (true) keeps n_ctx x vocab logits, only needed for logprobs;
    # interrupt_requests false: by default a new request cuts the stream in flight short.
    llama_py = [args.peers_python, os.path.join(HERE, "peers_llamacpp_server.py"), "--model", gguf,
                "--model_alias", "smollm2", "--host", "127.0.0.1", "--n_ctx", "8192", "--n_threads", n,
                "--n_threads_batch", n, "--cache", "true", "--cache_type", "ram", "--logits_all", "false",
                "--interrupt_requests", "false", "--verbose", "false"]
    # server command by concurrency: llama-server gets one slot per concurrent request.
    servers = {"hicache": lambda conc: hicache}
    if "llama.cpp-native" in peers:
        servers["llama.cpp-native"] = lambda conc: native.server_cmd(args.llama_bin, gguf, conc, os.cpu_count())
    if "llama.cpp" in peers:
        servers["llama.cpp"] = lambda conc: llama_py
    out: dict = {"commands": {}}
    for name, command in servers.items():
        for conc in args.concurrency:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            base = command(conc)
            out["commands"][f"{name}/c{conc}"] = shlex.join(base)
            with open(os.path.join(logdir, f"{name}-c{conc}.log"), "w") as log:
                print(f"  (d) {name} server, max concurrency {conc} ...", file=sys.stderr, flush=True)
                proc = start_server(base + ["--port", str(port)], url, log)
                try:
                    rep_file = os.path.join(logdir, f"{name}-c{conc}.json")
                    cmd = [sys.executable, "-m", "hicache.cli", "bench", "--base-url", url, "--model", "smollm2",
                           "--gsp-num-groups", str(args.groups), "--gsp-prompts-per-group", str(args.per_group),
                           "--gsp-system-prompt-len", str(args.system_len),
                           "--gsp-question-len", str(args.question_len), "--gsp-output-len", str(args.output_len),
                           "--gsp-num-turns", str(args.turns), "--max-concurrency", str(conc),
                           "--seed", str(args.seed), "--disable-tqdm", "--output-file", rep_file]
                    if name == "hicache":
                        cmd.append("--flush-cache")  # drop the warm-up request's pages
                    r = subprocess.run(cmd, capture_output=True, text=True)
                    if r.returncode != 0 and not os.path.exists(rep_file):
                        raise SystemExit(f"error: hicache bench against {name} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
                    with open(rep_file, encoding="utf-8") as f:
                        out[f"{name}/c{conc}"] = json.load(f)
                finally:
                    stop_server(proc)
    return out


# ---- tables ---------------------------------------------------------------------------
def mean_ms(xs) -> float:
    xs = list(xs)
    return 1e3 * statistics.fmean(xs) if xs else float("nan")


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a and b and b == b and a == a else "-"


def print_table(title: str, note: str, head: list[str], rows: list[list[str]]) -> None:
    print(f"\n== {title} ==")
    if note:
        print(note)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths))))
    for r in rows:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))


def agreement(mine: list[dict], other: list[dict]) -> str:
    same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(mine, other))
    first = sum(a["output_ids"][:1] == b["output_ids"][:1] for a, b in zip(mine, other))
    return f"{same}/{len(mine)} replies identical, {first}/{len(mine)} first tokens identical"


def report(res: dict, args: argparse.Namespace) -> None:
    def having(key: str) -> list[str]:
        """hicache first, then the peers that measured ``key`` (none when hicache did not)."""
        if key not in res.get("hicache", {}):
            return []
        return ["hicache"] + [p for p in PEERS if key in res.get(p, {})]

    eng = having("agent")
    if eng:
        peers = eng[1:]
        turns = sorted({r["turn"] for r in res["hicache"]["agent"]})
        rows = []

        def line(label, pick, prompt):
            vals = {e: mean_ms(r["ttft_s"] for r in res[e]["agent"] if pick(r)) for e in eng}
            return [label, prompt] + [f"{vals[e]:.1f}" for e in eng] + [ratio(vals["hicache"], vals[p]) for p in peers]

        for t in turns:
            pt = statistics.fmean(r["prompt_tokens"] for r in res["hicache"]["agent"] if r["turn"] == t)
            hit = sum(r["cached_tokens"] for r in res["hicache"]["agent"] if r["turn"] == t) / max(
                1, sum(r["prompt_tokens"] for r in res["hicache"]["agent"] if r["turn"] == t))
            rows.append(line(f"turn {t + 1} (hicache hit {hit:.0%})", lambda r, t=t: r["turn"] == t, f"{pt:.0f}"))
        allp = statistics.fmean(r["prompt_tokens"] for r in res["hicache"]["agent"])
        rows.append(line("all requests", lambda r: True, f"{allp:.0f}"))
        print_table(
            f"(a) multi-turn agent workload, in-process: {args.groups} groups x {args.per_group} conversations x "
            f"{args.turns} turns, system {args.system_len} + {args.question_len}/turn, {args.output_len} greedy "
            "output tokens, one request at a time",
            "mean TTFT in ms (ratio < 1: hicache faster). transformers: full-prompt prefill every turn (no KV reuse "
            "across turns; its honest baseline). llama.cpp (llama-cpp-python): LlamaRAMCache + its in-context "
            "prefix reuse. llama.cpp-native runs this workload in part (d) only.",
            ["", "prompt tok"] + [f"{e} ms" for e in eng] + [f"hicache/{p}" for p in peers], rows)
        for p in peers:
            print(f"outputs {p} vs hicache: {agreement(res['hicache']['agent'], res[p]['agent'])}")

    eng = having("cold")
    if eng:
        peers = eng[1:]
        rows = []
        for n in args.cold_sizes:
            vals = {e: 1e3 * statistics.median(c["ttft_s"] for c in res[e]["cold"] if c["prompt_tokens"] == n)
                    for e in eng}
            rows.append([f"{n} tokens"] + [f"{vals[e]:.1f}" for e in eng]
                        + [ratio(vals["hicache"], vals[p]) for p in peers])
        print_table(f"(b) cold prefill, one output token (median of {args.repeats})",
                    "TTFT in ms, caches flushed (ratio < 1: hicache faster); llama.cpp-native: llama-bench's prompt "
                    "time (pp), no sampling",
                    [""] + [f"{e} ms" for e in eng] + [f"hicache/{p}" for p in peers], rows)

    eng = having("decode")
    if eng:
        peers = eng[1:]
        vals = {e: res[e]["decode"]["tok_s"] for e in eng}
        print_table(f"(c) decode at batch 1: {args.decode_tokens} tokens after a 32-token prompt",
                    "tokens/s after the first token (ratio > 1: hicache faster); llama.cpp-native: llama-bench tg "
                    f"at depth 32, median of {args.repeats} (the model step, no sampling)",
                    [""] + [f"{e} tok/s" for e in eng] + [f"hicache/{p}" for p in peers],
                    [["batch 1"] + [f"{vals[e]:.1f}" for e in eng] + [ratio(vals["hicache"], vals[p]) for p in peers]])

    if "http" in res:
        h = res["http"]
        cols = [p for p in SERVED if any(h.get(f"{p}/c{c}") for c in args.concurrency)]
        rows = []

        def row(label: str, x: float, ys: list[float]) -> list[str]:
            return [label, f"{x:.1f}"] + [f"{y:.1f}" for y in ys] + [ratio(x, y) for y in ys]

        for conc in args.concurrency:
            a, bs = h.get(f"hicache/c{conc}"), [h.get(f"{p}/c{conc}") for p in cols]
            if not a or not cols or not all(bs):
                continue
            for label, key, stat in (("mean TTFT ms", "ttft_ms", "mean"), ("median ITL ms", "itl_ms", "median"),
                                     ("mean E2E ms", "e2e_ms", "mean")):
                rows.append(row(f"c={conc} {label}", a[key][stat], [b[key][stat] for b in bs]))
            for t in a["by_turn"]:
                ys = [b["by_turn"].get(t, {}).get("ttft_ms", {}).get("mean", 0) for b in bs]
                rows.append(row(f"c={conc}   turn {t} mean TTFT ms", a["by_turn"][t]["ttft_ms"]["mean"], ys))
            rows.append(row(f"c={conc} output tok/s (ratio > 1: hicache faster)", a["output_throughput"],
                            [b["output_throughput"] for b in bs]))
            rows.append([f"c={conc} ok/failed, output tokens"]
                        + [f"{x['completed']}/{x['failed']}, {x['total_output_tokens']}" for x in [a, *bs]]
                        + [""] * len(bs))
        if rows:
            print_table(
                f"(d) the same workload over HTTP: hicache bench (generated-shared-prefix {args.groups}x{args.per_group}, "
                f"system {args.system_len}, question {args.question_len}, output {args.output_len}, {args.turns} turns)",
                f"hicache serve ({args.hicache_args or 'default config'}); llama.cpp-native: llama-server -np <c> "
                "-c 8192*<c> --cache-reuse 256 (continuous batching over c slots, RAM prompt cache, ignore_eos as "
                "sent); llama.cpp: python -m llama_cpp.server --cache true (RAM cache, one request at a time: more "
                "wait in its queue; ignore_eos mapped to its min_tokens); chat requests with text; "
                "ms rows: ratio < 1: hicache faster",
                ["", "hicache"] + cols + [f"hicache/{p}" for p in cols], rows)
        for key, rep_ in h.items():
            if key != "commands" and rep_.get("errors"):
                print(f"errors {key}: {rep_['errors']}")


def main() -> None:
    ap = argparse.ArgumentParser(description="hicache vs. llama.cpp vs. transformers on the same GGUF file and "
                                 "token ids (see the module docstring for the parts).")
    ap.add_argument("--parts", default="a,b,c,d", help="Comma-separated subset of a,b,c,d.")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help=f"Comma-separated subset of the peers ({', '.join(PEERS)}); llama.cpp-native is skipped "
                         "with a note where its binaries are not built.")
    ap.add_argument("--quick", action="store_true", help="2 turns, cold 1K only, 32 decode tokens, 1 repeat.")
    ap.add_argument("--peers-python", default=os.path.join(ROOT, ".venv-peers", "bin", "python"))
    ap.add_argument("--llama-bin", default=None, metavar="DIR",
                    help="Where llama-bench and llama-server are (default: the folder of --peers-python).")
    ap.add_argument("--json", default=None, help="Write every figure here.")
    ap.add_argument("--gguf", default=None, metavar="PATH",
                    help="The GGUF file every engine runs (default: the embedded SmolLM2, Q4_1).")
    ap.add_argument("--quantize", default=None, metavar="TYPE",
                    help="First requantize that file with llama.cpp's own quantizer to TYPE (Q4_K_M, Q5_K_M, "
                         "Q6_K, Q8_0, Q4_0, Q5_0...; into out/, reused if there) and run every engine on the result.")
    ap.add_argument("--hicache-args", default="", metavar="FLAGS",
                    help='Engine flags for hicache, in-process and served, e.g. "--decode-weight-dtype bfloat16".')
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--per-group", type=int, default=2)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--cold-sizes", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=2,
                    help="Cold prefill samples per size (median); llama-bench's -r for parts b and c.")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                    help="First wait up to this long for the CPU to be idle (other processes skew every figure).")
    if "--quick" in sys.argv[1:]:  # new defaults; flags given explicitly still win
        ap.set_defaults(turns=2, cold_sizes=[1024], decode_tokens=32, repeats=1)
    args = ap.parse_args()
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    peers = {p.strip() for p in args.peers.split(",") if p.strip()}
    if parts - set("abcd") or peers - set(PEERS):
        ap.error(f"--parts takes a,b,c,d; --peers takes {','.join(PEERS)}")
    need_llama = "llama.cpp" in peers or bool(args.quantize)
    if need_llama and not os.path.exists(args.peers_python):
        ap.error(f"{args.peers_python} not found: run `make peers-setup` (or pass --peers-python)")
    args.llama_bin = args.llama_bin or os.path.dirname(args.peers_python)
    native_note = ""
    if "llama.cpp-native" in peers and not native.binaries(args.llama_bin):
        peers.discard("llama.cpp-native")
        native_note = (f"llama.cpp-native skipped: no llama-bench / llama-server in {args.llama_bin} "
                       "(`make peers-setup` builds them, or pass --llama-bin)")
        print(f"note: {native_note}", file=sys.stderr, flush=True)
    elif "llama.cpp-native" in peers and not parts & set("bcd"):
        peers.discard("llama.cpp-native")  # part (a) only: nothing for it to run

    gguf = args.gguf or str(packaged_model_path("smollm2"))
    if args.quantize:
        gguf = llamacpp_quantize(args.peers_python, gguf, args.quantize)
    from hicache.model.gguf_loader import load_gguf_tokenizer

    vocab = len(load_gguf_tokenizer(Path(gguf)).backend.get_vocab())
    wl = make_workload(args, vocab)
    busy_before = wait_idle(args.wait_idle) if args.wait_idle > 0 else cpu_busy()
    t_start = time.perf_counter()
    res: dict = {}
    inproc = parts & set("abc")
    if inproc:
        print("running hicache in-process ...", file=sys.stderr, flush=True)
        res["hicache"] = run_hicache(wl, inproc, args.hicache_args, gguf)
        gc.collect()  # the engine and its KV pool go before the peers run
        if "llama.cpp" in peers:
            print("running llama.cpp (llama-cpp-python) ...", file=sys.stderr, flush=True)
            res["llama.cpp"] = run_llamacpp(wl, inproc, args.peers_python, gguf)
        if "llama.cpp-native" in peers and inproc & set("bc"):
            print("running llama.cpp-native (llama-bench) ...", file=sys.stderr, flush=True)
            res["llama.cpp-native"] = native.run(args.llama_bin, gguf, inproc, threads=os.cpu_count(),
                                                 cold_sizes=args.cold_sizes, repeats=args.repeats,
                                                 decode_tokens=args.decode_tokens,
                                                 decode_depth=len(wl["decode"]["prompt"]))
        if "transformers" in peers:
            print("running transformers ...", file=sys.stderr, flush=True)
            res["transformers"] = run_transformers(wl, inproc, gguf)
            gc.collect()
    if "d" in parts:
        logdir = tempfile.mkdtemp(prefix="bench-peers-")
        print(f"running (d) over HTTP (server logs and reports in {logdir}) ...", file=sys.stderr, flush=True)
        res["http"] = run_http(args, peers, gguf, logdir)

    dtype = res.get("hicache", {}).get("dtype") or _resolved_dtype()
    llama_v = (f"{res['llama.cpp']['version']} (ggml {res['llama.cpp']['ggml']})" if "llama.cpp" in res else None) or (llamacpp_version(args.peers_python) if need_llama else "-")
    print(f"\n# bench_peers: {os.path.basename(gguf)} (the same file for all), seed {args.seed}")
    print("# " + machine_header(dtype, llama_v))
    if "llama.cpp" in res:
        print(f"# llama.cpp: n_threads {res['llama.cpp']['n_threads']}, n_ctx 8192, computes on the file's weights; "
              f"system_info: {res['llama.cpp']['system_info']}")
    if "llama.cpp-native" in peers:
        info = res.get("llama.cpp-native", {}).get("info", {})
        line = f"# llama.cpp-native: {native.version(args.llama_bin)}"
        if info:
            fa = native.FLASH_ATTN.get(info["flash_attn"], info["flash_attn"])
            line += (f", n_threads {info['n_threads']}, batch {info['n_batch']}/{info['n_ubatch']}, "
                     f"KV {info['type_k']}/{info['type_v']}, flash_attn {fa}, {info['backends']}, {info['model_type']}; "
                     + "; ".join(res["llama.cpp-native"]["commands"]))
        print(line)
    if native_note:
        print(f"# note: {native_note}")
    if "transformers" in res:
        print(f"# transformers: GGUF dequantized to float32 on load ({res['transformers']['load_s']:.1f} s), "
              "generate(do_sample=False)")
    config = args.hicache_args or "default config"
    print(f"# hicache: Engine({os.path.basename(gguf)!r}) {config} (GGUF dequantized to {dtype}), {hicache_revision()}")
    if busy_before > 0.10:
        print(f"# WARNING: the CPU was {busy_before:.0%} busy before the run (other processes): figures are skewed")
    report(res, args)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s; CPU busy before the run {busy_before:.0%}, "
          f"load average after {os.getloadavg()[0]:.2f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "results": res}, f, indent=1)
        print(f"figures written to {args.json}", file=sys.stderr)


def _resolved_dtype() -> str:
    """What Engine(dtype="auto") picks on this machine's CPU (when part a-c did not run)."""
    import torch

    from hicache.device import resolve_dtype, resolve_kv_cache_dtype

    cpu = torch.device("cpu")
    dtype = resolve_dtype("auto", cpu)[0]
    return f"{dtype}, KV {resolve_kv_cache_dtype('auto', 'auto', dtype, cpu)[0]}"


if __name__ == "__main__":
    main()
