"""One rank's place in the deployment and its torch.distributed groups.

World = PP x TP ranks; rank ``r`` is stage ``r // tp_size``, TP rank ``r % tp_size``. With
``nnodes`` machines, node ``n`` runs the consecutive ranks ``[n * k, (n + 1) * k)``, ``k = world //
nnodes`` (node 0 holds rank 0, the leader); a group may span machines, so only a TP group whose
ranks all sit on one node may sum through shared memory. Groups:

- per stage, a TP *control* group (gloo, CPU) for agreement (MIN of ready counts) and the
  leader's broadcast of each step's inputs, and a TP *tensor* group (gloo on CPU, NCCL on
  CUDA) for the model's partial-sum all-reduces;
- with context parallelism (``cp_size`` C > 1) a stage's TP ranks are C CP ranks of
  ``tp_size / C`` attention-TP ranks each (TP rank t: CP rank ``t // (tp_size / C)``): the
  tensor group is a CP rank's attention-TP ranks, and the ranks holding the same heads on
  different CP ranks form two CP groups (the per-layer K/V gathers, and the prefix gathers
  that run in the background); the control group still spans the whole stage, so agreement
  and the consensus checker include every CP rank;
- two world-wide gloo groups, one per storage background thread (prefetch, backup): each
  thread MIN-reduces hit and completed lengths over every rank, and a group must only ever be
  used by one thread so that every rank issues its collectives in the same order;
- the default group, for start-up agreement and point-to-point step messages between
  stages (pickled objects, sent with isend so a stage never blocks on its consumer).

Every socket listens on one address, never on all of them: rank 0's rendezvous store on the
rendezvous host (loopback on one machine, ``--dist-init-addr``'s host across machines), every
gloo group on this node's address (the same; on a node other than 0, the address its route to
node 0 leaves from).
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from .shm_allreduce import ShmAllReduce, open_shm_allreduce, shm_allreduce_supported

logger = logging.getLogger(__name__)

# A stalled peer shows up as a dead process in the frontend long before this.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
# Gloo with its sockets on this node's address (_register_gloo): torch's own "gloo" listens on
# whatever the machine's host name resolves to, often a public interface.
GLOO = "hicache_gloo"


@dataclass(frozen=True)
class RankInfo:
    rank: int
    tp_size: int
    pp_size: int
    nnodes: int = 1  # machines; each runs world_size // nnodes consecutive ranks
    cp_size: int = 1  # context-parallel ranks per stage (divides tp_size)

    @property
    def attn_tp_size(self) -> int:
        """Tensor-parallel ranks within one CP rank (heads and MLP split over them)."""
        return self.tp_size // self.cp_size

    @property
    def attn_tp_rank(self) -> int:
        return self.tp_rank % self.attn_tp_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def tp_on_one_node(self) -> bool:
        """Whether every TP rank of this stage runs on this rank's node."""
        first = self.rank_of(self.pp_rank, 0)
        return first // self.ranks_per_node == (first + self.tp_size - 1) // self.ranks_per_node

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def label(self) -> str:
        return rank_label(self.rank, self.tp_size)

    def rank_of(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank


class CPGroup:
    """One rank's CP group (:class:`hicache.model.prefix_gather.CPGroup`): blocking
    collectives on one gloo/torch group, the background prefix gathers on another, so that
    each group sees its collectives in the same order on every rank."""

    def __init__(self, group: Any, background: Any, rank: int, size: int) -> None:
        self.group, self.background, self.rank, self.size = group, background, rank, size

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(self.size, *x.shape)
        dist.all_gather(list(out.unbind(0)), x.contiguous(), group=self.group)
        return out

    def all_gather_start(self, x: torch.Tensor, out: torch.Tensor) -> Callable[[], float]:
        work = dist.all_gather(list(out.unbind(0)), x.contiguous(), group=self.background, async_op=True)
        done: list[float] = []
        work.get_future().add_done_callback(lambda _: done.append(time.perf_counter()))

        def wait() -> float:
            work.wait()
            return done[0] if done else time.perf_counter()

        return wait

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x


def rank_label(rank: int, tp_size: int) -> str:
    """``PPx/TPy``: how logs and the consensus checker name a rank."""
    return f"PP{rank // tp_size}/TP{rank % tp_size}"


def rendezvous_store(host: str, port: int, info: RankInfo) -> dist.TCPStore:
    """The ranks' rendezvous store at ``host:port``, served by rank 0 on ``host`` only.

    torch's ``tcp://`` rendezvous serves it on every address (``*:port``, IPv4 and IPv6) and
    has no option to bind one: rank 0 binds the socket here and hands it over
    (``master_listen_fd``; the store then owns it)."""
    if info.rank != 0:
        return dist.TCPStore(host, port, info.world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        listener = socket.create_server((host, port), family=family, backlog=socket.SOMAXCONN)
    except OSError as e:  # e.g. a --dist-init-addr host that is not an address of node 0
        raise OSError(f"rank 0 cannot serve the rendezvous on {host}:{port}: {e.strerror or e}") from None
    return dist.TCPStore(host, port, info.world_size, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                         master_listen_fd=listener.detach())


def node_address(host: str, port: int, node_rank: int) -> str:
    """The address this node's gloo sockets listen on: the rendezvous host on node 0 (loopback
    on one machine), else the address this node's packets to it leave from (a UDP connect only
    looks the route up; nothing is sent)."""
    if node_rank == 0:
        return host
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]


def _register_gloo(address: str) -> None:
    """Backend :data:`GLOO`: gloo whose device (its listening socket) is made for ``address``.
    torch.distributed takes no gloo device for a group, only a backend that builds one;
    ``GLOO_SOCKET_IFNAME``, when set, still picks interfaces instead, as in torch."""
    interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]

    def create(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        make = dist.ProcessGroupGloo.create_device
        opts._devices = [make(interface=i) for i in interfaces] or [make(hostname=address)]
        return dist.ProcessGroupGloo(store, rank, size, opts)

    dist.Backend.register_backend(GLOO, create, devices=["cpu", "cuda"])


def _gloo_pair(ranks: list[int]) -> tuple[Any, Any]:
    """Two gloo groups of ``ranks`` (one per thread that runs collectives on them; collective)."""
    return dist.new_group(ranks, backend=GLOO), dist.new_group(ranks, backend=GLOO)


def _own(rank: int, rank_sets: list[list[int]], backend: str | None) -> tuple[Any, list[int]]:
    """A group of each of ``rank_sets`` (``backend``; None: a gloo pair); the one ``rank`` is in,
    and its ranks (None, []: none). new_group is collective: every rank creates every group, in
    the same order."""
    made = [_gloo_pair(ranks) if backend is None else dist.new_group(ranks, backend=backend) for ranks in rank_sets]
    return next(((g, ranks) for g, ranks in zip(made, rank_sets) if rank in ranks), (None, []))


class ParallelGroups:
    def __init__(self, info: RankInfo, init_method: str, device: torch.device, latent_sharding: bool = False) -> None:
        """``latent_sharding``: no CP, but an MLA latent is page-sharded over each stage's TP
        ranks; they then form the stage's shard group (``self.cp``) for the prefix gathers."""
        self.info = info
        url = urlsplit(init_method)
        _register_gloo(node_address(url.hostname, url.port, info.rank // info.ranks_per_node))
        dist.init_process_group(GLOO, store=rendezvous_store(url.hostname, url.port, info), rank=info.rank,
                                world_size=info.world_size, timeout=COLLECTIVE_TIMEOUT)
        tensor_backend = "nccl" if device.type == "cuda" else GLOO
        a = info.attn_tp_size
        stages = [[info.rank_of(p, t) for t in range(info.tp_size)] for p in range(info.pp_size)]
        self.tp_ctrl = _own(info.rank, stages, GLOO)[0]
        # each CP rank's attention-TP ranks share partial sums
        self.tp_tensor = _own(info.rank, [s[c * a:(c + 1) * a] for s in stages for c in range(info.cp_size)],
                              tensor_backend)[0]
        # the shard group: the ranks holding the same heads on every CP rank, or (no CP) a stage's TP
        # ranks holding the same latent, sharded
        shards = [s[t::a] for s in stages for t in range(a)] if info.cp_size > 1 else stages if latent_sharding else []
        pair, ranks = _own(info.rank, shards, None)
        self.cp = CPGroup(*pair, ranks.index(info.rank), len(ranks)) if ranks else None
        self._storage = _gloo_pair(list(range(info.world_size)))
        self.stage_leader = info.rank_of(info.pp_rank, 0)
        self._sends: list[tuple[Any, ...]] = []  # in-flight isends and the buffers they read
        self._shm: ShmAllReduce | None = None

    def use_shared_memory_reduce(self, max_elems: int) -> bool:
        """CPU TP ranks on one host: sum through shared memory instead of gloo for tensors of
        up to ``max_elems`` elements. Collective: every TP rank calls it (and every TP rank
        computes the same ``tp_on_one_node``, so they all skip it together). Not with context
        parallelism: the segment serves a whole stage's TP group, CP ranks sum within theirs."""
        if self.info.cp_size > 1:
            return False
        if self.info.tp_size > 1 and not self.info.tp_on_one_node:
            if self.info.rank == self.stage_leader:
                logger.info("the TP group of stage %d spans machines: partial sums through gloo", self.info.pp_rank)
            return False
        if self.info.tp_size > 1 and shm_allreduce_supported():
            self._shm = open_shm_allreduce(self.info.tp_rank, self.info.tp_size, max_elems, self.tp_ctrl,
                                           self.stage_leader)
        return self._shm is not None

    def staging_bytes(self) -> int:
        """This rank's share of the host memory its collectives keep allocated (the shared
        all-reduce segment, split over the TP group): budgeted like the KV pools (DESIGN inv. 6)."""
        return 0 if self._shm is None else -(-self._shm.nbytes // self.info.tp_size)

    # ---- agreement ------------------------------------------------------------------------
    @staticmethod
    def _reduce(values: list[int], group: Any, op: Any = dist.ReduceOp.MIN) -> list[int]:
        """Element-wise ``op`` over ``group`` (every rank passes a vector of the same length)."""
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=op, group=group)
        return t.tolist()

    def tp_min(self, values: list[int]) -> list[int]:
        """MIN over this stage's TP ranks."""
        return values if self.info.tp_size == 1 else self._reduce(values, self.tp_ctrl)

    def tp_sum(self, values: list[int]) -> list[int]:
        """SUM over this stage's TP ranks."""
        return values if self.info.tp_size == 1 else self._reduce(values, self.tp_ctrl, dist.ReduceOp.SUM)

    def world_min(self, values: list[int]) -> list[int]:
        return values if self.info.world_size == 1 else self._reduce(values, None)

    def storage_agree(self) -> tuple:
        """``(prefetch, backup)`` MIN-reduce functions, one group each (one thread each)."""
        return tuple(functools.partial(self._reduce, group=group) for group in self._storage)

    def tp_gather_object(self, obj: Any) -> list[Any]:
        """Every TP rank's ``obj`` of this stage, in TP rank order (a collective: all call it)."""
        if self.info.tp_size == 1:
            return [obj]
        box: list[Any] = [None] * self.info.tp_size
        dist.all_gather_object(box, obj, group=self.tp_ctrl)
        return box

    def tp_broadcast(self, obj: Any) -> Any:
        """The stage leader's ``obj`` on every TP rank of the stage."""
        if self.info.tp_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.stage_leader, group=self.tp_ctrl)
        return box[0]

    # ---- tensor parallel ------------------------------------------------------------------
    def tp_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every TP rank's ``x``. On CPU the sum runs in float32 (through shared
        memory when enabled, else gloo) and is rounded back to ``x``'s dtype once."""
        if x.device.type == "cpu" and self._shm is not None:
            return self._shm(x.float()).to(x.dtype)
        if x.device.type == "cpu" and x.dtype != torch.float32:
            y = x.float()
            dist.all_reduce(y, group=self.tp_tensor)
            return y.to(x.dtype)
        dist.all_reduce(x, group=self.tp_tensor)
        return x

    # ---- point to point -------------------------------------------------------------------
    def send(self, dst: int, obj: Any) -> None:
        """Queue ``obj`` for rank ``dst`` without waiting for it to be received."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(data)], dtype=torch.int64)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        works = (dist.isend(size, dst), dist.isend(payload, dst))
        self._sends = [s for s in self._sends if not all(w.is_completed() for w in s[0])]
        self._sends.append((works, size, payload))

    def recv(self, src: int) -> Any:
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(payload, src)
        return pickle.loads(payload.numpy().tobytes())

    def close(self) -> None:
        for works, *_ in self._sends:
            for w in works:
                w.wait()
        self._sends.clear()
        if self._shm is not None:
            self._shm.close()
