"""`python -m bench.ended` at a tiny size: each start-up from a checkpoint, the scheduler's and
the dispatcher's, folds only what ended after it, however many leases ended before."""

from __future__ import annotations

from bench.ended import TAIL, run_ended_bench


def test_a_start_up_from_the_checkpoints_folds_only_the_leases_ended_after_it() -> None:
    result = run_ended_bench(steps=(100, 400), dispatcher=True)
    rows = result["steps"]
    assert [r["ended"] for r in rows] == [100, 400]
    for r in rows:
        # four events a lease: the tail, not the log (the full replay's count grows with N)
        assert r["events_after_checkpoint"] == 4 * TAIL
        assert r["events"] > 4 * r["ended"]
        assert r["dispatcher_events_after_checkpoint"] == 4 * TAIL
    assert "from ckpt s" in result["table"]
