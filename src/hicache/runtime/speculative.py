"""Speculative decoding: what every algorithm shares (:class:`SpeculativeMode`: verify rows,
acceptance, counts), and STANDALONE: a separate draft model proposes ``k`` tokens per sequence,
the target checks them in one forward pass of ``k + 1`` tokens (seed section 3). NGRAM, drafts
copied from text already seen: :mod:`.ngram`.

Per request (see :class:`~hicache.runtime.request.SpecState`): the target's KV is valid for the
first ``computed`` tokens of ``all_ids``, the draft's for the first ``req.spec.draft_computed``
(never more). Only tokens both have KV for are cached (``tokens_with_kv``): a prefix hit in any tier
then brings back the draft's history with the target's, so the draft never proposes from a hole.

One verify round for a sequence of ``n`` tokens (the last one has no KV yet)::

    draft pass 1   input all_ids[draft_computed:]   (1 token, or 2 after a round took every draft)
    draft pass i   input d_{i-1}                    (i = 2 .. k)    -> d_1 .. d_k
    verify         input [all_ids[-1], d_1 .. d_k]  at positions n-1 .. n-1+k, logits at every row
    accept         j drafts + one token of the target's own: greedy keeps the drafts that equal
                   the target's argmax; sampling uses the rejection rule (the output distribution
                   is the target's); deterministic inference, seeded: the drafts that equal the
                   target's keyed sample at their position (:func:`keyed_accept`)

after which the target's KV is valid up to ``n + j`` and the draft's up to ``n + min(j, k - 1)``
(the draft never saw ``d_k``). KV written for rejected positions sits in reserved slots past
``computed`` and is overwritten later; admission reserves ``k`` slots more per request for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from ..config import ConfigError, EngineConfig
from ..model.batch import KVView
from ..model.loader import LoadedModel
from ..model.spec import ModelSpec
from .batch import Batch, BatchKind
from .modes import DecodePlan, Mode, ModeContext
from .request import Request, SpecState
from .runner import ModelRunner
from .sampling import draw, keyed_sample, probabilities, top_token


class LayerWindow:
    """The draft's layers as a :class:`KVView`: layers ``offset ..`` of a shared view (packed:
    the draft's K/V are extra layers of the target's pool, waited for like the target's)."""

    def __init__(self, base: KVView, offset: int, count: int) -> None:
        self.base, self.offset = base, offset
        self.k_buffers = list(base.k_buffers[offset:offset + count])
        self.v_buffers = list(base.v_buffers[offset:offset + count])

    def wait_layer(self, layer: int) -> None:
        self.base.wait_layer(self.offset + layer)

    def layer_ready(self, layer: int) -> bool:
        return self.base.layer_ready(self.offset + layer)


def check_draft(target: LoadedModel, draft: LoadedModel, draft_name: str, context_length: int) -> None:
    """Refuse, in one sentence, a draft whose tokens mean something else than the target's, or
    that cannot see as far back as a request may reach."""
    problem = ""
    if draft.spec.vocab_size != target.spec.vocab_size:
        problem = f"its vocabulary has {draft.spec.vocab_size} tokens, the target's {target.spec.vocab_size}"
    elif draft.tokenizer.backend.get_vocab(with_added_tokens=True) != \
            target.tokenizer.backend.get_vocab(with_added_tokens=True):
        problem = "its tokenizer maps tokens to other ids"
    elif draft.tokenizer.eos_token_ids != target.tokenizer.eos_token_ids:
        problem = "its end-of-sequence tokens differ"
    if problem:
        raise ConfigError(f"the draft model {draft_name!r} cannot speculate for {target.name!r}: {problem}; "
                          "a draft must share the target's tokenizer.")
    if draft.spec.recurrent_layers:
        raise ConfigError(f"the draft model {draft_name!r} has recurrent layers, whose state a draft's passes do "
                          "not keep (the draft has KV pages but no state slots); use a draft without recurrent "
                          "layers, or --speculative-algorithm NGRAM.")
    if draft.spec.max_position_embeddings < context_length:
        raise ConfigError(f"the draft model {draft_name!r} has {draft.spec.max_position_embeddings} positions, "
                          f"fewer than the context length {context_length}; lower --context-length.")


