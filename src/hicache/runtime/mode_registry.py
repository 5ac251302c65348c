"""The modes an engine can run, one builder per line; each returns its mode or None (off).

Their order is the order of their hooks in every phase and of their items in the step's event
vector, the same on every rank. A new mode: a module with a ``Mode`` subclass and a builder
(see runtime/modes.py), and a line here.
"""

from __future__ import annotations

from typing import Callable, Optional

from . import edit_reuse, grammar, ngram, pd_role, penalties, speculative
from .modes import Mode, ModeContext

MODES: tuple[Callable[[ModeContext], Optional[Mode]], ...] = (
    speculative.build,  # --speculative-algorithm STANDALONE: verify passes check a draft model's proposals
    ngram.build,  # --speculative-algorithm NGRAM: verify passes check text copied from what was seen
    pd_role.build,  # --disaggregation-mode prefill | decode
    penalties.build,  # penalties, logit_bias, min_tokens: each row's logits adjusted before sampling
    grammar.build,  # structured output: grammar masks on the logits (after the drafts are known)
    edit_reuse.build,  # --enable-edit-reuse: spans past the cached prefix reuse cached KV at other positions
)


def build_modes(ctx: ModeContext) -> list[Mode]:
    """The modes ``ctx.cfg`` turns on, in registry order."""
    return [mode for build in MODES if (mode := build(ctx)) is not None]
