"""`pool bench projections --quick` runs end to end and every event it writes is applied.

Behaviour only (the views reach the log's end, the audit passes, the schema is dropped);
the figures it prints are never asserted against a speed.
"""

from __future__ import annotations

import psycopg

from bench.projections import run_projections_bench
from projections.views import VIEWS


def test_the_projections_bench_applies_every_event_and_the_audit_passes(database_url: str) -> None:
    # a pre-written log of 2,000 events and a second of live load at the quick rate (1,000/s)
    result = run_projections_bench(database_url=database_url, quick=True, events=2000,
                                   seconds=1.0)
    top = result["max_notification_id"]
    assert result["caught_up"]
    assert top >= 2000  # the pre-written log at least
    assert result["events"] == top == result["audit_position"]
    assert result["view_positions"] == {v: top for v in VIEWS}
    assert result["audit_ok"] and result["audit_discrepancies"] == 0
    assert result["credit_events"] > 0.5 * top
    assert result["lag_samples"] > 0 and 0 <= result["lag_p50_s"] <= result["lag_p99_s"]
    assert result["applied_events_per_s"] > 0 and result["raw_atomic_msgs_per_s"] > 0
    assert result["rebuild_1m_extrapolated"] and result["schema"].startswith("bench_proj_")
    assert "applied events/s" in result["table"]
    with psycopg.connect(database_url) as conn:
        left = conn.execute("SELECT count(*) FROM information_schema.schemata "
                            "WHERE schema_name = %s", (result["schema"],)).fetchone()
    assert left is not None and left[0] == 0  # the fresh schema was dropped
