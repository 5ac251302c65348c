"""A GGUF file copied with changes, written by the ``gguf`` package itself (what llama.cpp's
``gguf-new-metadata`` does): other metadata, an other architecture name, extra tensors. The
committed tiny files (tests/data/gguf/) are the sources."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

TINY = Path(__file__).resolve().parent / "data" / "gguf" / "tiny-llama-Q8_0.gguf"


def rewrite_gguf(dst: Path, src: Path = TINY, kv: dict[str, Any] | None = None,
                 tensors: dict[str, np.ndarray] | None = None, arch: str | None = None,
                 drop: tuple[str, ...] = ()) -> Path:
    """``src`` copied to ``dst`` with ``kv`` set (an existing key keeps its type, a new one is typed
    from its Python value, as is one that changes between a list and a number; None drops the key),
    ``tensors`` (float32 arrays) added, the tensors named in ``drop`` left out, and
    ``general.architecture`` = ``arch``; keys of the old architecture are renamed to the new one."""
    import gguf

    kv, tensors = dict(kv or {}), dict(tensors or {})
    reader = gguf.GGUFReader(src)
    old = reader.fields["general.architecture"].contents()
    arch = arch or old
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        name = field.name.replace(f"{old}.", f"{arch}.", 1) if field.name.startswith(f"{old}.") else field.name
        value = kv.pop(name) if name in kv else field.contents()
        if value is None:
            continue
        if isinstance(value, list) != (field.types[0] == gguf.GGUFValueType.ARRAY):
            kv[name] = value  # (a list for a number, or the other way: typed from its value below)
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
    for name, value in kv.items():
        if value is None:
            continue
        if isinstance(value, list):
            writer.add_key_value(name, value, gguf.GGUFValueType.ARRAY, sub_type=_kind(value[0]))
        else:
            writer.add_key_value(name, value, _kind(value))
    kept = [t for t in reader.tensors if t.name not in drop]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    for name, array in tensors.items():
        writer.add_tensor_info(name, array.shape, array.dtype, array.nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data)
    for array in tensors.values():
        writer.write_tensor_data(array)
    writer.close()
    return dst


def _kind(value: Any):
    import gguf

    return (gguf.GGUFValueType.STRING if isinstance(value, str) else gguf.GGUFValueType.BOOL
            if isinstance(value, bool) else gguf.GGUFValueType.INT32 if isinstance(value, int)
            else gguf.GGUFValueType.FLOAT32)
