"""The grammar vetting worker: a process of its own that compiles untrusted grammars.

Run as a script (``python -I grammar_worker.py``) by :class:`hicache.runtime.grammar_vet.GrammarVetter`,
never imported by the engine: it imports only the standard library, numpy, ``tokenizers`` and
llguidance, so it starts in a fraction of a second and a native crash, a runaway compile or its
memory stays here.

Protocol on stdin/stdout: messages of a 4-byte big-endian length and UTF-8 JSON. The first one in
is the configuration (the token table, the tokenizer's JSON, its vocabulary and EOS ids, the
limits: ``grammar_vet.tokenizer_config``); the worker
answers ``{"ready": true}``. Then each job ``{"kind", "source"}`` gets one verdict:

- ``{"ok": false, "error": one sentence}``; or
- ``{"ok": true, "grammar": llguidance's grammar text, "template_bytes", "request_bytes",
  "mask_us", "compile_ms", "steps"}``: the grammar compiled, its first mask allows a token, and a
  walk of up to ``walk_steps`` tokens it allows kept it usable. ``template_bytes``: bytes malloc
  holds more after the matcher was built and computed its first mask (glibc ``mallinfo2``; RSS
  where that is missing); ``request_bytes``: more again after a copy of it walked (what each
  request's own matcher adds: clones share the template's lexer); ``mask_us``: the slowest mask
  of the walk (the cost one step pays for one request of this grammar); ``compile_ms``: compile,
  first matcher and first mask.

Times are CPU time of this process (``time.process_time_ns``: every thread of it, so work
llguidance might hand to a thread of its own counts too; the main thread only waits meanwhile),
never wall-clock time: this process runs at the lowest priority, and on a busy machine its wall
clock mostly measures the other processes (a trivial schema's mask read 20-35 ms under load,
over the 20 ms budget; its CPU time stays well under a millisecond).

Limits set here, before any job: ``RLIMIT_AS`` (address space now + the memory limit), no core
files, a lower priority (``nice``) than the engine; each job runs on a thread whose stack is
``stack_bytes`` (the engine's grammar threads have several times more, so what passes here cannot
overflow there). The time limit is the parent's (CPU time of this process): it kills this process.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import random
import resource
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, Callable, Optional

import numpy as np

SENTENCE_CHARS = 300  # an error sentence is cut here (llguidance's can quote the whole grammar)
RETIME_FLOOR_US = 1_000  # a walk's new slowest mask over this is timed again (Vetter.timed_mask)
RETIMES = 2


def read_message(read: Callable[[int], Optional[bytes]]) -> Optional[dict]:
    """One message; ``read(n)``: the next ``n`` bytes (fewer, or None: the stream ended)."""
    header = read(4)
    if header is None or len(header) < 4:
        return None
    body = read(struct.unpack(">I", header)[0])
    return None if body is None else json.loads(body.decode())


def write_message(stream: BinaryIO, message: dict) -> None:
    body = json.dumps(message).encode()
    stream.write(struct.pack(">I", len(body)) + body)
    stream.flush()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _heap_meter():
    """A function giving the bytes the process's allocator holds in use (glibc's ``mallinfo2``:
    small and mapped blocks), or its resident set size where that is not available."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2

        def in_use() -> int:
            info = libc.mallinfo2()
            return info.uordblks + info.hblkhd

        in_use()
        return in_use, getattr(libc, "malloc_trim", None)
    except (OSError, AttributeError):
        page = os.sysconf("SC_PAGE_SIZE")
        return (lambda: int(open("/proc/self/statm").read().split()[1]) * page), None


def first_line(error: object) -> str:
    """llguidance's error as one sentence: its first line, and the parser's ``error:`` line where it
    names the cause on a later one (under a caret drawing)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    head = lines[0].rstrip(":.") if lines else "unknown error"
    cause = next((line.removeprefix("error:").strip() for line in lines[1:] if line.startswith("error:")), "")
    text = (f"{head}: {cause}" if cause else head).rstrip(".")
    return (text[:SENTENCE_CHARS] + "...") if len(text) > SENTENCE_CHARS else text + "."


class Vocabulary:
    """What ``llguidance.TokenizerWrapper`` reads: the engine's token table (a config of
    ``grammar_vet.tokenizer_config``, in this worker or on a rank) and ``encode`` (text -> ids, no
    special tokens added)."""

    def __init__(self, config: dict, encode: Callable[[str], list[int]]) -> None:
        self.tokens = [t.encode("latin-1") for t in config["tokens"]]
        self.special_token_ids = config["special"]
        self.eos_token_id, self.bos_token_id = config["eos"][0], None
        self._encode = encode

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # (TokenizerWrapper probes bytes first: it then passes text)
            raise TypeError("text only")
        return self._encode(text)


def ll_tokenizer(llguidance: Any, config: dict, encode: Callable[[str], list[int]]) -> Any:
    """llguidance's tokenizer over our token table (see :class:`Vocabulary`)."""
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary(config, encode)),
                                  n_vocab=config["vocab_size"], eos_token=config["eos"])


def token_bits(matcher: Any, vocab_size: int) -> np.ndarray:
    """What ``matcher`` allows next: one 0/1 byte per token id of the vocabulary."""
    return np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")[:vocab_size]


