"""The benchmark commands run at their --quick size and report complete, sane results.

They print figures; these tests check behaviour only (everything placed, nothing lost).
"""

from __future__ import annotations

from workers.bench_schedule import run_schedule_bench


def test_the_schedule_bench_places_every_request_it_submits() -> None:
    result = run_schedule_bench(quick=True)
    assert result["placed"] == result["requests"] == 3000
    assert result["steady_placed"] == int(result["steady_rate"] * 3)  # every steady request too
    assert result["steady_placements_per_s"] > 0 and result["backlog_placements_per_s"] > 0
    assert 0 < result["latency_p50_s"] <= result["latency_p99_s"]


def test_the_agent_bench_starts_every_workload_it_sends() -> None:
    from workers.bench_agent import run_agent_bench

    result = run_agent_bench(quick=True)
    process = result["process"]
    if "unavailable" in process:
        import pytest

        pytest.skip(process["unavailable"])
    assert process["published"]["n"] == process["delivered"]["n"] == result["starts"] == 5
    assert 0 < process["delivered"]["p50_ms"] <= process["delivered"]["p90_ms"]
