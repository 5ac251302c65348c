"""Every engine option in one dataclass. CLI flags map onto fields 1:1
(``--max-total-tokens`` <-> ``max_total_tokens``); names follow SGLang where one exists."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from .combinations import REFUSED
from .disagg_options import DisaggregationOptions
from .errors import ConfigError
from .options import check_bounds, flag, json_object, opt as _opt
from .ports import split_host_port
from .speculative_options import SpeculativeOptions

CP_STRATEGIES = ("zigzag", "interleave")  # how prefill tokens are split over context-parallel ranks
__all__ = ["ConfigError", "EngineConfig", "PassPrecision"]


@dataclass(frozen=True)
class PassPrecision:
    """What a model's passes read and compute with besides its weights' dtype (``load_model``): the
    decode and prefill weight copies, 8-bit decode inputs, one row-invariant path for every pass."""

    decode_weights: str = "auto"
    prefill_weights: str = "same"
    decode_activations: str = "float32"
    deterministic: bool = False


@dataclass
class EngineConfig(SpeculativeOptions, DisaggregationOptions):
    """The speculative-decoding and P/D options come from :class:`SpeculativeOptions` and
    :class:`DisaggregationOptions` (their modules)."""

    # Model
    model: str = _opt(
        "smollm2", "Model to serve: 'smollm2' (embedded SmolLM2-135M-Instruct), a local Hugging Face "
        "directory (config.json + *.safetensors + tokenizer.json), or 'random:<preset or JSON>'.")
    dtype: str = _opt(
        "auto", "Weight and activation dtype (the KV cache's: --kv-cache-dtype). 'auto': bfloat16 on CUDA (float16 "
        "without bf16), float32 on a CPU.", ("auto", "bfloat16", "float16", "float32"))
    kv_cache_dtype: str = _opt(
        "auto", "What the KV cache stores, in every tier. 'auto': float16 where --dtype auto chose float32 on a CPU "
        "with the native kernels (decode attention reads half the bytes; llama.cpp's KV is f16 too; lossy: its KV has "
        "its own cache keys), else --dtype. Attention computes in --dtype either way.",
        ("auto", "float32", "bfloat16", "float16"))
    prefill_weight_dtype: str = _opt(
        "auto", "Weights for passes of more than 8 tokens (prefill). 'auto': a bfloat16 copy where --dtype auto chose "
        "float32 on a CPU with AVX512-BF16 or AMX, else 'same' (the loaded weights). 'bfloat16': the copy "
        "(lossy: its KV has its own cache keys).", ("auto", "same", "bfloat16"))
    decode_weight_dtype: str = _opt(
        "auto", "Weights for decode steps (at most 8 tokens). 'auto': a float32 matrix's exact 4/8-bit GGUF blocks "
        "(Q4_1/Q8_0, e.g. smollm2) through the native kernels where it has them, else 'same' (the loaded "
        "weights). 'bfloat16': a rounded copy (lossy: its KV has its own cache keys).", ("auto", "same", "bfloat16"))
    decode_activations: str = _opt(
        "auto", "What decode steps multiply a GGUF file's quantized blocks with. 'int8': the inputs quantized per 32 "
        "values, as llama.cpp does (lossy: its KV has its own cache keys; faster GEMVs); 'float32': exact. 'auto': "
        "int8 where --dtype auto chose float32 on a CPU with the native kernels, else float32.",
        ("auto", "float32", "int8"))
    device: str = _opt("auto", "'auto' (cuda when present, else cpu), 'cpu' or 'cuda[:N]'.")
    context_length: Optional[int] = _opt(None, "Maximum tokens per request (prompt + output); default: the model's.",
                                         at_least=2)
    random_seed: int = _opt(0, "Seed for random-model weights.")
    num_threads: Optional[int] = _opt(None, "CPU threads for torch (default: torch's choice).")
    skip_server_warmup: bool = _opt(
        False, "Start without the warm-up pass (a 4-token prefill and a decode step on the padding slot, before "
        "the first request; one-rank engines only, counted nowhere).")
    # KV cache
    page_size: int = _opt(16, "Tokens per KV page; the radix tree matches whole pages.", at_least=1)
    max_total_tokens: Optional[int] = _opt(None, "Device KV pool size in tokens (overrides --mem-fraction-static); "
                                           "of a hybrid model (sliding-window layers), its full-attention layers'.")
    recurrent_snapshot_ratio: Optional[float] = _opt(
        None, "Recurrent-state snapshots kept on the device per 1K tokens the KV pool holds (models with recurrent "
        "layers: LFM2; a snapshot is every recurrent layer's state at a cached boundary, which a prefix hit resumes "
        "from). Default: 1, and at least two per running request plus 8.")
    swa_full_tokens_ratio: Optional[float] = _opt(
        None, "A hybrid model's window layers hold only pages inside some window still needed. By default full pages "
        "and window pages draw from one pool of blocks, so the split follows demand; a value fixes it: the window "
        "layers get a pool of their own, this many tokens per token of the full-attention layers' pool (SGLang's "
        "flag; 0.8 was the default).")
    disable_hybrid_swa_memory: bool = _opt(
        False, "Keep every layer's KV for every cached token of a hybrid model (no window pool; SGLang's flag).")
    mem_fraction_static: Optional[float] = _opt(
        None, "Fraction of device memory for weights + KV pool (default 0.85 on CUDA; on CPU 0.10 of available RAM).")
    disable_radix_cache: bool = _opt(False, "Turn prefix reuse off (every request computes its whole prompt).")
    radix_eviction_policy: str = _opt("lru", "Order in which unlocked leaves leave the device tier.", ("lru", "lfu"))
    cache_retention_max_fraction: float = _opt(
        0.5, "Most of each tier's pool (device, host) that clients' retention hints (Anthropic cache_control, OpenAI "
        "prompt_cache_retention, retention_seconds) may keep; a hint past it is clipped or kept a tier lower "
        "(docs/agent_contract.md). 0: hints are reported, never granted.", at_least=0)
    cache_generated_kv: str = _opt(
        "auto", "Whether a finished request's generated tokens keep their KV in the prefix cache (an agent's next "
        "turn resends the reply). 'auto': only under --enable-deterministic-inference (decode steps compute the "
        "prefill's bits) or speculative decoding (verify passes differ from a cold run anyway; NGRAM drafts from "
        "the replies the cache holds); elsewhere the next turn computes the reply again as prompt, so a hit keeps "
        "the cold greedy reply. 'on': always (a longer hit; the decode steps' KV may change a greedy reply by "
        "rounding). 'off': never.", ("auto", "on", "off"))
    # Hierarchical cache (L2 host tier)
    enable_hierarchical_cache: bool = _opt(False, "Keep KV that leaves the device in a host-memory pool (L2).")
    hicache_ratio: float = _opt(2.0, "Host pool size as a multiple of the device pool.", above=0)
    hicache_size: float = _opt(0.0, "Host pool size in GB (overrides --hicache-ratio when > 0).", at_least=0)
    hicache_write_policy: str = _opt(
        "write_through", "When device KV is copied to host: on insert, on the Nth hit (selective), or at device "
        "eviction.", ("write_through", "write_through_selective", "write_back"))
    hicache_write_through_threshold: int = _opt(2, "Hits before a node is backed up under write_through_selective.",
                                                at_least=1)
    hicache_mem_layout: str = _opt(
        "layer_first", "Host pool layout: layer_first, or page_first (one page of all layers contiguous); "
        "the unified key scheme uses page_unified instead.",
        ("layer_first", "page_first"))
    # Storage tier (L3)
    hicache_storage_backend: Optional[str] = _opt(
        None, "L3 backend: 'file', 'valkey', 'mooncake', 'memory' (this process; gone at exit), or 'module:Class' "
        "for your own (needs --enable-hierarchical-cache).")
    hicache_storage_backend_extra_config: Optional[str] = _opt(
        None, 'Backend options as JSON, e.g. \'{"path": "/data/kv", "max_bytes": 10000000000}\'.')
    hicache_storage_prefetch_policy: str = _opt(
        "adaptive", "How long a request waits for its storage prefetch: best_effort, not at all; wait_complete, "
        "until the read ends (at most 20x the timeout formula); timeout, at most the timeout formula below; adaptive, "
        "while loading is measured to be cheaper than recomputing, at most one recompute time (the timeout "
        "formula until both are measured).", ("best_effort", "wait_complete", "timeout", "adaptive"))
    hicache_storage_key_scheme: str = _opt(
        "rank-suffix", "How storage objects are cut and named: rank-suffix (one object per page and rank: only a "
        "deployment with the same TP/PP layout reads it) or unified (one fixed grid of layer ranges x KV-head "
        "groups per page, shared by every compatible TP/PP layout; docs/unified_layout.md).",
        ("rank-suffix", "unified"))
    hicache_storage_head_partition: int = _opt(
        1, "unified: KV heads per storage object (divides the model's KV heads; every rank's KV heads must be "
        "whole groups). Ignored for MLA, whose latent has no heads.", at_least=1)
    hicache_storage_layer_partition: Optional[int] = _opt(
        None, "unified: layers per storage object (default: all of them; every pipeline stage must start on a "
        "multiple of it).", at_least=1)
    hicache_storage_write_policy: str = _opt(
        "write_through", "Which host copies are written to storage: write_through, every one; selective, only "
        "prefixes a client asked to retain or hit at least --hicache-write-through-threshold times.",
        ("write_through", "selective"))
    hicache_storage_prefetch_threshold: int = _opt(256, "Least uncached prompt tokens for which storage is asked.")
    hicache_storage_prefetch_timeout_base: float = _opt(1.0, "timeout formula: seconds a prefetch may take ...")
    hicache_storage_prefetch_timeout_per_1k_tokens: float = _opt(0.25, "... plus this many seconds per 1K tokens.")
    hicache_storage_op_timeout: float = _opt(
        10.0, "Deadline in seconds of each storage backend call (exists/get/set of one batch); a call past it is "
        "abandoned and fails (recompute), and a backend that keeps failing is skipped and re-probed.", above=0)
    # Parallelism
    tp_size: int = _opt(1, "Tensor-parallel ranks per pipeline stage (attention heads and MLP sharded).", at_least=1)
    pp_size: int = _opt(1, "Pipeline stages (layers split across them); tp_size x pp_size rank processes.", at_least=1)
    attn_cp_size: int = _opt(
        1, "Context-parallel ranks per TP group (divides --tp-size): each takes a share of the prefill tokens; "
        "weights are replicated across them and tensor-parallel within (tp_size / attn_cp_size ranks).")
    enable_kv_cache_sharding: bool = _opt(
        False, "Page-shard the KV cache across the context-parallel ranks (page q on rank q mod N) instead of "
        "replicating it: each rank holds 1/N of every prefix, gathered per layer for attention. Without "
        "--attn-cp-size, an MLA model's latent (the same on every rank) is sharded over the attention-TP ranks.")
    cp_strategy: str = _opt(
        "zigzag", "How prefill tokens are split over context-parallel ranks: zigzag (2N pieces, rank r takes "
        "r and 2N-1-r) or interleave (page-sized blocks dealt round-robin).", choices=CP_STRATEGIES)
    nnodes: int = _opt(
        1, "Machines the ranks run on; each runs tp_size x pp_size / nnodes of them (see docs/parallel.md).", at_least=1
    )
    node_rank: int = _opt(
        0, "This machine's index in [0, nnodes): node 0 holds rank 0 and serves; the others run `hicache node`.")
    dist_init_addr: Optional[str] = _opt(
        None, "HOST:PORT where node 0's rank 0 listens for the other ranks to join (required when nnodes > 1).")
    # Scheduling
    chunked_prefill_size: int = _opt(2048, "Most prompt tokens computed in one prefill step (a long prompt is chunked).")
    max_running_requests: int = _opt(32, "Most requests decoding at once.", at_least=1)
    disable_shared_prefill_wait: bool = _opt(
        False, "Admit a request at once even when a request still computing its prompt holds 64+ more of its "
        "first tokens (by default it waits for those pages and hits them instead of computing them again).")
    max_logprobs: int = _opt(
        20, "Most alternatives a request may ask for per token (top_logprobs, /generate's "
        "top_logprobs_num; vLLM's flag): each is an entry in the answer, so this bounds its size.", at_least=0)
    chat_template: Optional[str] = _opt(
        None, "The chat template: a Jinja file, or a built-in name (chatml, gemma, llama3), instead of the model's; "
        "a model without one (a base model) refuses chats unless it is given.")
    grammar_backend: str = _opt(
        "llguidance", "Structured output (response_format, forced tool calls, json_schema / regex / ebnf): the grammar "
        "engine that masks each step's tokens; 'none' refuses such requests.", ("llguidance", "none"))
    grammar_compile_timeout: float = _opt(
        5.0, "CPU seconds a new grammar may take to compile and walk in the contained grammar checker, which runs "
        "at the lowest priority; a slower one is refused with 400, measured again if sent again (a checker that got "
        "no CPU for 4x that in wall-clock time: 503) (docs/structured_output.md).", above=0)
    grammar_memory_budget_mb: int = _opt(
        1024, "MiB of grammar matchers the engine holds: one per grammar plus each request's copy, as the grammar "
        "checker measured them. A grammar needing more alone is refused; past it, grammar requests wait.", above=0)
    grammar_mask_budget_ms: float = _opt(
        20.0, "Milliseconds of token masks one step may compute for its grammar requests (each grammar's slowest "
        "mask in CPU time, as measured when it was checked): a grammar slower alone is refused (measured again if "
        "sent again); past it, grammar requests wait.", above=0)
    enable_deterministic_inference: bool = _opt(
        False, "Bit-identical output for a greedy or seeded request whatever shares its batch, how its prompt was "
        "chunked, which tier its prefix came from, and with or without speculative decoding (docs/deterministic.md); "
        "prefill is slower.")
    enable_edit_reuse: bool = _opt(
        False, "Reuse after an edit (docs/edit_reuse.md): past a prompt's cached prefix, spans equal to cached pages "
        "at other positions reuse their KV (keys re-rotated), each span's first tokens computed again and checked "
        "by a quality gate that falls back to exact prefix reuse. Approximate KV: off by default, and per request "
        "(`edit_reuse`).")
    edit_reuse_recompute_tokens: int = _opt(
        32, "Reuse after an edit: the first tokens of each reused span that are computed anyway (they absorb the "
        "change before them); the gate checks their KV against the reused values.", above=0)
    edit_reuse_max_deviation: Optional[float] = _opt(
        None, "Reuse after an edit: the quality gate's threshold, the largest relative deviation (L2, any layer) "
        "between a span's recomputed KV and its reused KV that keeps the reuse. Unset: the model's calibrated value "
        "(`hicache calibrate-edit-reuse`), else 0.35.", above=0)

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ConfigError(
                f"--max-total-tokens {self.max_total_tokens} is smaller than one page ({self.page_size} tokens).")
        if self.recurrent_snapshot_ratio is not None and not 0.0 < self.recurrent_snapshot_ratio <= 1024.0:
            raise ConfigError(f"--recurrent-snapshot-ratio must be in (0, 1024], got {self.recurrent_snapshot_ratio}.")
        if self.swa_full_tokens_ratio is not None and not 0.0 < self.swa_full_tokens_ratio <= 64.0:
            raise ConfigError(f"--swa-full-tokens-ratio must be in (0, 64], got {self.swa_full_tokens_ratio}.")
        if not 0.0 <= self.cache_retention_max_fraction <= 1.0:
            raise ConfigError(f"--cache-retention-max-fraction must be in [0, 1], got {self.cache_retention_max_fraction}.")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ConfigError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}.")
        if self.chunked_prefill_size < self.page_size:
            raise ConfigError(
                f"--chunked-prefill-size {self.chunked_prefill_size} must be at least one page ({self.page_size}).")
        self._validate_nodes()
        self._validate_context_parallel()
        self._validate_speculative(cp=self.attn_cp_size > 1 or self.enable_kv_cache_sharding)
        self._validate_disaggregation()
        self.refuse_combinations({"draft"} if self.uses_draft_model else set())
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ConfigError("--enable-hierarchical-cache needs the radix cache; drop --disable-radix-cache.")
        if self.hicache_storage_key_scheme == "unified" and not self.hicache_storage_backend:
            raise ConfigError("--hicache-storage-key-scheme unified names storage objects: it needs "
                              "--hicache-storage-backend.")
        self._validate_deterministic()
        self._validate_edit_reuse()
        if self.hicache_storage_backend and not self.enable_hierarchical_cache:
            raise ConfigError("--hicache-storage-backend needs --enable-hierarchical-cache (storage moves through host memory).")
        if self.hicache_storage_backend_extra_config:
            json_object(self.hicache_storage_backend_extra_config, "--hicache-storage-backend-extra-config")
        for f in dataclasses.fields(self):
            choices, value = f.metadata.get("choices"), getattr(self, f.name)
            if choices and value not in choices and value is not None:  # None: unset
                raise ConfigError(f"{flag(f.name)} must be one of {', '.join(choices)}, got {value!r}.")

    def _validate_context_parallel(self) -> None:
        """The combinations CP is built for; anything else stops here with one sentence."""
        cp = self.attn_cp_size
        if cp < 1 or self.tp_size % cp:
            raise ConfigError(f"--attn-cp-size {cp} must be at least 1 and divide --tp-size {self.tp_size}.")
        if self.enable_kv_cache_sharding and self.tp_size == 1:
            raise ConfigError("--enable-kv-cache-sharding needs a shard group: --attn-cp-size 2 or more, or "
                              "--tp-size 2 or more for an MLA model.")
        if (cp > 1 or self.enable_kv_cache_sharding) and self.pp_size > 1:
            raise ConfigError("--attn-cp-size or --enable-kv-cache-sharding with --pp-size > 1 is not supported yet.")

    @property
    def decode_reuses_prefix(self) -> bool:
        """Whether requests may hit the radix tree: always, but on a decode server only with
        --disaggregation-decode-enable-radix-cache (as SGLang)."""
        return not self.disable_radix_cache and (self.disaggregation_mode != "decode"
                                                 or self.disaggregation_decode_enable_radix_cache)

    @property
    def caches_generated_kv(self) -> bool:
        """Whether finished requests cache their generated tokens' KV (``--cache-generated-kv``)."""
        return self.cache_generated_kv == "on" or self.cache_generated_kv == "auto" and (
            self.enable_deterministic_inference or self.speculative_algorithm is not None)

    @property
    def cache_dtypes(self) -> str:
        """The dtypes a cache namespace names (:func:`~hicache.cache.storage.keys.tree_namespace`):
        ``--dtype``, and the KV's where it differs (a float16 KV cache changes every later token's
        KV; namespaces of a KV in the model's dtype keep their old names)."""
        return self.dtype if self.kv_cache_dtype in ("auto", self.dtype) else f"{self.dtype}+kv-{self.kv_cache_dtype}"

    def precision_options(self) -> PassPrecision:  # resolved by hicache.device.choose_precision
        return PassPrecision(self.decode_weight_dtype, self.prefill_weight_dtype, self.decode_activations,
                             self.enable_deterministic_inference)

    def _validate_deterministic(self) -> None:
        """What deterministic inference does not cover is refused in one sentence each."""
        if not self.enable_deterministic_inference:
            return
        refused = (
            (self.attn_cp_size > 1 or self.enable_kv_cache_sharding,
             "context parallelism splits a prefix's attention over ranks and merges the parts"),
            (self.disaggregation_mode != "null", "prefill/decode disaggregation is not covered yet"),
            (self.tp_size > 2 and self.nnodes > 1, "a TP group of more than 2 ranks across machines sums its "
                                                  "partials through gloo, in an order that depends on the size"),
        )
        for given, why in refused:
            if given:
                raise ConfigError(f"--enable-deterministic-inference: {why}.")

    def _validate_edit_reuse(self) -> None:
        """The modes reuse after an edit does not run with yet, one sentence each."""
        if not self.enable_edit_reuse:
            return
        refused = (
            (self.disable_radix_cache, "it finds reusable pages in the radix cache; drop --disable-radix-cache"),
            (self.enable_deterministic_inference, "its KV is approximate, and deterministic inference promises the "
                                                  "cold run's bits"),
            (self.tp_size > 1 or self.pp_size > 1, "its quality gate is measured on each rank's own KV heads and "
                                                   "ranks do not agree on it yet; run it with --tp-size 1 --pp-size 1"),
            (self.disaggregation_mode != "null", "prefill/decode disaggregation is not covered yet"),
            (self.speculative_algorithm is not None, "speculative decoding is not covered yet (a draft model has no "
                                                     "KV for the reused spans)"),
        )
        for given, why in refused:
            if given:
                raise ConfigError(f"--enable-edit-reuse: {why}.")

    def refuse_combinations(self, components: set[str]) -> None:
        """Refuse the first pair of ``components`` (names of cache/components.py's kinds) x the modes
        this config turns on that :data:`~hicache.combinations.REFUSED` lists, in its sentence."""
        modes = {"cp": self.attn_cp_size > 1 or self.enable_kv_cache_sharding,
                 "latent-tp": self.enable_kv_cache_sharding and self.attn_cp_size == 1,
                 "pd": self.disaggregation_mode != "null", "tp": self.tp_size > 1, "pp": self.pp_size > 1,
                 "unified": self.hicache_storage_key_scheme == "unified",
                 "speculative": self.speculative_algorithm is not None, "standalone": self.uses_draft_model,
                 "edit-reuse": self.enable_edit_reuse}
        for (component, mode), why in REFUSED.items():
            if component in components and modes[mode]:
                raise ConfigError(why.format(model=self.model))

    def _validate_nodes(self) -> None:
        """Ranks across machines: every node runs the same number of ranks, node 0 included."""
        world = self.tp_size * self.pp_size
        if world % self.nnodes:
            raise ConfigError(
                f"--tp-size x --pp-size ({world}) must be divisible by --nnodes {self.nnodes} (same ranks per node).")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank must be in [0, {self.nnodes}) for --nnodes {self.nnodes}, got {self.node_rank}.")
        if self.nnodes > 1 and split_host_port(self.dist_init_addr) is None:
            raise ConfigError(
                f"--nnodes {self.nnodes} needs --dist-init-addr HOST:PORT (node 0's address), "
                f"got {self.dist_init_addr!r}."
            )

    @property
    def local_ranks(self) -> range:
        """The global ranks this node runs (node 0 holds rank 0, the leader): as many on every node."""
        per_node = self.tp_size * self.pp_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        unknown = sorted(set(kwargs) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(f"unknown engine option(s): {', '.join(unknown)}.")
        return cls(**kwargs)

    # ---- CLI mapping (options.add_cli_args, options.from_cli_args) ---------------------
    @classmethod
    def choices(cls, name: str) -> tuple:
        """The values flag ``name`` (a field name) accepts."""
        return next(f.metadata["choices"] for f in dataclasses.fields(cls) if f.name == name)


