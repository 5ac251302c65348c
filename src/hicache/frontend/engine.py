"""The in-process Engine API: ``Engine(model=..., **options).generate(prompts, sampling)``."""

from __future__ import annotations

import dataclasses
import itertools
import operator
import logging
import threading
import weakref
from concurrent.futures import Future
from typing import Any, Hashable, Sequence, Union, cast

import torch

from ..cache_hints import RetentionHint
from ..cache.storage.keys import tree_namespace
from ..config import ConfigError, EngineConfig
from ..device import DTYPES, choose_precision, resolve_device
from ..disagg.bootstrap import Bootstrap
from ..errors import ContextLengthError, EngineDeadError, HicacheError, InvalidRequestError
from ..model import load_model
from ..model.chat_render import render_limit_chars
from ..model.chat_templates import resolve_chat_template
from ..model.loader import LoadedModel
from ..parallel.rank_group import RankGroup
from ..runtime.grammar_vet import GrammarVetter, VetLimits
from ..runtime.request import GenerateResult, PDState, Request
from ..runtime.sampling import GrammarSpec, SamplingParams, check_token_ids
from ..runtime.speculative import check_draft
from ..runtime.storage_layout import layout_report
from .backend import Backend, LocalBackend, SchedulerView, make_backend

logger = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int]]


def _core_part(name: str) -> property:
    """That part of the in-process core (``Engine.cache``...); None with several ranks (each rank holds its own)."""
    return property(lambda engine: getattr(engine.backend.core, name) if engine.backend.core is not None else None)


