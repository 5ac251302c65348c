"""The in-process Engine API: ``Engine(model=..., **options).generate(prompts, sampling)``."""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any, Sequence, Union

import torch

from ..config import ConfigError, EngineConfig
from ..device import resolve_device
from ..errors import ContextLengthError, HicacheError, InvalidRequestError
from ..model import load_model
from ..model.parallel import check_parallel
from .core import build_core, core_stats
from .request import GenerateResult, Request
from .sampling import SamplingParams

if TYPE_CHECKING:
    from ..parallel.frontend import RankGroup

logger = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int]]


class Engine:
    """One model, one device KV pool with its prefix cache, one scheduler.

    Options are :class:`EngineConfig` fields, the CLI flags with underscores
    (``--max-total-tokens`` <-> ``max_total_tokens``).
    """

    def __init__(self, model: str = "smollm2", **options: Any) -> None:
        self.config = cfg = EngineConfig.from_kwargs(model=model, **options)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.device = resolve_device(cfg.device)
        self.dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[cfg.dtype]
        ranks = cfg.tp_size * cfg.pp_size
        # With several ranks this process only tokenizes: each rank loads its own slice.
        self.loaded = load_model(cfg.model, dtype=self.dtype, device=self.device, seed=cfg.random_seed,
                                 weights=ranks == 1)
        self.tokenizer = self.loaded.tokenizer
        spec = self.loaded.spec
        self.context_length = cfg.context_length or spec.max_position_embeddings
        if self.context_length > spec.max_position_embeddings:
            raise ConfigError(
                f"--context-length {self.context_length} exceeds the model's {spec.max_position_embeddings} positions."
            )
        # Cache keys of different models, dtypes or page sizes must never meet.
        self.model_namespace = hashlib.sha256(
            f"{self.loaded.identity}|{cfg.dtype}|page={cfg.page_size}".encode()
        ).hexdigest()[:16]
        self.group: "RankGroup | None" = None
        if ranks > 1:
            from ..parallel.frontend import RankGroup

            check_parallel(spec, cfg.tp_size, cfg.pp_size)
            self.group = RankGroup(cfg)
            self.scheduler = self.group.scheduler
            self.capacity_pages = self.group.capacity_pages
            self.cache = self.pool = self.host_pool = self.runner = None
        else:
            core = build_core(cfg, self.loaded, self.device, self.dtype)
            self.pool, self.host_pool, self.cache, self.runner = core.pool, core.host_pool, core.cache, core.runner
            self.scheduler = core.scheduler
            self.capacity_pages = self.cache.capacity_pages
            self._core = core
        # Stops the ranks or the cache's threads (pending writes finish) on shutdown(), when the
        # engine is garbage-collected without it, or at interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _stop_parts, self.group, self.cache)
        self._rids = itertools.count()
        # Set by EngineLoop (engine/loop.py) while its thread drives the scheduler; then only that
        # thread may call generate / flush_cache (DESIGN invariant 3).
        self._driver_thread: int | None = None
        logger.info(
            "engine ready: model=%s device=%s dtype=%s pool=%d tokens context=%d ranks=tp%dxpp%d",
            cfg.model, self.device, cfg.dtype, self.capacity_pages * cfg.page_size, self.context_length,
            cfg.tp_size, cfg.pp_size,
        )

    # ---- requests ------------------------------------------------------------------------
    def _make_request(self, prompt: Prompt, sampling: SamplingParams, cache_salt: str | None) -> Request:
        sampling.validate()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError("the prompt is empty.")
        vocab = self.loaded.spec.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab}).")
        if len(ids) >= self.context_length:
            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens but the context length is {self.context_length}; "
                "shorten it so at least one output token fits."
            )
        max_new = min(sampling.max_new_tokens, self.context_length - len(ids))
        need = -(-(len(ids) + max_new) // self.config.page_size)
        if need > self.capacity_pages:
            raise InvalidRequestError(
                f"the request needs {need} KV pages (prompt {len(ids)} + max_new_tokens {max_new} tokens) but the "
                f"device pool holds {self.capacity_pages}; raise --max-total-tokens or lower max_new_tokens."
            )
        namespace = self.model_namespace if not cache_salt else f"{self.model_namespace}|{cache_salt}"
        return Request(rid=next(self._rids), prompt_ids=ids, sampling=sampling, namespace=namespace,
                       max_new_tokens=max_new)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
    ) -> list[GenerateResult]:
        """Generate for one prompt or a list (text or token ids). Returns one result per prompt,
        in order. An invalid request raises :class:`InvalidRequestError` before anything runs."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams() for _ in prompts]
        if len(sampling) != len(prompts):
            raise InvalidRequestError(f"got {len(sampling)} sampling params for {len(prompts)} prompts.")
        self._check_driver("generate")
        reqs = [self._make_request(p, s, cache_salt) for p, s in zip(prompts, sampling)]
        for req in reqs:
            self.scheduler.add(req)
        pending = {r.rid for r in reqs}
        while pending:
            for req in self.scheduler.step():
                pending.discard(req.rid)
        return [GenerateResult.from_request(r) for r in reqs]

    def chat(
        self,
        messages: list[dict[str, str]],
        sampling: SamplingParams | None = None,
        cache_salt: str | None = None,
    ) -> GenerateResult:
        """One chat turn: ``messages`` ([{"role": ..., "content": ...}]) through the model's
        chat template, generation prompt appended."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([self.tokenizer.encode(text)], sampling, cache_salt)[0]

    # ---- cache control and introspection -------------------------------------------------
    def flush_cache(self) -> bool:
        """Empty the prefix cache. Refused (False) while requests are in flight."""
        self._check_driver("flush_cache")
        if self.scheduler.has_work():
            return False
        if self.group is not None:
            return self.group.call("flush")
        self.cache.flush()
        logger.info("cache flushed")
        return True

    def drain_idle(self) -> None:
        """Idle housekeeping: apply the transfer acks that are ready so no lock outlives its
        transfer (several ranks do this themselves, in agreed steps). Never waits: a storage
        write stuck in a hung backend must not hold the loop thread; the loop comes back (it
        polls while idle) and applies the rest once ready."""
        if self.group is None and not self.scheduler.has_work() and self.cache.has_pending_transfers():
            self.cache.drain_ready()

    def check_alive(self) -> None:
        """Raises :class:`EngineDeadError` if the engine can no longer serve (a rank died)."""
        if self.group is not None:
            self.group.check_alive()

    def _check_driver(self, what: str) -> None:
        if self._driver_thread is not None and threading.get_ident() != self._driver_thread:
            raise HicacheError(
                f"Engine.{what} cannot be called while an EngineLoop drives this engine; go through the loop."
            )

    def stats(self) -> dict[str, Any]:
        out = self.group.call("stats") if self.group is not None else core_stats(self._core, self.config.page_size)
        out["parallel"] = {"tp_size": self.config.tp_size, "pp_size": self.config.pp_size}
        return out

    def shutdown(self) -> None:
        """Drop requests and free the model and pools (stop the rank processes)."""
        if self.scheduler is None:
            return
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.abort(req.rid)
        self._finalizer()
        self.runner = self.scheduler = self.pool = self.cache = self.loaded = self._core = None  # type: ignore[assignment]

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _stop_parts(group: "RankGroup | None", cache: Any) -> None:
    """What ``Engine.shutdown`` stops; holds no reference to the engine (see weakref.finalize)."""
    if group is not None:
        group.shutdown()
    elif cache is not None:
        cache.shutdown()
