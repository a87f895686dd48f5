"""What a simulation delivered: utilisation, waits by tenant and width, fairness (Jain's index
of delivered share over weight), and the longest wait of a wide request.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from domain.policy.fairness import dominant_share
from sim.engine import SimResult


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def jain(values: Iterable[float]) -> float | None:
    """Jain's fairness index (Σx)² / (n·Σx²): 1 when all equal, 1/n when one has it all."""
    xs = list(values)
    if not xs:
        return None
    sq = sum(x * x for x in xs)
    if sq == 0:
        return 1.0
    return sum(xs) ** 2 / (len(xs) * sq)


@dataclass
class Waits:
    count: int = 0
    p50_seconds: float | None = None
    p99_seconds: float | None = None
    max_seconds: float | None = None
    never_started: int = 0

    @classmethod
    def of(cls, waits: Sequence[float], never_started: int = 0) -> Waits:
        return cls(len(waits), percentile(waits, 50), percentile(waits, 99),
                   max(waits) if waits else None, never_started)


@dataclass
class Report:
    """The figures of one policy's run over one workload."""

    policy: str
    requests: int
    utilisation: dict[str, float]  # dimension → delivered / (capacity × horizon)
    waits: Waits
    by_tenant: dict[str, Waits] = field(default_factory=dict)
    by_width: dict[str, Waits] = field(default_factory=dict)
    jain_share_over_weight: float | None = None
    wide_longest_wait_seconds: float | None = None
    cycles: int = 0
    reservations_made: int = 0
    held_back: int = 0

    def to_dict(self) -> dict[str, Any]:
        def w(x: Waits) -> dict[str, Any]:
            return {"count": x.count, "p50_seconds": x.p50_seconds, "p99_seconds": x.p99_seconds,
                    "max_seconds": x.max_seconds, "never_started": x.never_started}
        return {
            "policy": self.policy, "requests": self.requests,
            "utilisation": dict(self.utilisation), "waits": w(self.waits),
            "by_tenant": {k: w(v) for k, v in self.by_tenant.items()},
            "by_width": {k: w(v) for k, v in self.by_width.items()},
            "jain_share_over_weight": self.jain_share_over_weight,
            "wide_longest_wait_seconds": self.wide_longest_wait_seconds,
            "cycles": self.cycles, "reservations_made": self.reservations_made,
            "held_back": self.held_back,
        }


def report(result: SimResult) -> Report:
    """Measure a run. Utilisation counts what ran within the arrival horizon; waits count
    every request (the run goes on until the queue is empty)."""
    wl = result.workload
    horizon = wl.horizon
    totals = result.totals
    used = {"gpu": 0.0, "cpu": 0.0}
    delivered: dict[str, float] = {t.name: 0.0 for t in wl.tenants}
    waits: list[float] = []
    tenant_waits: dict[str, list[float]] = {t.name: [] for t in wl.tenants}
    width_waits: dict[str, list[float]] = {}
    missing_t: dict[str, int] = {}
    missing_w: dict[str, int] = {}
    missing = 0
    wide_longest: float | None = None
    for out in result.outcomes:
        req = out.request
        width_waits.setdefault(req.width, [])
        wait = out.wait_seconds
        if wait is None:
            missing += 1
            missing_t[req.tenant] = missing_t.get(req.tenant, 0) + 1
            missing_w[req.width] = missing_w.get(req.width, 0) + 1
            continue
        waits.append(wait)
        tenant_waits.setdefault(req.tenant, []).append(wait)
        width_waits[req.width].append(wait)
        if req.wide:
            wide_longest = wait if wide_longest is None else max(wide_longest, wait)
        assert out.started_at is not None
        end = out.ended_at if out.ended_at is not None else out.started_at + req.runtime_seconds
        inside = max(0.0, min(end, horizon) - min(out.started_at, horizon))
        res = req.shape.resources
        used["gpu"] += res.gpu_count * inside
        used["cpu"] += res.cpu_millis * inside
        delivered[req.tenant] = delivered.get(req.tenant, 0.0) + dominant_share(
            res, totals) * inside
    util = {}
    if horizon > 0:
        if totals.gpu_count:
            util["gpu"] = used["gpu"] / (totals.gpu_count * horizon)
        if totals.cpu_millis:
            util["cpu"] = used["cpu"] / (totals.cpu_millis * horizon)
    weights = {t.name: t.weight for t in wl.tenants}
    total_delivered = sum(delivered.values()) or 1.0
    fairness = jain(delivered[t] / total_delivered / weights.get(t, 1.0) for t in delivered)
    return Report(
        policy=result.policy.name, requests=len(result.outcomes), utilisation=util,
        waits=Waits.of(waits, missing),
        by_tenant={t: Waits.of(v, missing_t.get(t, 0)) for t, v in sorted(tenant_waits.items())},
        by_width={w: Waits.of(v, missing_w.get(w, 0)) for w, v in sorted(width_waits.items())},
        jain_share_over_weight=fairness, wide_longest_wait_seconds=wide_longest,
        cycles=result.cycles, reservations_made=result.reservations_made,
        held_back=result.held_back)
