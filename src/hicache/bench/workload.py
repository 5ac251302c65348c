"""Workloads for ``hicache bench``: generated shared-prefix multi-turn chats, and trace replay.

Text is random words drawn (seeded) from a small list. Lengths are in tokens of the server's
tokenizer when it offers ``/tokenize`` (hicache does), else approximated as one token per word.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Optional

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

    cid: int
    group: int
    system: str
    questions: list[str]


def generated_shared_prefix(num_groups: int, prompts_per_group: int, system_prompt_len: int, question_len: int,
                            num_turns: int, seed: int, tokens_per_word: float = 1.0) -> list[Conversation]:
    """``num_groups * prompts_per_group`` conversations in a seeded random order. Lengths are in
    tokens; ``tokens_per_word`` converts them to words."""
    rng = random.Random(seed)

    def words(tokens: int) -> int:
        return max(1, round(tokens / tokens_per_word))

    convs = []
    for g in range(num_groups):
        system = random_text(rng, words(system_prompt_len))
        for _ in range(prompts_per_group):
            qs = [random_text(rng, words(question_len)) for _ in range(num_turns)]
            convs.append(Conversation(cid=len(convs), group=g, system=system, questions=qs))
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
    prompt: Optional[str] = None
    turn: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


def load_trace(path: str, default_max_tokens: int) -> list[TraceRequest]:
    """Parse a trace file; raises ValueError with the line number on a bad line."""
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if ("messages" in obj) == ("prompt" in obj):
                    raise ValueError("give exactly one of 'messages' or 'prompt'")
                out.append(TraceRequest(
                    timestamp=float(obj.get("timestamp", 0.0)),
                    max_tokens=int(obj.get("max_tokens", default_max_tokens)),
                    messages=obj.get("messages"), prompt=obj.get("prompt"), turn=int(obj.get("turn", 1)),
                ))
            except (ValueError, TypeError, AttributeError) as e:
                raise ValueError(f"{path} line {n}: {e}") from None
    out.sort(key=lambda r: r.timestamp)
    return out
