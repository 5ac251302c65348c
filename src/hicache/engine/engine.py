"""The in-process Engine API: ``Engine(model=..., **options).generate(prompts, sampling)``."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import threading
from typing import Any, Sequence, Union

import torch

from ..cache.host_pool import HostKVPool
from ..cache.manager import KVCacheManager
from ..cache.storage.base import StorageError
from ..cache.storage.registry import create_backend
from ..cache.pools import DeviceKVPool
from ..config import ConfigError, EngineConfig
from ..device import device_memory_budget, resolve_device
from ..errors import ContextLengthError, HicacheError, InvalidRequestError
from ..model import load_model
from .request import GenerateResult, Request
from .runner import ModelRunner
from .sampling import SamplingParams
from .scheduler import Scheduler

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
        self.loaded = load_model(cfg.model, dtype=self.dtype, device=self.device, seed=cfg.random_seed)
        self.tokenizer = self.loaded.tokenizer
        spec = self.loaded.spec
        self.context_length = cfg.context_length or spec.max_position_embeddings
        if self.context_length > spec.max_position_embeddings:
            raise ConfigError(
                f"--context-length {self.context_length} exceeds the model's {spec.max_position_embeddings} positions."
            )
        num_pages = self._device_pool_pages()
        self.pool = DeviceKVPool(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, num_pages, cfg.page_size, self.dtype, self.device
        )
        self.host_pool = HostKVPool(self.pool, self._host_pool_pages(num_pages), cfg.hicache_mem_layout) \
            if cfg.enable_hierarchical_cache else None
        self.cache = KVCacheManager(
            storage=self._storage_backend(),
            prefetch_threshold=cfg.hicache_storage_prefetch_threshold,
            pool=self.pool,
            eviction_policy=cfg.radix_eviction_policy,
            enable_prefix_cache=not cfg.disable_radix_cache,
            host_pool=self.host_pool,
            write_policy=cfg.hicache_write_policy,
            write_through_threshold=cfg.hicache_write_through_threshold,
        )
        self.runner = ModelRunner(self.loaded.model, self.cache.kv_view, self.device)
        self.scheduler = Scheduler(
            cache=self.cache,
            forward=self.runner.forward,
            decode_text=self.tokenizer.decode,
            eos_token_ids=set(self.tokenizer.eos_token_ids),
            chunked_prefill_size=cfg.chunked_prefill_size,
            max_running_requests=cfg.max_running_requests,
            prefetch_policy=cfg.hicache_storage_prefetch_policy,
            prefetch_timeout=lambda tokens: cfg.hicache_storage_prefetch_timeout_base
            + cfg.hicache_storage_prefetch_timeout_per_1k_tokens * tokens / 1000,
        )
        # Cache keys of different models, dtypes or page sizes must never meet.
        self.model_namespace = hashlib.sha256(
            f"{self.loaded.identity}|{cfg.dtype}|page={cfg.page_size}".encode()
        ).hexdigest()[:16]
        self._rids = itertools.count()
        # Set by EngineLoop (engine/loop.py) while its thread drives the scheduler; then only that
        # thread may call generate / flush_cache (DESIGN invariant 3).
        self._driver_thread: int | None = None
        logger.info(
            "engine ready: model=%s device=%s dtype=%s pool=%d tokens context=%d",
            cfg.model, self.device, cfg.dtype, self.cache.capacity_pages * cfg.page_size, self.context_length,
        )

    def _device_pool_pages(self) -> int:
        """Usable pages + the reserved page 0."""
        cfg = self.config
        if cfg.max_total_tokens is not None:
            return cfg.max_total_tokens // cfg.page_size + 1
        bytes_per_page = self.loaded.spec.kv_bytes_per_token(self.dtype) * cfg.page_size
        budget = device_memory_budget(self.device, cfg.mem_fraction_static)
        pages = budget // bytes_per_page
        if pages < 1:
            raise ConfigError(
                f"the KV budget ({max(budget, 0) / 2**20:.0f} MiB) holds no page of {bytes_per_page} bytes; "
                "raise --mem-fraction-static or set --max-total-tokens."
            )
        return int(pages) + 1

    def _storage_backend(self):
        """The L3 backend, or None. A backend that is down at start is reported and skipped:
        the engine serves without storage rather than not at all."""
        cfg = self.config
        if not cfg.hicache_storage_backend:
            return None
        extra = json.loads(cfg.hicache_storage_backend_extra_config or "{}")
        try:
            return create_backend(cfg.hicache_storage_backend, extra)
        except StorageError as e:
            logger.warning("storage backend %s is unavailable (%s); serving without the storage tier",
                           cfg.hicache_storage_backend, e)
            return None

    def _host_pool_pages(self, device_pages: int) -> int:
        """Host pages + the reserved page 0: --hicache-size GB, else --hicache-ratio x device."""
        cfg = self.config
        if cfg.hicache_size > 0:
            pages = int(cfg.hicache_size * 1e9 // self.pool.bytes_per_page)
        else:
            pages = int((device_pages - 1) * cfg.hicache_ratio)
        if pages < 1:
            raise ConfigError("the host KV pool would hold no page; raise --hicache-size or --hicache-ratio.")
        return pages + 1

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
        need = self.cache.pages_for(len(ids) + max_new)
        if need > self.cache.capacity_pages:
            raise InvalidRequestError(
                f"the request needs {need} KV pages (prompt {len(ids)} + max_new_tokens {max_new} tokens) but the "
                f"device pool holds {self.cache.capacity_pages}; raise --max-total-tokens or lower max_new_tokens."
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
        self.cache.flush()
        logger.info("cache flushed")
        return True

    def _check_driver(self, what: str) -> None:
        if self._driver_thread is not None and threading.get_ident() != self._driver_thread:
            raise HicacheError(
                f"Engine.{what} cannot be called while an EngineLoop drives this engine; go through the loop."
            )

    def stats(self) -> dict[str, Any]:
        s = self.cache.stats
        hits = {"device": s.device_hit_tokens, "host": s.host_hit_tokens, "storage": s.storage_hit_tokens}
        out = {
            "prompt_tokens": s.prompt_tokens,
            "hit_tokens": hits,
            "hit_rate": (sum(hits.values()) / s.prompt_tokens) if s.prompt_tokens else 0.0,
            "evicted_device_pages": s.evicted_device_pages,
            "device_pool": self.cache.usage(),
            "running_requests": len(self.scheduler.running),
            "waiting_requests": len(self.scheduler.waiting),
        }
        if self.cache.storage is not None:
            st = self.cache.storage.stats
            out["storage"] = {
                "backend": self.cache.storage.backend.name,
                "prefetch_ops": st.prefetch_ops, "prefetched_tokens": st.prefetched_pages * self.config.page_size,
                "prefetch_bytes": st.prefetch_bytes, "prefetch_time_s": st.prefetch_time_s,
                "backup_tokens": st.backup_pages * self.config.page_size, "backup_bytes": st.backup_bytes,
                "backup_time_s": st.backup_time_s, "failures": dict(st.failures),
            }
        host = self.cache.host_usage()
        if host is not None:
            out["host_pool"] = host
            out["evicted_host_pages"] = s.evicted_host_pages
            out["transfers"] = {
                "backup_tokens": s.backup_tokens, "backup_bytes": s.backup_bytes,
                "load_tokens": s.load_tokens, "load_bytes": s.load_bytes,
                "load_time_s": s.load_time_s, "backup_skipped_pages": s.backup_skipped_pages,
            }
        return out

    def shutdown(self) -> None:
        """Drop requests and free the model and pools."""
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.abort(req.rid)
        self.cache.shutdown()
        self.runner = self.scheduler = self.pool = self.cache = self.loaded = None  # type: ignore[assignment]

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
