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
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Tensor types stored as plain numbers (the rest are blocks, seen as bytes).
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    data: np.ndarray  # read-only view of the file: numbers, or ``[..., bytes per row]`` of blocks


class GGUFFile:
    """``fields``: metadata key -> value (int, float, bool, str or a list of them);
    ``tensors``: the tensor table in file order. Raises ValueError on a malformed header."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        magic, version = self._unpack("<4sI")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"not a GGUF file of version 2 or 3 (magic {magic!r}, version {version})")
        num_tensors, num_fields = self._unpack("<QQ")
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I")[0])
        table = [self._tensor_info() for _ in range(num_tensors)]
        alignment = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in table]

    def _unpack(self, fmt: str) -> tuple:
        try:
            values = struct.unpack_from(fmt, self._map, self._pos)
        except struct.error:
            raise ValueError(f"the header ends early, at byte {self._pos} of {len(self._map)}") from None
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        if self._pos + n > len(self._map):
            raise ValueError(f"a string of {n} bytes at byte {self._pos} runs past the end ({len(self._map)} bytes)")
        s = self._map[self._pos : self._pos + n].decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._unpack("<" + _SCALARS[kind])[0]
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind} at byte {self._pos}")
        item, count = self._unpack("<IQ")
        if item in _SCALARS:
            dtype = np.dtype("<" + _SCALARS[item])
            values = np.frombuffer(self._map, dtype, count, self._pos)
            self._pos += dtype.itemsize * count
            return values.tolist()
        return [self._value(item) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        (ndims,) = self._unpack("<I")
        dims = self._unpack(f"<{ndims}Q")
        kind, offset = self._unpack("<IQ")
        return name, dims, kind, offset

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], kind: int, offset: int) -> GGUFTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        qtype = GGMLQuantizationType(kind)
        rows = tuple(reversed(dims))  # numpy order: slowest first
        elements = int(np.prod(dims))
        if kind in _PLAIN:
            data = np.frombuffer(self._map, _PLAIN[kind], elements, start + offset).reshape(rows)
        else:
            block, block_bytes = GGML_QUANT_SIZES[qtype]
            row_bytes = dims[0] // block * block_bytes
            data = np.frombuffer(self._map, np.uint8, elements // block * block_bytes, start + offset)
            data = data.reshape(*rows[:-1], row_bytes)
        return GGUFTensor(name, qtype, dims, data)
