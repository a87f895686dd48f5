"""The planner with place_fast's memory of shapes that fit nowhere, against the plain path
(`NodeTable.misses_remembered` False): the same fold planned both ways gives the same plans,
reasons and start estimates, cycle after cycle, on a varied generated workload. And the
planner without start estimates (`estimate_starts` False, as the policy simulator plans)
against the planner with them: the same plans, the estimates aside."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from domain.gang import GangMembership, member_key
from domain.lease import Lease
from domain.node import Node
from domain.policy.gang import GangSpec
from domain.pool import Pool, TenantPolicy
from domain.poolconfig import PoolConfig, PreemptionSettings
from domain.resources import NodeCapabilities, NodeId, PoolId, Resources, Shape, TenantId
from workers.scheduler import Planner, SchedulerFold

NOW = 1_000_000.0
TENANTS = ("alpha", "beta", "gamma")
# same resources with and without a selector, so a memory keyed on less than the whole
# shape answers one of them with the other's result
SHAPES = [
    Shape.build(cpu_millis=2000, memory_mib=2048),
    Shape.build(cpu_millis=2000, memory_mib=2048, zone="z1"),
    Shape.build(cpu_millis=2000, memory_mib=2048, zone="z2"),
    Shape.build(cpu_millis=6000, memory_mib=12288),
    Shape.build(cpu_millis=6000, memory_mib=12288, zone="z0"),
    Shape.build(cpu_millis=1000, memory_mib=4096, gpu_count=1),
    Shape.build(cpu_millis=1000, memory_mib=4096, gpu_count=1, gpu_model="a100"),
    Shape.build(cpu_millis=8000, memory_mib=30000, gpu_count=2),
    Shape.build(cpu_millis=500, memory_mib=512, runtime="microvm"),
    Shape.build(cpu_millis=64000, memory_mib=1024),  # never fits: rejected
]


def _events(seed: int, *, preempt: bool) -> list[Any]:
    """A pool of mixed nodes (zones, GPU models, sizes) and a queue of mixed requests, two
    priority classes, and gangs, as the events catch-up would read."""
    rnd = random.Random(seed)
    cfg = PoolConfig(priority_classes=(("low", 1), ("high", 10)),
                     default_priority_class="low", aging_seconds_per_rank=600,
                     preemption=PreemptionSettings(enabled=preempt))
    aggs: list[Any] = [Pool.create(pool_id=PoolId("p"), now=NOW, config=cfg)]
    aggs += [TenantPolicy.set(pool_id=PoolId("p"), tenant_id=TenantId(t), now=NOW)
             for t in TENANTS]
    for i in range(rnd.randint(12, 30)):
        gpus = rnd.choice((0, 0, 1, 2, 4))
        caps = NodeCapabilities(
            allocatable=Resources(cpu_millis=4000 * rnd.randint(1, 4),
                                  memory_mib=8192 * rnd.randint(1, 4), gpu_count=gpus),
            gpu_model=rnd.choice(("a100", "h100")) if gpus else None,
            zone=f"z{i % 3}", failure_domain=f"fd{i % 4}",
            runtimes=("container", "microvm") if i % 5 == 0 else ("container",))
        aggs.append(Node.register(node_id=NodeId(f"n{i}"), pool_id=PoolId("p"),
                                  capabilities=caps, now=NOW))
    for k in range(rnd.randint(60, 160)):
        tenant = rnd.choice(TENANTS)
        at = NOW - 500 + k
        prio = rnd.choice(("low", "low", "high"))
        if rnd.random() < 0.08:  # a gang of 2–4
            spec = GangSpec.build(rnd.randint(2, 4))
            shape = rnd.choice(SHAPES[:6])
            for m in GangMembership.members(tenant, f"g{k}", spec):
                aggs.append(_request(tenant, member_key(m.lead_key, m.member), shape, at,
                                     prio, gang=m))
            continue
        aggs.append(_request(tenant, f"r{k}", rnd.choice(SHAPES), at, prio))
    return [e for agg in aggs for e in agg.collect_events()]


def _request(tenant: str, key: str, shape: Shape, at: float, prio: str,
             gang: GangMembership | None = None) -> Lease:
    return Lease.request(tenant_id=TenantId(tenant), pool_id=PoolId("p"), idempotency_key=key,
                         shape=shape, maximum_runtime_seconds=600 + int(at) % 3000, now=at,
                         priority_class=prio, queued=True, gang=gang)


def _fold(events: list[Any], *, remembered: bool) -> SchedulerFold:
    fold = SchedulerFold()
    for event in events:
        fold.apply(event)
    fold.pools["p"].table.misses_remembered = remembered
    return fold


def _said(fold: SchedulerFold, planner: Planner, now: float) -> list[str]:
    """One cycle's plans and the fold's reasons after it, as comparable text."""
    planner.begin_cycle()
    planned = planner.plan(fold, fold.pools["p"], now)
    out = [json.dumps({"reservations": p.reservations(), "rejected": p.rejected,
                       "reasons": p.reasons, "holds": p.holds, "preempted": p.preempted,
                       "allocations": {n: [(str(x[0]), str(x[1]), x[2]) for x in v]
                                       for n, v in p.allocations.items()},
                       "events": [type(e).__name__ for a in p.aggregates
                                  for e in a.pending_events]},
                      default=str)
           for p in planned]
    out.append(json.dumps({"waiting": planned.waiting, "reasons": fold.reasons}, default=str))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_remembering_misses_plans_exactly_as_filtering_each_time(seed: int) -> None:
    events = _events(seed, preempt=seed % 2 == 1)
    fast, plain = _fold(events, remembered=True), _fold(events, remembered=False)
    planners = [Planner(backfill=seed % 3 != 0), Planner(backfill=seed % 3 != 0)]
    for cycle in range(3):  # later cycles see the earlier ones' placements, unsaved
        now = NOW + 60 * cycle
        assert _said(fast, planners[0], now) == _said(plain, planners[1], now), cycle
        for event in _more(seed, cycle, now):  # new requests, and a node now and then
            fast.apply(event)
            plain.apply(event)


def _more(seed: int, cycle: int, now: float) -> list[Any]:
    rnd = random.Random(seed * 100 + cycle)
    aggs: list[Any] = [_request(rnd.choice(TENANTS), f"c{cycle}-{k}", rnd.choice(SHAPES),
                                now + k, "high") for k in range(rnd.randint(5, 30))]
    if cycle % 2 == 0:
        caps = NodeCapabilities(allocatable=Resources(cpu_millis=16000, memory_mib=32768,
                                                      gpu_count=2), gpu_model="a100",
                                zone="z1", runtimes=("container", "microvm"))
        aggs.append(Node.register(node_id=NodeId(f"new{cycle}"), pool_id=PoolId("p"),
                                  capabilities=caps, now=now))
    return [e for agg in aggs for e in agg.collect_events()]


def _unestimated(said: list[str]) -> tuple[list[str], int]:
    """`_said` with every waiting request's estimated start blanked but a backfill head's
    (its reservation's start), and how many were blanked."""
    *plans, last = said
    after = json.loads(last)
    blanked = 0
    for why in after["reasons"].values():
        queue = why.get("queue")
        if queue is not None and not queue["reserved"]:
            blanked += queue["estimated_start_at"] is not None
            queue["estimated_start_at"] = None
    return [*plans, json.dumps(after)], blanked


@pytest.mark.parametrize("seed", range(6))
def test_a_planner_without_start_estimates_places_exactly_as_one_with(seed: int) -> None:
    events = _events(seed, preempt=seed % 2 == 1)
    with_, without = _fold(events, remembered=True), _fold(events, remembered=True)
    backfill = seed % 3 != 0
    planners = [Planner(backfill=backfill), Planner(backfill=backfill, estimate_starts=False)]
    estimated = 0
    for cycle in range(3):
        now = NOW + 60 * cycle
        said, blanked = _unestimated(_said(with_, planners[0], now))
        estimated += blanked
        unsaid, none = _unestimated(_said(without, planners[1], now))
        assert none == 0  # no estimate but a head's reservation start
        assert said == unsaid, cycle
        for event in _more(seed, cycle, now):
            with_.apply(event)
            without.apply(event)
    assert estimated > 0  # the workload has waits that the estimates explain


def _crowded(seed: int) -> list[Any]:
    """A few nodes and many more requests of a few shapes than they hold."""
    rnd = random.Random(seed)
    cfg = PoolConfig(priority_classes=(("low", 1), ("high", 10)), default_priority_class="low")
    aggs: list[Any] = [Pool.create(pool_id=PoolId("p"), now=NOW, config=cfg)]
    aggs += [TenantPolicy.set(pool_id=PoolId("p"), tenant_id=TenantId(t), now=NOW)
             for t in TENANTS]
    for i in range(rnd.randint(3, 6)):
        caps = NodeCapabilities(allocatable=Resources(
            cpu_millis=4000 * rnd.randint(1, 4), memory_mib=8192 * rnd.randint(1, 4),
            gpu_count=rnd.choice((0, 2))), gpu_model="a100", zone=f"z{i % 3}")
        aggs.append(Node.register(node_id=NodeId(f"n{i}"), pool_id=PoolId("p"),
                                  capabilities=caps, now=NOW))
    for k in range(rnd.randint(40, 120)):
        aggs.append(_request(rnd.choice(TENANTS), f"r{k}", rnd.choice(SHAPES[:7]),
                             NOW - 500 + k, rnd.choice(("low", "high"))))
    return [e for agg in aggs for e in agg.collect_events()]


def _placed(said: list[str]) -> list[str]:
    """`_said`'s plans without their reasons (a pass stopped early leaves the requests it
    did not pop their last reasons), and nothing of the fold's reasons."""
    out = []
    for text in said[:-1]:
        plan = json.loads(text)
        del plan["reasons"]
        out.append(json.dumps(plan))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_a_pass_that_stops_once_nothing_fits_places_exactly_as_a_full_one(seed: int) -> None:
    # half on a crowded pool, without gangs, microVMs (trust-limited) or a never-fitting
    # shape, where passes do stop early
    events = _events(seed, preempt=False) if seed % 2 else _crowded(seed)
    full, stopping = _fold(events, remembered=True), _fold(events, remembered=True)
    planners = [Planner(backfill=False), Planner(backfill=False, stop_when_nothing_fits=True)]
    for cycle in range(4):
        now = NOW + 60 * cycle
        assert _placed(_said(full, planners[0], now)) == \
            _placed(_said(stopping, planners[1], now)), cycle
        assert len(full.pools["p"].queue or ()) == len(stopping.pools["p"].queue or ())
        for event in _more(seed, cycle, now):
            full.apply(event)
            stopping.apply(event)
