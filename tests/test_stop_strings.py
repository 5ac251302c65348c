"""Stop strings (issue 56, S2): bounded in count and bytes (SamplingParams.validate), and matched
per token in time independent of their count (runtime/stopping.py: one automaton over the new
text only), finding the same stop, at the same token, as a search of the whole text each token."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.errors import InvalidRequestError
from hicache.runtime.request import Request
from hicache.runtime.sampling import MAX_STOP_STRING_BYTES, MAX_STOP_STRINGS, SamplingParams
from hicache.runtime.stopping import StopScan, stop_index, stop_reason

pytestmark = pytest.mark.engine


def full_search(text: str, stops: list[str]) -> int:
    """The reference: where the earliest stop string starts in ``text``, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.text(alphabet="ab\ufffd ", max_size=4), min_size=1, max_size=40),
       stops=st.lists(st.text(alphabet="ab ", min_size=1, max_size=6), min_size=1, max_size=6))
def test_the_scan_stops_where_a_whole_text_search_would(pieces: list[str], stops: list[str]) -> None:
    """Text grows a piece (a token's text) at a time; a trailing replacement character (an
    incomplete UTF-8 sequence) is rewritten by the next piece, as a decoder does."""
    scan, text = StopScan(stops), ""
    for piece in pieces:
        text = text.rstrip("\ufffd") + piece
        expected = full_search(text, stops) >= 0
        assert scan.hit(text) == expected, (text, stops)
        if expected:
            break
    assert stop_index(text, stops) == full_search(text, stops)


def test_limits_are_refused_with_one_sentence() -> None:
    SamplingParams(stop=["x" * MAX_STOP_STRING_BYTES] * MAX_STOP_STRINGS).validate()
    for stop, says in (([f"s{i}" for i in range(MAX_STOP_STRINGS + 1)], f"at most {MAX_STOP_STRINGS} stop strings"),
                       ("é" * (MAX_STOP_STRING_BYTES // 2 + 1), f"at most {MAX_STOP_STRING_BYTES} bytes"),
                       ([3], "a string or a list of strings")):
        with pytest.raises(InvalidRequestError, match=says) as e:
            SamplingParams(stop=stop).validate()
        assert e.value.param == "stop" and str(e.value).endswith(".")


def _per_token_s(stops: list[str], text: str, tokens: int = 400) -> float:
    """The median time of one token's stop check, the output ``text`` growing 6 characters a token."""
    sp = SamplingParams(max_new_tokens=10**6, stop=stops)
    req = Request(rid=1, prompt_ids=[1], sampling=sp, namespace="", max_new_tokens=10**6)
    times = []
    for i in range(tokens):
        req.output_ids.append(7)
        shown = text[:len(text) - 6 * (tokens - 1 - i)]
        t0 = time.perf_counter()
        assert stop_reason(req, set(), lambda _ids: shown) == ""
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def test_a_token_check_costs_the_same_for_one_stop_string_or_the_limit() -> None:
    """Before: every token searched the whole text once per stop string (at 500,000 strings, 1.7 s a token)."""
    text = "lorem ipsum dolor sit amet " * 2000  # 54,000 characters, no stop string in it
    at_limit = [f"Q{i:03d}" for i in range(MAX_STOP_STRINGS - 1)] + ["Z" * MAX_STOP_STRING_BYTES]
    one, many = _per_token_s(["Q999"], text), _per_token_s(at_limit, text)
    assert many < 4 * one + 50e-6, (one, many)
