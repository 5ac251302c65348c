"""The P/D scenario of ``make demo`` (also ``make pd-demo``): a prefill server, a decode server
that reuses its own device and host tiers, and SGLang's router in front, all on 127.0.0.1; the
demo's coding agent talks to the router, and each turn shows how much of its prompt the decode
server already held (``decode_prefix_len``) and how much KV crossed from prefill.

    python -m hicache.launch.pd_demo [--model smollm2] [--turns 4] [--max-new-tokens 24]
"""

from __future__ import annotations

import argparse
import random
import sys
import textwrap

from ..frontend.demo import SYSTEM, TASK, tool_output
from .servers import pd_servers

DECODE_REUSE = "--disaggregation-decode-enable-radix-cache --enable-hierarchical-cache"


def run_pd_demo(model: str, turns: int, max_new_tokens: int, server_args: str = "") -> int:
    import httpx

    rng = random.Random(0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    with pd_servers(f"--model {model} {server_args}", decode_args=DECODE_REUSE) as pd:
        print(f"P/D demo: prefill {pd.prefill_url} (bootstrap port {pd.bootstrap_port}), decode {pd.decode_url} "
              f"(device + host reuse), sglang-router {pd.url}\n")
        print(f"{'turn':>4} {'input':>6} {'decode has':>10} {'device':>6} {'host':>5} {'KV sent':>8} {'KV MiB':>7} "
              f"{'TTFT ms':>8}  reply")
        sent = total = 0
        for turn in range(turns):
            body = {"model": model, "messages": messages, "max_tokens": max_new_tokens, "temperature": 0}
            r = httpx.post(f"{pd.url}/v1/chat/completions", json=body, timeout=300)
            r.raise_for_status()
            out = r.json()
            usage, text = out["usage"], out["choices"][0]["message"]["content"]
            tiers = usage["prompt_tokens_details"]["cached_tokens_details"]
            sent, total = sent + usage["kv_transferred_tokens"], total + usage["prompt_tokens"]
            reply = textwrap.shorten(text.replace("\n", " "), 44, placeholder="...")
            print(f"{turn + 1:>4} {usage['prompt_tokens']:>6} {usage['decode_prefix_len']:>10} {tiers['device']:>6} "
                  f"{tiers['host']:>5} {usage['kv_transferred_tokens']:>8} {usage['kv_transferred_bytes'] / 2**20:>7.2f} "
                  f"{out['timing']['ttft_s'] * 1000:>8.1f}  {reply}")
            messages.append({"role": "assistant", "content": text})
            messages.append({"role": "user", "content": f"Tool output:\n{tool_output(turn, rng)}\nWhat next?"})
        print(f"\nsummary: {sent} of {total} prompt tokens' KV crossed from prefill to decode ({sent / total:.0%}); "
              "the rest the decode server held itself")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--server-args", default="", help="More `hicache serve` flags for both servers.")
    args = ap.parse_args(argv)
    return run_pd_demo(args.model, args.turns, args.max_new_tokens, args.server_args)


if __name__ == "__main__":
    sys.exit(main())