@dataclass(frozen=True)
class DraftKV:
    """Where the draft's KV lives. ``packed``: its layers follow the target's in the target's
    pools and page objects (its rows have the target's shape); else a *sidecar*: pools and
    storage objects of its own, on the target's page ids. Either way one page id names the
    same tokens in both, so every tier moves both together."""

    packed: bool
    layers: int
    row: tuple[int, int]  # (kv_heads, head_dim) of one token of one layer


def plan_draft_kv(cfg: EngineConfig, draft: Optional[ModelSpec], target_row: tuple[int, int],
                  draft_row: Optional[tuple[int, int]] = None) -> Optional[DraftKV]:
    """The draft's KV layout for ``--speculative-draft-kv-layout`` (auto: packed when the rows
    match); None without a draft. ``draft_row``: its local row when sharded (default: the
    whole model's). (The dtype is the engine's, shared by both models.)"""
    if draft is None:
        return None
    row = draft_row or (draft.num_kv_heads, draft.head_dim)
    layout = cfg.speculative_draft_kv_layout
    if layout == "packed" and row != target_row:
        raise ConfigError(f"--speculative-draft-kv-layout packed needs the draft's KV rows to match the target's "
                          f"({target_row[0]} KV heads x {target_row[1]}); {cfg.speculative_draft_model_path!r} has "
                          f"{row[0]} x {row[1]}.")
    packed = layout == "packed" or (layout == "auto" and row == target_row)
    return DraftKV(packed, draft.num_layers, row)


@dataclass
class Proposal:
    """What the draft proposed for a verify batch: ``tokens[b]`` (k each) and, for sampled
    requests, the draft's distribution at each of them ``probs[b]`` ``[k, vocab]`` (None: a greedy
    request, drafts that are certain: copied text, or keyed drafts, which the keyed acceptance
    does not weigh)."""

    tokens: list[list[int]]
    probs: list[Optional[torch.Tensor]]


class SpeculativeMode(Mode):
    """What every speculative algorithm shares: slots for the drafts, per-request counts, and
    turning a verify pass's logits into the accepted tokens (greedy: the drafts equal to the
    target's argmax; sampling: the rejection rule; seeded under deterministic inference: the
    drafts equal to the target's keyed samples). Each request's rows in a verify pass are its
    last token + its drafts (their number may differ between requests, and be 0)."""

    name = "speculative"
    draft_kv = True  # whether the algorithm's drafts have KV of their own (a draft model's)

    def __init__(self, num_steps: int, deterministic: bool = False) -> None:
        """``deterministic`` (``--enable-deterministic-inference``): seeded requests accept by
        their keyed samples, so their output is the one plain decoding gives."""
        self.num_steps = num_steps  # the most drafts a request verifies in one pass
        self.deterministic = deterministic
        self.request_verify_steps = 0  # verify passes, counted once per request in each
        self.accepted_tokens = 0

    def reserve_slots(self) -> int:
        return self.num_steps  # a verify pass writes KV for its drafts past the last token

    def on_admit(self, req: Request) -> None:
        req.spec = SpecState.admitted(req, self.draft_kv)

    def sample(self, batch: Batch, logits: torch.Tensor) -> Optional[list]:
        return self.verify(batch, logits) if batch.kind == BatchKind.VERIFY else None

    def on_accepted(self, req: Request, drafts: int, taken: int) -> None:
        req.spec.verify_steps += 1
        req.spec.accepted_tokens += taken
        self.request_verify_steps += 1
        self.accepted_tokens += taken

    def stats(self) -> dict[str, Any]:
        return {
            # verify passes counted once per request in each (a pass of 4 requests counts 4)
            "num_steps": self.num_steps, "request_verify_steps": self.request_verify_steps,
            "accepted_tokens": self.accepted_tokens,
            # mean tokens a verify pass gives a request, its own token included (SGLang's accept length)
            "accept_length": self.accepted_tokens / max(self.request_verify_steps, 1),
        }

    def verify(self, batch: Batch, logits: torch.Tensor) -> list[list[int]]:
        """The accepted tokens of each request (1 to its drafts + 1): ``logits`` ``[T, vocab]``,
        the target's at each verify row, sequence after sequence (``batch.new_tokens`` rows each)."""
        out = []
        for b, (r, n, start) in enumerate(zip(batch.reqs, batch.new_tokens, batch.first_rows())):
            rows = logits[start:start + n]
            drafts, q = batch.proposal.tokens[b], batch.proposal.probs[b]
            if r.sampling.greedy:
                out.append(greedy_accept(drafts, rows))
            elif self.keyed(r):
                out.append(keyed_accept(drafts, rows, r))
            else:
                out.append(rejection_accept(drafts, q, rows, r))
        return out

    def keyed(self, req: Request) -> bool:
        """``req`` samples keyed by position (deterministic inference, a seeded sampled request)."""
        return self.deterministic and req.sampling.seed is not None and not req.sampling.greedy


