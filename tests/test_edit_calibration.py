"""Edit reuse's gate threshold (issue 61): the calibration keeps the largest deviation whose kept
pairs hold the quality targets, and the engine reads what `--write` recorded for its model."""

from __future__ import annotations

import pytest

from hicache import Engine, SamplingParams
from hicache.bench.edit_calibration import PairQuality, threshold, write
from hicache.runtime import edit_reuse

pytestmark = pytest.mark.engine


def pair(deviation: float, kl: float, reused: int = 100, top1: float = 1.0) -> PairQuality:
    return PairQuality("uuid_timestamp", 0, deviation, kl, top1, 1.0, reused, 200)


def test_the_threshold_is_the_largest_deviation_whose_kept_pairs_hold_the_targets() -> None:
    pairs = [pair(0.05, 0.001), pair(0.10, 0.01), pair(0.20, 0.09), pair(0.30, 0.002), pair(0.5, 0.3)]
    # up to 0.10 every pair is under 0.02; 0.20's pair is over it, and every threshold past it keeps that pair
    assert threshold(pairs, target_kl=0.02) == 0.10
    assert threshold(pairs, target_kl=0.1) == 0.30  # looser: only 0.5's pair is over it
    assert threshold([pair(0.05, 0.5)], target_kl=0.02) is None
    assert threshold([pair(0.05, 0.001), pair(0.1, 0.001, top1=0.75)], target_kl=0.02) == 0.05  # a top-1 flipped
    assert threshold([pair(0.01, 0.0, reused=0), pair(0.2, 0.001)], 0.02) == 0.2  # a pair that reused nothing: no say


def test_the_engine_takes_the_recorded_threshold_unless_a_flag_sets_one(tmp_path, monkeypatch) -> None:
    table = tmp_path / "edit_reuse_calibration.json"
    monkeypatch.setattr(edit_reuse, "CALIBRATION_FILE", table)
    write("random:small", 0.123, [pair(0.123, 0.001)], 0.02, path=table)
    assert edit_reuse.calibrated_max_deviation("random:small") == 0.123
    assert edit_reuse.calibrated_max_deviation("random:tiny") is None
    for flag, expected in ((None, 0.123), (0.5, 0.5)):
        e = Engine("random:small", dtype="float32", max_total_tokens=1024, enable_edit_reuse=True,
                   edit_reuse_max_deviation=flag)
        try:
            e.generate([1, 2, 3], SamplingParams(max_new_tokens=1))
            assert e.stats()["edit_reuse"]["max_deviation"] == expected
        finally:
            e.shutdown()
