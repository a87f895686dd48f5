"""The policy simulator: a virtual clock, seeded workloads, the scheduler's policy replayed."""

from __future__ import annotations

from collections import defaultdict

import pytest

from domain.lease import Lease
from domain.resources import NodeCapabilities, NodeId, PoolId, Resources, Shape, TenantId
from sim import (
    DRF,
    DRF_BACKFILL,
    FIFO,
    SimNode,
    SimRequest,
    Simulator,
    SyntheticSpec,
    Tenant,
    VirtualClock,
    Workload,
    from_leases,
    report,
    synthetic,
)
from sim.metrics import jain, percentile

ONE = Shape.build(gpu_count=1)
EIGHT = Shape.build(gpu_count=8)


def test_the_virtual_clock_moves_only_forward() -> None:
    clock = VirtualClock(5.0)
    clock.advance_to(7.0)
    assert clock() == 7.0
    with pytest.raises(ValueError):
        clock.advance_to(6.0)


def test_a_synthetic_workload_is_the_same_for_the_same_seed() -> None:
    spec = SyntheticSpec(days=1, gpu_nodes=2, cpu_nodes=1, seed=7)
    assert synthetic(spec).requests == synthetic(spec).requests
    other = synthetic(SyntheticSpec(days=1, gpu_nodes=2, cpu_nodes=1, seed=8))
    assert other.requests != synthetic(spec).requests


def test_a_synthetic_workload_has_its_cohorts_tenants_and_widths() -> None:
    wl = synthetic(SyntheticSpec(days=2, gpu_nodes=4, cpu_nodes=2, seed=3))
    assert len(wl.tenants) == 12
    assert len({t.cohort for t in wl.tenants}) == 3
    assert {r.width for r in wl.requests} == {"1-gpu", "8-gpu", "wide-cpu"}
    assert all(r.runtime_seconds <= r.maximum_runtime_seconds for r in wl.requests)
    assert all(0 <= r.arrival < wl.horizon for r in wl.requests)
    assert {r.width for r in wl.requests if r.wide} == {"8-gpu", "wide-cpu"}


def _never_over_capacity(wl: Workload, policy_result: object) -> None:
    """Sweep each node's starts and ends: what runs there never exceeds what it has."""
    from sim.engine import SimResult
    assert isinstance(policy_result, SimResult)
    caps = {n.node_id: n.capabilities.allocatable for n in wl.nodes}
    events: dict[str, list[tuple[float, int, Resources]]] = defaultdict(list)
    for out in policy_result.outcomes:
        assert out.started_at is not None and out.ended_at is not None and out.node_id
        assert out.started_at >= out.request.arrival
        res = out.request.shape.resources
        events[out.node_id].append((out.started_at, 1, res))
        events[out.node_id].append((out.ended_at, 0, res))  # ends sort before starts
    for node_id, evs in events.items():
        used = Resources()
        for _, kind, res in sorted(evs, key=lambda e: (e[0], e[1])):
            used = used + res if kind else used - res
            assert used.fits_in(caps[node_id]), node_id


@pytest.mark.parametrize("policy", [FIFO, DRF, DRF_BACKFILL], ids=lambda p: p.name)
def test_every_request_runs_once_within_each_nodes_capacity(policy: object) -> None:
    wl = synthetic(SyntheticSpec(days=1, gpu_nodes=3, cpu_nodes=2, offered_load=1.2, seed=5))
    result = Simulator(wl, policy, cycle_seconds=60.0).run()  # type: ignore[arg-type]
    assert len(result.outcomes) == len(wl.requests)
    _never_over_capacity(wl, result)


def _starving_wide() -> Workload:
    """One 8-GPU node; tenant `small` keeps four 1-GPU runs of an hour going all day, and
    tenant `wide` asks for the whole node early on."""
    node = SimNode("n", NodeCapabilities(allocatable=Resources(gpu_count=8)))
    reqs = [SimRequest(f"s{i}", "small", i * 900.0, ONE, 3600.0, 3600, width="1-gpu")
            for i in range(96)]
    reqs += [SimRequest(f"f{i}", "filler", 0.0, ONE, 7200.0, 7200, width="1-gpu")
             for i in range(4)]
    reqs.append(SimRequest("w", "wide", 600.0, EIGHT, 3600.0, 3600, width="8-gpu", wide=True))
    reqs.sort(key=lambda r: (r.arrival, r.request_id))
    tenants = (Tenant("small", "a", 1.0), Tenant("filler", "a", 1.0), Tenant("wide", "b", 1.0))
    return Workload((node,), tenants, tuple(reqs), 86_400.0)


def _wide_wait(policy: object) -> float:
    result = Simulator(_starving_wide(), policy).run()  # type: ignore[arg-type]
    (wide,) = [o for o in result.outcomes if o.request.request_id == "w"]
    assert wide.wait_seconds is not None
    return wide.wait_seconds


def test_backfill_starts_a_wide_request_that_a_stream_of_small_ones_holds_off() -> None:
    without, with_backfill = _wide_wait(DRF), _wide_wait(DRF_BACKFILL)
    # without a reservation every GPU freed goes to the next small run; with one, the node
    # drains for the wide request once the runs already there have ended (by 7,200 s)
    assert without > 20 * 3600
    assert with_backfill <= 7200


