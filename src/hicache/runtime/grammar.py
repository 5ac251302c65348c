"""Structured output: a grammar decides which tokens may come next (JSON schema, regex, EBNF, Lark).

A request whose ``SamplingParams.grammar`` is set (the server sets it from ``response_format``,
forced tool calls, SGLang's ``json_schema`` / ``regex`` / ``ebnf``) arrives vetted
(runtime/grammar_vet.py: compiled in a contained process, its :class:`GrammarCost` measured).
Here, on every rank that samples, :class:`GrammarMode`:

- builds one matcher per grammar (a *template*) on a thread of its own, never on the scheduler
  thread; each request gets a copy of it (llguidance's ``deep_copy``: copies share the template's
  lexer, so a request adds little memory), made on the mask thread at its first mask;
- admits a grammar request only once its template is built on every rank of the group (an open
  work item, agreed like any background work: runtime/events.py) and only while the grammars'
  memory (templates held + copies of the admitted requests, as vetting measured them) stays
  within ``--grammar-memory-budget-mb`` and the admitted requests' mask times within
  ``--grammar-mask-budget-ms``; otherwise it waits, holding nothing. Idle templates are evicted
  (least recently used) to make room. The counts come with the requests, so every rank -- those
  that do not sample too -- makes the same decisions;
- before any sampler sees a batch's logits (:meth:`GrammarMode.constrain`) sets every token the
  grammar does not allow at a row to -inf. So a grammar request's output is always a prefix of a
  string the grammar accepts; EOS is allowed only where the grammar accepts (a reply cut by
  ``max_tokens`` ends with "length");
- never drops a grammar: a matcher that fails mid-request (it hit one of llguidance's limits, or
  refused a token sampled elsewhere -- a P/D prefill server's first token) ends that request
  with finish reason "error" and error code ``grammar_failed`` (what :meth:`GrammarMode.constrain`
  returns); its output so far is what the grammar allowed;
- verify passes (speculative decoding): row j is masked after the last token and drafts 1..j,
  so a draft the grammar refuses has probability 0 and is rejected;
- a *lazy* grammar (``GrammarSpec.triggers``: a tool call in an ``auto`` reply) masks nothing until
  a trigger matches the output (runtime/grammar_state.py: TriggerScan), then takes the trigger's prefix and the
  output after it and holds from there. It never fails a request: where its matcher cannot take
  what the model wrote, or fails later, it lets go and the rest of the reply is free (logged).

Masks of a batch are computed on the mask thread while its forward runs (llguidance releases the
GIL). Both threads have stacks of :data:`~.grammar_vet.ENGINE_STACK_BYTES`, several times the
vetting thread's, so a grammar that passed vetting cannot overflow them. Under pipeline
parallelism stage 0 (which holds no matchers) agrees the builds; the last stage waits for its own
template at its first mask if it is slower.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..model.tokenizer import Tokenizer
from .batch import Batch, BatchKind
from .events import WorkEvent, split_over
from .grammar_state import GrammarState, RowMasks, Template, TriggerScan, compile_triggers, unseen_specials
from .grammar_vet import ENGINE_STACK_BYTES, PARSER_LIMITS, tokenizer_config
from .grammar_worker import first_line, ll_tokenizer, token_bits
from .modes import Action, Fail, Mode, ModeContext
from .request import Request, Status
from .sampling import GrammarSpec
from .stacked_worker import StackedWorker

logger = logging.getLogger(__name__)

GRAMMAR_FAILED = "grammar_failed"  # the error code of a request whose grammar could not be kept


class GrammarMode(Mode):
    """Templates, budgets and masks of grammar requests (see the module docstring)."""

    name = "grammar"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, memory_bytes: int, mask_us: int,
                 samples: bool = True, overlap: bool = True) -> None:
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self.memory_bytes, self.mask_us = memory_bytes, mask_us  # the budgets
        self.samples = samples  # this rank samples (not an earlier pipeline stage): it keeps matchers
        self.overlap = overlap  # masks computed during the forward (False: after it, for measuring)
        self._templates: OrderedDict[GrammarSpec, Template] = OrderedDict()  # least recently used first
        self._building: list[Template] = []  # open work items, in the order their builds started
        self.held_bytes = 0  # templates held + copies of the admitted requests
        self.peak_held_bytes = 0
        self.admitted_mask_us = 0
        self.admitted = 0
        self._lg: Any = None  # llguidance and its tokenizer, made on the builder thread
        self._builder = StackedWorker("hicache-grammar-build", ENGINE_STACK_BYTES)  # (threads start at first use)
        self._masker = StackedWorker("hicache-grammar-mask", ENGINE_STACK_BYTES)
        self._pending: dict[int, Future] = {}
        # lazy_triggered: lazy grammars that took over a reply (a tool call began); lazy_released: ... and
        # let go of it (the model wrote what they could not take)
        self.counts = dict.fromkeys(("masked_rows", "failed_requests", "lazy_triggered", "lazy_released",
                                     "evicted_templates"), 0)
        self._table: Optional[dict] = None  # the token table (tokenizer_config), read on the mask thread

    # ---- admission ---------------------------------------------------------------------
    def admissible(self, req: Request) -> bool:
        spec = req.sampling.grammar
        if spec is None:
            return True
        if spec.cost is None:
            raise RuntimeError(f"rid={req.rid}: a grammar reached the scheduler without being vetted")
        template = self._templates.get(spec)
        if template is None:
            if not self._make_room(spec.cost.template_bytes, None):
                return False
            template = self._start(spec)
        self._templates.move_to_end(spec)
        if not template.agreed:
            if not any(r is req for r in template.waiting):
                template.waiting.append(req)
            return False
        if self.admitted and self.admitted_mask_us + spec.cost.mask_us > self.mask_us:
            return False  # its masks would stall every step: it waits for others to finish
        return self._make_room(spec.cost.request_bytes, template)

    def _make_room(self, need: int, keep: Optional[Template]) -> bool:
        """Evict idle templates (least recently used first) until ``need`` more bytes fit."""
        for spec, t in list(self._templates.items()):
            if self.held_bytes + need <= self.memory_bytes:
                break
            if t is not keep and t.agreed and not t.users:
                del self._templates[spec]
                self.held_bytes -= t.bytes
                self.counts["evicted_templates"] += 1
        return self.held_bytes + need <= self.memory_bytes

    def _start(self, spec: GrammarSpec) -> Template:
        template = Template(spec, self._builder.submit(self._build, spec) if self.samples else None,
                            patterns=compile_triggers(spec.triggers))
        self._templates[spec] = template
        self._building.append(template)
        self._hold(template.bytes)
        return template

    def _hold(self, n: int) -> None:
        self.held_bytes += n
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)

    def _build(self, spec: GrammarSpec) -> Any:
        """The template matcher of ``spec`` (builder thread), its first mask computed so that
        copies share a warm lexer."""
        if self._lg is None:
            import llguidance

            backend = self._tokenizer.backend
            self._lg = (llguidance, ll_tokenizer(llguidance, tokenizer_config(self._tokenizer, self._vocab_size),
                                                 lambda text: backend.encode(text, add_special_tokens=False).ids))
        lg, lltok = self._lg
        matcher = lg.LLMatcher(lltok, spec.cost.grammar, log_level=0, limits=lg.LLParserLimits(**PARSER_LIMITS))
        matcher.compute_bitmask()
        if matcher.is_error():
            raise ValueError(first_line(matcher.get_error()))
        return matcher

    def on_admit(self, req: Request) -> None:
        spec = req.sampling.grammar
        if spec is not None:
            template = self._templates[spec]
            template.waiting = [r for r in template.waiting if r is not req]
            template.users += 1
            self._hold(spec.cost.request_bytes)
            self.admitted_mask_us += spec.cost.mask_us
            self.admitted += 1
            req.grammar = GrammarState(template, scan=TriggerScan(template.patterns) if spec.lazy else None)

    def on_finish(self, req: Request) -> bool:
        """Release what ``req`` held. A request whose grammar failed retires its template: llguidance's
        limits count the lexer the copies share, so a spent one would fail every later copy; the next
        request of the grammar builds a fresh template (every rank hears of the failure alike)."""
        state: Optional[GrammarState] = req.grammar
        if state is not None:
            cost, template = req.sampling.grammar.cost, state.template
            template.users -= 1
            self.held_bytes -= cost.request_bytes
            self.admitted_mask_us -= cost.mask_us
            self.admitted -= 1
            req.grammar = None  # the matcher's memory goes with it
            if req.error_code == GRAMMAR_FAILED and not template.retired:
                template.retired = True
                del self._templates[template.spec]
            if template.retired and not template.users:
                self.held_bytes -= template.bytes
        return False

    def refuses(self, req: Request, token: int) -> Optional[tuple[str, str]]:
        """A P/D decode request's first token, sampled by the prefill server under the same grammar
        (the router sends it the same request): one that breaks the grammar ends the request."""
        state: Optional[GrammarState] = req.grammar
        if state is None or not self.samples or state.template.spec.lazy:
            return None  # (a lazy grammar has not begun at a first token, and never fails a request)
        state.catch_up(req)  # its own matcher, made here (not in any batch yet: the mask thread does not hold it)
        if state.matcher.validate_tokens([token]) == 1:
            return None
        self.counts["failed_requests"] += 1
        return GRAMMAR_FAILED, self._failure(req, f"the prefill server's first token ({token}) breaks it")

    # ---- events: template builds -----------------------------------------------------------
    def open_work(self) -> int:
        return len(self._building)

    def local_events(self) -> tuple[WorkEvent, ...]:
        return tuple(t.local_event() for t in self._building)

    def apply_events(self, events: Sequence[WorkEvent]) -> list[Action]:
        """Builds that ended on every rank: their requests may be admitted; a failed one fails
        the requests that waited for it (and is forgotten: a later request builds it anew)."""
        actions: list[Action] = []
        self._building, over = split_over(events, self._building)
        for template, e in over:
            if e.ok:
                template.agreed, template.waiting = True, []
                continue
            del self._templates[template.spec]
            self.held_bytes -= template.bytes
            local = template.build.exception() if template.build is not None else None
            why = first_line(local) if local is not None else "it failed on another rank"
            logger.warning("grammar: building a %s matcher failed: %s", template.spec.kind, why)
            actions += [Fail(r, f"the {template.spec.kind} grammar could not be built: {why}", GRAMMAR_FAILED)
                        for r in template.waiting if r.status is Status.WAITING]
        return actions

    # ---- masks -----------------------------------------------------------------------------
    def before_forward(self, batch: Batch, handed: Any = None) -> None:
        if self.overlap and self._grammar_rows(batch):
            self._pending[id(batch)] = self._masker.submit(self._row_masks, batch)

    def constrain(self, batch: Batch, logits: torch.Tensor) -> dict[int, tuple[str, str]]:
        future = self._pending.pop(id(batch), None)
        if future is None:
            if not self._grammar_rows(batch):
                return {}
            future = self._masker.submit(self._row_masks, batch)
        masks: RowMasks = future.result()
        with torch.inference_mode():  # the forward's logits are inference tensors
            for row, mask in masks.masks:  # the masks are made on the CPU
                logits[row].masked_fill_(~mask.to(logits.device), float("-inf"))
        self.counts["masked_rows"] += len(masks.masks)
        self.counts["failed_requests"] += len(masks.failed)
        return {i: (GRAMMAR_FAILED, why) for i, why in masks.failed.items()}

    def _grammar_rows(self, batch: Batch) -> bool:
        return self.samples and any(r.grammar is not None for r in batch.reqs)

    def _row_masks(self, batch: Batch) -> RowMasks:
        """The mask of every logits row a grammar request samples from in ``batch`` (mask thread)."""
        out, rows, verify = RowMasks(), batch.first_rows(), batch.kind == BatchKind.VERIFY
        for i in batch.result_rows():  # (a verify pass: every request's)
            if batch.reqs[i].grammar is not None:
                self._request_masks(i, batch.reqs[i], rows[i], batch.proposal.tokens[i] if verify else (), out)
        return out

    def _catch_up(self, req: Request, i: int, out: RowMasks) -> bool:
        """Bring ``req``'s grammar up to its output (a lazy one: scan for its triggers, start there);
        True when it masks ``req``'s rows now."""
        state: GrammarState = req.grammar
        if state.scan is not None:
            start = state.scan.feed(req.output_ids, *self._scan_text(state.template))
            if start is None:
                return False
            state.scan, state.consumed = None, len(req.output_ids)
            state.matcher = self._started(state.template, start)
            self.counts["lazy_triggered"] += 1
            logger.info("grammar rid=%d: a tool call began after %d output tokens", req.rid, len(req.output_ids))
            if state.matcher is None:
                return self._settle(req, i, f"it cannot take the call's beginning {start[:40]!r}", out)
            return True
        return self._settle(req, i, state.catch_up(req), out) and state.holds

    def _settle(self, req: Request, i: int, why: str, out: RowMasks) -> bool:
        """True when ``why`` is empty; else a strict grammar fails ``req`` and a lazy one lets go."""
        if not why:
            return True
        state: GrammarState = req.grammar
        if state.template.spec.lazy:
            state.released, state.matcher = True, None
            self.counts["lazy_released"] += 1
            logger.info("grammar rid=%d: the tool-call grammar let go after %d output tokens: %s", req.rid,
                        len(req.output_ids), why)
        else:
            out.failed[i] = self._failure(req, why)
        return False

    def _request_masks(self, i: int, req: Request, row: int, drafts: Sequence[int], out: RowMasks) -> None:
        """Rows ``row + j`` of request ``i``: the mask after ``drafts[:j]`` (a verify pass's; else none).
        Past a draft the grammar refuses no row is masked: that draft has probability 0 at its row, so
        nothing after it is accepted."""
        state: GrammarState = req.grammar
        if not self._catch_up(req, i, out):
            if state.scan is not None and drafts:
                self._drafts_triggering(req, row, drafts, out)
            return
        if self._settle(req, i, self._add(out, row, state.matcher), out):
            self._mask_drafts(out, row, state.matcher, drafts)

    def _mask_drafts(self, out: RowMasks, row: int, matcher: Any, drafts: Sequence[int]) -> None:
        """Rows ``row + j`` (``j`` >= 1) masked after drafts[:j] (``row`` is already), up to a draft the
        grammar refuses; ``matcher`` is rolled back to where it was."""
        taken = 0
        for j, draft in enumerate(drafts, start=1):
            if matcher.try_consume_tokens([draft]) != 1:
                break
            taken += 1
            if self._add(out, row + j, matcher):
                break  # (the matcher failed at a draft: plain decoding will meet it there)
        if taken:
            matcher.rollback(taken)

    def _drafts_triggering(self, req: Request, row: int, drafts: Sequence[int], out: RowMasks) -> None:
        """A lazy grammar not triggered yet, in a verify pass: where a draft would trigger it, the rows
        after are masked as plain decoding would mask them (a scratch scan and matcher: the request's
        own meet the accepted tokens at its next step), so speculation changes no greedy output."""
        state: GrammarState = req.grammar
        scan, ids, text = dataclasses.replace(state.scan), list(req.output_ids), self._scan_text(state.template)
        for j, token in enumerate(drafts, start=1):
            ids.append(token)
            start = scan.feed(ids, *text)
            if start is None:
                continue
            matcher = self._started(state.template, start)  # (None: plain decoding lets go here, nothing is masked)
            if matcher is not None and not self._add(out, row + j, matcher):
                self._mask_drafts(out, row + j, matcher, drafts[j:])
            return

    def _scan_text(self, template: Template) -> tuple[list[str], frozenset[int]]:
        """What a trigger scan of ``template`` reads: each id's text, and the special ids it passes over."""
        if self._table is None:
            self._table = tokenizer_config(self._tokenizer, self._vocab_size)
        if template.unseen is None:
            template.unseen = unseen_specials(template.patterns, self._table["tokens"], self._table["special"])
        return self._table["tokens"], template.unseen

    def _started(self, template: Template, start: str) -> Any:
        """A copy of ``template``'s matcher that took a triggered grammar's ``start`` text; None if it cannot."""
        matcher = template.build.result().deep_copy()
        ids = self._tokenizer.backend.encode(start, add_special_tokens=False).ids
        return matcher if matcher.consume_tokens(ids) else None

    def _add(self, out: RowMasks, row: int, matcher: Any) -> str:
        """Mask ``row`` by what ``matcher`` allows: "" or why it allows nothing."""
        bits = token_bits(matcher, self._vocab_size)
        if matcher.is_error():
            return f"its matcher failed: {first_line(matcher.get_error())}"
        mask = torch.from_numpy(bits.astype(np.bool_))
        if not bool(mask.any()):
            return "it allows no token here"
        out.masks.append((row, mask))
        return ""

    def _failure(self, req: Request, why: str) -> str:
        spec = req.sampling.grammar
        logger.warning("grammar rid=%d failed after %d output tokens: %s", req.rid, len(req.output_ids), why)
        return (f"the {spec.kind} grammar could not be enforced after {len(req.output_ids)} output tokens (nothing "
                f"after them was generated): {why}").rstrip(".")

    def stats(self) -> dict[str, Any]:
        if not self._templates and not self.counts["masked_rows"] and not self.counts["failed_requests"]:
            return {}
        return {**self.counts, "templates": len(self._templates), "admitted": self.admitted,
                "held_bytes": self.held_bytes, "peak_held_bytes": self.peak_held_bytes,
                "budget_bytes": self.memory_bytes,
                "admitted_mask_us": self.admitted_mask_us, "mask_budget_us": self.mask_us}

    def close(self) -> None:
        self._builder.close()
        self._masker.close()


def build(ctx: ModeContext) -> Optional[Mode]:
    """Grammar masks unless ``--grammar-backend none`` (then grammar requests are refused upstream)."""
    cfg = ctx.cfg
    if cfg.grammar_backend == "none" or ctx.tokenizer is None:
        return None
    return GrammarMode(ctx.tokenizer, ctx.vocab_size, cfg.grammar_memory_budget_mb << 20,
                       int(cfg.grammar_mask_budget_ms * 1000), samples=ctx.samples)
