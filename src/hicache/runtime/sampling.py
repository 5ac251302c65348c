"""Sampling parameters and the sampler (greedy, temperature, top-p, top-k, min-p, seeded).

Penalties, ``logit_bias`` and ``min_tokens`` change a request's logits before any sampler sees
them (runtime/penalties.py), as grammars do (runtime/grammar.py); what is left here turns the
adjusted logits into a token.

No parameter value that passes :meth:`SamplingParams.validate` can make the sampler produce a
NaN or fail: temperatures below :data:`GREEDY_TEMPERATURE` decode greedily, logits are shifted
by their maximum before scaling, top-p always keeps the most likely token, and a row that still
has no valid distribution (non-finite logits from the model) falls back to its argmax.

One tie rule everywhere: the most likely token is the lowest id among the maximal logits
(:func:`top_token`). Greedy, top-p's always-kept token and the argmax fallbacks all pick it, so
``temperature=0`` and ``top_p`` -> 0 give the same text even where low-precision logits tie.

Keyed sampling (``--enable-deterministic-inference``): a seeded request's token at absolute
sequence position ``n`` (the index in ``all_ids`` it will take) is a function of ``(seed, n,
logits row)`` alone -- Gumbel-max over the request's distribution with noise from a generator
seeded by :func:`sample_key` -- not of how many draws the request made before. Plain decoding,
chunked prefill and a speculative verify pass (whose row ``j`` stands for position ``n + j``)
then pick the same token from the same logits.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from typing import NoReturn, Optional, Sequence

import numpy as np
import torch

from ..errors import InvalidRequestError
from ..sampling_ranges import DEFAULTABLE, is_int, is_real, range_error

logger = logging.getLogger(__name__)

# Below this temperature sampling is greedy, as in vLLM and SGLang: dividing logits by a tinier
# number only overflows, it cannot change which token is most likely.
GREEDY_TEMPERATURE = 1e-5
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts
MASK64 = 2**64 - 1
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "lark")
MAX_GRAMMAR_CHARS = 256 * 1024  # a JSON schema of a few hundred tools; more is refused, not compiled
MAX_LOGIT_BIAS = 100.0  # OpenAI: each bias is in [-100, 100]
# Stop strings: each token is checked against all of them (runtime/stopping.py, one automaton, so
# in time independent of their count), and a stream holds back the longest one's length - 1
# characters. OpenAI takes 4; these leave room for agent frameworks' lists and bound the rest.
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_BYTES = 256  # each one, UTF-8 encoded


def _refuse(param: str, message: str) -> NoReturn:
    raise InvalidRequestError(message, param=param)


@dataclass(frozen=True)
class GrammarCost:
    """What vetting a grammar found (runtime/grammar_vet.py), carried with every request of it so
    that every rank budgets it alike: llguidance's compiled ``grammar`` text, the bytes of the
    matcher a rank builds once per grammar (``template_bytes``) and of each request's copy
    (``request_bytes``), and the slowest token mask measured (``mask_us``, microseconds)."""

    grammar: str
    template_bytes: int
    request_bytes: int
    mask_us: int


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match (runtime/grammar.py compiles it): ``kind`` is
    ``json_schema`` (``source``: the schema as JSON text; ``{"type": "object"}`` is OpenAI's
    json_object mode), ``regex``, ``ebnf`` (GBNF, as SGLang's ``ebnf``) or ``lark``. ``cost``:
    set once the grammar was vetted (equal specs are the same grammar, vetted or not).

    ``triggers`` (empty: the grammar holds from the first output token) make the grammar *lazy*, as
    llama.cpp's tool-call grammars are: the output is free until one of them matches it, then the
    grammar holds for the rest. Each is ``(pattern, prefix)``: a regular expression searched in the
    output's bytes (the earliest match wins), and the text the grammar takes in place of what it
    matched (its own spelling of it; the output after the match follows). A lazy grammar promises
    nothing about the output: where it cannot take what the model wrote, it lets go
    (runtime/grammar.py)."""

    kind: str
    source: str
    cost: Optional[GrammarCost] = field(default=None, compare=False, repr=False)
    triggers: tuple[tuple[str, str], ...] = ()

    @property
    def lazy(self) -> bool:
        return bool(self.triggers)

    def validate(self) -> None:
        """InvalidRequestError (``param="grammar"``) for a grammar no backend is asked to compile."""
        if self.kind not in GRAMMAR_KINDS:
            _refuse("grammar", f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}.")
        if not isinstance(self.source, str) or not self.source:
            _refuse("grammar", f"the {self.kind} grammar must be a non-empty string.")
        if len(self.source) > MAX_GRAMMAR_CHARS:
            _refuse("grammar", f"the {self.kind} grammar has {len(self.source)} characters; at most "
                               f"{MAX_GRAMMAR_CHARS} are accepted.")
        for pattern, _ in self.triggers:
            try:
                re.compile(pattern.encode())
            except re.error as e:
                _refuse("grammar", f"the grammar trigger {pattern!r} is not a regular expression: {e}.")


