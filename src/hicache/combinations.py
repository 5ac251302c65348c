"""The KV components x modes that cannot run together yet.

A component is a kind of cached state (``cache/components.py``: full, window, latent, draft, ...);
a mode is a way of running (context parallelism, KV sharding, P/D). ``EngineConfig.refuse_combinations``,
the one rule that refuses them, checks this table before anything is allocated: a draft's row when
the config is validated, the model's components (``runtime/rank_plan.py::model_components``) once
its spec is read.
"""

# (component, mode) -> the sentence a user gets; the first listed pair a deployment holds is refused.
# ``{model}``: --model.
REFUSED: dict[tuple[str, str], str] = {
    ("window", "cp"): "{model} has sliding-window layers, which context parallelism and KV sharding do not implement "
                      "yet (the window component is not page-sharded); run it without --attn-cp-size / "
                      "--enable-kv-cache-sharding.",
    ("full", "latent-tp"): "--enable-kv-cache-sharding without --attn-cp-size shards an MLA latent over the TP ranks, "
                           "and {model} is not an MLA model (its full component's KV heads are page-sharded over "
                           "context-parallel ranks only); set --attn-cp-size.",
    ("draft", "pd"): "--disaggregation-mode with --speculative-algorithm STANDALONE is not supported yet: P/D sends "
                     "no draft component (a draft model's KV; NGRAM is supported: it needs none).",
    # A recurrent layer's state (issue 59): a scan is sequential over a prompt's tokens, so the CP ranks of one
    # prompt would each wait for the state at the end of the others' tokens.
    ("recurrent_state", "cp"): "{model} has recurrent layers, whose scan is sequential over a prompt's tokens: "
                               "context parallelism would leave each rank waiting for the state at the end of the "
                               "previous rank's tokens (the recurrent_state component is not split by tokens); run it "
                               "without --attn-cp-size / --enable-kv-cache-sharding.",
    # Speculative decoding: NGRAM runs (a verify pass steps the recurrent layers token by token, and the running
    # slot takes the accepted row's state: docs/hybrid_kv.md); a draft model stays refused.
    ("recurrent_state", "standalone"): "{model} has recurrent layers, and --speculative-algorithm STANDALONE is not "
                                       "supported with them (its verify passes of k+1 rows for every running request "
                                       "would keep k states of the recurrent_state component per request, and a "
                                       "recurrent draft model's own state would need the same rollback); use "
                                       "--speculative-algorithm NGRAM.",
    # Reuse after an edit (issue 61) moves cached keys to new positions by re-rotating them: what is more than a
    # rotation of its position cannot move (model/rope_shift.py).
    ("window", "edit-reuse"): "{model} has sliding-window layers, whose window component's keys depend on the window "
                              "they were computed in and cannot be moved to new positions (reuse after an edit): run it "
                              "without --enable-edit-reuse.",
    ("recurrent_state", "edit-reuse"): "{model} has recurrent layers, whose recurrent_state component is not per "
                                       "token and cannot be moved to new positions (reuse after an edit): run it "
                                       "without --enable-edit-reuse.",
    ("latent", "edit-reuse"): "{model} stores an MLA latent, whose latent component's shared rotary half is not "
                              "re-rotated to new positions yet (reuse after an edit): run it without --enable-edit-reuse.",
}
