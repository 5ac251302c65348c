"""The simulator's virtual clock: what a request's prefill costs, given where its prefix hit.

Per engine, prefills run one at a time, in arrival order (the queue a prefill server has):

    storage_read = storage_hit_tokens x kv_bytes_per_token / storage_gbps   (prefetched while queued)
    ready        = max(arrival + storage_read, engine free)
    forward      = max(missed_tokens / prefill_tokens_per_s,                 (load-backs overlap
                       host_hit_tokens x kv_bytes_per_token / host_gbps)     the forward layer by layer)
    TTFT         = ready + forward - arrival;  the engine is free again at ready + forward

Decode is not modelled (a decode server, or decode batches interleaved with prefills, is
another resource); device hits cost nothing. Units: tokens are real tokens, bandwidths GB/s
(10^9 bytes/s), times seconds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    name: str
    prefill_tokens_per_s: float
    host_gbps: float  # host -> device load-back
    storage_gbps: float  # storage -> host prefetch
    kv_bytes_per_token: int  # the model's KV of one token, all layers, K and V
    source: str  # where the figures come from

    def storage_read_s(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / (self.storage_gbps * 1e9)

    def forward_s(self, missed_tokens: int, host_tokens: int) -> float:
        return max(missed_tokens / self.prefill_tokens_per_s, host_tokens * self.kv_bytes_per_token / (self.host_gbps * 1e9))


PROFILES: dict[str, CostModel] = {
    "cpu": CostModel(
        "cpu", prefill_tokens_per_s=785.0, host_gbps=10.0, storage_gbps=2.1, kv_bytes_per_token=46_080,
        source="measured on this project's 2-core AMD EPYC VM (AVX2, no AVX-512), SmolLM2-135M float32: cold "
               "1K-token prefill 1305 ms (README, bench_ttft); DRAM copies ~10 GB/s (docs/benchmarks.md); a 4K "
               "prefix from the file store adds 90 ms over L1 for 189 MB (README, bench_hicache); KV 30 layers x "
               "3 heads x 64 x K/V x 4 bytes"),
    "gpu": CostModel(
        "gpu", prefill_tokens_per_s=28_000.0, host_gbps=400.0, storage_gbps=50.0, kv_bytes_per_token=327_680,
        source="derived for a 70B-class model (Llama-3-70B: 80 layers x 8 KV heads x 128 x K/V x bf16) on 8 H100s "
               "at TP8: 2 x 70.6e9 FLOP per token against 8 x 989 TFLOPS dense bf16 (NVIDIA H100 SXM datasheet) "
               "at 50% MFU; host loads over 8 PCIe Gen5 x16 links at ~50 of their 64 GB/s; storage over four "
               "200 Gb/s RDMA NICs at half their line rate"),
}
