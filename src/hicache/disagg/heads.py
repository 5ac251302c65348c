"""Which KV heads cross between which ranks when prefill and decode run different TP sizes.

Every rank's pool holds a contiguous range of the model's KV heads (``ModelShard.kv_heads``:
model-global indices; a head whose query group straddles two ranks is held by both, and an MLA
latent, one "head", by every rank). A decode rank needs all of its heads; each one comes from
the *lowest* prefill rank that holds it, so a replicated head crosses once per decode rank that
needs it, never once per prefill rank that has it. The prefill server's bootstrap socket (its
rank 0) tells decode ranks where every prefill rank listens and which heads it holds: the
*route*.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .bootstrap import endpoint

WILDCARD_HOSTS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class RankEndpoint:
    """One prefill rank: where its KV sender listens and the model-global KV heads its pool holds."""

    host: str
    port: int
    heads: range

    @property
    def address(self) -> str:
        return endpoint(self.host, self.port)

    def to_wire(self) -> list:
        return [self.host, self.port, self.heads.start, self.heads.stop]

    @classmethod
    def from_wire(cls, item: list, bootstrap_host: str) -> "RankEndpoint":
        """A rank that listens on every interface is reached where its bootstrap socket was."""
        host = str(item[0])
        return cls(bootstrap_host if host in WILDCARD_HOSTS else host, int(item[1]), range(int(item[2]), int(item[3])))


def heads_from(route: list[RankEndpoint], mine: range) -> list[range]:
    """Per prefill rank of ``route``, the heads of ``mine`` it supplies (empty for most ranks):
    contiguous, since ranks hold increasing contiguous ranges. Raises ValueError when no
    prefill rank holds one of ``mine`` (the servers run different models)."""
    out = []
    next_head = mine.start
    for rank in route:
        held = rank.heads.start <= next_head < min(rank.heads.stop, mine.stop)
        stop = min(rank.heads.stop, mine.stop) if held else next_head
        out.append(range(next_head, stop))
        next_head = stop
    if next_head < mine.stop:
        raise ValueError(f"no prefill rank holds KV heads {next_head}-{mine.stop - 1} "
                         f"(the prefill ranks hold {[(r.heads.start, r.heads.stop - 1) for r in route]})")
    return out


@dataclass(frozen=True)
class TPRanks:
    """This server's tensor-parallel ranks as the P/D role sees them (the TP group's
    collectives; on one rank the identity functions).

    ``heads``: the model-global KV heads of this rank's pool; ``gather``: every TP rank's
    object, in rank order; ``total``: the element-wise SUM of every TP rank's int vector."""

    rank: int
    size: int
    heads: range
    gather: Callable[[Any], list[Any]]
    total: Callable[[list[int]], list[int]]

    @classmethod
    def alone(cls, kv_heads: int) -> "TPRanks":
        return cls(0, 1, range(kv_heads), lambda obj: [obj], lambda values: values)
