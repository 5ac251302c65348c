"""The ``hicache`` command: generate | chat | demo | agent-demo | serve | node | bench.

Engine flags are the :class:`EngineConfig` fields (SGLang names); a user error prints one
sentence and exits with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import Callable, Sequence

from .config import EngineConfig
from .errors import ConfigError, HicacheError


def _add_sampling_args(p: argparse.ArgumentParser, max_new_tokens: int = 128, temperature: float = 0.0) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="Most tokens to generate per request.")
    g.add_argument("--temperature", type=float, default=temperature, help="0 is greedy.")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1, help="-1 is off.")
    g.add_argument("--seed", type=int, default=None, help="Seed for reproducible sampling.")
    g.add_argument("--stop", action="append", default=None, help="Stop string (repeatable).")


def _sampling(args: argparse.Namespace):
    from .frontend import SamplingParams

    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=args.stop)


def _engine(args: argparse.Namespace):
    from .frontend import Engine

    cfg = EngineConfig.from_cli_args(args)
    if cfg.disaggregation_bootstrap_host is None and getattr(args, "host", None):  # serve: next to the HTTP API
        cfg = dataclasses.replace(cfg, disaggregation_bootstrap_host=args.host)
    return Engine(**dataclasses.asdict(cfg))


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = list(args.prompt or [])
    for path in args.prompt_file or []:
        try:
            with open(path, encoding="utf-8") as f:
                prompts.append(f.read())
        except OSError as e:
            raise HicacheError(f"cannot read prompt file {path}: {e.strerror}.") from None
    if not prompts:
        raise HicacheError("give a prompt with --prompt TEXT or --prompt-file FILE.")
    with _engine(args) as engine:  # shut down in order: storage writes finish, ranks exit
        if args.chat:
            prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        for res in engine.generate(prompts, _sampling(args)):
            if args.json:
                print(json.dumps(dataclasses.asdict(res), ensure_ascii=False))
            else:
                print(res.text)
                print(f"[{res.prompt_tokens} prompt tokens, {res.cached_tokens} cached, "
                      f"{res.completion_tokens} generated, TTFT {res.ttft_s * 1000:.0f} ms, {res.finish_reason}]",
                      file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    with _engine(args) as engine:
        _chat_loop(engine, args)
    return 0


def _chat_loop(engine, args: argparse.Namespace) -> None:
    sampling = _sampling(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("hicache chat: type a message; /reset clears the history, /exit quits.", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        res = engine.chat(messages, sampling)
        messages.append({"role": "assistant", "content": res.text})
        print(f"assistant> {res.text}")
        print(f"  [{res.prompt_tokens} prompt tokens, {res.cached_tokens} cached {res.cached_tokens_details}, "
              f"TTFT {res.ttft_s * 1000:.0f} ms]", file=sys.stderr)


def cmd_demo(args: argparse.Namespace) -> int:
    from .frontend.demo import run_demo

    with _engine(args) as engine:
        return run_demo(engine, turns=args.turns, max_new_tokens=args.max_new_tokens, agents=args.agents,
                        cold_rerun=not args.no_cold_rerun)


def cmd_agent_demo(args: argparse.Namespace) -> int:
    from .frontend.agent_demo import run_agent_demo

    return run_agent_demo(model=args.model, server_args=args.server_args, api=args.api)


def cmd_serve(args: argparse.Namespace) -> int:
    from .processes import die_with_parent  # (standard library only)

    die_with_parent()  # (a server started by a test, benchmark or demo stops with it)
    api_key = _api_key(args.api_key, os.environ.get("HICACHE_API_KEY"))  # refused before the model loads
    limits = {} if args.max_logprob_tokens is None else {"max_logprob_tokens": args.max_logprob_tokens}
    if limits and args.max_logprob_tokens < 1:
        raise ConfigError(f"--max-logprob-tokens must be at least 1, got {args.max_logprob_tokens}.")
    if args.responses_store_size < 0 or args.responses_store_mb < 0:
        raise ConfigError("--responses-store-size and --responses-store-mb must be at least 0.")
    if args.default_max_tokens is not None and args.default_max_tokens < 1:
        raise ConfigError(f"--default-max-tokens must be at least 1, got {args.default_max_tokens}.")
    from .server.serve import run_server  # after the checks above: a refused flag costs no torch import

    return run_server(_engine(args), host=args.host, port=args.port, served_model_name=args.served_model_name,
                      max_queued_requests=args.max_queued_requests, log_level=args.log_level, api_key=api_key,
                      max_request_bytes=args.max_request_bytes, tool_call_parser=args.tool_call_parser,
                      tool_call_grammar=args.tool_call_grammar,
                      responses_store_size=args.responses_store_size, responses_store_mb=args.responses_store_mb,
                      default_max_tokens=args.default_max_tokens, **limits)


def _api_key(flag: str | None, env: str | None) -> str | None:
    """The key every request must send, or None. An empty key (``--api-key "$UNSET"``) would
    serve without authentication while the operator believes it on: refused."""
    key, source = (flag, "--api-key") if flag is not None else (env, "$HICACHE_API_KEY")
    if key is not None and not key.strip():
        raise ConfigError(f"{source} is empty (an unset variable?); give a key, or leave it out to serve without "
                          "authentication.")
    return key


def cmd_node(args: argparse.Namespace) -> int:
    """Run this machine's ranks of an engine served from node 0; exit when node 0 stops them."""
    from .parallel.node import NodeFailed, run_node

    try:
        return run_node(EngineConfig.from_cli_args(args), report=lambda line: print(line, file=sys.stderr, flush=True))
    except NodeFailed as e:  # a rank failed (status 1), unlike a bad flag (status 2)
        print(f"error: {e}", file=sys.stderr)
        return 1


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.main import run_bench

    return run_bench(args)


