"""Structured output: a grammar decides which tokens may come next (JSON schema, regex, EBNF, Lark).

A request whose ``SamplingParams.grammar`` is set (the server sets it from ``response_format``,
forced tool calls, SGLang's ``json_schema`` / ``regex`` / ``ebnf``) gets a matcher of the grammar
engine (llguidance, ``--grammar-backend``). Before any sampler sees a batch's logits -- plain
sampling, speculative acceptance -- :meth:`GrammarMode.constrain` sets every token the grammar
does not allow at that row to -inf. So:

- a grammar request's output is always a prefix of a string the grammar accepts; EOS is allowed
  only where the grammar accepts (a reply cut by ``max_tokens`` ends with finish reason "length");
- a verify pass's rows are masked at the position each stands for (row j after the last token and
  drafts 1..j), so a draft the grammar refuses has probability 0 and is rejected: drafts are
  checked against the grammar, and the accepted tokens are the ones plain decoding could give;
- every rank that samples keeps its own matcher per request and advances it by the same appended
  tokens in the same order, so TP ranks and PP's last stage agree without sending masks.

Masks of a batch are computed on a worker thread while its forward runs (llguidance releases the
GIL); compiled grammars are cached by their spec, so a repeated schema compiles once.
"""

from __future__ import annotations

import functools
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..errors import InvalidRequestError
from ..model.tokenizer import Tokenizer
from .batch import Batch
from .modes import Mode, ModeContext
from .request import Request
from .sampling import GrammarSpec

logger = logging.getLogger(__name__)

GRAMMAR_BACKENDS = ("llguidance", "none")
COMPILED_CACHE = 256  # compiled grammars kept (by spec)
# JSON as json.dumps writes it: a small model given free whitespace between tokens can spend its
# whole budget on it; vLLM and SGLang constrain it likewise by default.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarCompiler:
    """Grammars compiled against one tokenizer (llguidance); built on the first grammar request."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        import llguidance

        self._lg = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                eos_token=sorted(tokenizer.eos_token_ids))
        self.grammar = functools.lru_cache(maxsize=COMPILED_CACHE)(self._grammar)
        self.check = functools.lru_cache(maxsize=COMPILED_CACHE)(self._check)  # only what passed is kept

    def _grammar(self, spec: GrammarSpec) -> str:
        """llguidance's grammar for ``spec``; InvalidRequestError if it cannot be built."""
        try:
            if spec.kind == "json_schema":  # fixed separators, no free whitespace (a schema's x-guidance may differ)
                grammar = self._lg.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_OPTIONS)
            else:
                grammar = self._lg.grammar_from({"regex": "regex", "ebnf": "gbnf", "lark": "lark"}[spec.kind],
                                                spec.source)
        except ValueError as e:
            raise InvalidRequestError(f"the {spec.kind} grammar cannot be compiled: {_first_line(e)}", param="grammar") from None
        is_error, messages = self._lg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise InvalidRequestError(f"the {spec.kind} grammar cannot be compiled: {_first_line(messages[0])}", param="grammar")
        return grammar

    def matcher(self, spec: GrammarSpec) -> Any:
        """A fresh matcher at the grammar's start; InvalidRequestError if the grammar is unusable."""
        matcher = self._lg.LLMatcher(self.tokenizer, self.grammar(spec), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"the {spec.kind} grammar cannot be compiled: {_first_line(matcher.get_error())}", param="grammar")
        return matcher

    def _check(self, spec: GrammarSpec) -> None:
        """Refuse a grammar that does not compile or that no token can start (e.g. a regex whose
        language is empty): a request with it could only fail later."""
        matcher = self.matcher(spec)
        mask = self.allowed(matcher)
        if matcher.is_error() or not bool(mask.any()):
            raise InvalidRequestError(f"the {spec.kind} grammar matches nothing this model's vocabulary can spell.", param="grammar")

    def allowed(self, matcher: Any) -> torch.Tensor:
        """The tokens ``matcher`` allows next: a bool tensor ``[vocab_size]``."""
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return torch.from_numpy(bits[: self.vocab_size].astype(np.bool_))


