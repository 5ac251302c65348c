"""transformers' conversions of GGUF files, the references the tokenizer and model tests compare to.

Each packaged model's tokenizer is converted once per test session (several test files compare to
the same one), and transformers reads files with gguf's own parser over a plain array
(:class:`PlainArrayReader`): gguf's reader slices a ``numpy.memmap`` several times per metadata
element, and each memmap slice runs ``memmap.__getitem__`` and ``__array_finalize__`` in Python
(Gemma 3's 262K-token vocabulary: 61 s of parsing on a loaded 2-core VM, 9.6 s over the plain array;
the same fields, checked by tests/test_model_loader.py::test_gguf_header_reads_as_the_gguf_package_reads_it).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any, Iterator

import gguf
import numpy as np
import pytest

from hicache.model.packaged import packaged_model_path


class PlainArrayReader(gguf.GGUFReader):
    """gguf's reader, its file mapped as a plain ``numpy.ndarray`` (a view of the same read-only memory
    map) instead of a ``numpy.memmap``: the same parse, the same bytes, no memmap subclass per slice."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.memmap) -> None:  # GGUFReader.__init__ assigns its memmap here
        self._plain = mapped.view(np.ndarray)


@contextlib.contextmanager
def fast_gguf_reading() -> Iterator[None]:
    """While transformers loads a GGUF file: gguf's reader over a plain array, each file parsed once
    (transformers parses the header twice for a model: its config, then its weights), and gguf's
    tensor-name table built once per architecture (it rebuilds it for every module). All are pure."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=None)(PlainArrayReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        yield


def transformers_tokenizer(path: Path) -> Any:
    """transformers' tokenizer converted from the GGUF file at ``path`` (skips the test without transformers)."""
    transformers = pytest.importorskip("transformers")
    with fast_gguf_reading():
        return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@functools.lru_cache(maxsize=None)
def packaged_transformers_tokenizer(name: str) -> Any:
    """:func:`transformers_tokenizer` of packaged model ``name``'s file, converted once per session
    (the file does not change while the tests run). Shared: callers only encode with it."""
    return transformers_tokenizer(packaged_model_path(name))
