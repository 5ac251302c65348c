"""The edit-reuse benchmark's workloads (bench/edit_workloads.py) and quality measures
(bench/edit_quality.py): each pair changes what its workload says and nothing else, its text is
found in the files it names, prefix-only reuse gets little of (a) and (b), and a seed fixes a pair."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from hicache.bench.edit_quality import agreement, first_divergence, topk_kl
from hicache.bench.edit_sources import CAPTURE, checkout_root, claude_code_system
from hicache.bench.edit_workloads import WORKLOADS, edit_pairs
from hicache.model.loader import load_model

pytestmark = pytest.mark.engine

ROOT = checkout_root()
PAGE = 16  # the engine's default page: prefix reuse takes whole pages


@pytest.fixture(scope="module", params=["smollm2", "qwen2.5-coder-0.5b"])
def tok(request):
    return load_model(request.param, torch.float32, weights=False).tokenizer


def prefix_pages_share(a: list[int], b: list[int]) -> float:
    """The share of ``b`` that exact prefix reuse could take after ``a`` was cached (whole pages)."""
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return common // PAGE * PAGE / len(b)


def assert_real(pair) -> None:
    for s in pair.sections:
        assert s.text and s.text in (ROOT / s.path).read_text(encoding="utf-8"), (s.path, s.heading)


def test_claude_code_changes_only_the_git_status_before_the_tools(tok):
    capture = json.loads((ROOT / CAPTURE).read_text())["body"]
    described = {t["name"]: t["description"] for t in capture["tools"]}
    system = claude_code_system(ROOT)
    for pair in edit_pairs("claude_code", tok, 3, target_tokens=4096):
        orig, edit = pair.original.messages, pair.edited.messages
        assert pair.original.tools == pair.edited.tools and orig[1:] == edit[1:]
        head, status = orig[0]["content"].split("Status:\n")
        edit_head, edit_status = edit[0]["content"].split("Status:\n")
        assert head == edit_head and head in system  # the capture's text, its tail
        before, after = status.split("\n\nRecent commits:")[0], edit_status.split("\n\nRecent commits:")[0]
        files = after.splitlines()  # the edit lists one file more
        assert files[:-1] == ([] if before == "(clean)" else before.splitlines())
        assert all((ROOT / line[3:]).is_file() for line in files)
        for t in pair.original.tools:  # each tool as captured, its description maybe cut
            assert described[t["function"]["name"]].startswith(t["function"]["description"])
        text = tok.decode(pair.edited_ids)  # the tools come after the changed lines (Qwen2.5's template too)
        assert text.index(files[-1]) < text.index(json.dumps(pair.original.tools[0]["function"]["name"]))
        assert prefix_pages_share(pair.original_ids, pair.edited_ids) < 0.15
        assert 0.85 * 4096 <= len(pair.original_ids) <= 4096


def test_uuid_and_timestamp_change_in_the_first_line_only(tok):
    for pair in edit_pairs("uuid_timestamp", tok, 3, target_tokens=4096):
        first, rest = pair.original.messages[0]["content"].split("\n", 1)
        edit_first, edit_rest = pair.edited.messages[0]["content"].split("\n", 1)
        assert rest == edit_rest and pair.original.messages[1:] == pair.edited.messages[1:]
        uid, stamp = first.split()[1].rstrip(","), first.split()[-1]
        assert uid not in edit_first and stamp not in edit_first
        assert len(pair.sections) >= 2 and all(f"# {s.heading}\n{s.text}" in rest for s in pair.sections)
        assert_real(pair)
        assert prefix_pages_share(pair.original_ids, pair.edited_ids) < 0.15
        assert 0.95 * 4096 <= len(pair.original_ids) <= 4096


@pytest.mark.parametrize("size", [1024, 4096])
def test_dropped_turns_keep_the_newer_turns_in_order(tok, size):
    for pair in edit_pairs("dropped_turns", tok, 3, target_tokens=size):
        orig, edit = pair.original.messages, pair.edited.messages
        assert orig[0] == edit[0]
        kept = edit[1:-2]  # the turns kept and the last question, then the new reply and question
        dropped = len(orig) - len(kept)
        assert dropped >= 3 and (dropped - 1) % 2 == 0 and orig[dropped:] == kept  # whole turns, oldest first
        assert len(kept) >= 3  # a turn kept, and the last question
        assert edit[-2]["role"] == "assistant" and edit[-1]["role"] == "user"
        assert_real(pair)
        assert all(m["content"] in {s.text for s in pair.sections} for m in orig[1:] if m["role"] == "assistant")


def test_reordered_passages_hold_the_same_passages(tok):
    for pair in edit_pairs("reordered_passages", tok, 3, target_tokens=4096):
        orig, edit = pair.original.messages[1]["content"], pair.edited.messages[1]["content"]
        blocks = [f"[{s.path}: {s.heading}]\n{s.text}" for s in pair.sections]
        assert orig != edit and len(orig) == len(edit) and all(b in orig and b in edit for b in blocks)
        assert orig.rsplit("\n\n", 1)[1] == edit.rsplit("\n\n", 1)[1]  # the same question
        first = pair.sections[0]
        assert not edit.startswith(f"[{first.path}: {first.heading}]")  # the first passage moved
        assert len(pair.sections) >= 2
        assert_real(pair)


def test_a_seed_fixes_the_pairs(tok):
    for w in WORKLOADS:
        again = [p.edited_ids for p in edit_pairs(w, tok, 2, seed=7, target_tokens=1024)]
        assert [p.edited_ids for p in edit_pairs(w, tok, 2, seed=7, target_tokens=1024)] == again
        assert [p.edited_ids for p in edit_pairs(w, tok, 2, seed=8, target_tokens=1024)] != again
        assert again[0] != again[1]


def test_a_wrong_workload_or_size_names_it(tok):
    with pytest.raises(ValueError, match="workload"):
        next(edit_pairs("claude", tok, 1))
    with pytest.raises(ValueError, match="target_tokens"):
        next(edit_pairs("claude_code", tok, 1, target_tokens=10))


def test_agreement_and_first_divergence():
    assert agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0 and first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert agreement([1, 2, 3, 4], [1, 9, 3, 4]) == 0.75 and first_divergence([1, 2, 3, 4], [1, 9, 3, 4]) == 1
    assert agreement([1, 2, 3, 4], [1, 2]) == 0.5 and first_divergence([1, 2, 3, 4], [1, 2]) == 2


def test_topk_kl_is_the_kl_when_the_lists_hold_all_the_mass_and_a_lower_bound_otherwise():
    p, q = [0.7, 0.2, 0.1], [0.5, 0.3, 0.2]
    exact = sum(a * math.log(a / b) for a, b in zip(p, q))
    as_list = lambda d: [(t, math.log(x)) for t, x in enumerate(d)]  # noqa: E731
    assert topk_kl(as_list(p), as_list(p)) == pytest.approx(0.0, abs=1e-12)
    assert topk_kl(as_list(p), as_list(q)) == pytest.approx(exact)
    rng = random.Random(0)
    for _ in range(20):
        p, q = ([rng.random() ** 4 for _ in range(50)] for _ in range(2))
        p, q = [x / sum(p) for x in p], [x / sum(q) for x in q]
        full = sum(a * math.log(a / b) for a, b in zip(p, q))
        top = lambda d: sorted(as_list(d), key=lambda t: -t[1])[:10]  # noqa: E731
        assert 0.0 <= topk_kl(top(p), top(q)) <= full + 1e-9
