"""`pool bench gang` on a small fleet: every figure is there and within its bounds, and the
run is deterministic for a seed (the waits are simulated, not measured)."""

from __future__ import annotations

from bench.gang import GangBenchSpec, _run


def test_the_gang_bench_reports_waits_by_size_utilisation_and_starvation() -> None:
    spec = GangBenchSpec(nodes=48, hours=2.0, warmup_hours=0.25, seed=3)
    off = _run(spec, guard=False)
    on = _run(spec, guard=True)
    for r in (off, on):
        assert 0.0 < r["gpu_utilisation"] <= 1.0
        assert r["placements"] > 0 and r["starved"] >= 0
        assert any(k.endswith("_wait_p99_s") for k in r)
    # the simulated waits depend on the seed only
    assert _run(spec, guard=False)["gpu_utilisation"] == off["gpu_utilisation"]
