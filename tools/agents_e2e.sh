#!/usr/bin/env bash
# Codex CLI and Claude Code, unmodified, against `hicache serve` (issue 57; not in CI: it installs
# both CLIs from npm into a cache folder and runs minutes of prefill on 2 cores).
#
# Each agent works 3 turns on a coding task in a scratch git repository (add a function, add its
# test, run the tests); per turn it prints, for every request the agent sent: prompt tokens, cached
# tokens per tier (device / host / storage), TTFT, and whether a tool ran in that turn.
#
#   tools/agents_e2e.sh [--model M] [--agents codex,claude] [--turns N] [--task T]... [--port P] [-- serve flags...]
#
# --task (repeatable) replaces the default tasks: turn i asks task i (cycling), e.g. a plain ask for a
# tool: --turns 4 --task "..." x3 --task "Run \`ls\` with your Bash tool and tell me the files."
#
# Serve flags after `--` go to `hicache serve`; on qwen2.5-coder-0.5b, none given means Qwen2.5 Instruct's sampling
# (--preferred-sampling-params: the agents send no temperature).
#
# --model (or $HICACHE_E2E_MODEL) defaults to qwen2.5-coder-0.5b (32K context: Claude Code's first
# prompt is ~19K tokens, Codex's ~10K; SmolLM2's 8K context holds neither). A GGUF path works too.
# The CLIs go to $HICACHE_AGENTS_CACHE (default ~/.cache/hicache/agents) at pinned versions (the
# ones tests/data/agents/ was captured from). Only the install touches the network: where
# `unshare -rn` works, the server and the agents then run in a network namespace with loopback
# only; either way the agents' telemetry and update checks are switched off by their own settings.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
MODEL=${HICACHE_E2E_MODEL:-qwen2.5-coder-0.5b}
AGENTS=codex,claude
TURNS=3
PORT=${HICACHE_E2E_PORT:-18765}
CACHE=${HICACHE_AGENTS_CACHE:-$HOME/.cache/hicache/agents}
CODEX_VERSION=0.171.0
CLAUDE_VERSION=2.1.197
SERVE_FLAGS=()
SERVE_FLAGS_GIVEN=
TASKS=("Add a function mul(a, b) that returns a * b to calc.py."
       "Add a file test_calc.py with a pytest test for mul."
       "Run python -m pytest -q in this repository and tell me the result.")
GIVEN_TASKS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --agents) AGENTS=$2; shift 2 ;;
    --turns) TURNS=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --task) GIVEN_TASKS+=("$2"); shift 2 ;;
    --) shift; SERVE_FLAGS=("$@"); SERVE_FLAGS_GIVEN=1; break ;;
    *) echo "unknown argument: $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
if [ -z "$SERVE_FLAGS_GIVEN" ] && [ "$MODEL" = qwen2.5-coder-0.5b ]; then
  # The agents send no temperature: serve them Qwen2.5 Instruct's published sampling (the shipped GGUF names
  # none; docs/sampling.md "Defaults"). Serve flags after `--` replace these.
  SERVE_FLAGS=(--preferred-sampling-params '{"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1}')
fi
PY=${HICACHE_PYTHON:-$ROOT/.venv/bin/python}
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's server, whichever venv runs it
BIN=$CACHE/npm/node_modules/.bin