class Speculator(SpeculativeMode):
    """STANDALONE: runs the draft model over the same slots as the target. ``runner``: the
    draft's :class:`ModelRunner` (its own weights, its KV on the target's slots)."""

    def __init__(self, runner: Optional[ModelRunner], num_steps: int,
                 share_draws: Optional[Callable[[Any], Any]] = None, deterministic: bool = False) -> None:
        """``runner`` None: a later pipeline stage, which verifies (the last) or passes on what
        the first stage's draft proposed. ``share_draws``: with several TP ranks, one rank's
        random draft draws for the whole stage. ``deterministic``: see :class:`SpeculativeMode`;
        the draft then proposes its keyed samples too."""
        super().__init__(num_steps, deterministic)
        self.runner = runner
        self.share_draws = share_draws

    # ---- the mode's hooks ----------------------------------------------------------------
    def decode_batch(self, reqs: Sequence[Request]) -> DecodePlan:
        return DecodePlan(BatchKind.VERIFY, [self.num_steps + 1] * len(reqs))  # k drafts + the last token each

    def before_forward(self, batch: Batch, handed: Any = None) -> None:
        """A verify batch's drafts: those stage 0 proposed (``handed``), else proposed here."""
        if batch.kind == BatchKind.VERIFY:
            batch.proposal = handed if handed is not None else self.propose(batch)

    def after_forward(self, batch: Batch) -> None:
        if batch.kind == BatchKind.PREFILL and self.runner is not None:
            self.extend(batch)  # after the target: a load-back copies the draft's layers last

    def on_computed(self, req: Request) -> None:
        req.spec.draft_computed = req.computed  # the draft ran over the same chunk

    def on_accepted(self, req: Request, drafts: int, taken: int) -> None:
        """The draft's KV now covers all but the last of the ``drafts`` accepted (it never saw
        d_k); ``taken`` tokens were appended (fewer when one stopped the request)."""
        before = len(req.all_ids) - taken
        req.spec.draft_computed = before + min(drafts, self.num_steps - 1)
        super().on_accepted(req, drafts, taken)

    # ---- the draft ------------------------------------------------------------------------

    def extend(self, batch: Batch) -> None:
        """A prefill chunk: the draft computes its KV for the same tokens (called after the
        target's pass, so a layer-wise load-back's draft layers, copied last, have arrived)."""
        self.runner.forward(batch.input_ids(), batch.prefix_lens(), batch.context_slots())

    def propose(self, batch: Batch) -> Proposal:
        """``k`` draft passes over the whole verify batch; the first also feeds every token the
        draft has not seen yet (1, or 2 after a round that took every draft)."""
        if self.runner is None:
            raise RuntimeError("a verify batch reached a pipeline stage without the first stage's drafts")
        reqs = batch.reqs
        seqs = [r.all_ids for r in reqs]
        tokens: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        inputs = [s[r.spec.draft_computed:] for r, s in zip(reqs, seqs)]
        starts = [r.spec.draft_computed for r in reqs]
        for step in range(self.num_steps):
            ends = [p + len(ids) for p, ids in zip(starts, inputs)]
            logits = self.runner.forward(inputs, starts, [r.kv.slots[:e] for r, e in zip(reqs, ends)], generated=True)
            # draft ``step`` takes position len(all_ids) + step: the target's verify row ``step``
            drawn = [(keyed_sample(logits[b], r.sampling, len(s) + step), None) if self.keyed(r)
                     else _draw(logits[b], r) for b, (r, s) in enumerate(zip(reqs, seqs))]
            step_tokens = [tok for tok, _ in drawn]
            if self.share_draws is not None and any(not r.sampling.greedy for r in reqs):
                step_tokens = self.share_draws(step_tokens)
            for b, (tok, (_, dist)) in enumerate(zip(step_tokens, drawn)):
                tokens[b].append(tok)
                if dist is not None:
                    probs[b].append(dist)
            inputs, starts = [[t[-1]] for t in tokens], ends
        return Proposal(tokens, [torch.stack(p) if p else None for p in probs])


