"""The fair-share audit: replays a pool's placements from the log and checks that each one made
while two tenants both waited went to the one further below its weighted dominant share.

It judges the scheduler's decisions, not a sampled count of running cores, so neither a fast
machine nor a slow one can fool it: `check_fair_share` folds plain records (a pure function,
testable alone), `records_from_log` reads them from the JetStream log.
"""

from __future__ import annotations

import json
from collections import defaultdict, deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from domain.policy.fairness import weighted_dominant_share
from domain.resources import ZERO, Resources

# a placement's competitor must have waited since before the scheduler's view could have
# missed it: requests and releases newer than this (by their own clocks) are given the
# benefit of the doubt, so a scheduler that lags the log is never called unfair for it
DEFAULT_LAG_SECONDS = 1.0
EPSILON = 1e-9


@dataclass(frozen=True)
class Requested:
    """A lease entered the pool's queue (first request, or requeued)."""

    lease_id: str
    tenant: str
    shape_key: str  # equal keys: the same requested shape, so one fits wherever the other does
    at: float


@dataclass(frozen=True)
class Placed:
    lease_id: str
    resources: Resources
    at: float


@dataclass(frozen=True)
class Freed:
    lease_id: str
    at: float


@dataclass(frozen=True)
class Left:
    """A waiting lease left the queue without a placement (rejected, cancelled, expired)."""

    lease_id: str


@dataclass(frozen=True)
class NodeChanged:
    """A node of the pool registered (its allocatable) or changed state: only ready nodes count
    in the shares' denominator, as the scheduler counts them."""

    node: str
    allocatable: Resources | None  # None: unchanged
    ready: bool


Record = Requested | Placed | Freed | Left | NodeChanged


@dataclass
class FairShareReport:
    """Placements made under contention, and those that went to the wrong tenant."""

    tenants: tuple[str, ...]
    weights: dict[str, float]
    contended: int = 0  # placements checked: another of `tenants` waited with the same shape
    by_tenant: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    # running usage (the dominant resource's share) at each contended placement, summed
    share_sums: dict[str, float] = field(default_factory=dict)

    def ok(self, *, minimum: int, tolerance: float = 0.05) -> bool:
        """Enough contended placements to judge, and (nearly) all of them fair."""
        return (self.contended >= minimum
                and len(self.violations) <= tolerance * self.contended)

    def mean_share(self, tenant: str) -> float:
        return self.share_sums.get(tenant, 0.0) / max(1, self.contended)

    def describe(self) -> str:
        counts = ", ".join(f"{t} {self.by_tenant.get(t, 0)}" for t in self.tenants)
        return (f"{self.contended - len(self.violations)} of {self.contended} contended "
                f"placements went to the tenant furthest below its weighted share ({counts})")


def check_fair_share(records: Iterable[Record], weights: Mapping[str, float],
                     totals: Resources = ZERO, *, tenants: tuple[str, ...] | None = None,
                     lag_seconds: float = DEFAULT_LAG_SECONDS) -> FairShareReport:
    """Fold `records` (one pool's, in log order). For each placement of one of `tenants` made
    while another of them had a request of the same shape waiting since at least `lag_seconds`
    before it, the placed tenant's weighted dominant share must not exceed the other's.

    Lenient where the scheduler's view may lag the log: the placed tenant's share is taken as
    low as it could have been (every release before the placement counted), the waiting
    one's as high as it could have been (its releases in the last `lag_seconds` not counted).
    """
    names = tuple(tenants if tenants is not None else weights)
    report = FairShareReport(names, dict(weights))
    owner: dict[str, str] = {}
    shape_of: dict[str, str] = {}
    waiting: dict[str, dict[str, tuple[str, float]]] = defaultdict(dict)  # tenant → lease → …
    usage: dict[str, Resources] = defaultdict(lambda: ZERO)
    held: dict[str, Resources] = {}
    recent: dict[str, deque[tuple[float, Resources]]] = defaultdict(deque)
    nodes: dict[str, tuple[Resources, bool]] = {}
    denominator = [totals]

    def share(tenant: str, amount: Resources) -> float:
        return weighted_dominant_share(amount, denominator[0], weights.get(tenant, 1.0))

    for rec in records:
        if isinstance(rec, NodeChanged):
            alloc = rec.allocatable or nodes.get(rec.node, (ZERO, False))[0]
            nodes[rec.node] = (alloc, rec.ready)
            denominator[0] = sum((a for a, ready in nodes.values() if ready), totals)
        elif isinstance(rec, Requested):
            owner[rec.lease_id] = rec.tenant
            shape_of[rec.lease_id] = rec.shape_key
            waiting[rec.tenant][rec.lease_id] = (rec.shape_key, rec.at)
        elif isinstance(rec, Left):
            tenant = owner.get(rec.lease_id)
            if tenant is not None:
                waiting[tenant].pop(rec.lease_id, None)
        elif isinstance(rec, Freed):
            tenant = owner.get(rec.lease_id)
            amount = held.pop(rec.lease_id, None)
            if tenant is not None and amount is not None:
                usage[tenant] = usage[tenant] - amount
                recent[tenant].append((rec.at, amount))
        elif isinstance(rec, Placed):
            tenant = owner.get(rec.lease_id)
            if tenant is None:
                continue  # requested in another pool, or before the log's window
            waiting[tenant].pop(rec.lease_id, None)
            if tenant in names:
                _judge(report, tenant, rec, shape_of.get(rec.lease_id, ""), names, waiting,
                       usage, recent, share, lag_seconds)
            usage[tenant] = usage[tenant] + rec.resources
            held[rec.lease_id] = rec.resources
    return report


