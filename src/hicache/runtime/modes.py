"""Modes that plug into a step: speculative decoding, the P/D roles, and whatever comes next.

A mode is a :class:`Mode`: hooks that the scheduler (and the step driver, around the forward)
calls at fixed points of every step, on the scheduler thread, in the same order on every rank.
A hook says what should happen -- by its return value, or by changing only the mode's own
state (its object on the request, e.g. ``req.spec``) -- and the scheduler applies it; no mode
calls back into the scheduler. The fixed points, in step order::

    admission       reserve_slots()            KV slots a request needs past its own tokens
                    admission_namespace(req)   the namespace it is admitted (and cached) in, when not its own
                    admissible(req)            False: it waits (e.g. its grammar's matcher is not built)
                    kv_arrives(req)            True: its prompt's KV comes from elsewhere (RECEIVING)
                    on_admit(req)              it was admitted
    events          local_events()             this rank's view of the mode's open work items
                    apply_events(events)       -> [StartDecode | Fail | Release]
    batch           decode_batch(reqs)         a decode batch's kind, rows per request, drafts known now
    forward         before_forward(b, handed)  e.g. propose the drafts a verify pass checks
                    after_forward(b)           e.g. the draft's KV for a prefill chunk
    output          constrain(b, logits)       restrict what each row may sample (in place; grammars)
                                               -> requests that cannot go on (a grammar failed): (code, error)
                    sample(b, logits)          a verify batch's accepted tokens
                    on_computed(req)           the target's KV grew (prefill chunk, first token)
                    refuses(req, token)        a token sampled elsewhere (P/D's first) cannot be its next
                    on_accepted(req, j, taken) a verify pass accepted j drafts; ``taken`` tokens appended
    prefill         chunk_limit(req)           the most prompt tokens its next chunk may take (edit reuse)
                    after_chunk(req)           where its prompt KV ends after a chunk, when a mode filled
                                               in tokens (or dropped them): ``req.computed`` becomes it
    finish          on_finish(req)             True: the mode still uses its KV (released later)

Which modes an engine runs: :data:`hicache.runtime.mode_registry.MODES`, one builder per mode
(``build(ctx: ModeContext) -> Mode | None``, in the mode's own module). Adding a mode is a module
with a :class:`Mode` subclass and its builder, and one line in that registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..cache.manager import KVCacheManager
from ..config import EngineConfig
from ..disagg.heads import TPRanks
from ..model.loader import LoadedModel
from ..model.spec import ModelSpec
from ..model.tokenizer import Tokenizer
from .batch import Batch, BatchKind
from .events import WorkEvent
from .request import Request


@dataclass(frozen=True)
class ModeContext:
    """What a mode's builder may use: the engine's config and this rank's parts. ``layers``:
    the target's layers on this rank; ``draft_packed``: the draft's layers when they follow
    the target's in its pools (0: a sidecar or no draft); ``share_draws``: with several TP
    ranks, one rank's random draws for the whole stage; ``samples``: this rank samples tokens
    (one rank, or a rank of the last pipeline stage); ``spec``: the target model's."""

    cfg: EngineConfig
    cache: KVCacheManager
    device: Any
    layers: int
    vocab_size: int
    pd_ranks: TPRanks
    draft: Optional[LoadedModel] = None
    draft_packed: int = 0
    share_draws: Optional[Callable[[Any], Any]] = None
    tokenizer: Optional[Tokenizer] = None
    samples: bool = True
    spec: Optional[ModelSpec] = None


@dataclass(frozen=True)
class StartDecode:
    """``req``'s whole prompt has KV now (received): decode from ``first_token``."""

    req: Request
    first_token: int


@dataclass(frozen=True)
class Fail:
    """End ``req`` with ``error`` (finish reason "error"; ``code``: what failed, for the client),
    releasing what it holds; a request still waiting holds nothing."""

    req: Request
    error: str
    code: str = ""


@dataclass(frozen=True)
class Release:
    """The mode no longer uses ``req``'s KV: cache what has KV, free the rest; ``report``: the
    request's finish was held back until now (its ``on_update`` is called once more)."""

    req: Request
    report: bool = False


Action = Union[StartDecode, Fail, Release]


@dataclass(frozen=True)
class DecodePlan:
    """How a mode composes a batch of decoding requests: its ``kind``, the rows (new tokens)
    of each request, and the proposal when the mode knows it while scheduling (NGRAM drafts:
    they decide the rows; a draft model proposes before the forward instead)."""

    kind: BatchKind
    rows: list[int]
    proposal: Any = None


