"""Where system messages go in a chat prompt, for any chat template.

Agents send system text in the middle of a conversation: Claude Code a ``{"role": "system"}``
message after its first user turn (Anthropic's mid-conversation system messages), Codex two
``developer`` messages in a row. Chat templates differ in what they take: ChatML and Qwen2.5's
render a system turn anywhere, Llama 3's too, while Gemma's folds a system message into the
next user turn and keeps only the last of several in a row (hicache's built-in ``gemma``), or
raises on any but the first (Google's own).

The rule (:func:`place_system_messages`), chosen to keep the prompt's prefix stable from turn
to turn (so later turns hit the prefix cache):

- where the template renders two leading system messages and one between two user turns, each
  where it is (probed once per tokenizer, :func:`takes_system_turns`), every message stays where
  it is, as the template writes it;
- otherwise the leading run of system messages becomes one system prompt (joined by a blank
  line), and each later system message is folded into the next user message (before its text,
  a blank line between), or into the previous user message when none follows -- never into the
  system prompt at the top, which would change the whole prompt's prefix each time one appears.
"""

from __future__ import annotations

import weakref
from typing import Any

# Two leading system messages, then one between two user turns: a template "takes system turns" when
# it renders all three, in order, between the right turns (Gemma's keeps only the last leading one)
_PROBE = [("system", "hicache-probe-system-1"), ("system", "hicache-probe-system-2"), ("user", "hicache-probe-user-1"),
          ("assistant", "hicache-probe-reply"), ("system", "hicache-probe-system-3"), ("user", "hicache-probe-user-2")]

# tokenizer -> whether its template renders system turns where they are
_TAKES: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def takes_system_turns(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s chat template renders several leading system messages and one between
    two user turns, each where it is (it neither raises, drops one, nor moves it)."""
    known = _TAKES.get(tokenizer)
    if known is not None:
        return known
    try:
        text = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in _PROBE], add_generation_prompt=False)
        places = [text.find(c) for _, c in _PROBE]
        takes = -1 not in places and places == sorted(places)
    except Exception:  # the template refuses it (a "roles must alternate" check), or there is none
        takes = False
    _TAKES[tokenizer] = takes
    return takes


def place_system_messages(messages: list[dict[str, Any]], tokenizer: Any) -> list[dict[str, Any]]:
    """``messages`` (chat dicts with ``role`` / ``content``) with their system messages where the
    template can take them (module docstring); unchanged when there is no later system message or
    the template takes them in place."""
    lead = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))  # the leading run
    later = [i for i in range(lead, len(messages)) if messages[i]["role"] == "system"]
    if (lead <= 1 and not later) or takes_system_turns(tokenizer):
        return messages
    out = [dict(m) for m in messages]
    system = [m["content"] for m in out[:lead] if m["content"]]
    before: dict[int, list[str]] = {}  # user message index -> system texts folded in before its text
    after: dict[int, list[str]] = {}
    for i in later:
        following = next((j for j in range(i + 1, len(out)) if out[j]["role"] == "user"), None)
        previous = next((j for j in range(i - 1, lead - 1, -1) if out[j]["role"] == "user"), None)
        if following is not None:
            before.setdefault(following, []).append(out[i]["content"])
        elif previous is not None:
            after.setdefault(previous, []).append(out[i]["content"])
        else:  # no user turn at all: the system prompt is all there is to take it
            system.append(out[i]["content"])
    for j in before.keys() | after.keys():
        out[j]["content"] = "\n\n".join([*before.get(j, []), out[j]["content"], *after.get(j, [])])
    head = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    return head + [m for k, m in enumerate(out) if k >= lead and m["role"] != "system"]
