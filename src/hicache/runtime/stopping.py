"""Why a request stops after its last output token: EOS or a stop token ("stop"), a stop string
in its text ("stop": the string itself is cut from the answer), ``max_new_tokens`` ("length")."""

from __future__ import annotations

from typing import Callable, Sequence

from .request import Request


def stop_reason(req: Request, eos_token_ids: set[int], decode_text: Callable[[Sequence[int]], str]) -> str:
    """Why ``req`` stops after its last output token ("stop", "length"), or ""."""
    tok, sp = req.output_ids[-1], req.sampling
    if (tok in eos_token_ids and not sp.ignore_eos) or tok in sp.stop_token_ids:
        return "stop"
    if sp.stop_strings and stop_index(decode_text(req.output_ids), sp.stop_strings) >= 0:
        return "stop"
    if len(req.output_ids) >= req.max_new_tokens:
        return "length"
    return ""


def stop_index(text: str, stops: list[str]) -> int:
    """Where the earliest stop string starts in ``text``, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1
