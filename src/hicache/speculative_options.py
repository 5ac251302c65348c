"""The speculative-decoding options of :class:`~hicache.config.EngineConfig` (SGLang's flag
names) and their checks: STANDALONE (a draft model proposes) and NGRAM (drafts copied from the
request's own text and from the token sequences the radix tree holds; runtime/ngram.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import ConfigError
from .options import opt

SPEC_ALGORITHMS = ("STANDALONE", "NGRAM")
SPEC_KV_LAYOUTS = ("auto", "packed", "sidecar")  # where a draft model's KV lives (runtime/speculative.py)
NGRAM_MATCH_TYPES = ("BFS", "PROB")
DEFAULT_SPEC_STEPS = 3
# NGRAM: at most 7 drafts + the last token a verify pass by default -- 8 rows, one pass of the
# block kernels (model/projection.py DECODE_ROWS); SGLang's default is min(max trie depth, 12).
DEFAULT_NGRAM_DRAFT_TOKENS = 8
DEFAULT_NGRAM_TRIE_DEPTH = 18
BFS_BREADTH_HELP = "NGRAM: branches per draft level. Drafts here are chains: only 1 is accepted."


@dataclass
class SpeculativeOptions:
    speculative_algorithm: Optional[str] = opt(
        None, "Speculative decoding: STANDALONE (a separate draft model proposes tokens, the target verifies "
        "them in one pass) or NGRAM (drafts copied from the request's own text and from every token sequence "
        "the radix tree holds; no draft model); off when unset.", SPEC_ALGORITHMS
    )
    speculative_draft_model_path: Optional[str] = opt(
        None, "The draft model: any name --model takes ('smollm2:int4-g64', a GGUF file, a Hugging Face "
        "directory, 'random:...'); it must share the target's tokenizer."
    )
    speculative_num_steps: Optional[int] = opt(
        None, "Draft tokens proposed per sequence before each verify pass (default 3, or num_draft_tokens - 1; "
        "NGRAM: the most, each request's count adapts to its recent acceptance).", at_least=1
    )
    speculative_num_draft_tokens: Optional[int] = opt(
        None, "Tokens per sequence in a verify pass: the last token plus the drafts, so num_steps + 1 for the "
        "chain drafts built here (the default; NGRAM: min(max trie depth, 8)).", at_least=1
    )
    speculative_draft_kv_layout: str = opt(
        "auto", "Where the draft's KV lives in every tier: 'packed' (extra layers of the target's pages: needs the "
        "same KV row shape and dtype), 'sidecar' (its own pools and storage objects on the target's pages), or "
        "'auto' (packed when it fits).", SPEC_KV_LAYOUTS
    )
    speculative_ngram_min_match_window_size: int = opt(
        1, "NGRAM: the fewest trailing tokens of a request that must match earlier text for its continuation to "
        "be drafted."
    )
    speculative_ngram_max_match_window_size: int = opt(
        12, "NGRAM: the most trailing tokens compared; among matches the longest wins."
    )
    speculative_ngram_max_trie_depth: Optional[int] = opt(
        None, f"NGRAM: the longest suffix matched, in tokens (default {DEFAULT_NGRAM_TRIE_DEPTH}); caps the match "
        "window and the default draft tokens."
    )
    speculative_ngram_branch_length: Optional[int] = opt(
        None, "Older SGLang name of --speculative-ngram-max-trie-depth."
    )
    speculative_ngram_match_type: str = opt(
        "BFS", "NGRAM: which of the longest matches gives the drafts: BFS (the most recent occurrence) or PROB "
        "(the continuation most occurrences share).", NGRAM_MATCH_TYPES
    )
    speculative_ngram_capacity: int = opt(
        10_000_000, "NGRAM: tokens of the radix tree indexed for lookups (past it the oldest sequences leave the "
        "index first; the tree itself is untouched).", at_least=1
    )
    speculative_ngram_min_bfs_breadth: int = opt(1, BFS_BREADTH_HELP)
    speculative_ngram_max_bfs_breadth: int = opt(1, BFS_BREADTH_HELP)

    # ---- checks and derived values ---------------------------------------------------------------
    def _validate_speculative(self, cp: bool) -> None:
        """Chain drafts, one sentence for what is not built; ``cp``: context parallel or sharded KV."""
        algo = self.speculative_algorithm
        if algo is None:
            if self.speculative_draft_model_path:
                raise ConfigError("--speculative-draft-model-path needs --speculative-algorithm STANDALONE.")
            return
        if algo == "STANDALONE" and not self.speculative_draft_model_path:
            raise ConfigError(f"--speculative-algorithm {algo} needs --speculative-draft-model-path (the draft model).")
        if algo == "NGRAM":
            self._validate_ngram()
        steps, tokens = self.speculative_num_steps, self.speculative_num_draft_tokens
        if tokens is not None and steps is not None and tokens != steps + 1:
            raise ConfigError(f"--speculative-num-draft-tokens {tokens} must be --speculative-num-steps + 1 "
                              f"({steps + 1}): drafts are chains (tree drafts are not built).")
        if tokens == 1:
            raise ConfigError("--speculative-num-draft-tokens 1 verifies no draft token; use 2 or more.")
        if cp:
            raise ConfigError("--speculative-algorithm with --attn-cp-size > 1 or --enable-kv-cache-sharding is "
                              "not supported yet.")

    def _validate_ngram(self) -> None:
        if self.speculative_draft_model_path:
            raise ConfigError("--speculative-algorithm NGRAM takes no draft model: its drafts are copied from text "
                              "already seen; drop --speculative-draft-model-path.")
        depth, branch = self.speculative_ngram_max_trie_depth, self.speculative_ngram_branch_length
        if depth is not None and branch is not None and depth != branch:
            raise ConfigError(f"--speculative-ngram-max-trie-depth {depth} and its older name "
                              f"--speculative-ngram-branch-length {branch} disagree; give one.")
        lo, hi = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if not 1 <= lo <= hi:
            raise ConfigError(f"--speculative-ngram-min-match-window-size {lo} and --speculative-ngram-max-match-"
                              f"window-size {hi} must satisfy 1 <= min <= max.")
        if self.ngram_trie_depth < 2:
            raise ConfigError(f"--speculative-ngram-max-trie-depth must be at least 2, got {self.ngram_trie_depth}.")
        if (self.speculative_ngram_min_bfs_breadth, self.speculative_ngram_max_bfs_breadth) != (1, 1):
            raise ConfigError("--speculative-ngram-min-bfs-breadth / --speculative-ngram-max-bfs-breadth above 1 "
                              "ask for tree drafts, which are not built: NGRAM drafts here are chains (use 1).")
        if self.speculative_ngram_match_type not in NGRAM_MATCH_TYPES:
            raise ConfigError(f"--speculative-ngram-match-type must be BFS or PROB, got "
                              f"{self.speculative_ngram_match_type!r}.")

    @property
    def ngram_trie_depth(self) -> int:
        """--speculative-ngram-max-trie-depth under either of its names."""
        given = self.speculative_ngram_max_trie_depth or self.speculative_ngram_branch_length
        return DEFAULT_NGRAM_TRIE_DEPTH if given is None else given

    @property
    def speculative_steps(self) -> int:
        """Draft tokens per sequence per verify pass, the most (0: speculation off)."""
        if self.speculative_algorithm is None:
            return 0
        if self.speculative_num_steps is not None:
            return self.speculative_num_steps
        if self.speculative_num_draft_tokens is not None:
            return self.speculative_num_draft_tokens - 1
        if self.speculative_algorithm == "NGRAM":
            return min(self.ngram_trie_depth, DEFAULT_NGRAM_DRAFT_TOKENS) - 1
        return DEFAULT_SPEC_STEPS

    @property
    def uses_draft_model(self) -> bool:
        return self.speculative_algorithm == "STANDALONE"
