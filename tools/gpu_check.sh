#!/usr/bin/env bash
# Issue 50's prepared run on a device machine (one H200): install the carried wheels beside the image's
# torch (into $SITE; hicache itself runs from src/), a fail-fast smoke stage, the `cuda` tests, then benchmarks/bench_gpu.py; every stage's result is
# appended to $OUT/gpu_check.json as it ends (the bench's figures to $OUT/gpu_bench.jsonl as measured), so a
# cut run still reports. Idempotent: run it again as is.
#
#   here:    tools/gpu_wheels.sh                    # .gpu-wheels/ (ignored by git, ~9 MiB)
#   device:  run(command="OUT=$OUT bash tools/gpu_check.sh", carry=[".gpu-wheels"], timeout_s=500)
#
# Stages and their limits (seconds): install 60, smoke 90, tests 120, bench 180. Exit status: the first failing
# stage's.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
REPORT="$OUT/gpu_check.json"
PY=${PY:-python3}
SITE=${SITE:-/tmp/hicache-site}
export PYTHONUNBUFFERED=1 HICACHE_MODEL_CACHE=${HICACHE_MODEL_CACHE:-/tmp/hicache-models}
export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"

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
  if [ "$rc" -ne 0 ]; then echo "gpu_check: stage $name failed ($rc)"; exit "$rc"; fi
}

: >"$REPORT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>&1 || true
record "machine" 0 0 "\"gpu\": \"$(head -n 1 "$OUT/gpu.txt")\", \"torch\": \"$($PY -c 'import torch; print(torch.__version__)')\""

stage install 60 "$PY" -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --upgrade \
  --target "$SITE" .gpu-wheels/*.whl
stage smoke 90 "$PY" - <<'PYEOF'
# random:small on the GPU in bf16 and float32 with the host tier: a prompt, the same prompt again (a device hit),
# a third prompt pushing the first to host memory, the first again (a host hit, loaded on the copy stream)
import json, logging, time, torch
from hicache import Engine, SamplingParams
from hicache.kernels import cpu_kernels
logging.basicConfig(level=logging.INFO)
assert torch.cuda.is_available(), "no CUDA device"
g = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
for dtype in ("bfloat16", "float32"):
    t0 = time.perf_counter()
    e = Engine("random:small", device="cuda", dtype=dtype, max_total_tokens=512, enable_hierarchical_cache=True,
               hicache_ratio=4.0)
    first, other = list(range(3, 300)), list(range(303, 600))
    a, b = (e.generate([first], g)[0] for _ in range(2))
    e.generate([other], g)
    c = e.generate([first], g)[0]
    host = e.cache.host
    ops = host.controller
    assert host.host_pool.pinned, "the host pool is not pinned"
    assert next(e.loaded.model.parameters()).is_cuda and e.cache.pool.k_buffers[0].is_cuda
    assert c.cached_tokens_details["host"] > 0, c.cached_tokens_details
    stats = e.stats()
    e.shutdown()
    if dtype == "float32":
        assert a.output_ids == b.output_ids == c.output_ids, (a.output_ids, b.output_ids, c.output_ids)
    print(json.dumps({"dtype": dtype, "seconds": round(time.perf_counter() - t0, 2), "hit": b.cached_tokens_details,
                      "host_hit": c.cached_tokens_details, "same_tokens": a.output_ids == b.output_ids == c.output_ids,
                      "staging_bytes": ops.staging_bytes, "transfers": stats["transfers"],
                      "native_cpu_kernels": cpu_kernels() is not None}))
PYEOF
stage tests 120 "$PY" -m pytest -q -x -s -m cuda -p no:cacheprovider tests/test_cuda.py
# the figures, one JSON line each as measured (benchmarks/bench_gpu.py), beside the stage lines
stage bench 180 "$PY" benchmarks/bench_gpu.py --device cuda --json "$OUT/gpu_bench.jsonl"
echo "gpu_check: all stages passed; report in $REPORT, figures in $OUT/gpu_bench.jsonl"
