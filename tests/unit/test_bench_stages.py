"""The split of request → reserved into stages (bench.latency), over records made by hand."""

from __future__ import annotations

import pytest

from bench.latency import stage_lines, stages


def test_each_stage_is_the_difference_of_its_two_times_per_lease() -> None:
    # (sent, replied, ok, lease ids, code); b's request was never seen stored, c was refused
    records = [(100.0, 100.030, True, ("a",), ""), (200.0, 200.050, True, ("b",), ""),
               (300.0, 300.010, False, (), "quota")]
    got = stages(records, {"a": 100.010}, {"a": 100.100}, {"a": 100.104, "b": 200.2})
    assert got["sent_to_stored"]["p50_ms"] == pytest.approx(10.0)
    assert got["stored_to_reply"]["p50_ms"] == pytest.approx(20.0)
    assert got["stored_to_reserved"]["p50_ms"] == pytest.approx(90.0)
    assert got["reserved_to_feed"]["p99_ms"] == pytest.approx(4.0)


def test_a_lease_counts_only_in_the_stages_it_reached() -> None:
    records = [(1.0, 1.020, True, ("a", "b", "c"), "")]
    requested = {"a": 1.005, "b": 1.006, "c": 1.007}
    got = stages(records, requested, {"b": 1.050, "c": 1.060}, {"b": 1.060})
    assert got["sent_to_stored"]["p99_ms"] == pytest.approx(7.0)
    assert got["stored_to_reserved"]["p50_ms"] == pytest.approx(53.0)  # b 44, c 53
    assert got["reserved_to_feed"]["p50_ms"] == pytest.approx(10.0)  # c not on the feed yet
    line = stage_lines({"stages": got}, "at 1/s offered")
    assert line and "reservation stored → on the tenant's feed 10.0 / 10.0" in line[0]


def test_no_stage_seen_prints_no_line() -> None:
    got = stages([(1.0, 1.1, True, ("a",), "")], {}, {}, {})
    assert all(s["p50_ms"] is None for s in got.values())
    assert stage_lines({"stages": got}, "x") == []
