"""`pool whatif`: a window of a pool's real requests replayed through the simulator under
another policy, set beside what the log says really happened to each of them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from bench.policy import NothingToReplay, PoolLog, pool_from_log
from sim import (
    DRF,
    DRF_BACKFILL,
    DRF_DECAY,
    DRF_DECAY_BACKFILL,
    FIFO,
    Policy,
    Report,
    Simulator,
    Tenant,
    Workload,
    from_leases,
    report,
)
from sim.engine import Outcome, SimResult

NAMED: dict[str, Policy] = {p.name: p for p in (FIFO, DRF, DRF_DECAY, DRF_BACKFILL,
                                                 DRF_DECAY_BACKFILL)}
# what the replay leaves out: said by `pool whatif --help`, its output and docs/audit.md
NOT_MODELLED: tuple[str, ...] = (
    "quotas, cohorts and borrowing (no tenant is held back by a quota)",
    "credits (every request can pay its hold)",
    "gangs (each member replays as a lone request)",
    "preemption and requeues (a lease is placed once and runs its observed runtime)",
    ("the time from placement to the job's start (a lease holds its node for its observed "
    "runtime from its placement)"),
    ("cancellations and queue timeouts (a request that left the queue unplaced replays as if "
    "it had stayed, running its maximum runtime)"),
    ("advance reservations, node drains and failures (the pool's nodes as the log last "
    "knows them, all ready)"),
    "leases requested before the window (the replay starts with an empty pool)",
)
MOST_MOVED = 10


class BadPolicy(ValueError):
    """A policy SPEC or weight override that names nothing the simulator has."""

    code = "bad_policy"


def parse_policy(spec: str) -> Policy:
    """`fifo` or `drf`, then any of `+backfill` and `+decay` (a week's half-life of past
    usage, as the pool setting fair_share_half_life_seconds counts it; drf only)."""
    words = [w.strip().lower() for w in spec.split("+")]
    base, extras = words[0], set(words[1:])
    if base not in ("fifo", "drf") or not extras <= {"backfill", "decay"} \
            or len(extras) != len(words) - 1:
        raise BadPolicy(f"{spec!r} is not a policy: one of {', '.join(NAMED)}")
    if base == "fifo" and "decay" in extras:
        raise BadPolicy(f"{spec!r}: decay weighs fair shares, which fifo has none of")
    name = base + "".join(f"+{x}" for x in ("decay", "backfill") if x in extras)
    return NAMED.get(name) or Policy(name, order="fifo", backfill="backfill" in extras)


def with_weights(workload: Workload, weights: dict[str, float]) -> Workload:
    """The workload with some tenants' weights replaced (each must have a request in it)."""
    names = {t.name for t in workload.tenants}
    unknown = sorted(set(weights) - names)
    if unknown:
        raise BadPolicy(f"no request of tenant {unknown[0]!r} in the window (tenants: "
                        f"{', '.join(sorted(names)) or 'none'})")
    return replace(workload, tenants=tuple(
        Tenant(t.name, t.cohort, weights.get(t.name, t.weight)) for t in workload.tenants))


@dataclass(frozen=True)
class LeaseMove:
    """One lease of the window: when it was requested, and when it started (was first
    placed) in the log and in the replay (None: it never was)."""

    lease_id: str
    tenant: str
    requested_at: float
    real_start_at: float | None
    whatif_start_at: float | None

    @property
    def real_wait_seconds(self) -> float | None:
        return None if self.real_start_at is None else self.real_start_at - self.requested_at

    @property
    def whatif_wait_seconds(self) -> float | None:
        return (None if self.whatif_start_at is None
                else self.whatif_start_at - self.requested_at)

    @property
    def moved_seconds(self) -> float | None:
        if self.real_start_at is None or self.whatif_start_at is None:
            return None
        return self.whatif_start_at - self.real_start_at

    def to_dict(self) -> dict[str, Any]:
        return {"lease_id": self.lease_id, "tenant": self.tenant,
                "requested_at": self.requested_at, "real_start_at": self.real_start_at,
                "real_wait_seconds": self.real_wait_seconds,
                "whatif_start_at": self.whatif_start_at,
                "whatif_wait_seconds": self.whatif_wait_seconds,
                "moved_seconds": self.moved_seconds}


