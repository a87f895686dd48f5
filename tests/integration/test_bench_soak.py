"""`pool bench soak` at a small size: every lease ends, and each mark is measured."""

from __future__ import annotations

from bench.soak import run_soak


def test_the_soak_ends_every_lease_and_measures_memory_and_replay_at_each_mark() -> None:
    # the pause at each mark lets the scheduler's memory settle for the figure, which the test
    # does not judge: a short one. The scheduler takes up the new pool within a third of its
    # leadership TTL: 10 s (the default's 30 s left the first commit waiting up to 10 s)
    result = run_soak(leases=60, settle_seconds=0.1, leader_ttl_seconds=10.0)
    assert result["errors"] == {}
    assert [r["leases"] for r in result["rss"]] == [0, 6, 30, 60]
    assert all(r["rss_mib"] > 0 for r in result["rss"])
    assert [r["leases"] for r in result["replays"]] == [20, 40, 60]
    # each third's replay reads more of the log: the leases' events are there to read
    events = [r["events"] for r in result["replays"]]
    assert events == sorted(events) and events[0] > 0
    assert "start-up replay after" in result["table"]
