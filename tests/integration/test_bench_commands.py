"""The benchmark commands run at their --quick size and report complete, sane results.

They print figures; these tests check behaviour only (everything placed, nothing lost).
"""

from __future__ import annotations

import pytest

from bench.schedule import BACKLOG_LABEL, run_schedule_bench


@pytest.mark.parametrize("priced", [False, True], ids=["free", "priced"])
def test_the_schedule_bench_places_every_request_it_submits(priced: bool) -> None:
    result = run_schedule_bench(quick=True, priced=priced)
    assert result["placed"] == result["requests"] == 3000
    assert result["steady_placed"] == int(result["steady_rate"] * 3)  # every steady request too
    assert result["steady_placements_per_s"] > 0 and result["backlog_placements_per_s"] > 0
    assert 0 < result["latency_p50_s"] <= result["latency_p99_s"]
    # the scheduler-alone figure says so, and its timer includes reading the backlog
    assert BACKLOG_LABEL in result["table"]
    assert 0 < result["backlog_read_s"] < result["backlog_s"]
    # messages per placement: a LeaseReserved each, one node event per node per batch, and
    # when the pool has prices one CreditsHeldBatch per tenant per batch (a CreditsHeld per
    # placement would make it over 2)
    per_placement = result["backlog_msgs_per_s"] / result["backlog_placements_per_s"]
    assert 1.0 < per_placement < 1.2


def test_the_agent_bench_starts_every_workload_it_sends() -> None:
    from bench.agent import run_agent_bench

    result = run_agent_bench(quick=True)
    process = result["process"]
    if "unavailable" in process:
        pytest.skip(process["unavailable"])
    assert process["published"]["n"] == process["delivered"]["n"] == result["starts"] == 5
    assert 0 < process["delivered"]["p50_ms"] <= process["delivered"]["p90_ms"]