def _first_line(error: object) -> str:
    """llguidance's error as one sentence: its first line, and the parser's ``error:`` line
    where it names the cause on a later one (under a caret drawing)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    head = lines[0].rstrip(":.") if lines else "unknown error"
    cause = next((line.removeprefix("error:").strip() for line in lines[1:] if line.startswith("error:")), "")
    return (f"{head}: {cause}" if cause else head).rstrip(".") + "."


@dataclass
class GrammarState:
    """One request's matcher; ``consumed``: how many of its output tokens the matcher has taken
    (it catches up lazily, before each mask). ``broken``: the matcher refused a token (a P/D
    first token sampled without the grammar) -- the request then runs unconstrained."""

    matcher: Any
    consumed: int = 0
    broken: str = ""

    def catch_up(self, req: Request) -> bool:
        """Feed the matcher the output tokens it has not seen; False once it is broken."""
        if self.broken:
            return False
        new = req.output_ids[self.consumed:]
        if new and not self.matcher.consume_tokens(new):
            self.broken = self.matcher.get_error() or "a token the grammar does not allow"
            logger.warning("grammar rid=%d no longer constrains the request: %s", req.rid, self.broken)
            return False
        self.consumed = len(req.output_ids)
        return True


@dataclass
class RowMasks:
    """Allowed tokens per logits row: ``rows[i]`` is masked by ``masks[i]``."""

    rows: list[int] = field(default_factory=list)
    masks: list[torch.Tensor] = field(default_factory=list)


class GrammarMode(Mode):
    """Applies each grammar request's token mask to its logits rows (see the module docstring)."""

    name = "grammar"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, samples: bool = True, overlap: bool = True) -> None:
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self.samples = samples  # this rank samples (not an earlier pipeline stage): it keeps matchers
        self.overlap = overlap  # masks computed during the forward (False: after it, for measuring)
        self._compiler: Optional[GrammarCompiler] = None
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pending: dict[int, Future] = {}
        self.masked_rows = 0

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size)
        return self._compiler

    def on_admit(self, req: Request) -> bool:
        spec = req.sampling.grammar
        if spec is not None and self.samples:
            req.grammar = GrammarState(self.compiler.matcher(spec))
        return False

    def before_forward(self, batch: Batch, handed: Any = None) -> None:
        if self.overlap and any(r.grammar is not None for r in batch.reqs):
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
            self._pending[id(batch)] = self._pool.submit(self._row_masks, batch)

    def constrain(self, batch: Batch, logits: torch.Tensor) -> None:
        future = self._pending.pop(id(batch), None)
        if future is None and not any(r.grammar is not None for r in batch.reqs):
            return
        masks = future.result() if future is not None else self._row_masks(batch)
        with torch.inference_mode():  # the forward's logits are inference tensors
            for row, mask in zip(masks.rows, masks.masks):
                logits[row].masked_fill_(~mask, float("-inf"))
        self.masked_rows += len(masks.rows)

    def _row_masks(self, batch: Batch) -> RowMasks:
        """The mask of every logits row a grammar request samples from in ``batch``."""
        out = RowMasks()
        if batch.kind == "verify":
            row = 0
            for req, n, drafts in zip(batch.reqs, batch.new_tokens, batch.proposal.tokens):
                if req.grammar is not None and req.grammar.catch_up(req):
                    self._verify_masks(req.grammar.matcher, row, drafts, out)
                row += n
            return out
        for i in batch.result_rows():
            req = batch.reqs[i]
            if req.grammar is not None and req.grammar.catch_up(req):
                self._add(out, i, req.grammar.matcher)
        return out

    def _verify_masks(self, matcher: Any, row: int, drafts: Sequence[int], out: RowMasks) -> None:
        """Rows ``row + j``: the mask after drafts[:j]. Past a draft the grammar refuses no row is
        masked: that draft has probability 0 at its row, so nothing after it is accepted."""
        taken = 0
        for j in range(len(drafts) + 1):
            self._add(out, row + j, matcher)
            if j == len(drafts) or matcher.try_consume_tokens([drafts[j]]) != 1:
                break
            taken += 1
        if taken:
            matcher.rollback(taken)

    def _add(self, out: RowMasks, row: int, matcher: Any) -> None:
        mask = self.compiler.allowed(matcher)
        if bool(mask.any()):  # never leave a row with no token at all
            out.rows.append(row)
            out.masks.append(mask)

    def on_finish(self, req: Request) -> bool:
        req.grammar = None  # the matcher's memory goes with it
        return False

    def stats(self) -> dict[str, Any]:
        return {"masked_rows": self.masked_rows} if self.masked_rows else {}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def build(ctx: ModeContext) -> Optional[Mode]:
    """Grammar masks unless ``--grammar-backend none`` (then grammar requests are refused upstream)."""
    if ctx.cfg.grammar_backend == "none" or ctx.tokenizer is None:
        return None
    return GrammarMode(ctx.tokenizer, ctx.vocab_size, samples=ctx.samples)
