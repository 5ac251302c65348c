"""The recurrent_state component's part of a P/D transfer (issue 59, docs/hybrid_kv.md "Recurrent
state"): a recurrent layer keeps no rows per token, so what crosses is whole states, never one per
page -- the state at the prompt's *end* (the decode side's running slot: its first decode step reads
it) and, where the prefill side holds it on the device, the snapshot at the prompt's *checkpoint*
``floor((P - 1) / S) * S`` (the decode side's tree takes it, so a later request extending the prompt
hits there). The attention rows cross as before, from ``decode_prefix_len`` on.

A slot's state is every recurrent layer's tensors at one slot index (:attr:`StateSlots.tensors`, the
order both sides enumerate); each rank holds its TP shard, so decode rank r asks prefill rank r for
the states (the servers must run the same ``--tp-size``: checked on the route).

On the wire: an ask's ``state_at`` (the positions wanted: the prompt's end first, then maybe its
checkpoint) and ``state_bytes`` (the asker's slot size); with Mooncake also ``state_buffers`` (its
state tensors' base addresses) and ``state_slots`` (the slot each position goes to). The answer
header's ``state_at`` lists the positions sent (the end always; the checkpoint where held); with
zmq one frame per position and tensor follows the KV frames.

Units: positions are tokens of the prompt; slots are state-pool slot ids.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from ..cache.state_pool import StatePool
from .fields import MAX_TOKENS, WireError, int_list, integer

MAX_TENSORS = 1 << 18  # state tensors of one rank (layers x tensors per layer)
MAX_ADDRESS = 1 << 64
Span = tuple[int, int, int]  # (source address, destination address, bytes)


def positions(msg: dict, key: str, end: int) -> tuple[int, ...]:
    """1 or 2 distinct positions in ``[1, end]``, the first ``end`` (the prompt's end state)."""
    value = msg.get(key)
    if not isinstance(value, list) or not 1 <= len(value) <= 2 or value[0] != end or len(set(value)) != len(value) \
            or any(type(p) is not int or not 1 <= p <= end for p in value):
        raise WireError(f"{key!r} must list the prompt's end ({end}) and at most one earlier position")
    return tuple(value)


@dataclass(frozen=True)
class StateAsk:
    """An ask's state part: the states wanted at positions ``at`` (the prompt's end first);
    ``slot_bytes``: the asker's slot size (its shard); Mooncake: the asker's state tensors' base
    ``buffers`` and the slot each position goes to."""

    at: tuple[int, ...]
    slot_bytes: int
    buffers: tuple[int, ...] = ()
    slots: tuple[int, ...] = ()

    def to_wire(self) -> dict:
        msg: dict = {"state_at": list(self.at), "state_bytes": self.slot_bytes}
        if self.buffers:
            msg.update(state_buffers=list(self.buffers), state_slots=list(self.slots))
        return msg

    @classmethod
    def parse(cls, msg: dict, prompt_len: int) -> Optional["StateAsk"]:
        """None: the ask wants no state (a model without recurrent layers, or not this rank's)."""
        if "state_at" not in msg:
            return None
        at = positions(msg, "state_at", prompt_len)
        slot_bytes = integer(msg, "state_bytes", 1, 1 << 40)
        if "state_buffers" not in msg:
            return cls(at, slot_bytes)
        buffers = msg["state_buffers"]
        if not isinstance(buffers, list) or not 1 <= len(buffers) <= MAX_TENSORS:
            raise WireError(f"'state_buffers' must list 1 to {MAX_TENSORS} addresses")
        buffers = int_list(msg, "state_buffers", len(buffers), 0, MAX_ADDRESS)
        return cls(at, slot_bytes, tuple(buffers), tuple(int_list(msg, "state_slots", len(at), 1, MAX_TOKENS)))


class StateSlots:
    """A pool's recurrent state as P/D moves it, on either side (``pool`` None: a model without
    recurrent layers; then nothing is asked or sent)."""

    def __init__(self, pool: Optional[StatePool]) -> None:
        self.tensors = [t for layer in pool.buffers for t in layer] if pool is not None else []
        self.slot_bytes = pool.bytes_per_slot if pool is not None else 0
        self.frame_bytes = [t[0].numel() * t.element_size() for t in self.tensors]  # one slot of each tensor

    # ---- the decode side ----
    def ask(self, into: dict[int, int], mooncake: bool) -> StateAsk:
        """The ask for the states going ``into`` slots (position -> slot, the prompt's end first)."""
        buffers = tuple(t.data_ptr() for t in self.tensors) if mooncake else ()
        return StateAsk(tuple(into), self.slot_bytes, buffers, tuple(into.values()) if mooncake else ())

    def check_answer(self, into: dict[int, int], sent: tuple[int, ...]) -> None:
        """Raises WireError unless ``sent`` is the end state and maybe the checkpoint asked, in order."""
        if not sent or sent[0] != next(iter(into)) or any(p not in into for p in sent):
            raise WireError(f"states at {list(sent)}, not the prompt's end and what was asked ({list(into)})")

    def store(self, into: dict[int, int], sent: tuple[int, ...], frames: list) -> int:
        """The frames of the states ``sent`` (per position, a frame per tensor) into their slots;
        returns their bytes. Raises WireError for frames of other sizes."""
        n = len(self.tensors)
        if len(frames) != n * len(sent) or any(len(f.buffer) != self.frame_bytes[i % n] for i, f in enumerate(frames)):
            raise WireError("state frames of other sizes than this server's state slots")
        for j, position in enumerate(sent):
            slot = into[position]
            for t, frame in zip(self.tensors, frames[j * n:(j + 1) * n]):
                with warnings.catch_warnings():  # a read-only frame: only read from
                    warnings.simplefilter("ignore", UserWarning)
                    state = torch.frombuffer(frame.buffer, dtype=t.dtype).view(t.shape[1:])
                t[slot].copy_(state.to(t.device))
        if self.tensors and self.tensors[0].is_cuda:  # landed before the scheduler sees the job done
            torch.cuda.current_stream(self.tensors[0].device).synchronize()
        return sum(len(f.buffer) for f in frames)

    # ---- the prefill side ----
    def sendable(self, want: StateAsk, held: dict[int, int]) -> tuple[int, ...]:
        """The positions of ``want`` this rank sends: the prompt's end and the checkpoint where held.
        Raises ValueError for an ask this pool cannot serve."""
        if not self.tensors:
            raise ValueError("the decode server asked for recurrent state; this prefill server's model has none")
        if want.slot_bytes != self.slot_bytes:
            raise ValueError(f"the decode server's recurrent state is {want.slot_bytes} bytes a slot, this prefill "
                             f"server's {self.slot_bytes} (not the same model, dtype or --tp-size)")
        if want.buffers and len(want.buffers) != len(self.tensors):
            raise ValueError(f"the decode server lists {len(want.buffers)} state tensors, this one has "
                             f"{len(self.tensors)}")
        if want.at[0] not in held:
            raise ValueError("this prefill server holds no state at the prompt's end")
        return tuple(p for p in want.at if p in held)

    def frames(self, slots: list[int]) -> list[memoryview]:
        """Each slot's tensors as raw bytes (a frame per slot and tensor)."""
        return [t[slot].cpu().contiguous().view(torch.uint8).numpy().data for slot in slots for t in self.tensors]

    def spans(self, want: StateAsk, held: dict[int, int], sent: tuple[int, ...]) -> list[Span]:
        """Mooncake: the states ``sent`` from their slots here into the asker's slots."""
        if not sent:
            return []
        dst_slot = dict(zip(want.at, want.slots))
        return [(t.data_ptr() + held[p] * n, base + dst_slot[p] * n, n)
                for p in sent for t, base, n in zip(self.tensors, want.buffers, self.frame_bytes)]