if [ -z "${HICACHE_E2E_INSIDE:-}" ]; then
  if [ ! -x "$BIN/codex" ] || [ ! -x "$BIN/claude" ]; then
    echo "installing @openai/codex@$CODEX_VERSION and @anthropic-ai/claude-code@$CLAUDE_VERSION into $CACHE/npm"
    mkdir -p "$CACHE/npm"
    npm install --silent --prefix "$CACHE/npm" "@openai/codex@$CODEX_VERSION" \
        "@anthropic-ai/claude-code@$CLAUDE_VERSION" >/dev/null
  fi
  args=(--model "$MODEL" --agents "$AGENTS" --turns "$TURNS" --port "$PORT")
  for t in ${GIVEN_TASKS[@]+"${GIVEN_TASKS[@]}"}; do args+=(--task "$t"); done
  args+=(-- ${SERVE_FLAGS[@]+"${SERVE_FLAGS[@]}"})
  if unshare -rn true 2>/dev/null; then
    echo "running in a network namespace with loopback only (unshare -rn)"
    exec unshare -rn env HICACHE_E2E_INSIDE=netns bash -c 'ip link set lo up && exec "$0" "$@"' "$0" "${args[@]}"
  fi
  echo "unshare -rn is not available here: running on the host's network (the agents' own settings keep them local)"
  export HICACHE_E2E_INSIDE=host
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/hicache-agents.XXXXXX")
LOG=$WORK/serve.log
SERVER_PID=
cleanup() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
}
trap cleanup EXIT

echo "starting hicache serve --model $MODEL on 127.0.0.1:$PORT (log: $LOG)"
"$PY" -c "import sys; from hicache.cli import main; sys.exit(main())" serve --model "$MODEL" --host 127.0.0.1 --port "$PORT" --served-model-name hicache \
    --log-level info ${SERVE_FLAGS[@]+"${SERVE_FLAGS[@]}"} >"$LOG" 2>&1 &
SERVER_PID=$!
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  kill -0 "$SERVER_PID" 2>/dev/null || { echo "the server exited:"; tail -20 "$LOG"; exit 1; }
  sleep 1
done

new_repo() {  # a scratch git repository with one module
  local repo=$WORK/$1
  mkdir -p "$repo"
  printf 'def add(a, b):\n    return a + b\n' >"$repo/calc.py"
  git -C "$repo" init -q
  git -C "$repo" add calc.py
  git -C "$repo" -c user.email=e2e@hicache -c user.name=e2e commit -qm "calc: add"
  echo "$repo"
}

