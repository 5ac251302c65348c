"""Reuse after an edit (docs/edit_reuse.md, "In the APIs") in the answers' usage.

Two figures, the same in every API:

- ``reused_tokens`` (in OpenAI's ``prompt_tokens_details``, the Responses API's
  ``input_tokens_details``, ``/generate``'s ``meta_info``): prompt tokens whose KV was copied from
  cached pages at another position. Present on every answer of a server started with
  ``--enable-edit-reuse`` (0 when the request did not try, found nothing, or was gated off) and
  absent on a server without it, so a client can tell "off" from "nothing reused". Never counted
  in ``cached_tokens``: those are exact prefix hits.
- ``hicache_edit_reuse``: what the attempt did (:meth:`EditReuseOutcome.to_json`), present only
  when the request tried (the server runs with the flag and the request did not say
  ``edit_reuse: false``).

Several prompts in one answer (``/v1/completions`` with a list): each prompt's first choice
counts, as for ``cached_tokens``; the outcomes add up (deviation: the largest, gated: any).
Units: tokens of the prompt.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ..edit_reuse_outcome import EditReuseOutcome
from ..runtime.request import GenerateResult


def reused_details(results: Sequence[GenerateResult], enabled: bool) -> dict[str, int]:
    """``{"reused_tokens": n}`` for a usage's prompt-token details (``results``: one per prompt) on a
    server with edit reuse ``enabled``; nothing otherwise."""
    return {"reused_tokens": sum(r.reused_tokens for r in results)} if enabled else {}


def outcome_usage(results: Sequence[GenerateResult]) -> dict[str, Any]:
    """``{"hicache_edit_reuse": outcome}`` when a request of ``results`` (one per prompt) tried edit
    reuse; nothing otherwise."""
    outcome = combined([r.edit_reuse for r in results])
    return {"hicache_edit_reuse": outcome.to_json()} if outcome is not None else {}


def combined(outcomes: Sequence[Optional[EditReuseOutcome]]) -> Optional[EditReuseOutcome]:
    """The outcomes of several prompts as one: token counts added, the largest deviation, gated if
    any was; None when none of them tried."""
    tried = [o for o in outcomes if o is not None]
    if not tried:
        return None
    return EditReuseOutcome(reused_tokens=sum(o.reused_tokens for o in tried),
                            recomputed_tokens=sum(o.recomputed_tokens for o in tried),
                            gated=any(o.gated for o in tried), deviation=max(o.deviation for o in tried),
                            approximate_hit_tokens=sum(o.approximate_hit_tokens for o in tried))


def request_outcome(res: GenerateResult) -> Optional[str]:
    """A finished request's label in ``hicache_edit_reuse_requests_total``: ``kept`` (tokens
    reused), ``gated`` (the gate fell back to exact prefix reuse), ``none`` (it tried and found no
    span); None when it did not try."""
    outcome = res.edit_reuse
    if outcome is None:
        return None
    return "gated" if outcome.gated else "kept" if outcome.reused_tokens > 0 else "none"