class Mode:
    """The hooks with their neutral answers: a mode overrides what it takes part in."""

    name = "mode"

    # ---- admission -----------------------------------------------------------------------
    def reserve_slots(self) -> int:
        """KV slots a request reserves past its prompt and output (e.g. a verify pass's drafts)."""
        return 0

    def admissible(self, req: Request) -> bool:
        """Whether waiting ``req`` may be admitted now: a function of agreed state only (the same
        answer on every rank); False leaves it waiting (later requests may go first)."""
        return True

    def admission_namespace(self, req: Request) -> Optional[str]:
        """The tree namespace ``req`` should be admitted in and cache into from now on, when not
        ``req.namespace`` (edit reuse: its approximate one holds more of the prompt); None: its own."""
        return None

    def kv_arrives(self, req: Request) -> bool:
        """Whether ``req``'s prompt KV will arrive from elsewhere (a P/D decode server's): it is then
        admitted RECEIVING, to wait for it instead of computing it, and a hybrid pool may hit a
        full-layer prefix whose window it does not hold, the window of the prompt's end arriving
        with the rest (the fresh SWA tail)."""
        return False

    def on_admit(self, req: Request) -> None:
        """``req`` was just admitted (``req.computed`` prompt tokens hit; status PREFILL, or
        RECEIVING where a mode's :meth:`kv_arrives` said so)."""

    # ---- events ---------------------------------------------------------------------------
    def open_work(self) -> int:
        """Items of background work open (the same on every rank: opened at agreed points)."""
        return 0

    def local_events(self) -> tuple[WorkEvent, ...]:
        """This rank's view of each open item, in the order they opened (ranks MIN-reduce it).
        May raise EngineDeadError."""
        return ()

    def apply_events(self, events: Sequence[WorkEvent]) -> list[Action]:
        """Act on the agreed ``events``, one per open item."""
        return []

    # ---- batch composition --------------------------------------------------------------
    def decode_batch(self, reqs: Sequence[Request]) -> Optional[DecodePlan]:
        """How to run these decoding requests this step, or None (a plain decode batch, one row
        each). Called once per decode batch, on every rank with the same requests."""
        return None

    # ---- around the forward ---------------------------------------------------------------
    def before_forward(self, batch: Batch, handed: Any = None) -> None:
        """Before ``batch``'s forward; ``handed``: what stage 0 attached to it (later pipeline stages)."""

    def after_forward(self, batch: Batch) -> None:
        """After ``batch``'s forward on this rank (before its output is used)."""

    # ---- output ---------------------------------------------------------------------------
    def constrain(self, batch: Batch, logits: torch.Tensor) -> dict[int, tuple[str, str]]:
        """Set to -inf, in ``logits`` (the rows the batch samples from), what a row may not sample
        (on ranks that sample). Returns the requests of ``batch`` (their index) that cannot go on,
        each with an error code and why: they end with finish reason "error" instead of a token."""
        return {}

    def sample(self, batch: Batch, logits: torch.Tensor) -> Optional[list]:
        """The tokens of a batch this mode composed (one list per request), or None."""
        return None

    def on_computed(self, req: Request) -> None:
        """The target's KV of ``req`` now covers ``req.computed`` tokens."""

    def refuses(self, req: Request, token: int) -> Optional[tuple[str, str]]:
        """(error code, why) if ``token``, sampled elsewhere (a P/D prefill server's first token),
        cannot be ``req``'s next output token: the request ends with an error instead; else None."""
        return None

    def on_accepted(self, req: Request, drafts: int, taken: int) -> None:
        """A verify pass accepted ``drafts`` proposals for ``req`` and appended ``taken`` tokens
        (fewer than drafts + 1 when one stopped the request; ``req.computed`` counts them)."""

    # ---- prefill ---------------------------------------------------------------------------
    def chunk_limit(self, req: Request) -> Optional[int]:
        """The most prompt tokens ``req``'s next chunk may take (None: no limit of this mode's)."""
        return None

    def after_chunk(self, req: Request) -> Optional[int]:
        """After a prompt chunk of ``req`` (``req.computed`` counts it): the length its prompt's KV has
        now when the mode changed it -- filled in a span (further) or dropped approximate KV (back) --
        else None."""
        return None

    # ---- finish and life ----------------------------------------------------------------
    def on_finish(self, req: Request) -> bool:
        """``req`` finished; True: the mode still uses its KV and releases it by an action later."""
        return False

    def check_alive(self) -> None:
        """Raise EngineDeadError once a thread the mode serves with has died."""

    def stats(self) -> dict[str, Any]:
        """``Engine.stats()[name]``; empty: nothing to show."""
        return {}

    def close(self) -> None:
        """Stop the mode's threads."""