if [ ${#GIVEN_TASKS[@]} -gt 0 ]; then TASKS=("${GIVEN_TASKS[@]}"); fi

report() {  # agent turn log_offset tools: one row per request the server served since the offset
  "$PY" - "$LOG" "$3" "$1" "$2" "$4" <<'EOF'
import re, sys
log, offset, agent, turn, tools = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
lines = open(log, errors="replace").read().splitlines()[offset:]
admit = {m["rid"]: m for m in (re.search(r"admit rid=(?P<rid>\d+) prompt=(?P<prompt>\d+) cached\(device=(?P<d>\d+) "
                                         r"host=(?P<h>\d+) storage=(?P<s>\d+)\)", l) for l in lines) if m}
rows = [m for m in (re.search(r"finish rid=(?P<rid>\d+) reason=(?P<reason>\w+) prompt=(?P<prompt>\d+) "
                              r"output=(?P<out>\d+) ttft=(?P<ttft>[\d.]+)s", l) for l in lines) if m]
for i, f in enumerate(rows):
    a = admit.get(f["rid"])
    cached = f"{a['d']:>6} {a['h']:>5} {a['s']:>5}" if a else f"{'?':>6} {'?':>5} {'?':>5}"
    print(f"{agent:<7} {turn:>4} {i:>3} {f['prompt']:>7} {cached} {float(f['ttft']):>8.2f} {f['out']:>6} "
          f"{f['reason']:<7} {tools if i == len(rows) - 1 else ''}")
if not rows:
    print(f"{agent:<7} {turn:>4}   -  (no request finished: see the agent's output above)")
EOF
}

header() {
  echo
  printf '%-7s %4s %3s %7s %6s %5s %5s %8s %6s %-7s %s\n' agent turn req prompt device host store "TTFT s" output finish "tools run"
}

run_codex() {
  local repo home
  repo=$(new_repo codex-repo)
  home=$CACHE/codex-home  # (Codex refuses to put its helper binaries under a temporary folder)
  mkdir -p "$home"
  rm -rf "$home/sessions"
  cat >"$home/config.toml" <<EOF
model = "hicache"
model_provider = "hicache"
check_for_update_on_startup = false

[analytics]
enabled = false

[otel]
exporter = "none"

[model_providers.hicache]
name = "hicache"
base_url = "http://127.0.0.1:$PORT/v1"
wire_api = "responses"
env_key = "HICACHE_E2E_KEY"
EOF
  header
  for turn in $(seq "$TURNS"); do
    local offset out tools
    offset=$(wc -l <"$LOG")
    out=$WORK/codex-turn$turn.jsonl
    local cmd=(exec --json --skip-git-repo-check -s workspace-write)
    [ "$turn" -gt 1 ] && cmd=(exec resume --last --json --skip-git-repo-check)
    (cd "$repo" && CODEX_HOME=$home HICACHE_E2E_KEY=none timeout 3600 "$BIN/codex" "${cmd[@]}" \
        "${TASKS[$(( (turn - 1) % ${#TASKS[@]} ))]}" </dev/null >"$out" 2>"$out.err") || echo "codex turn $turn exited $?"
    tools=$(grep -c '"type":"item.completed".*"type":"\(command_execution\|file_change\)"' "$out" || true)
    report codex "$turn" "$offset" "$tools"
  done
  echo "codex repository: $(git -C "$repo" status --short | tr '\n' ' ')"
}

run_claude() {
  local repo home
  repo=$(new_repo claude-repo)
  home=$WORK/claude-home
  mkdir -p "$home"
  header
  for turn in $(seq "$TURNS"); do
    local offset out tools
    offset=$(wc -l <"$LOG")
    out=$WORK/claude-turn$turn.jsonl
    local cont=()
    [ "$turn" -gt 1 ] && cont=(--continue)
    # Claude Code's subagents and small tasks ask for its haiku / sonnet / opus models by name (a subagent's
    # first request asked for claude-haiku-4-5-20251001 and got 404): its own settings point them at the server too
    (cd "$repo" && HOME=$home ANTHROPIC_BASE_URL="http://127.0.0.1:$PORT" ANTHROPIC_API_KEY=none \
        ANTHROPIC_DEFAULT_HAIKU_MODEL=hicache ANTHROPIC_DEFAULT_SONNET_MODEL=hicache \
        ANTHROPIC_DEFAULT_OPUS_MODEL=hicache ANTHROPIC_SMALL_FAST_MODEL=hicache CLAUDE_CODE_SUBAGENT_MODEL=hicache \
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_TELEMETRY=1 DISABLE_AUTOUPDATER=1 \
        DISABLE_ERROR_REPORTING=1 timeout 3600 "$BIN/claude" -p "${TASKS[$(( (turn - 1) % ${#TASKS[@]} ))]}" \
        ${cont[@]+"${cont[@]}"} --model hicache --output-format stream-json --verbose \
        --permission-mode acceptEdits --allowedTools=Bash </dev/null >"$out" 2>"$out.err") \
        || echo "claude turn $turn exited $?"
    tools=$(grep -c '"type":"tool_result"' "$out" || true)
    report claude "$turn" "$offset" "$tools"
  done
  echo "claude repository: $(git -C "$repo" status --short | tr '\n' ' ')"
}

case ",$AGENTS," in *,codex,*) run_codex ;; esac
case ",$AGENTS," in *,claude,*) run_claude ;; esac
echo
curl -s "http://127.0.0.1:$PORT/stats" > "$WORK/stats.json" || true
"$PY" - "$WORK/stats.json" <<'PYEOF' || true
import json, sys
s = json.load(open(sys.argv[1]))
g = s.get("grammar") or {}
print(f"server: prompt tokens {s['prompt_tokens']}, computed {s['prefill_computed_tokens']}, hit tokens "
      f"{s['hit_tokens']}, hit rate {s['hit_rate']:.1%}; tool-call grammar: {g.get('lazy_triggered', 0)} calls "
      f"begun under it, {g.get('lazy_released', 0)} let go, {g.get('failed_requests', 0)} failed")
PYEOF
echo "agents' outputs and the server log: $WORK"