def test_drf_gives_a_light_tenant_its_turn_before_a_flood_that_came_first() -> None:
    node = SimNode("n", NodeCapabilities(allocatable=Resources(gpu_count=2)))
    reqs = tuple([SimRequest(f"h{i}", "heavy", 0.0, ONE, 200.0 if i == 1 else 100.0, 200)
                  for i in range(5)] + [SimRequest("l", "light", 1.0, ONE, 100.0, 100)])
    wl = Workload((node,), (Tenant("heavy", "", 1.0), Tenant("light", "", 1.0)), reqs, 10.0)

    def started(policy: object) -> list[str]:
        outs = Simulator(wl, policy, cycle_seconds=1.0).run().outcomes  # type: ignore[arg-type]
        return [o.request.request_id for o in sorted(outs, key=lambda o: o.started_at or 0)]

    assert started(FIFO).index("l") == 5  # arrival order: behind the whole flood
    # the first GPU freed (at 100, while heavy still runs one) goes to the tenant with none
    assert started(DRF).index("l") == 2


def test_a_report_counts_utilisation_and_waits() -> None:
    node = SimNode("n", NodeCapabilities(allocatable=Resources(gpu_count=2)))
    reqs = (SimRequest("a", "t", 0.0, ONE, 50.0, 60, width="1-gpu"),
            SimRequest("b", "t", 0.0, Shape.build(gpu_count=2), 50.0, 60, width="8-gpu",
                       wide=True))
    wl = Workload((node,), (Tenant("t", "", 1.0),), reqs, 100.0)
    rep = report(Simulator(wl, DRF, cycle_seconds=1.0).run())
    # "a" runs 0-50, then "b" 50-100: 150 GPU-seconds of 200
    assert rep.utilisation["gpu"] == pytest.approx(0.75)
    assert rep.by_width["8-gpu"].max_seconds == pytest.approx(50.0)
    assert rep.wide_longest_wait_seconds == pytest.approx(50.0)
    assert rep.jain_share_over_weight == pytest.approx(1.0)


def test_jain_is_one_when_equal_and_one_over_n_when_one_has_it_all() -> None:
    assert jain([2.0, 2.0, 2.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)


def test_percentiles_interpolate() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([], 99) is None


def test_a_logged_lease_replays_with_the_runtime_it_was_observed_to_run() -> None:
    lease = Lease.request(tenant_id=TenantId("t"), pool_id=PoolId("p"), idempotency_key="k",
                          shape=ONE, maximum_runtime_seconds=3600, now=1000.0)
    lease.queue(1000.0)
    lease.reserve(1010.0, node_id=NodeId("n"), commit_timeout_seconds=30, hold_microcredits=0)
    lease.commit(1020.0)
    lease.release(1620.0)
    never = Lease.request(tenant_id=TenantId("t"), pool_id=PoolId("p"), idempotency_key="j",
                          shape=ONE, maximum_runtime_seconds=60, now=1100.0)
    node = SimNode("n", NodeCapabilities(allocatable=Resources(gpu_count=1)))
    wl = from_leases([lease, never], [node])
    by_id = {r.request_id: r for r in wl.requests}
    ran = by_id[str(lease.id)]
    assert (ran.arrival, ran.runtime_seconds, ran.maximum_runtime_seconds) == (0.0, 600.0, 3600)
    assert by_id[str(never.id)].runtime_seconds == 60.0  # never ran: its bound
    assert ran.wide  # one GPU of a one-GPU node is the whole node
    result = Simulator(wl, DRF, cycle_seconds=1.0).run()
    assert all(o.ended_at is not None for o in result.outcomes)


def test_a_pool_that_preempts_replays_without_preemption() -> None:
    # preemption is not simulated (docs/audit.md): a high-priority request waits for a node
    # to free instead of noticing the low one running there, and every request runs once
    from domain.poolconfig import PoolConfig, PreemptionSettings

    node = SimNode("n", NodeCapabilities(allocatable=Resources(gpu_count=1)))
    reqs = (SimRequest("low", "t", 0.0, ONE, 600.0, 600, priority_class="low"),
            SimRequest("high", "u", 60.0, ONE, 60.0, 60, priority_class="high"))
    wl = Workload((node,), (Tenant("t", "", 1.0), Tenant("u", "", 1.0)), reqs, 100.0)
    cfg = PoolConfig(priority_classes=(("low", 0), ("high", 10)), default_priority_class="low",
                     preemption=PreemptionSettings(enabled=True))
    states: set[str] = set()

    def look(now: float, placed: int) -> None:
        states.update(str(a.state) for a in sim.fold.aggregates.values()
                      if isinstance(a, Lease))

    sim = Simulator(wl, DRF, config=cfg, cycle_seconds=60.0, on_cycle=look)
    result = sim.run()
    started = {o.request.request_id: o.started_at for o in result.outcomes}
    assert started == {"low": 0.0, "high": 600.0}
    assert "preempting" not in states and "running" in states  # no victim noticed
    _never_over_capacity(wl, result)
