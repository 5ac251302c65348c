"""The prefill/decode disaggregation options of :class:`~hicache.config.EngineConfig` (SGLang's
flag names, and the decode side's admission limits of issue 46) and their checks; the roles
themselves are runtime/pd_role.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import ConfigError
from .options import opt
from .ports import split_host_port

DISAGG_MODES = ("null", "prefill", "decode")  # prefill/decode disaggregation (hicache.disagg)
DISAGG_BACKENDS = ("zmq", "mooncake")


@dataclass
class DisaggregationOptions:
    disaggregation_mode: str = opt(
        "null", "This server's role: 'null' (both phases), 'prefill' (computes prompts, sends their KV), or "
        "'decode' (receives the KV its own tiers lack, decodes).", DISAGG_MODES
    )
    disaggregation_bootstrap_port: int = opt(
        8998, "Prefill side: the port of the bootstrap socket decode servers ask for KV on (0: any free port)."
    )
    disaggregation_bootstrap_host: Optional[str] = opt(
        None, "The address this server's P/D sockets listen on: the prefill bootstrap socket, a Mooncake transfer "
        "engine (default: hicache serve's --host; 127.0.0.1 for the Python API)."
    )
    disaggregation_transfer_backend: str = opt(
        "zmq", "How KV crosses between the servers: 'zmq' (the rows in ZeroMQ messages) or 'mooncake' (Mooncake's "
        "transfer engine writes them straight into the decode pool's pages; TCP here, RDMA in production).",
        DISAGG_BACKENDS
    )
    disaggregation_transfer_timeout: float = opt(
        60.0, "Seconds a request's KV transfer may take: a decode request gets an error (and frees its pages) "
        "when no KV arrived by then; a finished prefill frees its KV when no decode server asked by then.", above=0
    )
    disaggregation_handshake_timeout: float = opt(
        5.0, "Decode side: seconds the prefill server a request names has to answer its first message (the "
        "route of its ranks); one that does not is taken for dead or hostile and the request fails at once.", above=0)
    disaggregation_decode_max_receiving: Optional[int] = opt(
        None, "Decode side: most requests waiting for KV from a prefill server at once (each holds a running slot "
        "and its pages); more wait in the queue, unadmitted, so clients naming slow or hostile prefill servers "
        "cannot take every slot. Default: half of --max-running-requests.", at_least=1)
    disaggregation_prefill_allowlist: Optional[str] = opt(
        None, "Decode side: the prefill bootstrap addresses requests may name, 'host:port,host:port' as the router "
        "sends them (default: any). Set it on a decode server that untrusted clients can reach.")
    disaggregation_decode_enable_radix_cache: bool = opt(
        False, "Decode side: keep a radix tree (and with --enable-hierarchical-cache the host and storage tiers) "
        "so a request asks prefill only for the KV after what it already holds."
    )

    def _validate_disaggregation(self) -> None:
        if self.disaggregation_mode == "null":
            return
        if self.pp_size > 1 or self.attn_cp_size > 1 or self.enable_kv_cache_sharding or self.nnodes > 1:
            raise ConfigError(f"--disaggregation-mode {self.disaggregation_mode} runs with --tp-size on one machine "
                              "for now; drop --pp-size / --attn-cp-size / --enable-kv-cache-sharding / --nnodes.")
        if self.disaggregation_mode == "decode" and self.enable_hierarchical_cache and \
                not self.disaggregation_decode_enable_radix_cache:
            raise ConfigError("a decode server reuses its host tier through its radix tree: add "
                              "--disaggregation-decode-enable-radix-cache to --enable-hierarchical-cache.")
        if self.disaggregation_prefill_allowlist is not None and self.prefill_allowlist is None:
            raise ConfigError(f"--disaggregation-prefill-allowlist must be 'host:port' entries separated by commas, "
                              f"got {self.disaggregation_prefill_allowlist!r}.")
        if not 0 <= self.disaggregation_bootstrap_port < 65536:
            raise ConfigError(f"--disaggregation-bootstrap-port must be in [0, 65535], got "
                              f"{self.disaggregation_bootstrap_port}.")

    @property
    def max_receiving(self) -> int:
        """Decode side: most requests waiting for a prefill server's KV at once."""
        return self.disaggregation_decode_max_receiving or max(1, self.max_running_requests // 2)

    @property
    def prefill_allowlist(self) -> Optional[frozenset[tuple[str, int]]]:
        """The (host, port) pairs a request's bootstrap may name; None: any (or a malformed list)."""
        if self.disaggregation_prefill_allowlist is None:
            return None
        pairs = [split_host_port(a.strip()) for a in self.disaggregation_prefill_allowlist.split(",")]
        return None if not pairs or None in pairs else frozenset(pairs)