class Vetter:
    def __init__(self, config: dict) -> None:
        import llguidance
        from tokenizers import Tokenizer

        self.lg, self.config = llguidance, config
        backend = Tokenizer.from_str(config["tokenizer"])
        self.tokenizer = ll_tokenizer(llguidance, config,
                                      lambda text: backend.encode(text, add_special_tokens=False).ids)
        self.limits = llguidance.LLParserLimits(**config["parser_limits"])
        self.eos = set(config["eos"])
        self.in_use, self.trim = _heap_meter()

    def compile(self, kind: str, source: str) -> str:
        """llguidance's grammar text for a request's ``kind`` and ``source``; ValueError if it has none."""
        lg = self.lg
        if kind == "json_schema":
            grammar = lg.LLMatcher.grammar_from_json_schema(source, defaults=self.config["json_options"])
        else:
            grammar = lg.grammar_from({"regex": "regex", "ebnf": "gbnf", "lark": "lark"}[kind], source)
        is_error, messages = lg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer, limits=self.limits)
        if is_error:
            raise ValueError(messages[0] if messages else "the grammar is not valid")
        return grammar

    def allowed(self, matcher: Any) -> np.ndarray:
        return np.flatnonzero(token_bits(matcher, self.config["vocab_size"]))

    def answer(self, job: dict) -> dict:
        """The verdict on ``job`` (:meth:`vet`'s), or the sentence for what its compile raised."""
        try:
            return self.vet(job["kind"], job["source"])
        except MemoryError:
            return {"ok": False, "error": f"the {job['kind']} grammar needs more than its memory limit to compile."}
        except Exception as e:  # llguidance raising for a grammar: its message, not a traceback
            return {"ok": False, "error": f"the {job['kind']} grammar cannot be compiled: {first_line(e)}"}

    def vet(self, kind: str, source: str) -> dict:
        what = f"the {kind} grammar"
        t0 = time.process_time_ns()
        try:
            grammar = self.compile(kind, source)
        except ValueError as e:
            return {"ok": False, "error": f"{what} cannot be compiled: {first_line(e)}"}
        gc.collect()
        before = self.in_use()
        template = self.lg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        first = self.allowed(template)
        error = template.get_error() if template.is_error() else ""
        if not len(first) or error.startswith("NoExtensionBias"):  # (llguidance: no token can start it)
            return {"ok": False, "error": f"{what} matches nothing this model's vocabulary can spell."}
        if error:
            return {"ok": False, "error": f"{what} cannot be compiled: {first_line(error)}"}
        compile_ms = (time.process_time_ns() - t0) / 1e6
        built = self.in_use()
        walk = self.walk(template.deep_copy())
        if isinstance(walk, str):
            return {"ok": False, "error": f"{what} cannot be enforced: {walk}"}  # (walk ends with a period)
        steps, mask_us = walk
        template_bytes, request_bytes = max(built - before, 0), max(self.in_use() - built, 0)
        return {"ok": True, "grammar": grammar, "template_bytes": template_bytes, "request_bytes": request_bytes,
                "mask_us": mask_us, "compile_ms": compile_ms, "steps": steps}

    def timed_mask(self, matcher: Any, slowest: int) -> tuple[np.ndarray, int]:
        """What ``matcher`` allows next and its cost in CPU microseconds. A cost that would raise
        ``slowest`` past :data:`RETIME_FLOOR_US` is measured :data:`RETIMES` more times on the same
        state and the least kept: a mask is a pure function of the state, while in a VM the time the
        host takes a preempted vCPU away can count as this process's CPU time (CI: one ~0.6 ms mask
        of a trivial schema read 21 ms). A grammar that is slow is slow every time (a ~40 ms mask
        repeats at 35-45 ms), so this never lets one through."""
        best = sys.maxsize
        for _ in range(1 + RETIMES):
            t0 = time.process_time_ns()
            allowed = self.allowed(matcher)
            cost = (time.process_time_ns() - t0) // 1000
            best = min(best, cost)
            if best <= max(slowest, RETIME_FLOOR_US):
                break
        return allowed, best

    def walk(self, matcher: Any) -> tuple[int, int] | str:
        """Up to ``walk_steps`` tokens the grammar allows (a seeded choice, EOS last), each mask
        timed: (steps, slowest mask in CPU microseconds), or why the matcher failed on the way."""
        pick = random.Random(0)
        slowest, taken = 0, 0
        for _ in range(self.config["walk_steps"]):
            allowed, mask_us = self.timed_mask(matcher, slowest)
            slowest = max(slowest, mask_us)
            if matcher.is_error():
                return f"after {taken} token(s) its matcher fails: {first_line(matcher.get_error())}"
            choices = [int(t) for t in allowed[:4096] if int(t) not in self.eos]
            if not choices:
                break  # only EOS (or nothing but the end) is left: a complete output
            if not matcher.consume_token(pick.choice(choices)) or matcher.is_error():
                return f"after {taken + 1} token(s) its matcher fails: {first_line(matcher.get_error())}"
            taken += 1
        return taken, slowest


def _apply_limits(config: dict) -> None:
    with contextlib.suppress(OSError, AttributeError):  # die with the engine (Linux): a compile must not outlive it
        ctypes.CDLL("libc.so.6").prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    if os.getppid() != config["parent"]:
        sys.exit(0)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    with contextlib.suppress(OSError):
        os.nice(config["nice"])
    page = os.sysconf("SC_PAGE_SIZE")
    address_space = int(open("/proc/self/statm").read().split()[0]) * page
    limit = address_space + config["stack_bytes"] + config["memory_bytes"]
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main() -> int:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    config = read_message(stdin.read)
    if config is None:
        return 1
    vetter = Vetter(config)
    _apply_limits(config)
    threading.stack_size(config["stack_bytes"])  # the jobs' thread's
    jobs = ThreadPoolExecutor(1, "vet")
    write_message(stdout, {"ready": True})
    while (job := read_message(stdin.read)) is not None:
        write_message(stdout, jobs.submit(vetter.answer, job).result())
        gc.collect()
        if vetter.trim is not None:
            vetter.trim(0)  # give the job's memory back, so the next job's figures start low
    return 0


if __name__ == "__main__":
    sys.exit(main())
