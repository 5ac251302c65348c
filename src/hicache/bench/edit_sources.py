"""Real text for the edit-reuse workloads (bench/edit_workloads.py), read from the repository
checkout: Claude Code's captured first request (``tests/data/agents/claude_code_turn1.json``: its
system text, which ends with a gitStatus snapshot, its 24 tools and its user turn), the sections of
the project's Markdown docs, and the paths of its source files (what a gitStatus snapshot lists).

Nothing here is made up: every text a workload takes from this module is found verbatim in the file
its :class:`Section` names (paths relative to the checkout). Lengths here are in characters.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CAPTURE = "tests/data/agents/claude_code_turn1.json"
BILLING_PREFIX = "x-anthropic-billing-header:"  # the attribution block the server drops too (server/anthropic.py)
MIN_SECTION, MAX_SECTION = 300, 6000  # characters: shorter sections are headings and lists; longer ones tables


@dataclass(frozen=True)
class Section:
    """A Markdown section: the lines under ``heading`` up to the next heading, verbatim."""

    path: str  # relative to the checkout
    heading: str
    text: str


def checkout_root() -> Path:
    """The repository checkout this module lives in (``src/hicache/bench/`` is three levels down)."""
    return Path(__file__).resolve().parents[3]


def _read(root: Path, rel: str) -> str:
    path = root / rel
    if not path.is_file():
        raise FileNotFoundError(f"the edit workloads read real text from the repository checkout: {path} is missing.")
    return path.read_text(encoding="utf-8")


@functools.lru_cache(maxsize=4)
def claude_code_capture(root: Path) -> dict[str, Any]:
    """The captured request body of Claude Code's first turn (tests/data/agents/README.md)."""
    return json.loads(_read(root, CAPTURE))["body"]


def claude_code_system(root: Path) -> str:
    """The system text as the server makes it of the system blocks: joined, the billing line dropped."""
    blocks = claude_code_capture(root)["system"]
    return "".join(b["text"] for b in blocks if not b["text"].startswith(BILLING_PREFIX))


def claude_code_user_text(root: Path) -> str:
    """The first user turn's text blocks, joined (a <system-reminder> with the date, then the task)."""
    first = claude_code_capture(root)["messages"][0]
    return "".join(b["text"] for b in first["content"] if b.get("type") == "text")


def claude_code_tools(root: Path) -> list[dict[str, Any]]:
    """The 24 captured tools as OpenAI function tools (what the server turns Anthropic tools into)."""
    return [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                              "parameters": t["input_schema"]}}
            for t in claude_code_capture(root)["tools"]]


def _sections_of(rel: str, text: str) -> list[Section]:
    out, heading, lines, fenced = [], None, [], False
    for line in text.splitlines(keepends=True) + ["# end\n"]:
        fenced ^= line.startswith("```")  # a "#" line inside a code block is a comment, not a heading
        if line.startswith("#") and not fenced:
            body = "".join(lines).strip()
            if heading is not None and MIN_SECTION <= len(body) <= MAX_SECTION:
                out.append(Section(rel, heading, body))
            heading, lines = line.lstrip("#").strip(), []
        else:
            lines.append(line)
    return out


@functools.lru_cache(maxsize=4)
def doc_sections(root: Path) -> tuple[Section, ...]:
    """The sections of README.md and docs/*.md (in path order) of 300 to 6000 characters."""
    paths = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    out: list[Section] = []
    for path in paths:
        rel = path.relative_to(root).as_posix()
        out += _sections_of(rel, _read(root, rel))
    if len(out) < 8:
        raise FileNotFoundError(f"the edit workloads need the docs of the checkout at {root}: found {len(out)} sections.")
    return tuple(out)


@functools.lru_cache(maxsize=4)
def source_files(root: Path) -> tuple[str, ...]:
    """The checkout's Python files under src/ and tests/, sorted (the files a gitStatus lists)."""
    files = sorted(p.relative_to(root).as_posix() for d in ("src", "tests") for p in (root / d).rglob("*.py"))
    if not files:
        raise FileNotFoundError(f"the edit workloads list the checkout's source files: none under {root}/src.")
    return tuple(files)


def take_chars(texts: list[str], budget: int) -> list[str]:
    """``texts`` in order until ``budget`` characters: the last one cut short, the rest dropped."""
    out: list[str] = []
    for text in texts:
        if budget <= 0:
            break
        out.append(text[:budget])
        budget -= len(out[-1])
    return out