def cmd_simulate(args: argparse.Namespace) -> int:
    from .sim.cli import run_simulate

    return run_simulate(args)


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    """``hicache serve``'s own flags (the HTTP layer's; the engine's come from EngineConfig)."""
    from .server.tool_formats import PARSER_CHOICES  # (standard library only)

    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--served-model-name", default=None, help="Model name clients use (default: --model).")
    p.add_argument("--max-queued-requests", type=int, default=512,
                   help="Requests allowed to wait beyond --max-running-requests; more are refused with 503.")
    p.add_argument("--api-key", default=None,
                   help="Require 'Authorization: Bearer <key>' on every endpoint but /health and /metrics "
                        "(default: $HICACHE_API_KEY, else no key).")
    p.add_argument("--max-request-bytes", type=int, default=8 * 2**20,
                   help="Largest request body accepted (default 8 MiB); larger ones get 413 before they are "
                        "read in full.")
    p.add_argument("--responses-store-size", type=int, default=1024,
                   help="Responses (/v1/responses with store) kept for previous_response_id, the least recently "
                        "used dropped first (0: none kept).")
    p.add_argument("--responses-store-mb", type=int, default=256,
                   help="Memory those stored responses may hold together (MiB, roughly); the least recently used "
                        "are dropped first.")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="Most output tokens of a Chat Completions or Responses request that sets no max (default: "
                        "the rest of the context, as OpenAI's; such a request reserves KV up to the context length, "
                        "so this also lets more run at once). Completions keep 16, /generate 128, Messages its "
                        "max_tokens.")
    p.add_argument("--max-logprob-tokens", type=int, default=None,
                   help="Most n x prompts x max_tokens a non-streamed answer with logprobs may ask for (each token "
                        "carries its top_logprobs alternatives; default 16384, ~25 MB of JSON); larger ones get 400 "
                        "and should stream.")
    # server/tool_formats.py writes and parses them; qwen25 and hermes name one format (SGLang's and vLLM's names)
    p.add_argument("--tool-call-parser", default="auto", choices=PARSER_CHOICES,
                   help="The format tool calls are written and parsed in. auto: the chat template's (<tool_call> "
                        "tags: hermes; [TOOL_CALLS]: mistral; <|python_tag|> or Llama 3 headers with \"parameters\": "
                        "llama3; a template without tools: hermes, described in a system message); one log line says "
                        "which (docs/structured_output.md).")
    p.add_argument("--tool-call-grammar", default="lazy", choices=("lazy", "forced-only"),
                   help="lazy: once a reply under tool_choice auto begins a call (<tool_call>, a reply that opens "
                        "with {\"name\" ...), the rest of the call is constrained to a given function and its "
                        "parameters' schema, as llama.cpp's lazy grammars do; text before it stays free. "
                        "forced-only: only tool_choice required / a named function constrains the reply.")


