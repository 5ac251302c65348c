#!/usr/bin/env bash
# Issue 50's prepared run on a device machine (one H200): install the carried wheels beside the image's
# torch (into $SITE; hicache itself runs from src/), a fail-fast smoke stage (tools/gpu_smoke.py), the `cuda`
# tests, then benchmarks/bench_gpu.py; every stage's result is appended to $OUT/gpu_check.json as it ends (the bench's figures to $OUT/gpu_bench.jsonl as measured), so a
# cut run still reports. Idempotent: run it again as is.
#
#   here:    tools/gpu_wheels.sh                    # .gpu-wheels/ (ignored by git, ~9 MiB)
#   device:  run(command="bash tools/gpu_check.sh", carry=[".gpu-wheels"], timeout_s=600)
#   dry run here: DEVICE=cpu PY=.venv/bin/python OUT=/tmp/gpu_dry bash tools/gpu_check.sh
#
# Stages and their limits (seconds): install 60, smoke 90, features 90 (recorded, not fatal), tests 120,
# bench 180. Exit status: the first failing fatal stage's.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
REPORT="$OUT/gpu_check.json"
PY=${PY:-python3}
SITE=${SITE:-/tmp/hicache-site}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu: a dry run of the script here (the cpu variants, the bench's --quick)
export PYTHONUNBUFFERED=1 HICACHE_MODEL_CACHE=${HICACHE_MODEL_CACHE:-/tmp/hicache-models}
export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
# The device machine's memory starts small and grows as it is used (device tool, H200.md): MemAvailable at start
# would refuse the bench's host pools (3 x the device pool); the machine has 128 GiB
export HICACHE_HOST_MEMORY=${HICACHE_HOST_MEMORY:-110G}

record() {  # record STAGE STATUS SECONDS [JSON-EXTRA]: one line per stage (JSON lines)
  printf '{"stage": "%s", "status": %s, "seconds": %s%s}\n' "$1" "$2" "$3" "${4:+, $4}" >>"$REPORT"
}

stage() {  # stage NAME LIMIT COMMAND...: run it, record it, stop the run at the first failure
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  record "$name" "$rc" "$((SECONDS - t0))"
  tail -n 20 "$OUT/$name.log"
  if [ "$rc" -ne 0 ]; then
    echo "gpu_check: stage $name failed ($rc)"
    [ "${SOFT:-0}" = 1 ] || exit "$rc"
  fi
}

: >"$REPORT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>/dev/null \
  || echo "none (no nvidia-smi)" >"$OUT/gpu.txt"
record "machine" 0 0 "\"gpu\": \"$(head -n 1 "$OUT/gpu.txt")\", \"torch\": \"$($PY -c 'import torch; print(torch.__version__)')\""

[ "$DEVICE" = cpu ] || stage install 60 "$PY" -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --upgrade \
  --target "$SITE" .gpu-wheels/*.whl
stage smoke 90 "$PY" tools/gpu_smoke.py --device "$DEVICE" --part core
# what greedy decoding does not reach (seeded sampling, penalties, grammars, page_first, budgets, pinned size):
# recorded, but the tests and the figures still run when it fails
SOFT=1 stage features 90 "$PY" tools/gpu_smoke.py --device "$DEVICE" --part features
if [ "$DEVICE" = cpu ]; then marker="not cuda"; quick=--quick; else marker=cuda; quick=; fi
stage tests 120 "$PY" -m pytest -q -x -s -m "$marker" -p no:cacheprovider tests/test_cuda.py
# the figures, one JSON line each as measured (benchmarks/bench_gpu.py), beside the stage lines
stage bench 180 "$PY" benchmarks/bench_gpu.py --device "$DEVICE" $quick --json "$OUT/gpu_bench.jsonl"
echo "gpu_check: done; stages in $REPORT, figures in $OUT/gpu_bench.jsonl"
