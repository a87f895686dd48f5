"""`python -m bench.snapshots --quick`: a cold load through the snapshot reads only the events
after it, a load of the whole history reads them all (figures, not timings, are checked)."""

from __future__ import annotations

from bench.snapshots import run_snapshot_bench


def test_the_snapshot_bench_loads_the_tail_beside_the_whole_history() -> None:
    out = run_snapshot_bench(quick=True)
    assert out["snapshot_version"] is not None and out["snapshot_bytes"] > 0
    # the snapshot's own event (checked to be where the snapshot says) and the tail after it
    assert out["messages_with_snapshot"] == out["events"] - out["snapshot_version"] + 1 > 1
    assert out["messages_whole_history"] == out["events"]
    assert len(out["with_snapshot_runs_ms"]) == len(out["whole_history_runs_ms"]) == out["runs"]
