"""Workloads for ``hicache bench``: generated shared-prefix multi-turn chats, and trace replay.

Text is random words drawn (seeded) from a small list. Lengths are in tokens of the server's
tokenizer when it offers ``/tokenize`` (hicache does), else approximated as one token per word.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Optional, Union

WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have or by one had not but "
    "what all were when we there can an your which their said if do will each about how up out them then she "
    "many some so these would other into has more her two like him see time could no make than first been its "
    "who now people my made over did down only way find use may water long little very after words called just "
    "where most know get through back much before go good new write our used me man too any day same right look "
    "think also around another came come work three word must because does part even place well such here take "
    "why things help put years different away again off went old number great tell men say small every found "
    "still between name should home big give air line set own under read last never us left end along while "
    "might next sound below saw something thought both few those always looked show large often together asked "
    "house world going want school important until form food keep children feet land side without boy once "
    "animals life enough took sometimes four head above kind began almost live page got earth need far hand high "
    "year mother light parts country father let night following picture being study second eyes soon times story "
    "boys since white days ever paper hard near sentence better best across during today others however sure "
    "means knew try told young miles sun ways thing whole hear example heard several change answer room sea "
    "against top turned learn point city play toward five using himself usually cache memory token layer model"
).split()


def random_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(num_words, 1)))


@dataclass
class Conversation:
    """One multi-turn chat: a system prompt shared by its group, one question per turn."""

    system: str
    questions: list[str]


def generated_shared_prefix(num_groups: int, prompts_per_group: int, system_prompt_len: int, question_len: int,
                            num_turns: int, seed: int, tokens_per_word: float = 1.0) -> list[Conversation]:
    """``num_groups * prompts_per_group`` conversations in a seeded random order. Lengths are in
    tokens; ``tokens_per_word`` converts them to words."""
    rng = random.Random(seed)
    system_words, question_words = (max(1, round(n / tokens_per_word)) for n in (system_prompt_len, question_len))
    convs = []
    for _ in range(num_groups):
        system = random_text(rng, system_words)
        for _ in range(prompts_per_group):
            qs = [random_text(rng, question_words) for _ in range(num_turns)]
            convs.append(Conversation(system, qs))
    rng.shuffle(convs)
    return convs


@dataclass
class TraceRequest:
    """One line of a trace file (JSON Lines)::

        {"timestamp": 0.0, "messages": [...], "max_tokens": 64, "turn": 1}
        {"timestamp": 0.8, "prompt": "text", "max_tokens": 16}

    ``timestamp`` is in seconds (only differences matter); ``messages`` goes to the chat
    endpoint, ``prompt`` to the completions endpoint; ``turn`` (optional, default 1) groups
    TTFT by turn in the report.
    """

    timestamp: float
    max_tokens: int
    messages: Optional[list[dict[str, Any]]] = None
    prompt: Optional[Union[str, list[int]]] = None
    turn: int = 1


def load_trace(path: str, default_max_tokens: int) -> list[TraceRequest]:
    """Parse a trace file; raises ValueError with the line number on a bad line."""
    from ..sim.trace import json_lines

    def request(obj: dict[str, Any]) -> TraceRequest:
        if ("messages" in obj) == ("prompt" in obj):
            raise ValueError("give exactly one of 'messages' or 'prompt'")
        return TraceRequest(timestamp=float(obj.get("timestamp", 0.0)),
                            max_tokens=int(obj.get("max_tokens", default_max_tokens)),
                            messages=obj.get("messages"), prompt=obj.get("prompt"), turn=int(obj.get("turn", 1)))

    return sorted(json_lines(path, request), key=lambda r: r.timestamp)


TOKEN_ID_RANGE = (20, 250)  # token-id prompts: ids every model here has (past SmolLM2's specials)


def mooncake_requests(path: str, block_tokens: int, tokens_per_word: float = 1.0,
                      max_requests: Optional[int] = None, token_ids: bool = False) -> list[TraceRequest]:
    """A Mooncake-format trace (hicache.sim.trace) as completion prompts, scaled down: each
    512-token block becomes ``block_tokens`` tokens of words drawn from a generator seeded by its
    id (equal blocks are equal text, so a shared prefix is shared text), the last block cut in
    proportion to its real length; then two words of the request's own (a new turn's text: a
    fully seen prefix still ends in something to compute). ``max_tokens`` is the trace's output
    length scaled the same way (at least 1); ``turn`` is 1 for the first request of a conversation
    (its first two blocks new together) and 2 for a later one (TTFT by turn: cold vs returning).

    ``token_ids``: prompts are token ids instead (``block_tokens`` ids per block exactly, so blocks
    line up with KV pages; hicache, SGLang and vLLM take them on /v1/completions)."""
    from ..sim.trace import BLOCK_TOKENS, read_trace

    words_per_block = block_tokens if token_ids else max(1, round(block_tokens / tokens_per_word))

    def draw(rng: random.Random, n: int) -> list:
        return [rng.randrange(*TOKEN_ID_RANGE) for _ in range(n)] if token_ids else [rng.choice(WORDS) for _ in range(n)]

    texts: dict[int, list] = {}
    seen: set[tuple[int, ...]] = set()
    out = []
    for n, req in enumerate(read_trace(path, max_requests)):
        parts = []
        for b, length in zip(req.hash_ids, req.block_lengths()):
            if b not in texts:
                texts[b] = draw(random.Random(b), words_per_block)
            parts += texts[b][: max(1, -(-words_per_block * length // BLOCK_TOKENS))]
        parts += draw(random.Random(f"own {n}"), 2)  # (a str seed: no collision with a block id's)
        conversation = req.hash_ids[:2]  # every prompt starts with the same block; a conversation, two
        returning = conversation in seen
        seen.add(conversation)
        out.append(TraceRequest(timestamp=req.timestamp_ms / 1000, prompt=parts if token_ids else " ".join(parts),
                                turn=1 + returning,
                                max_tokens=max(1, req.output_length * block_tokens // BLOCK_TOKENS)))
    out.sort(key=lambda r: r.timestamp)
    return out
