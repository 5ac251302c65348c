"""A GGUF file's header read fast: metadata values and the tensor table, tensors memory-mapped.

Why not ``gguf.GGUFReader``: it decodes every metadata element through numpy memmap slices, and
the embedded SmolLM2's 49K-token vocabulary and 49K merges took it 2.5-7 s per process on the
2-core VM -- paid again by every rank process of a parallel engine. This reads the same header
with :mod:`struct` (arrays of numbers with one ``numpy.frombuffer``) in a fraction of that. The
``gguf`` package still owns what it is good at: the type codes and ``gguf.quants.dequantize``,
which takes these tensors' data as they are (shaped as GGUFReader shapes them).

Format (version 2 and 3, little-endian): magic ``GGUF``, version u32, tensor count u64,
metadata count u64; each metadata entry a string key, a u32 value type and the value (strings
are a u64 length and UTF-8 bytes; arrays a u32 element type, a u64 count and the elements);
then per tensor its name, u32 dims, u64 dims (fastest first), u32 type and u64 offset into
the data section, which starts at the next multiple of ``general.alignment`` (default 32).

Bounded (issue 56): every count, length and offset is checked against the file before anything
is allocated for it, so a hostile header fails in one sentence (:class:`ValueError`), in time and
memory proportional to the file: strings and arrays fit in the bytes left, an array holds at most
:data:`MAX_ARRAY_ITEMS` items and arrays nest at most :data:`MAX_NESTING` deep, keys are unique
and at most 65,535 bytes (the format's rule), tensor names at most :data:`MAX_NAME_BYTES`, the
alignment is a power of two, and each tensor (1 to 4 dimensions, a known type, whole blocks per
row) lies inside the file at an aligned offset, sharing no byte with another.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hicache.model.errors import quoted

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Tensor types stored as plain numbers (the rest are blocks, seen as bytes).
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}
MAX_KEY_BYTES = 65535  # the GGUF format's own limit on a metadata key
MAX_NAME_BYTES = 1024  # a tensor name (llama.cpp's own limit is 63)
MAX_ARRAY_ITEMS = 1 << 24  # one metadata array (Gemma 3's vocabulary: 262,144 tokens)
MAX_NESTING = 4  # arrays of arrays
MAX_TENSORS = MAX_FIELDS = 1 << 16
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ALIGNMENT = 1 << 20


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    data: np.ndarray  # read-only view of the file: numbers, or ``[..., bytes per row]`` of blocks


class GGUFFile:
    """``fields``: metadata key -> value (int, float, bool, str or a list of them);
    ``tensors``: the tensor table in file order. Raises ValueError (one sentence, without its
    final period) on a malformed or hostile header."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        magic, version = self._unpack("<4sI")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"not a GGUF file of version 2 or 3 (magic {magic!r}, version {version})")
        num_tensors, num_fields = self._unpack("<QQ")
        self._check_count("metadata entries", num_fields, MAX_FIELDS, 13)
        self._check_count("tensors", num_tensors, MAX_TENSORS, 32)
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string(MAX_KEY_BYTES, "a metadata key")
            if key in self.fields:
                raise ValueError(f"the metadata key {quoted(key)} appears twice")
            self.fields[key] = self._value(self._unpack("<I")[0], 0)
        table = [self._tensor_info() for _ in range(num_tensors)]
        alignment = self._alignment()
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in table]
        self._check_layout(table, alignment)

    def _check_count(self, what: str, count: int, most: int, min_bytes: int) -> None:
        """``count`` items of at least ``min_bytes`` each must fit in the bytes left, and be at most ``most``."""
        left = len(self._map) - self._pos
        if count > most or count * min_bytes > left:
            raise ValueError(f"the header declares {count} {what} at byte {self._pos}, more than "
                             f"{min(most, left // min_bytes)} (the most the {left} bytes left can hold)")

    def _unpack(self, fmt: str) -> tuple:
        try:
            values = struct.unpack_from(fmt, self._map, self._pos)
        except struct.error:
            raise ValueError(f"the header ends early, at byte {self._pos} of {len(self._map)}") from None
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self, most: int | None = None, what: str = "a string") -> str:
        (n,) = self._unpack("<Q")
        if self._pos + n > len(self._map):
            raise ValueError(f"{what} of {n} bytes at byte {self._pos} runs past the end ({len(self._map)} bytes)")
        if most is not None and n > most:
            raise ValueError(f"{what} of {n} bytes at byte {self._pos} is longer than {most} bytes")
        s = self._map[self._pos : self._pos + n].decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, kind: int, depth: int) -> Any:
        """A value of type ``kind``; ``depth``: how many arrays hold it."""
        if kind in _SCALARS:
            return self._unpack("<" + _SCALARS[kind])[0]
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind} at byte {self._pos}")
        if depth >= MAX_NESTING:
            raise ValueError(f"arrays nest deeper than {MAX_NESTING} levels at byte {self._pos}")
        item, count = self._unpack("<IQ")
        size = struct.calcsize(_SCALARS[item]) if item in _SCALARS else 8 if item == _STRING else 12
        self._check_count("array items", count, MAX_ARRAY_ITEMS, size)
        if item in _SCALARS:
            dtype = np.dtype("<" + _SCALARS[item])
            values = np.frombuffer(self._map, dtype, count, self._pos)
            self._pos += dtype.itemsize * count
            return values.tolist()
        return [self._value(item, depth + 1) for _ in range(count)]

    def _alignment(self) -> int:
        """``general.alignment`` (default 32): a power of two, at most :data:`MAX_ALIGNMENT`."""
        alignment = self.fields.get("general.alignment", 32)
        if type(alignment) is not int or not 0 < alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
            raise ValueError(f"general.alignment = {quoted(alignment)} is not a power of two up to {MAX_ALIGNMENT}")
        return alignment

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string(MAX_NAME_BYTES, "a tensor name")
        (ndims,) = self._unpack("<I")
        if not 1 <= ndims <= MAX_DIMS:
            raise ValueError(f"tensor {quoted(name)} has {ndims} dimensions (1 to {MAX_DIMS} are possible)")
        dims = self._unpack(f"<{ndims}Q")
        kind, offset = self._unpack("<IQ")
        return name, dims, kind, offset

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], kind: int, offset: int) -> GGUFTensor:
        """The tensor's view of the map, once its type is known and its bytes lie inside the file."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        if kind not in {int(t) for t in GGML_QUANT_SIZES}:
            raise ValueError(f"tensor {quoted(name)} has the unknown type {kind}")
        qtype = GGMLQuantizationType(kind)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        elements = int(np.prod(dims, dtype=object))
        nbytes = elements // block * block_bytes
        if dims[0] % block:
            raise ValueError(f"tensor {quoted(name)} of type {qtype.name} has rows of {dims[0]} values, not whole "
                             f"blocks of {block}")
        if start + offset + nbytes > len(self._map):
            raise ValueError(f"tensor {quoted(name)} of shape {list(dims)} and type {qtype.name} at offset {offset} "
                             f"runs past the end of the file ({len(self._map)} bytes)")
        rows = tuple(reversed(dims))  # numpy order: slowest first
        if kind in _PLAIN:
            data = np.frombuffer(self._map, _PLAIN[kind], elements, start + offset).reshape(rows)
        else:
            data = np.frombuffer(self._map, np.uint8, nbytes, start + offset)
            data = data.reshape(*rows[:-1], dims[0] // block * block_bytes)
        return GGUFTensor(name, qtype, dims, data)

    def _check_layout(self, table: list[tuple[str, tuple[int, ...], int, int]], alignment: int) -> None:
        """Each tensor's offset aligned, its name unique, and no two tensors sharing a byte."""
        spans = []
        for (name, _, _, offset), tensor in zip(table, self.tensors):
            if offset % alignment:
                raise ValueError(f"tensor {quoted(name)} starts at offset {offset}, not a multiple of the "
                                 f"alignment {alignment}")
            spans.append((offset, offset + tensor.data.nbytes, name))
        if len({name for _, _, name in spans}) != len(spans):
            raise ValueError("two tensors have the same name")
        spans.sort()
        for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
            if begin < end:
                raise ValueError(f"tensors {quoted(first)} and {quoted(second)} overlap in the file")