LOG_LEVELS = ("debug", "info", "warning", "error")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="warning", choices=LOG_LEVELS)
    # Every subcommand takes it too (`hicache serve --log-level info`); given there, it wins.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS,
                        help="Log level (also accepted before the subcommand).")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, **kw) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], **kw)

    _add_local_commands(command)
    _add_service_commands(command)
    return parser


def _add_local_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    """Commands that run an engine in this process: generate, chat, demo, agent-demo."""
    p = command("generate", help="Generate text for one or more prompts.")
    p.add_argument("--prompt", action="append", help="Prompt text (repeatable).")
    p.add_argument("--prompt-file", action="append", help="File whose whole content is one prompt (repeatable).")
    p.add_argument("--chat", action="store_true", help="Wrap each prompt as a user message in the chat template.")
    p.add_argument("--json", action="store_true", help="Print one JSON object per result.")
    _add_sampling_args(p)
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=cmd_generate)

    p = command("chat", help="Interactive multi-turn chat.")
    p.add_argument("--system", default=None, help="System prompt.")
    _add_sampling_args(p, max_new_tokens=256)
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=cmd_chat)

    p = command("demo", help="A scripted multi-turn agent session showing cache hits and TTFT.")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--agents", type=int, default=1, help="Sessions taking turns round-robin.")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--no-cold-rerun", action="store_true",
                   help="Skip the summary's rerun of the last prompt without the cache (the warm vs. cold TTFT).")
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=cmd_demo)

    p = command("agent-demo", help="A three-step tool-using agent on SmolLM2 through the openai SDK and "
                                          "`hicache serve` (Chat Completions, then the Responses API); exits 1 when "
                                          "a final answer is wrong.")
    p.add_argument("--api", default="both", choices=("chat", "responses", "both"),
                   help="Which API drives the agent: chat.completions, responses (previous_response_id), or both, "
                        "one after the other on a flushed cache.")
    p.add_argument("--model", default="smollm2", help="The model `hicache serve` loads (the answer is checked on "
                                                      "smollm2 and qwen2.5-coder-0.5b, the `make demo` runs).")
    p.add_argument("--server-args", default="", help="More `hicache serve` flags, shell-quoted, e.g. "
                                                     "--server-args='--enable-hierarchical-cache'.")
    p.set_defaults(func=cmd_agent_demo)


def _add_service_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    """Commands that serve, join or measure: serve, node, simulate, bench."""
    p = command("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, /metrics, ...).")
    _add_serve_args(p)
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=cmd_serve)

    p = command("node", help="Run the ranks of node --node-rank R > 0 of an engine served by node 0 "
                                    "(--nnodes, --dist-init-addr and the same engine flags as node 0).")
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=cmd_node)

    p = command("simulate", help="Replay a Mooncake-format trace through the cache code (no model) on a "
                                        "virtual clock: hit ratio per tier, TTFT estimates.")
    from .sim.cli import add_simulate_args

    add_simulate_args(p)
    p.set_defaults(func=cmd_simulate)

    p = command("bench", help="Benchmark an OpenAI-compatible server (multi-turn shared prefix, trace replay).")
    from .bench.main import add_bench_args

    add_bench_args(p)
    p.set_defaults(func=cmd_bench)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except HicacheError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
