#!/usr/bin/env bash
# The wheels a device machine's image lacks (issue 50) into .gpu-wheels/ (ignored by git): the device tool
# carries that folder (`carry: [".gpu-wheels"]`) and tools/gpu_check.sh installs from it with --no-deps
# --no-index into a folder of its own beside the image's torch; hicache itself runs from src/ (the copy of
# the working tree the device tool carries), so no wheel of it can be stale. Versions are this checkout's .venv's, for the image's Python
# (3.12, x86-64: docs of the device tool). Run here, where the package registries can be reached.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=.gpu-wheels
PYVER=${GPU_PYTHON_VERSION:-3.12}
# hicache's dependencies the image does not hold, with theirs (the image has torch, numpy, tokenizers, jinja2, tqdm,
# safetensors, anyio, h11, httpx, click, pyyaml, prometheus-client, ninja, matplotlib, sentencepiece, ...: the
# device tool's KINDS.md lists them). Found by importing what the cuda tests, the bench and the server import and
# subtracting that list.
MISSING="fastapi starlette pydantic pydantic-core annotated-types typing-inspection opentelemetry-api python-multipart
uvicorn gguf llguidance pyzmq valkey pyahocorasick"
rm -rf "$OUT" && mkdir -p "$OUT"
pins=()
for name in $MISSING; do
  pin=$("$PY" -m pip freeze 2>/dev/null | grep -i -E "^${name//-/[-_]}==" || true)
  [ -n "$pin" ] || { echo "gpu_wheels: $name is not in $PY's environment (run make setup first)" >&2; exit 1; }
  pins+=("$pin")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
  --platform any -d "$OUT" "${pins[@]}"
du -sh "$OUT" && ls "$OUT"