@dataclass
class SamplingParams:
    """Per-request decoding options (SGLang's names and defaults).

    ``temperature=0`` is greedy. ``seed`` makes sampling reproducible for that request,
    whatever else shares its batch.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: Optional[Sequence[str] | str] = None
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: Optional[int] = None
    grammar: Optional[GrammarSpec] = None  # structured output: every output token keeps it matchable
    # OpenAI's penalties, over the output so far: presence once per token seen, frequency per occurrence
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # over the prompt and the output (CTRL; vLLM, SGLang): positive logits divided by it, negative multiplied
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # tokens less likely than min_p x the most likely one are dropped
    logit_bias: Optional[dict[int, float]] = None  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many output tokens
    logprobs: Optional[int] = None  # None: off; k: each output token's log-probability and the k most likely
    # reuse after an edit (--enable-edit-reuse): None the engine's setting, False off for this request, True
    # asks for it (refused by an engine without it)
    edit_reuse: Optional[bool] = None

    def validate(self) -> None:
        """Types and ranges that hold for any model (the vocabulary's: :meth:`check_token_ids`);
        InvalidRequestError naming the field otherwise."""
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            _refuse("max_new_tokens", f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}.")
        for name in DEFAULTABLE:  # temperature, top_p, top_k, the penalties, min_p
            if (error := range_error(name, getattr(self, name))) is not None:
                _refuse(name, error)
        if self.seed is not None and (not is_int(self.seed) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            _refuse("seed", f"seed must be an integer in [-2^63, 2^64), got {self.seed!r}.")
        if any(not is_int(t) for t in self.stop_token_ids):
            _refuse("stop_token_ids", "stop_token_ids must be integers.")
        self._validate_stop()
        self._validate_adjustments()
        if self.grammar is not None:
            self.grammar.validate()
            for name, given in (("ignore_eos", self.ignore_eos), ("min_tokens", self.min_tokens > 0)):
                if given:
                    _refuse(name, f"{name} cannot be combined with a grammar: the grammar decides where "
                                  "the output ends.")

    def _validate_stop(self) -> None:
        """At most MAX_STOP_STRINGS stop strings, each at most MAX_STOP_STRING_BYTES UTF-8 bytes."""
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is None:
            return
        if not isinstance(stops, (list, tuple)) or any(not isinstance(s, str) for s in stops):
            _refuse("stop", "stop must be a string or a list of strings.")
        if len(stops) > MAX_STOP_STRINGS:
            _refuse("stop", f"at most {MAX_STOP_STRINGS} stop strings are accepted, got {len(stops)}.")
        longest = max((len(s.encode("utf-8", "surrogatepass")) for s in stops), default=0)
        if longest > MAX_STOP_STRING_BYTES:
            _refuse("stop", f"a stop string may have at most {MAX_STOP_STRING_BYTES} bytes (UTF-8), got one of "
                            f"{longest}.")

    def _validate_adjustments(self) -> None:
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            _refuse("min_tokens", f"min_tokens must be an integer in [0, max_new_tokens], got {self.min_tokens!r}.")
        if self.edit_reuse is not None and not isinstance(self.edit_reuse, bool):
            _refuse("edit_reuse", f"edit_reuse must be true or false, got {self.edit_reuse!r}.")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            _refuse("logprobs", f"top_logprobs must be an integer >= 0, got {self.logprobs!r}.")
        for tok, bias in (self.logit_bias or {}).items():
            if not is_int(tok):
                _refuse("logit_bias", f"logit_bias keys must be token ids (integers), got {tok!r}.")
            if not is_real(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                _refuse("logit_bias", f"logit_bias values must be in [-100, 100], got {bias!r} for token {tok}.")

    def check_token_ids(self, vocab_size: int) -> None:
        """Every token id the request names (``stop_token_ids``, ``logit_bias`` keys) is one of the
        model's; the prompt's are checked by the engine with the same :func:`check_token_ids`."""
        check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)
        check_token_ids("logit_bias", list(self.logit_bias or ()), vocab_size)

    def for_choice(self, index: int) -> "SamplingParams":
        """The parameters of choice ``index`` of ``n``: the same, with seed ``seed + index`` (wrapping
        past 2^64) so that seeded choices differ from each other and each is reproducible alone."""
        if self.seed is None or index == 0:
            return self
        seed = self.seed + index
        return dataclasses.replace(self, seed=seed - 2**64 if seed >= SEED_RANGE[1] else seed)

    @property
    def adjusts_logits(self) -> bool:
        """The request's logits change before sampling (runtime/penalties.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def check_token_ids(param: str, ids: Sequence[int], vocab_size: int) -> None:
    """The one range check of token ids a client sends (prompt ids, ``stop_token_ids``,
    ``logit_bias`` keys; integers, as the callers made sure): InvalidRequestError naming ``param``
    unless each is in ``[0, vocab_size)``. An id out of range would index past a logits row (an
    IndexError on the scheduler thread kills the engine) or, negative, silently name the last ids.
    A long prompt is checked by its minimum and maximum (C loops); the offender is found only then."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise InvalidRequestError(f"{param} must be token ids in [0, {vocab_size}) (this model's vocabulary), "
                                  f"got {bad!r}.", param=param)


def top_token(logits: torch.Tensor) -> torch.Tensor:
    """The most likely token of each row (last dim): the lowest id among the maxima (a NaN counts
    as the maximum), as ``torch.argmax`` and ``numpy.argmax`` both document. On the CPU numpy's
    (SIMD) argmax takes ~22 us for 4 rows of SmolLM2's 49,152 logits, torch's ~470 us."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(axis=-1)))
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
           positions: Optional[Sequence[int]] = None) -> list[int]:
    """One token per row of ``logits`` ``[B, vocab]`` (float32). ``positions`` (deterministic
    inference): each row's absolute position; seeded sampled rows then take their keyed sample
    (:func:`keyed_sample`) instead of drawing from their generator."""
    out = top_token(logits).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = probabilities(logits[i], p)
        if probs is None:
            logger.warning("no valid distribution for row %d (non-finite logits); taking its argmax", i)
            continue
        if positions is not None and p.seed is not None:
            out[i] = keyed_choice(probs, p.seed, positions[i])
        else:
            out[i] = draw(probs, generators[i])
    return out


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn from ``probs`` (non-negative, any sum) with ``generator``: torch's
    multinomial where the generator lives on the probabilities' device; a request's CPU generator
    with probabilities on a GPU takes :func:`inverse_cdf` (the GPU's multinomial refuses it)."""
    if generator is None or generator.device == probs.device:
        return int(torch.multinomial(probs, 1, generator=generator).item())
    return inverse_cdf(probs, generator)


def inverse_cdf(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One uniform from ``generator`` (a CPU one: a seed gives one stream per device type -- the
    CPU draws by multinomial, a GPU this way, so their tokens differ), the cumulative distribution
    inverted on ``probs``' device; a zero-probability index is not chosen (``right=True``: the first
    index whose cumulative mass exceeds the draw)."""
    u = torch.rand((), generator=generator, dtype=torch.float64)
    cdf = probs.double().cumsum(0)
    index = torch.searchsorted(cdf, (u.to(cdf.device) * cdf[-1]).reshape(1), right=True)
    return int(index.clamp_(max=probs.numel() - 1))


def splitmix64(x: int) -> int:
    """SplitMix64 (Steele, Lea, Flood 2014): the output for state ``x``; a bijection of [0, 2^64)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def sample_key(seed: int, position: int) -> int:
    """The noise key of a seeded request's token at absolute ``position`` (>= 0), in [0, 2^64)
    (what ``torch.Generator.manual_seed`` takes): ``splitmix64(splitmix64(seed mod 2^64) XOR
    position)``. Hashing the seed before mixing in the position keeps the keys of neighbouring
    seeds (choice ``i`` of ``n`` has seed ``seed + i``) apart at every position."""
    return splitmix64(splitmix64(seed & MASK64) ^ position)


def keyed_choice(probs: torch.Tensor, seed: int, position: int) -> int:
    """The keyed token for a distribution ``probs`` ``[vocab]`` (>= 0, any positive sum): the
    exponential race ``argmax_i log probs_i - log E_i``, ``E_i ~ Exp(1)`` i.i.d. from the key's
    generator -- Gumbel-max, so token ``i`` wins with probability ``probs_i / sum(probs)``; a
    token of probability 0 never wins. The noise is drawn in float64 on the CPU, so the choice
    depends on ``(seed, position, probs)`` only, not on the device or on earlier draws."""
    gen = torch.Generator().manual_seed(sample_key(seed, position))
    # -log1p(-u), u in [0, 1): Exp(1) in [0, inf); its log is -inf only for u == 0 (p = 2^-53)
    log_e = torch.log(-torch.log1p(-torch.rand(probs.numel(), generator=gen, dtype=torch.float64)))
    p = probs.detach().to("cpu", torch.float64)
    score = torch.where(p > 0, p.log() - log_e, float("-inf"))
    return int(score.argmax())


def keyed_sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The token of a request at absolute ``position`` from its row of (already constrained)
    ``logits`` ``[vocab]``: greedy (or without a valid distribution) its argmax, else the keyed
    choice over :func:`probabilities` with the request's seed (0 when it has none)."""
    probs = None if params.greedy else probabilities(logits, params)
    if probs is None:
        return int(top_token(logits))
    return keyed_choice(probs, params.seed or 0, position)


def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor | None:
    """The row's sampling distribution after temperature, top-k, min-p and top-p; None if it has none."""
    # Shift by the max first: the best token scales to exactly 0, the rest to <= 0 (or -inf),
    # so no temperature can overflow to inf - inf.
    row = (logits - logits.max()) / p.temperature
    if p.top_k > 0:
        kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # The sort orders equal probabilities (tied logits, or a temperature that flattens them)
        # arbitrarily: put the greedy token, top_token(logits), first. Its probability is the
        # maximum, so the order stays sorted.
        top = int((order == top_token(logits)).nonzero()[0])
        order[[0, top]] = order[[top, 0]]
        # Keep the smallest head whose mass reaches top_p, and always the most likely token
        # (rounding in the cumulative sum could otherwise drop every token for a tiny top_p).
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        drop[0] = False
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if p.min_p > 0.0:  # last, as in SGLang: relative to the most likely token, which every step keeps
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
        return None
    return probs