def _draw(logits: torch.Tensor, req) -> tuple[int, Optional[torch.Tensor]]:
    """The draft's token for one row, and its distribution when the request samples (drawn
    from the request's draft stream, so every rank layout draws the same drafts)."""
    if req.sampling.greedy:
        return int(top_token(logits)), None
    dist = _distribution(logits, req)
    if dist is None:  # no valid distribution: take the argmax, as the sampler does, and tell
        tok = int(top_token(logits))  # the rejection rule the draft proposed it with certainty
        dist = torch.zeros_like(logits)
        dist[tok] = 1.0
        return tok, dist
    return draw(dist, req.spec.generator), dist


def _distribution(logits: torch.Tensor, req) -> Optional[torch.Tensor]:
    """The request's sampling distribution, normalised: top-p and top-k leave mass that does
    not sum to 1, which multinomial forgives but the ratios of the rejection rule do not."""
    dist = probabilities(logits, req.sampling)
    return None if dist is None else dist / dist.sum()


def greedy_accept(drafts: Sequence[int], logits: torch.Tensor) -> list[int]:
    """The drafts that equal the target's argmax, then the target's token after them."""
    target = top_token(logits).tolist()
    return accept_matching(drafts, target.__getitem__)


def keyed_accept(drafts: Sequence[int], logits: torch.Tensor, req) -> list[int]:
    """Deterministic inference, a seeded sampled request: verify row ``j`` stands for position
    ``len(req.all_ids) + j``, and the target's token there is its keyed sample. The drafts that
    equal those tokens, then the target's token after them -- exactly what plain decoding in
    this mode samples, draft by draft, from the same logits (so the output is distributed as the
    target's keyed samples whatever the drafts)."""
    base = len(req.all_ids)
    return accept_matching(drafts, lambda j: keyed_sample(logits[j], req.sampling, base + j))


def accept_matching(drafts: Sequence[int], target: Callable[[int], int]) -> list[int]:
    """The drafts while each equals ``target(j)`` (the target's token at verify row ``j``), then
    the target's token at the first mismatch, or at the bonus row ``len(drafts)``. ``target`` is
    asked only for rows up to that one."""
    out: list[int] = []
    for j, d in enumerate(drafts):
        tok = target(j)
        if tok != d:
            return out + [tok]
        out.append(d)
    return out + [target(len(drafts))]


def rejection_accept(drafts: Sequence[int], draft_probs: Optional[torch.Tensor], logits: torch.Tensor,
                     req) -> list[int]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): draft ``i`` is kept with
    probability ``min(1, p_i(d) / q_i(d))``; the first rejected one is replaced by a draw from
    ``max(p_i - q_i, 0)`` (normalised), and when every draft is kept one more token is drawn from
    ``p_k``. The tokens are distributed exactly as the target would sample them one by one.
    ``draft_probs`` None: deterministic drafts (copied text, q_i = 1 at d), kept with probability
    p_i(d), a rejection drawing from p_i without d."""
    gen = req.generator
    out: list[int] = []
    for i, d in enumerate(drafts):
        p = _distribution(logits[i], req)
        if p is None:  # the target has no valid distribution here: take its argmax and stop
            return out + [int(top_token(logits[i]))]
        u = float(torch.rand((), generator=gen))
        q_d = 1.0 if draft_probs is None else float(draft_probs[i][d])
        if u * q_d < float(p[d]):  # u < p/q without dividing by a zero q
            out.append(d)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_(min=0)
        dist = residual if float(residual.sum()) > 0 else p
        return out + [draw(dist, gen)]
    p = _distribution(logits[len(drafts)], req)
    bonus = int(top_token(logits[len(drafts)])) if p is None else draw(p, gen)
    return out + [bonus]


def build(ctx: ModeContext) -> Optional[Mode]:
    """The speculative mode (``--speculative-algorithm``): the draft's runner over its KV (packed:
    the layers after the target's; else the sidecar); with speculation on and no draft here (a
    later pipeline stage) one that only verifies what the first stage proposed."""
    if ctx.draft is None and not ctx.cfg.uses_draft_model:
        return None
    runner = None
    if ctx.draft is not None:
        cache = ctx.cache
        view = LayerWindow(cache.kv_view, ctx.layers, ctx.draft_packed) if ctx.draft_packed else cache.sidecar_view
        runner = ModelRunner(ctx.draft.model, view, ctx.device)
    return Speculator(runner, ctx.cfg.speculative_steps, ctx.share_draws, ctx.cfg.enable_deterministic_inference)
