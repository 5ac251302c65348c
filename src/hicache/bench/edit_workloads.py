"""The four workloads of the edit-reuse benchmark (issue 61): pairs of prompts, an original the cache
has seen and an edited one that keeps most of its text at other positions, built from real text
(bench/edit_sources.py: Claude Code's captured request, the project's docs and file names).

- ``claude_code``: Claude Code's system text, whose last lines (a gitStatus snapshot) gain a changed
  file, then its tool block (rendered by the chat template after the system text, as Qwen2.5's
  does; appended to the system text as the server does for a template without tools), then its
  user turn. The system part is cut to ~6% of the prompt (Claude Code's: 1,381 of ~19,000 tokens).
- ``uuid_timestamp``: a session UUID and a timestamp in the first line of a docs system prompt;
  both change.
- ``dropped_turns``: a multi-turn history about the docs; the next request drops its oldest turns
  (about a quarter of the history) and adds the last reply and a new question.
- ``reordered_passages``: retrieved doc sections before a question; the next request holds the same
  sections in another order (the first one moved).

The framing lines (the UUID line, the questions) are the benchmark's; the bulk is real text.
Sizes are in tokens of the given tokenizer: each original prompt holds at most ``target_tokens``
(within a tool schema or a few tokens of it). A pair depends only on (workload, seed, index, tokenizer).
"""

from __future__ import annotations

import datetime
import random
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Optional, Protocol, TypeVar

from hicache.bench.edit_sources import (Section, checkout_root, claude_code_system, claude_code_tools,
                                        claude_code_user_text, doc_sections, source_files, take_chars)
from hicache.server.tool_formats import HERMES

WORKLOADS = ("claude_code", "uuid_timestamp", "dropped_turns", "reordered_passages")
SYSTEM_SHARE = 0.06  # claude_code: the system text's share of the prompt (Claude Code's own: 1,381 / ~19,000)
GIT_MARK = "\n\ngitStatus:"
T = TypeVar("T")


class ChatTokenizer(Protocol):
    """What the workloads need of a tokenizer (hicache.model.tokenizer.Tokenizer has it)."""

    @property
    def renders_tools(self) -> bool: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str: ...

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class Prompt:
    """A chat request: its messages and the tools the template renders (None: none)."""

    messages: list[dict[str, Any]]
    tools: Optional[list[dict[str, Any]]] = None


@dataclass(frozen=True)
class EditPair:
    """An original prompt and its edit, rendered to token ids; ``change`` says in one line what
    changed; ``sections`` are the doc sections the prompts hold (empty for claude_code)."""

    workload: str
    index: int
    original: Prompt
    edited: Prompt
    original_ids: list[int]
    edited_ids: list[int]
    change: str
    sections: tuple[Section, ...] = ()


def encode_chat(tok: ChatTokenizer, prompt: Prompt) -> list[int]:
    """The prompt's token ids with the generation prompt; tools go to a template that renders them,
    else after the system text in the Hermes format (as server/tools.py writes them)."""
    messages, tools = prompt.messages, prompt.tools
    if tools and not tok.renders_tools:
        first = messages[0]
        messages = [{**first, "content": f"{first['content']}\n\n{HERMES.system_text(tools)}"}, *messages[1:]]
        tools = None
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools))