@dataclass
class WhatIf:
    """The replay beside the log: the same figures for both, and every lease's move."""

    pool_id: str
    policy: Policy
    weights: dict[str, float]
    window: tuple[float | None, float | None]
    description: str
    real: Report
    whatif: Report
    leases: list[LeaseMove]

    def most_moved(self, n: int = MOST_MOVED) -> list[LeaseMove]:
        moved = [m for m in self.leases if m.moved_seconds is not None and m.moved_seconds]
        return sorted(moved, key=lambda m: (-abs(m.moved_seconds or 0.0), m.lease_id))[:n]

    def to_dict(self) -> dict[str, Any]:
        return {
            "pool": self.pool_id, "policy": self.policy.name,
            "policy_description": self.policy.describe(), "weights": dict(self.weights),
            "from": self.window[0], "to": self.window[1], "workload": self.description,
            "requests": len(self.leases), "not_modelled": list(NOT_MODELLED),
            "real": self.real.to_dict(), "whatif": self.whatif.to_dict(),
            "most_moved": [m.to_dict() for m in self.most_moved()],
            "leases": [m.to_dict() for m in self.leases],
        }

    def table(self) -> str:
        r, w = self.real, self.whatif
        over = (", weights " + ", ".join(f"{k}={v:g}" for k, v in sorted(self.weights.items()))
                if self.weights else "")
        lines = [self.description,
                 f"what if: {self.policy.name} ({self.policy.describe()}){over}",
                 f"not modelled: {'; '.join(NOT_MODELLED)}", ""]
        head = f"{'':<22}{'real':>22}{'what if':>22}"
        lines += [head, "-" * len(head)]
        for dim in sorted(set(r.utilisation) | set(w.utilisation)):
            lines.append(f"{dim + ' utilisation':<22}{_ratio(r.utilisation.get(dim)):>22}"
                         f"{_ratio(w.utilisation.get(dim)):>22}")
        lines.append(f"{'wait p50 / p99':<22}{_pair(r.waits.p50_seconds, r.waits.p99_seconds):>22}"
                     f"{_pair(w.waits.p50_seconds, w.waits.p99_seconds):>22}")
        lines.append(f"{'never started':<22}{r.waits.never_started:>22}"
                     f"{w.waits.never_started:>22}")
        for tenant in sorted(set(r.by_tenant) | set(w.by_tenant)):
            a, b = r.by_tenant.get(tenant), w.by_tenant.get(tenant)
            lines.append(f"{tenant[:21]:<22}"
                         f"{_pair(a.p50_seconds, a.p99_seconds) if a else '-':>22}"
                         f"{_pair(b.p50_seconds, b.p99_seconds) if b else '-':>22}")
        moved = self.most_moved()
        lines += ["", "leases whose start moved most" if moved
                  else "no lease started at another time"]
        if moved:
            lines.append(f"{'lease':<38}{'tenant':<14}{'real wait':>11}{'what-if wait':>14}"
                         f"{'moved':>10}")
            for m in moved:
                lines.append(f"{m.lease_id:<38}{m.tenant[:13]:<14}"
                             f"{duration(m.real_wait_seconds):>11}"
                             f"{duration(m.whatif_wait_seconds):>14}"
                             f"{_signed(m.moved_seconds):>10}")
        return "\n".join(lines)


def whatif_from_log(app: Any, policy: Policy, *, pool_id: str | None = None,
                    start: float | None = None, end: float | None = None,
                    weights: dict[str, float] | None = None,
                    cycle_seconds: float = 1.0) -> WhatIf:
    """The requests made in [start, end) (default: the whole log) in one pool, replayed
    under `policy` (with `weights` overriding tenants'), beside the log's own outcome."""
    log = pool_from_log(app, pool_id)
    return whatif(log, policy, start=start, end=end, weights=weights,
                  cycle_seconds=cycle_seconds)


def whatif(log: PoolLog, policy: Policy, *, start: float | None = None,
           end: float | None = None, weights: dict[str, float] | None = None,
           cycle_seconds: float = 1.0) -> WhatIf:
    """`whatif_from_log` on a pool already read from the log."""
    picked = [lease for lease in log.leases if lease.requested_at is not None
              and (start is None or lease.requested_at >= start)
              and (end is None or lease.requested_at < end)]
    if not picked:
        raise NothingToReplay(f"pool {log.pool_id!r} has no request in the window")
    t0 = min(float(lease.requested_at or 0.0) for lease in picked)
    workload = from_leases(picked, log.nodes, log.weights)
    workload = with_weights(workload, dict(weights or {}))
    result = Simulator(workload, policy, config=log.config, cycle_seconds=cycle_seconds).run()
    replayed = {o.request.request_id: o for o in result.outcomes}
    by_id = {str(lease.id): lease for lease in picked}
    real_outcomes: list[Outcome] = []
    moves: list[LeaseMove] = []
    for req in workload.requests:
        lease = by_id[req.request_id]
        first = log.first_reserved_at.get(req.request_id)
        ended = lease.ended_at if first is not None else None
        real_outcomes.append(Outcome(
            req, None if first is None else first - t0,
            None if ended is None else ended - t0, lease.node_id))
        sim = replayed.get(req.request_id)
        sim_start = None if sim is None or sim.started_at is None else t0 + sim.started_at
        moves.append(LeaseMove(req.request_id, req.tenant, float(lease.requested_at or 0.0),
                               first, sim_start))
    real = report(SimResult(workload, Policy("real"), real_outcomes, totals=result.totals))
    real.cycles = 0
    return WhatIf(log.pool_id, policy, dict(weights or {}), (start, end),
                  f"pool {log.pool_id}: {workload.description}, {len(log.nodes)} nodes",
                  real, report(result), moves)


def duration(seconds: float | None) -> str:
    """`45s`, `1m10s`, `3h05m`, `2.1d`; `-` for none."""
    if seconds is None:
        return "-"
    s = round(abs(seconds))
    sign = "-" if seconds < 0 else ""
    if s < 60:
        return f"{sign}{s}s"
    if s < 3600:
        return f"{sign}{s // 60}m" + (f"{s % 60:02d}s" if s % 60 else "")
    if s < 86_400:
        return f"{sign}{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{sign}{s / 86_400:.1f}d"


def _signed(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return ("+" if seconds > 0 else "") + duration(seconds)


def _pair(a: float | None, b: float | None) -> str:
    return f"{duration(a)} / {duration(b)}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


__all__ = ["NOT_MODELLED", "BadPolicy", "LeaseMove", "WhatIf", "parse_policy",
           "whatif", "whatif_from_log", "with_weights"]
