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
import pathlib
import sys
from typing import Callable, Sequence

from .config import EngineConfig
from .errors import ConfigError, HicacheError
from .options import add_cli_args, from_cli_args


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

    given = args.disaggregation_bootstrap_host
    host = getattr(args, "host", None) if given is None else given  # serve: next to the HTTP API unless given
    return Engine(**dataclasses.asdict(from_cli_args(EngineConfig, args, disaggregation_bootstrap_host=host)))


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = list(args.prompt or [])
    for path in args.prompt_file or []:
        try:
            prompts.append(pathlib.Path(path).read_text(encoding="utf-8"))
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
    sampling = _sampling(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    with _engine(args) as engine:
        print("hicache chat: type a message; /reset clears the history, /exit quits.", file=sys.stderr)
        while (line := _read_line()) is not None and line.strip() not in ("/exit", "/quit"):
            if line.strip() == "/reset":
                messages = list(system)
            elif line.strip():
                messages.append({"role": "user", "content": line})
                res = engine.chat(messages, sampling)
                messages.append({"role": "assistant", "content": res.text})
                print(f"assistant> {res.text}")
                print(f"  [{res.prompt_tokens} prompt tokens, {res.cached_tokens} cached {res.cached_tokens_details}, "
                      f"TTFT {res.ttft_s * 1000:.0f} ms]", file=sys.stderr)
    return 0


def _read_line() -> str | None:
    """The user's next line; None at end of input."""
    try:
        return input("you> ")
    except EOFError:
        return None


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
    from .server.options import ServerOptions  # (standard library only)

    die_with_parent()  # (a server started by a test, benchmark or demo stops with it)
    # the key and the flags' bounds are refused before the model loads
    opts = from_cli_args(ServerOptions, args, api_key=_api_key(args.api_key, os.environ.get("HICACHE_API_KEY")))
    from .server.serve import run_server  # after the checks above: a refused flag costs no torch import

    return run_server(_engine(args), args.host, args.port, opts, args.log_level)


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
        return run_node(from_cli_args(EngineConfig, args), report=lambda line: print(line, file=sys.stderr, flush=True))
    except NodeFailed as e:  # a rank failed (status 1), unlike a bad flag (status 2)
        print(f"error: {e}", file=sys.stderr)
        return 1


LOG_LEVELS = ("debug", "info", "warning", "error")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="warning", choices=LOG_LEVELS)
    # Every subcommand takes it too (`hicache serve --log-level info`); given there, it wins.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS,
                        help="Log level (also accepted before the subcommand).")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, func: Callable[[argparse.Namespace], int], **kw) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], **kw)
        p.set_defaults(func=func)
        return p

    _add_local_commands(command)
    _add_service_commands(command)
    for name in ENGINE_COMMANDS:
        add_cli_args(EngineConfig, sub.choices[name], "engine options")
    return parser


ENGINE_COMMANDS = ("generate", "chat", "demo", "serve", "node")  # the commands that take EngineConfig's flags


def _add_local_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    """Commands that run an engine in this process: generate, chat, demo, agent-demo."""
    p = command("generate", cmd_generate, help="Generate text for one or more prompts.")
    p.add_argument("--prompt", action="append", help="Prompt text (repeatable).")
    p.add_argument("--prompt-file", action="append", help="File whose whole content is one prompt (repeatable).")
    p.add_argument("--chat", action="store_true", help="Wrap each prompt as a user message in the chat template.")
    p.add_argument("--json", action="store_true", help="Print one JSON object per result.")
    _add_sampling_args(p)

    p = command("chat", cmd_chat, help="Interactive multi-turn chat.")
    p.add_argument("--system", default=None, help="System prompt.")
    _add_sampling_args(p, max_new_tokens=256)

    p = command("demo", cmd_demo, help="A scripted multi-turn agent session showing cache hits and TTFT.")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--agents", type=int, default=1, help="Sessions taking turns round-robin.")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--no-cold-rerun", action="store_true",
                   help="Skip the summary's rerun of the last prompt without the cache (the warm vs. cold TTFT).")

    p = command("agent-demo", cmd_agent_demo, help="A three-step tool-using agent on SmolLM2 through the openai SDK "
                "and `hicache serve` (Chat Completions, then the Responses API); exits 1 when a final answer is wrong.")
    p.add_argument("--api", default="both", choices=("chat", "responses", "both"),
                   help="Which API drives the agent: chat.completions, responses (previous_response_id), or both, "
                        "one after the other on a flushed cache.")
    p.add_argument("--model", default="smollm2", help="The model `hicache serve` loads (the answer is checked on "
                                                      "smollm2 and qwen2.5-coder-0.5b, the `make demo` runs).")
    p.add_argument("--server-args", default="", help="More `hicache serve` flags, shell-quoted, e.g. "
                                                     "--server-args='--enable-hierarchical-cache'.")


def _add_service_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    """Commands that serve, join or measure: serve, node, simulate, bench."""
    from .bench.main import add_bench_args, run_bench
    from .server.options import ServerOptions  # (standard library only)
    from .sim.cli import add_simulate_args, run_simulate

    p = command("serve", cmd_serve, help="OpenAI-compatible HTTP server (/v1/chat/completions, /metrics, ...).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    add_cli_args(ServerOptions, p, "server options")
    command("node", cmd_node, help="Run the ranks of node --node-rank R > 0 of an engine served by node 0 "
            "(--nnodes, --dist-init-addr and the same engine flags as node 0).")
    add_simulate_args(command("simulate", run_simulate, help="Replay a Mooncake-format trace through the cache code "
                              "(no model) on a virtual clock: hit ratio per tier, TTFT estimates."))
    add_bench_args(command("bench", run_bench, help="Benchmark an OpenAI-compatible server (multi-turn shared "
                           "prefix, trace replay)."))
    p = command("calibrate-edit-reuse", cmd_calibrate_edit_reuse, help="Measure edit reuse's quality gate threshold "
                "for a model on the edit workloads (docs/edit_reuse.md); --write records it for the engine.")
    p.add_argument("--model", default="smollm2", help="The model, as --model names it (the table's key).")
    p.add_argument("--pairs", type=int, default=4, help="Edit pairs per workload.")
    p.add_argument("--tokens", type=int, default=2048, help="Prompt size of each pair, in tokens.")
    p.add_argument("--target-kl", type=float, default=0.02, help="The teacher-forced KL (nats) each kept pair may have at most.")
    p.add_argument("--write", action="store_true", help="Record the threshold in the table the engine reads.")


def cmd_calibrate_edit_reuse(args: argparse.Namespace) -> int:
    from .bench.edit_calibration import calibrate

    value = calibrate(args.model, args.pairs, target_tokens=args.tokens, target_kl=args.target_kl, save=args.write)
    return 0 if value is not None else 1


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
