"""`pool bench policy`: one synthetic workload replayed through each scheduling policy variant
by the simulator (sim/), and what each delivered.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from domain.lease import Lease
from domain.node import Node
from domain.poolconfig import PoolConfig
from sim import (
    DRF,
    DRF_BACKFILL,
    DRF_DECAY,
    DRF_DECAY_BACKFILL,
    FIFO,
    Policy,
    Report,
    SimNode,
    Simulator,
    SyntheticSpec,
    Workload,
    from_leases,
    report,
    synthetic,
)

HOUR = 3600.0
# the full run: a month of three cohorts of four tenants on 24 GPU nodes and 16 CPU nodes
FULL = SyntheticSpec()
QUICK = SyntheticSpec(days=7.0, gpu_nodes=6, cpu_nodes=4)
# "drf" is the scheduler with no fair-share half-life; the decay variants count past usage
# with a half-life of a week, as the pool setting fair_share_half_life_seconds does
POLICIES: tuple[Policy, ...] = (FIFO, DRF, DRF_DECAY, DRF_BACKFILL, DRF_DECAY_BACKFILL)


def _hours(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / HOUR:.1f}"


LEASE_TOPIC = f"{Lease.__module__}:{Lease.__qualname__}."  # the topics of a lease's events


class NothingToReplay(ValueError):
    """The log holds no pool (or not the one named) with leases to replay."""

    code = "nothing_to_replay"


@dataclass
class PoolLog:
    """One pool as the log leaves it: its leases folded whole, its nodes, tenant weights (as
    `tenant set` gave them) and settings, and when each lease was first placed."""

    pool_id: str
    leases: list[Lease]
    nodes: list[SimNode]
    weights: dict[str, float]
    config: PoolConfig
    first_reserved_at: dict[str, float] = field(default_factory=dict)  # lease id → epoch


def pool_from_log(app: Any, pool_id: str | None = None) -> PoolLog:
    """The leases of one pool (the named one, else the one with the most leases) folded from
    the log, with the pool's nodes, weights and settings from the scheduler's own catch-up."""
    from workers.application import WEIGHT_SCALE
    from workers.scheduler import Scheduler

    scheduler = Scheduler(app)
    try:
        scheduler.catch_up()
    finally:
        scheduler.close()
    # the scheduler forgets ended leases and holds queued ones compactly: the leases are
    # folded here, whole, from every event of theirs
    first: dict[str, float] = {}
    leases = _fold_leases(app, first_reserved_at=first)
    if pool_id is None:
        counts: dict[str, int] = {}
        for lease in leases:
            counts[lease.pool_id] = counts.get(lease.pool_id, 0) + 1
        if not counts:
            raise NothingToReplay("the log holds no lease to replay")
        pool_id = max(sorted(counts), key=counts.__getitem__)
    state = scheduler.pools.get(pool_id)
    if state is None:
        raise NothingToReplay(f"the log holds no pool {pool_id!r}")
    nodes = [SimNode(n.node_id, n.capabilities) for n in scheduler.aggregates.values()
             if isinstance(n, Node) and n.pool_id == pool_id]
    mine = [lease for lease in leases if lease.pool_id == pool_id]
    if not mine:
        raise NothingToReplay(f"pool {pool_id!r} has no lease in the log")
    weights = {t: w / WEIGHT_SCALE for t, w in state.weights.items()}
    return PoolLog(pool_id, mine, nodes, weights, state.pool.config,
                   {k: v for k, v in first.items() if k in {str(x.id) for x in mine}})


def workload_from_log(app: Any, pool_id: str | None = None) -> tuple[Workload, PoolConfig]:
    """The leases of one pool (`pool_from_log`) as a workload to replay: what-if, under
    another policy."""
    log = pool_from_log(app, pool_id)
    workload = from_leases(log.leases, log.nodes, log.weights)
    return replace(workload, description=f"pool {log.pool_id}: {workload.description}, "
                   f"{len(log.nodes)} nodes"), log.config


def _fold_leases(app: Any, page: int = 1000, *,
                 first_reserved_at: dict[str, float] | None = None) -> list[Lease]:
    """Every lease in the log as its events leave it (the library's own fold); when each was
    first reserved goes into `first_reserved_at` (a requeue's placement replaces the lease's
    own `reserved_at`)."""
    found: dict[Any, Lease] = {}
    start = 1
    while True:
        notifications = app.recorder.select_notifications(start=start, limit=page)
        if not notifications:
            return list(found.values())
        for n in notifications:
            if not n.topic.startswith(LEASE_TOPIC):
                continue
            event = app.mapper.to_domain_event(n)
            lease = event.mutate(found.get(event.originator_id))
            if isinstance(lease, Lease):
                found[lease.id] = lease
                if (first_reserved_at is not None and lease.reserved_at is not None
                        and str(lease.id) not in first_reserved_at):
                    first_reserved_at[str(lease.id)] = lease.reserved_at
        start = notifications[-1].id + 1


def run_policy_bench(*, quick: bool = False, days: float | None = None, seed: int = 1,
                     offered_load: float | None = None, cycle_seconds: float = 60.0,
                     workload: Workload | None = None, config: PoolConfig | None = None,
                     progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Replay one workload (seeded and synthetic unless given) through every policy; figures
    and a table. `config` is the pool's settings (priority classes, aging, packing)."""
    if workload is None:
        base = QUICK if quick else FULL
        spec = SyntheticSpec(
            days=base.days if days is None else days, gpu_nodes=base.gpu_nodes,
            cpu_nodes=base.cpu_nodes, seed=seed,
            offered_load=base.offered_load if offered_load is None else offered_load)
        workload = synthetic(spec)
    if progress:
        progress(f"{workload.description}: {len(workload.requests)} requests")
    reports: list[Report] = []
    seconds: dict[str, float] = {}
    for policy in POLICIES:
        started = time.perf_counter()
        result = Simulator(workload, policy, config=config, cycle_seconds=cycle_seconds).run()
        seconds[policy.name] = time.perf_counter() - started
        reports.append(report(result))
        if progress:
            progress(f"{policy.name}: {result.cycles} cycles simulated in "
                     f"{seconds[policy.name]:.1f} s")
    by_name = {r.policy: r for r in reports}
    drf, bf = by_name[DRF.name], by_name[DRF_BACKFILL.name]
    checks = {
        "backfill_raises_utilisation": _util(bf) > _util(drf),
        "backfill_cuts_the_longest_wide_wait": (
            bf.wide_longest_wait_seconds is not None and drf.wide_longest_wait_seconds is not None
            and bf.wide_longest_wait_seconds < drf.wide_longest_wait_seconds),
    }
    return {
        "workload": workload.description,
        "requests": len(workload.requests),
        "cycle_seconds": cycle_seconds,
        "policies": [r.to_dict() for r in reports],
        "simulated_in_seconds": seconds,
        "checks": checks,
        "policy_descriptions": {p.name: p.describe() for p in POLICIES},
        "table": _table(workload.description, reports, checks),
    }


def _util(r: Report) -> float:
    """The utilisation figure the checks compare: GPU when the pool has GPUs."""
    return r.utilisation.get("gpu", r.utilisation.get("cpu", 0.0))


def _table(description: str, reports: list[Report], checks: dict[str, bool]) -> str:
    widths = sorted({w for r in reports for w in r.by_width})
    lines = [description, ""]
    head = (f"{'policy':<20}{'gpu util':>9}{'cpu util':>9}{'wait p50 h':>11}{'p99 h':>8}"
            f"{'jain':>7}{'wide max h':>11}")
    lines += [head, "-" * len(head)]
    for r in reports:
        lines.append(
            f"{r.policy:<20}{r.utilisation.get('gpu', 0):>9.3f}{r.utilisation.get('cpu', 0):>9.3f}"
            f"{_hours(r.waits.p50_seconds):>11}{_hours(r.waits.p99_seconds):>8}"
            f"{(r.jain_share_over_weight or 0):>7.3f}{_hours(r.wide_longest_wait_seconds):>11}")
    lines += ["", "wait by request width, hours (p50 / p99 / max)"]
    lines.append(f"{'policy':<20}" + "".join(f"{w:>22}" for w in widths))
    for r in reports:
        cells = []
        for w in widths:
            x = r.by_width.get(w)
            cells.append("-" if x is None else
                         f"{_hours(x.p50_seconds)} / {_hours(x.p99_seconds)} / "
                         f"{_hours(x.max_seconds)}")
        lines.append(f"{r.policy:<20}" + "".join(f"{c:>22}" for c in cells))
    tenants = sorted({t for r in reports for t in r.by_tenant})
    lines += ["", "wait by tenant, hours (p50 / p99)"]
    lines.append(f"{'tenant':<14}" + "".join(f"{r.policy:>20}" for r in reports))
    for t in tenants:
        cells = []
        for r in reports:
            x = r.by_tenant.get(t)
            cells.append("-" if x is None else
                         f"{_hours(x.p50_seconds)} / {_hours(x.p99_seconds)}")
        lines.append(f"{t:<14}" + "".join(f"{c:>20}" for c in cells))
    lines.append("")
    lines += [f"{name.replace('_', ' ')}: {'yes' if ok else 'NO'}" for name, ok in checks.items()]
    return "\n".join(lines)