def _judge(report: FairShareReport, tenant: str, rec: Placed, shape_key: str,
           names: tuple[str, ...], waiting: Mapping[str, Mapping[str, tuple[str, float]]],
           usage: Mapping[str, Resources], recent: Mapping[str, deque[tuple[float, Resources]]],
           share: Any, lag_seconds: float) -> None:
    since = rec.at - lag_seconds
    rivals = [u for u in names if u != tenant and any(
        key == shape_key and at <= since for key, at in waiting[u].values())]
    if not rivals:
        return
    report.contended += 1
    report.by_tenant[tenant] = report.by_tenant.get(tenant, 0) + 1
    for t in names:
        report.share_sums[t] = report.share_sums.get(t, 0.0) + share(t, usage[t])
    mine = share(tenant, usage[tenant])
    for u in rivals:
        q = recent[u]
        while q and q[0][0] < since:
            q.popleft()
        most = sum((amount for _, amount in q), usage[u])
        if mine > share(u, most) + EPSILON:
            report.violations.append(
                f"{rec.lease_id} placed for {tenant} at {rec.at:.3f} (weighted share "
                f"{mine:.4f}) while {u} waited at {share(u, most):.4f}")
            return


# -- from the log ----------------------------------------------------------------------------

_ENDS_WAITING = frozenset({"LeaseRejected", "LeaseCancelled", "LeaseExpired",
                           "ReservationVoided"})


_NODE_READY = {"NodeUncordoned": True, "MaintenanceEnded": True, "NodeReregistered": True,
               "NodeCordoned": False, "DrainStarted": False, "MaintenanceStarted": False,
               "NodeLost": False}


def records_from_log(app: Any, pool_id: str, *, page: int = 5000) -> list[Record]:
    """The pool's queue entries, placements, releases and node changes from `app`'s whole log,
    in order."""
    records: list[Record] = []
    pool_nodes: set[str] = set()
    in_pool: dict[str, dict[str, Any]] = {}  # lease → its requested shape
    for n in _notifications(app, page):
        name = n.topic.rsplit(".", 1)[-1]
        if name == "LeaseRequested":
            st = json.loads(n.state)
            if st.get("pool_id") != pool_id:
                continue
            lid = str(n.originator_id)
            in_pool[lid] = st["shape"]
            records.append(Requested(lid, str(st["tenant_id"]), _key(st["shape"]),
                                     float(st.get("requested_at") or 0.0)))
        elif name == "LeaseRequeued" and str(n.originator_id) in in_pool:
            st = json.loads(n.state)
            lid = str(n.originator_id)
            records.append(Requested(lid, "", _key(in_pool[lid]), float(st.get("at") or 0.0)))
        elif name == "LeaseReserved" and str(n.originator_id) in in_pool:
            st = json.loads(n.state)
            lid = str(n.originator_id)
            shape = st.get("shape") or in_pool[lid]
            records.append(Placed(lid, Resources.from_dict(shape["resources"]),
                                  float(st["at"])))
        elif name == "CapacityFreed":
            st = json.loads(n.state)
            if str(st["lease_id"]) in in_pool:
                records.append(Freed(str(st["lease_id"]), float(st["at"])))
        elif name in _ENDS_WAITING and str(n.originator_id) in in_pool:
            records.append(Left(str(n.originator_id)))
        elif name == "NodeRegistered":
            st = json.loads(n.state)
            if st.get("pool_id") == pool_id:
                pool_nodes.add(str(n.originator_id))
                records.append(NodeChanged(str(n.originator_id), Resources.from_dict(
                    st["capabilities"]["allocatable"]), True))
        elif name in _NODE_READY and str(n.originator_id) in pool_nodes:
            st = json.loads(n.state)
            caps = st.get("capabilities")
            records.append(NodeChanged(str(n.originator_id), Resources.from_dict(
                caps["allocatable"]) if caps else None, _NODE_READY[name]))
    return _requeues_named(records)


def _requeues_named(records: list[Record]) -> list[Record]:
    """A requeue record knows its lease, not its tenant: take it from the first request."""
    tenant_of: dict[str, str] = {}
    out: list[Record] = []
    for r in records:
        if isinstance(r, Requested):
            if r.tenant:
                tenant_of[r.lease_id] = r.tenant
            else:
                r = Requested(r.lease_id, tenant_of.get(r.lease_id, ""), r.shape_key, r.at)
        out.append(r)
    return out


def _key(shape: Mapping[str, Any]) -> str:
    return json.dumps(shape, sort_keys=True)


def _notifications(app: Any, page: int) -> Iterator[Any]:
    start = 1
    while True:
        batch = app.recorder.select_notifications(start, page)
        if not batch:
            return
        yield from batch
        start = batch[-1].id + 1