class Engine:
    """One model, one device KV pool with its prefix cache, one scheduler.

    Options are :class:`EngineConfig` fields, the CLI flags with underscores
    (``--max-total-tokens`` <-> ``max_total_tokens``). Where the scheduler runs (this process,
    or rank processes) is the :class:`~hicache.frontend.backend.Backend`'s business.
    """

    def __init__(self, model: str = "smollm2", **options: Any) -> None:
        cfg = EngineConfig.from_kwargs(model=model, **options)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.device = resolve_device(cfg.device)
        # Resolved once, here: rank processes, cache namespaces and storage keys see the real dtype.
        self.config = cfg = choose_precision(cfg, self.device)
        self.dtype, self.kv_dtype = DTYPES[cfg.dtype], DTYPES[cfg.kv_cache_dtype]  # kv_dtype: what every KV tier holds
        ranks = cfg.tp_size * cfg.pp_size
        # With several ranks this process only tokenizes: each rank loads its own slice.
        self.loaded = load_model(cfg.model, dtype=self.dtype, device=self.device, seed=cfg.random_seed,
                                 weights=ranks == 1, precision=cfg.precision_options())
        self.tokenizer = self.loaded.tokenizer
        if cfg.chat_template is not None:  # a wrapper of its own: loaded tokenizers are shared in the process
            self.tokenizer = self.tokenizer.with_chat_template(resolve_chat_template(cfg.chat_template))
        spec = self.loaded.spec
        self.context_length = cfg.context_length or spec.max_position_embeddings
        if self.context_length > spec.max_position_embeddings:
            raise ConfigError(f"--context-length {self.context_length} exceeds the model's "
                              f"{spec.max_position_embeddings} positions.")
        # chats render within a limit that leaves room for any prompt the context holds (model/chat_render.py)
        self.tokenizer = self.tokenizer.with_render_limit(render_limit_chars(self.context_length))
        self.draft: LoadedModel | None = None  # the speculative draft model
        if cfg.uses_draft_model:
            self.draft = load_model(cfg.speculative_draft_model_path, dtype=self.dtype, device=self.device,
                                    seed=cfg.random_seed, weights=ranks == 1, precision=cfg.precision_options())
            check_draft(self.loaded, self.draft, cfg.speculative_draft_model_path, self.context_length)
        # Cache keys of different models, dtypes or page sizes must never meet (storage.keys owns
        # them); with a draft, cached pages hold its KV too, so its identity is part of the name.
        self.cache_identity = self.loaded.identity if self.draft is None else \
            f"{self.loaded.identity}+draft:{self.draft.identity}"
        self.model_namespace = tree_namespace(self.cache_identity, cfg.cache_dtypes, cfg.page_size)
        self.backend: Backend = make_backend(cfg, self.loaded, self.device, self.dtype, self.draft)
        self.capacity_pages = self.backend.capacity_pages  # usable device KV pages (every rank holds as many)
        self.vocab_size = spec.vocab_size
        self._closed = False
        self._failed: str | None = None  # why a step raised: the engine's state is no longer known good
        # Stops the ranks or the cache's threads (pending writes finish) on shutdown(), when the
        # engine is garbage-collected without it, or at interpreter exit, whichever comes first.
        # The bound method holds the backend, never the engine (or it would never be collected).
        self._finalizer = weakref.finalize(self, self.backend.shutdown)
        self._rids = itertools.count()
        self._vetter: GrammarVetter | None = None  # started on the first grammar request
        self._vetter_lock = threading.Lock()
        self._driver: threading.Thread | None = None  # an EngineLoop's thread while it drives (drive)
        model = self.loaded.model  # None with several ranks: each holds its own shards
        decode = cfg.decode_weight_dtype if model is None else ",".join(
            f"{fmt}x{n}" for fmt, n in sorted(model.decode_formats().items()))
        resident = "" if model is None else f" weights={model.weight_bytes() / 2**20:.0f}MiB"
        logger.info(
            "engine ready: model=%s device=%s dtype=%s kv=%s prefill-weights=%s decode-weights=%s%s pool=%s "
            "components=%s context=%d ranks=tp%dxpp%d%s",
            cfg.model, self.device, cfg.dtype, cfg.kv_cache_dtype, cfg.prefill_weight_dtype, decode, resident,
            self._pool_summary(), ",".join(f"{c['name']}:{c['layers']}" for c in self.backend.stats()["components"]),
            self.context_length,
            cfg.tp_size, cfg.pp_size, f" cp{cfg.attn_cp_size}" + (" kv-sharded" if cfg.enable_kv_cache_sharding else "")
            if cfg.attn_cp_size > 1 else "",
        )

    def _pool_summary(self) -> str:
        """The device pool in tokens (and, hybrid, each component's tokens and bytes, whole model)."""
        cfg, spec = self.config, self.loaded.spec
        full = self.capacity_pages * cfg.page_size
        window = self.backend.component_pages.get("window", 0) * cfg.page_size
        if not window:
            return f"{full} tokens"
        row = 2 * spec.num_kv_heads * spec.head_dim * self.kv_dtype.itemsize  # K + V of one token, one layer
        sliding = sum(1 for i in range(spec.num_layers) if spec.layer_window(i))
        dense = spec.num_layers - sliding
        if self.backend.stats()["device_pool"]["window"].get("shared_blocks"):  # one pool both draw from
            return (f"{full} tokens of full-layer pages or {window} of window pages, shared "
                    f"({full * row * dense / 2**20:.1f} MiB; {dense} full layers, {sliding} layers of "
                    f"{spec.sliding_window})")
        return (f"full {full} tokens ({full * row * dense / 2**20:.1f} MiB, {dense} layers) + window {window} tokens "
                f"({window * row * sliding / 2**20:.1f} MiB, {sliding} layers of {spec.sliding_window})")

    # ---- the backend's parts (tests, benchmarks, the demo) -------------------------------
    @property
    def scheduler(self) -> SchedulerView | None:
        """The scheduler (a stand-in for the leader's with several ranks); None once shut down."""
        return None if self._closed else self.backend.scheduler

    cache = _core_part("cache")  # KVCacheManager
    pool = _core_part("pool")  # DeviceKVPool
    host_pool = _core_part("host_pool")  # HostKVPool
    runner = _core_part("runner")  # ModelRunner

    @property
    def group(self) -> RankGroup | None:
        """The rank processes (their pids, the checker's monitor and trace); None on one rank.
        Inspection only: the engine itself never asks which backend it holds."""
        return None if isinstance(self.backend, LocalBackend) else cast(RankGroup, self.backend)

    # ---- requests ------------------------------------------------------------------------
    def vet_grammar(self, spec: GrammarSpec, client: Hashable = None) -> Future:
        """A future of ``spec`` vetted (runtime/grammar_vet.py: compiled in a contained process,
        its cost attached), raising InvalidRequestError (one sentence, ``param="grammar"``) for a
        grammar the engine will not run, OverloadedError when it could not be checked (retry).
        Raises OverloadedError now when too many wait. ``client``: whose request it is (grammars
        are checked fairly between clients); cancelling the future gives up waiting. Any thread."""
        if self.config.grammar_backend == "none":
            raise InvalidRequestError("structured output is off on this server (--grammar-backend none).",
                                      param="grammar")
        with self._vetter_lock:
            if self._vetter is None:
                cfg = self.config
                self._vetter = GrammarVetter(self.tokenizer, self.vocab_size, VetLimits(
                    cfg.grammar_compile_timeout, cfg.grammar_memory_budget_mb << 20,
                    int(cfg.grammar_mask_budget_ms * 1000)))
        return self._vetter.vet(spec, client)

    def check_grammar(self, sampling: SamplingParams) -> SamplingParams:
        """``sampling`` with its grammar vetted (waits for the verdict; see :meth:`vet_grammar`)."""
        spec = sampling.grammar
        if spec is None or spec.cost is not None:
            return sampling
        return dataclasses.replace(sampling, grammar=self.vet_grammar(spec).result())

    def check_sampling(self, sampling: SamplingParams) -> None:
        """InvalidRequestError (naming the field) for parameters this engine cannot honour: any
        :meth:`SamplingParams.validate` refuses, token ids outside the vocabulary, more
        ``logprobs`` alternatives than ``--max-logprobs``, ``edit_reuse`` without ``--enable-edit-reuse``. The grammar is :meth:`check_grammar`'s."""
        sampling.validate()
        sampling.check_token_ids(self.vocab_size)
        if sampling.edit_reuse and not self.config.enable_edit_reuse:
            raise InvalidRequestError("edit_reuse needs a server started with --enable-edit-reuse.", param="edit_reuse")
        limit = self.config.max_logprobs
        if sampling.logprobs is not None and sampling.logprobs > limit:
            raise InvalidRequestError(f"top_logprobs must be at most {limit} on this server (--max-logprobs), got "
                                      f"{sampling.logprobs}.", param="logprobs")

    def make_request(self, prompt: Prompt, sampling: SamplingParams, cache_salt: str | None,
                     bootstrap: Bootstrap | None = None, hints: Sequence[RetentionHint] = ()) -> Request:
        """A request for the scheduler, the prompt checked (InvalidRequestError, ContextLengthError).
        ``sampling`` passed :meth:`check_sampling`, its one check (:meth:`generate`, the server).
        ``hints``: prefixes to keep cached a while (:mod:`hicache.cache_hints`)."""
        sampling = self.check_grammar(sampling)
        try:  # (numpy integers are integers; floats are not)
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [operator.index(t) for t in prompt]
        except TypeError:
            raise InvalidRequestError("prompt token ids must be integers.", param="prompt") from None
        if not ids:
            raise InvalidRequestError("the prompt is empty.", param="prompt")
        check_token_ids("prompt", ids, self.vocab_size)
        if len(ids) >= self.context_length:
            raise ContextLengthError(f"the prompt has {len(ids)} tokens but the context length is "
                                     f"{self.context_length}; shorten it so at least one output token fits.")
        allowed = self.config.prefill_allowlist
        if bootstrap is not None and allowed is not None and (bootstrap.host, bootstrap.port) not in allowed:
            raise InvalidRequestError(f"the prefill server {bootstrap.host}:{bootstrap.port} is not one this server "
                                      "takes KV from (--disaggregation-prefill-allowlist).", param="bootstrap_host")
        max_new = min(sampling.max_new_tokens, self.context_length - len(ids))
        if bootstrap is not None and self.config.disaggregation_mode == "prefill":
            max_new = 1  # the first token; the decode server generates the rest
        # + the slots a verify pass writes past the last token (speculative decoding)
        need = -(-(len(ids) + max_new + self.config.speculative_steps) // self.config.page_size)
        if need > self.capacity_pages:
            raise InvalidRequestError(f"the request needs {need} KV pages (prompt {len(ids)} + max_new_tokens "
                                      f"{max_new} tokens) but the device pool holds {self.capacity_pages}; raise "
                                      "--max-total-tokens or lower max_new_tokens.")
        namespace = tree_namespace(self.cache_identity, self.config.cache_dtypes, self.config.page_size, cache_salt)
        return Request(rid=next(self._rids), prompt_ids=ids, sampling=sampling, namespace=namespace,
                       max_new_tokens=max_new, pd=PDState(bootstrap) if bootstrap is not None else None,
                       hints=tuple(hints))

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None, cache_salt: str | None = None,
                 bootstrap: Bootstrap | Sequence[Bootstrap | None] | None = None, n: int = 1,
                 hints: Sequence[RetentionHint] = ()) -> list[GenerateResult]:
        """Generate for one prompt or a list (text or token ids). Returns ``n`` results per prompt,
        prompt after prompt. An invalid request raises :class:`InvalidRequestError` before anything
        runs. ``n`` > 1: the choices share the prompt's pages (computed once; choice i is seeded
        ``seed + i``, :meth:`SamplingParams.for_choice`). ``bootstrap`` (P/D, per prompt): where the
        request's other half runs; a prefill server returns once each prompt's KV was handed over.
        ``hints``: retention hints every prompt carries (``GenerateResult.retention``: what it got)."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams() for _ in prompts]
        if bootstrap is None or isinstance(bootstrap, Bootstrap):
            bootstrap = [bootstrap] * len(prompts)
        if len(sampling) != len(prompts) or len(bootstrap) != len(prompts):
            raise InvalidRequestError(f"got {len(sampling)} sampling params and {len(bootstrap)} bootstraps for "
                                      f"{len(prompts)} prompts.")
        if n < 1 or (n > 1 and any(b is not None for b in bootstrap)):
            raise InvalidRequestError("n must be >= 1, and 1 for a disaggregated request.")
        self._check_driver("generate")
        sched = self._live_scheduler()
        reqs = []
        for p, s, b in zip(prompts, sampling, bootstrap):
            self.check_sampling(s)  # (the one check: make_request trusts it)
            first = self.make_request(p, s, cache_salt, b, hints)
            reqs.append(first)
            for i in range(1, n):  # (a choice differs in its seed only, kept in range: checked with s)
                reqs.append(self.make_request(first.prompt_ids, s.for_choice(i), cache_salt))
                reqs[-1].waits_for = first.rid
        sched.add(*reqs)  # one intake: a rank group's leader takes them all at one step
        pending = {r.rid for r in reqs}
        try:
            while pending or sched.has_work():
                for req in sched.step():
                    pending.discard(req.rid)
        except BaseException as e:  # a bug or a dead rank: later calls fail at once rather than spin on its requests
            self._failed = f"{type(e).__name__}: {e}"
            raise
        return [GenerateResult.from_request(r) for r in reqs]

    def chat(self, messages: list[dict[str, str]], sampling: SamplingParams | None = None,
             cache_salt: str | None = None) -> GenerateResult:
        """One chat turn: ``messages`` ([{"role": ..., "content": ...}]) through the model's
        chat template, generation prompt appended."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([self.tokenizer.encode(text)], sampling, cache_salt)[0]

    # ---- cache control and introspection -------------------------------------------------
    def flush_cache(self) -> bool:
        """Empty the prefix cache. Refused (False) while requests are in flight."""
        self._check_driver("flush_cache")
        return not self._live_scheduler().has_work() and self.backend.flush()

    def release_retention(self, prompt_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Drop the retention hints granted on the cached prefix of ``prompt_ids`` (a stored
        conversation deleted): its pages are plain LRU again. Returns the tokens released."""
        self._check_driver("release_retention")
        self._live_scheduler()
        namespace = tree_namespace(self.cache_identity, self.config.cache_dtypes, self.config.page_size, cache_salt)
        return self.backend.release_retention(namespace, list(prompt_ids))

    def drain_idle(self) -> None:
        """Idle housekeeping: apply the transfer acks that are ready so no lock outlives its
        transfer (several ranks do this themselves, in agreed steps). Never waits: a storage
        write stuck in a hung backend must not hold the loop thread; the loop comes back (it
        polls while idle) and applies the rest once ready."""
        self.backend.drain_idle()

    def check_alive(self) -> None:
        """Raises :class:`EngineDeadError` if the engine can no longer serve (a rank died, a step raised)."""
        if self._failed is not None:
            raise EngineDeadError(f"the engine failed in an earlier step ({self._failed[:200]}); start a new one.")
        self.backend.check_alive()

    def drive(self, thread: threading.Thread | None) -> None:
        """Hand the scheduler to ``thread`` (an EngineLoop's; None: back to in-process use). While it
        drives, only that thread may call generate / flush_cache (DESIGN invariant 3)."""
        if thread is not None and self._driver is not None:
            raise HicacheError("another EngineLoop already drives this engine.")
        self._driver = thread

    def _check_driver(self, what: str) -> None:
        if self._driver is not None and threading.current_thread() is not self._driver:
            raise HicacheError(f"Engine.{what} cannot be called while an EngineLoop drives this engine; go through "
                               "the loop.")

    def _live_scheduler(self) -> SchedulerView:
        # After shutdown() a remote scheduler would wait for ranks that are gone: refuse at once.
        if self._closed:
            raise HicacheError("the engine was shut down.")
        if self._failed is not None:
            self.check_alive()
        return self.backend.scheduler

    def stats(self) -> dict[str, Any]:
        cfg = self.config
        return {**self.backend.stats(), "parallel": {"tp_size": cfg.tp_size, "pp_size": cfg.pp_size,
                                                     "attn_cp_size": cfg.attn_cp_size,
                                                     "kv_cache_sharding": cfg.enable_kv_cache_sharding}}

    def storage_layout(self) -> dict[str, Any]:
        """The L3 object layout for external routers: with the unified key scheme the namespace
        digest, key pattern, grid and every rank's read / write cells (``GET
        /get_hicache_l3_cache_layout``)."""
        return layout_report(self.config, self.loaded.spec, self.kv_dtype, self.model_namespace,
                             self.draft.spec if self.draft is not None else None,
                             hybrid="window" in self.backend.component_pages)

    def shutdown(self) -> None:
        """Drop requests and free the model and pools (stop the rank processes)."""
        if self._closed:
            return
        sched = self.backend.scheduler
        for req in list(sched.running) + list(sched.waiting):
            sched.abort(req.rid)
        self._closed = True
        if self._vetter is not None:
            self._vetter.close()
        self._finalizer()  # the backend drops its model and pools
        self.loaded = None  # type: ignore[assignment]

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