def _fit(build: Callable[[int], T], size: Callable[[T], int], target: int, hi: int) -> T:
    """``build(n)`` for the largest n in [0, hi] whose size is at most ``target`` (size grows with n)."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if size(build(mid)) <= target:
            lo = mid
        else:
            hi = mid - 1
    return build(lo)


def _rng(workload: str, seed: int, index: int) -> random.Random:
    return random.Random(f"{workload}:{seed}:{index}")  # str seeds are hashed the same on every run


def _status(files: list[str]) -> str:
    return "\n".join(files) if files else "(clean)"


class Built(NamedTuple):
    """What a workload builder returns (see :class:`EditPair`)."""

    original: Prompt
    edited: Prompt
    change: str
    sections: tuple[Section, ...] = ()


def claude_code(tok: ChatTokenizer, rng: random.Random, target: int, root: Path) -> Built:
    """The system text's tail (whole paragraphs, ~6% of ``target``) ending in its gitStatus, whose
    status gains one file; the tools (rotated by the pair, descriptions cut to fit); the user turn."""
    head, git = claude_code_system(root).split(GIT_MARK)
    git = GIT_MARK + git
    paragraphs = head.split("\n\n")
    tail = _fit(lambda n: "\n\n".join(paragraphs[len(paragraphs) - n:]) if n else "",
                lambda t: len(tok.encode(t + git)), int(target * SYSTEM_SHARE), len(paragraphs))
    files = rng.sample(source_files(root), 4)
    before = [f" M {f}" for f in files[:rng.randint(0, 3)]]
    after = before + [rng.choice([" M ", "?? "]) + files[3]]
    user = claude_code_user_text(root)
    tools = claude_code_tools(root)
    turn = rng.randrange(len(tools))
    tools = tools[turn:] + tools[:turn]

    def prompt(status: list[str], budget: int) -> Prompt:
        cut = take_chars([t["function"]["description"] for t in tools], budget)
        kept = [{**t, "function": {**t["function"], "description": d}} for t, d in zip(tools, cut)]
        system = tail + git.replace("Status:\n(clean)", f"Status:\n{_status(status)}")
        return Prompt([{"role": "system", "content": system}, {"role": "user", "content": user}], kept)

    hi = sum(len(t["function"]["description"]) for t in tools)
    budget = _fit(lambda n: n, lambda n: len(encode_chat(tok, prompt(before, n))), target, hi)
    return Built(prompt(before, budget), prompt(after, budget), f"gitStatus gains '{after[-1]}' ({len(before)} listed)")


def _cut(sections: list[Section], budget: int) -> list[Section]:
    """``sections`` in order until ``budget`` characters of text: the last one cut short."""
    texts = take_chars([s.text for s in sections], budget)
    return [Section(s.path, s.heading, t) for s, t in zip(sections, texts)]


def uuid_timestamp(tok: ChatTokenizer, rng: random.Random, target: int, root: Path) -> Built:
    """A system prompt of doc sections under a first line naming a session UUID and the time."""
    sections = rng.sample(doc_sections(root), 40)
    start = datetime.datetime(2026, 12, 1, tzinfo=datetime.timezone.utc) + datetime.timedelta(seconds=rng.randrange(10**6))
    stamps = [start, start + datetime.timedelta(seconds=rng.randrange(30, 7200))]
    ids = [uuid.UUID(int=rng.getrandbits(128), version=4) for _ in stamps]

    def prompt(n: int, k: int) -> Prompt:
        kept = _cut(sections, n)
        text = "\n\n".join(f"# {s.heading}\n{s.text}" for s in kept)
        header = f"Session {ids[k]}, started {stamps[k].isoformat(timespec='seconds')}."
        question = f"What does the section \"{kept[-1].heading}\" of {kept[-1].path} say?" if kept else "Hello."
        return Prompt([{"role": "system", "content": f"{header}\n\n{text}"}, {"role": "user", "content": question}])

    hi = sum(len(s.text) for s in sections)
    n = _fit(lambda n: n, lambda n: len(encode_chat(tok, prompt(n, 0))), target, hi)
    return Built(prompt(n, 0), prompt(n, 1), "the session UUID and the timestamp of the first line change",
                 tuple(_cut(sections, n)))


def _turns(sections: list[Section]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for s in sections:
        out += [{"role": "user", "content": f"Explain \"{s.heading}\" from {s.path}."},
                {"role": "assistant", "content": s.text}]
    return out


def dropped_turns(tok: ChatTokenizer, rng: random.Random, target: int, root: Path) -> Built:
    """A history of doc questions answered with the sections' text (each cut to ~1/6 of the prompt);
    the next request drops the oldest turns (those holding closest to a quarter of the history's
    characters) and adds the last reply and a new question."""
    cap = target * 4 // 6  # characters a reply (~1/6 of the prompt at ~4 a token): several turns at any size
    sections = [Section(s.path, s.heading, s.text[:cap]) for s in rng.sample(doc_sections(root), 60)]
    system = {"role": "system", "content": "You answer questions about the hicache project from its documentation."}

    hi = sum(len(s.text) for s in sections[:-2])
    ask, nxt = _turns(sections[-2:-1]), _turns(sections[-1:])[0]
    n = _fit(lambda n: n, lambda n: len(encode_chat(tok, Prompt([system, *_turns(_cut(sections[:-2], n)), ask[0]]))),
             target, hi)
    kept = _cut(sections[:-2], n)
    turns = _turns(kept)
    sizes = [len(m["content"]) for m in turns]
    # whole turns (a question and its answer: two messages), at least one dropped and one kept
    dropped = min(range(2, max(len(turns) - 1, 3), 2), key=lambda d: abs(sum(sizes[:d]) - sum(sizes) / 4))
    # the reply the next request adds is cut to the dropped characters: both prompts are about as long
    reply = {**ask[1], "content": ask[1]["content"][:max(sum(sizes[:dropped]) - len(nxt["content"]), 200)]}
    original = Prompt([system, *turns, ask[0]])
    edited = Prompt([system, *turns[dropped:], ask[0], reply, nxt])
    return Built(original, edited, f"the oldest {dropped // 2} of {len(turns) // 2} turns dropped, one turn added",
                 (*kept, *sections[-2:-1]))


def reordered_passages(tok: ChatTokenizer, rng: random.Random, target: int, root: Path) -> Built:
    """Doc sections retrieved for a question (each cut to ~1/6 of the prompt: several passages at
    any size), then the same sections in another (seeded) order."""
    cap = target * 4 // 6  # characters, at ~4 characters a token
    sections = [Section(s.path, s.heading, s.text[:cap]) for s in rng.sample(doc_sections(root), 40)]
    system = {"role": "system", "content": "Answer the question from the retrieved passages."}

    def prompt(order: list[Section]) -> Prompt:  # the question is about the first passage retrieved
        passages = "\n\n".join(f"[{s.path}: {s.heading}]\n{s.text}" for s in order)
        question = f"Question: what does {sections[0].path} say about \"{sections[0].heading}\"?"
        return Prompt([system, {"role": "user", "content": f"{passages}\n\n{question}"}])

    hi = sum(len(s.text) for s in sections)
    kept = _fit(lambda n: _cut(sections, n), lambda c: len(encode_chat(tok, prompt(c))), target, hi)
    order = kept[:]
    while len(order) > 1 and order[0] == kept[0]:
        rng.shuffle(order)
    return Built(prompt(kept), prompt(order), f"{len(kept)} passages reordered", tuple(kept))


BUILDERS: dict[str, Callable[[ChatTokenizer, random.Random, int, Path], Built]] = {
    "claude_code": claude_code, "uuid_timestamp": uuid_timestamp, "dropped_turns": dropped_turns,
    "reordered_passages": reordered_passages}


def edit_pairs(workload: str, tok: ChatTokenizer, count: int, seed: int = 0, target_tokens: int = 4096,
               root: Optional[Path] = None) -> Iterator[EditPair]:
    """``count`` pairs of ``workload`` (one of :data:`WORKLOADS`), each original prompt at most
    ``target_tokens`` long; the same arguments give the same pairs."""
    if workload not in BUILDERS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {workload!r}.")
    if target_tokens < 256:
        raise ValueError(f"target_tokens must be at least 256, got {target_tokens}.")
    root = root or checkout_root()
    for index in range(count):
        built = BUILDERS[workload](tok, _rng(workload, seed, index), target_tokens, root)
        yield EditPair(workload, index, built.original, built.edited, encode_chat(tok, built.original),
                       encode_chat(tok, built.edited), built.change, built.sections)
