"""The fair-share audit judges placements, not sampled cores: a scheduler that honours the
weights passes it on any machine, one that ignores them fails, on the simulator's clock."""

from __future__ import annotations

import random

from domain.resources import NodeCapabilities, Resources, Shape
from projections.fair_share import (
    Freed,
    Left,
    Placed,
    Record,
    Requested,
    check_fair_share,
)
from sim.engine import DRF_BACKFILL, SimResult, Simulator
from sim.workload import SimNode, SimRequest, Tenant, Workload

WEIGHTS = {"acme": 3.0, "globex": 2.0}
JOB = Shape.build(cpu_millis=32_000, memory_mib=65_536)
NODE = NodeCapabilities(allocatable=Resources(32_000, 65_536, 0, 0))


def flood(weights: dict[str, float], *, nodes: int = 30, jobs: int = 300) -> SimResult:
    """The demo's flood on the simulator: whole-node jobs of 2–4 s from two tenants, arriving
    over ten seconds, many more than the nodes hold."""
    rnd = random.Random(7)
    requests = tuple(
        SimRequest(f"r{i}", ("acme", "globex")[i % 2], i * 10.0 / jobs, JOB,
                   float(rnd.choice((2, 3, 4))), 120)
        for i in range(jobs))
    workload = Workload(tuple(SimNode(f"n{k}", NODE) for k in range(nodes)),
                        tuple(Tenant(t, "", w) for t, w in weights.items()), requests, 10.0)
    return Simulator(workload, DRF_BACKFILL, cycle_seconds=0.05).run()


def records(result: SimResult) -> list[Record]:
    """The run as the log would record it: ends, then arrivals, then a cycle's placements in
    the order made, at each instant."""
    order = {rid: k for k, rid in enumerate(result.placements)}
    timed: list[tuple[float, int, int, Record]] = []
    for out in result.outcomes:
        req = out.request
        timed.append((req.arrival, 1, 0, Requested(req.request_id, req.tenant, "job",
                                                   req.arrival)))
        if out.started_at is not None:
            timed.append((out.started_at, 2, order[req.request_id],
                          Placed(req.request_id, req.shape.resources, out.started_at)))
        if out.ended_at is not None:
            timed.append((out.ended_at, 0, 0, Freed(req.request_id, out.ended_at)))
    return [r for *_, r in sorted(timed, key=lambda t: t[:3])]


def test_a_scheduler_that_honours_weights_places_every_contended_lease_fairly() -> None:
    result = flood(WEIGHTS)
    report = check_fair_share(records(result), WEIGHTS, result.totals, lag_seconds=0.0)
    assert report.contended >= 100, report.describe()
    assert not report.violations, report.violations[:3]
    assert report.ok(minimum=100)
    # and the placements under contention come out near the weights, 3:2
    assert 1.2 <= report.by_tenant["acme"] / report.by_tenant["globex"] <= 1.8


def test_a_scheduler_that_ignores_weights_fails_the_audit() -> None:
    result = flood({"acme": 1.0, "globex": 1.0})  # the scheduler's weights, ignored
    report = check_fair_share(records(result), WEIGHTS, result.totals, lag_seconds=0.0)
    assert report.contended >= 100
    assert len(report.violations) > 0.05 * report.contended, report.describe()
    assert not report.ok(minimum=100)


def test_too_few_contended_placements_are_not_a_verdict() -> None:
    recs: list[Record] = [Requested("a1", "acme", "job", 0.0), Requested("g1", "globex", "job", 0.0),
                          Placed("a1", JOB.resources, 5.0), Freed("a1", 6.0), Left("g1")]
    report = check_fair_share(recs, WEIGHTS, Resources(64_000, 131_072, 0, 0))
    assert (report.contended, report.violations) == (1, [])
    assert not report.ok(minimum=5) and report.ok(minimum=1)


def test_a_waiting_tenant_is_judged_as_high_as_its_recent_releases_leave_it() -> None:
    """The scheduler may not yet have seen a release in the last `lag_seconds`: a placement
    that was fair before it is not called unfair after it."""
    total = Resources(320_000, 655_360, 0, 0)
    recs: list[Record] = [Requested(f"a{i}", "acme", "job", 0.0) for i in range(4)]
    recs += [Requested(f"g{i}", "globex", "job", 0.0) for i in range(4)]
    # in fair order: acme holds 3 of 10 nodes and globex 2, each 0.1 by weight: tied
    recs += [Placed(lid, JOB.resources, 1.0) for lid in ("a0", "g0", "a1", "g1", "a2")]
    # two of acme's jobs end just before globex places: too late for the scheduler to know
    recs += [Freed("a0", 9.8), Freed("a1", 9.9), Placed("g2", JOB.resources, 10.0)]
    assert check_fair_share(recs, WEIGHTS, total, lag_seconds=1.0).violations == []
    late = check_fair_share(recs, WEIGHTS, total, lag_seconds=0.0)
    assert len(late.violations) == 1 and "globex" in late.violations[0]
