"""The e2e bench's split of request → reserved into stages, over records made by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.e2e import _stage_lines, _stages


def test_each_stage_is_the_difference_of_its_two_times_per_lease() -> None:
    # (sent, replied, ok, lease ids, code); the request of b and the refused one are skipped
    records = [(100.0, 100.030, True, ("a",), ""), (200.0, 200.050, True, ("b",), ""),
               (300.0, 300.010, False, (), "quota")]
    watcher = SimpleNamespace(requested_stored={"a": 100.010}, reserved_stored={"a": 100.100},
                              reserved={"a": 100.104})
    got = _stages(records, watcher)
    assert got["sent_to_stored"]["p50_ms"] == pytest.approx(10.0)
    assert got["stored_to_reply"]["p50_ms"] == pytest.approx(20.0)
    assert got["stored_to_reserved"]["p50_ms"] == pytest.approx(90.0)
    assert got["reserved_to_seen"]["p99_ms"] == pytest.approx(4.0)


def test_a_request_not_yet_reserved_counts_only_in_the_stages_it_reached() -> None:
    records = [(1.0, 1.020, True, ("a", "b"), "")]
    watcher = SimpleNamespace(requested_stored={"a": 1.005, "b": 1.006},
                              reserved_stored={"b": 1.050}, reserved={"b": 1.060})
    got = _stages(records, watcher)
    assert got["sent_to_stored"]["p99_ms"] == pytest.approx(6.0)
    assert got["stored_to_reserved"]["p50_ms"] == pytest.approx(44.0)
    line = _stage_lines({"stages": got}, "at 1/s offered")
    assert line and "request stored → reservation stored 44.0 / 44.0" in line[0]


def test_no_stage_seen_prints_no_line() -> None:
    watcher = SimpleNamespace(requested_stored={}, reserved_stored={}, reserved={})
    got = _stages([(1.0, 1.1, True, ("a",), "")], watcher)
    assert all(s["p50_ms"] is None for s in got.values())
    assert _stage_lines({"stages": got}, "x") == []
