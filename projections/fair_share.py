"""The fair-share audit: replays a pool's placements from the log and checks that each one made
while two tenants both waited went to the one further below its weighted dominant share.

It judges the scheduler's decisions, not a sampled count of running cores, so neither a fast
machine nor a slow one can fool it: `check_fair_share` folds plain records (a pure function,
testable alone), `records_from_log` reads them from the JetStream log.
"""

from __future__ import annotations

import json
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from domain.policy.fairness import weighted_dominant_share
from domain.resources import ZERO, Resources
from projections.replay import notifications

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
    priority_class: str = ""  # only requests of one class compete by share


@dataclass(frozen=True)
class Placed:
    lease_id: str
    resources: Resources
    at: float
    seq: int = 0  # the event's position in the log (0: not from a log)


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


@dataclass(frozen=True)
class Weighted:
    """A tenant's weight in the pool was set (any scale: only ratios count)."""

    tenant: str
    weight: float


@dataclass(frozen=True)
class Funds:
    """A tenant's available credits (granted less held less spent) changed."""

    tenant: str
    available: int
    at: float
    seq: int = 0


@dataclass(frozen=True)
class Configured:
    """The pool's priority classes (name → rank) and aging were set (created or configured)."""

    ranks: dict[str, int]
    aging_seconds_per_rank: float


Record = Requested | Placed | Freed | Left | NodeChanged | Weighted | Funds | Configured


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


def check_fair_share(records: Iterable[Record], weights: Mapping[str, float] | None = None,
                     totals: Resources = ZERO, *, tenants: tuple[str, ...] | None = None,
                     lag_seconds: float = DEFAULT_LAG_SECONDS,
                     ran: set[str] | None = None,
                     holds: Mapping[str, int] | None = None,
                     seqs: range | None = None) -> FairShareReport:
    """Fold `records` (one pool's, in log order). For each placement of one of `tenants` made
    while another of them had a request of the same shape waiting since at least `lag_seconds`
    before it, the placed tenant's weighted dominant share must not exceed the other's.

    Lenient where the scheduler's view may lag the log: the placed tenant's share is taken as
    low as it could have been (every release before the placement counted), the waiting
    one's as high as it could have been (its releases in the last `lag_seconds` not counted).

    `weights` as given, else from the records' `Weighted` entries (then `tenants`, if None, is
    every tenant weighted or requesting). `ran`: only waiting requests in it compete (the
    leases that were placed at some time). `holds`: each lease's credit hold when placed; with
    `Funds` records, a waiting request competes only while its tenant had that much available
    all through the last `lag_seconds` (a tenant waiting for credits is not passed over).
    `seqs`: judge only the placements at these events of the log.
    """
    records = list(records)
    weights = dict(weights) if weights is not None else {
        r.tenant: r.weight for r in records if isinstance(r, Weighted)}
    names = tuple(tenants if tenants is not None else sorted(
        set(weights) | {r.tenant for r in records if isinstance(r, Requested)}))
    report = FairShareReport(names, weights)
    owner: dict[str, str] = {}
    shape_of: dict[str, str] = {}
    waiting: dict[str, dict[str, tuple[str, float]]] = defaultdict(dict)  # tenant → lease → …
    usage: dict[str, Resources] = defaultdict(lambda: ZERO)
    held: dict[str, Resources] = {}
    recent: dict[str, deque[tuple[float, Resources]]] = defaultdict(deque)
    nodes: dict[str, tuple[Resources, bool]] = {}
    denominator = [totals]
    funds: dict[str, deque[tuple[float, int]]] = {}  # tenant → (since, available), recent

    def share(tenant: str, amount: Resources) -> float:
        return weighted_dominant_share(amount, denominator[0], weights.get(tenant, 1.0))

    for rec in records:
        if isinstance(rec, Funds):
            funds.setdefault(rec.tenant, deque()).append((rec.at, rec.available))
        elif isinstance(rec, Weighted):
            weights[rec.tenant] = rec.weight
        elif isinstance(rec, NodeChanged):
            alloc = rec.allocatable or nodes.get(rec.node, (ZERO, False))[0]
            nodes[rec.node] = (alloc, rec.ready)
            denominator[0] = sum((a for a, ready in nodes.values() if ready), totals)
        elif isinstance(rec, Requested):
            owner[rec.lease_id] = rec.tenant
            shape_of[rec.lease_id] = key = f"{rec.priority_class}/{rec.shape_key}"
            if ran is None or rec.lease_id in ran:
                waiting[rec.tenant][rec.lease_id] = (key, rec.at)
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
            if tenant in names and (seqs is None or rec.seq in seqs):
                _judge(report, tenant, rec, shape_of.get(rec.lease_id, ""), names, waiting,
                       usage, recent, share, lag_seconds, funds, holds or {})
            usage[tenant] = usage[tenant] + rec.resources
            held[rec.lease_id] = rec.resources
    return report


def _judge(report: FairShareReport, tenant: str, rec: Placed, shape_key: str,
           names: tuple[str, ...], waiting: Mapping[str, Mapping[str, tuple[str, float]]],
           usage: Mapping[str, Resources], recent: Mapping[str, deque[tuple[float, Resources]]],
           share: Any, lag_seconds: float, funds: Mapping[str, deque[tuple[float, int]]],
           holds: Mapping[str, int]) -> None:
    since = rec.at - lag_seconds

    def afforded(tenant: str, lease_id: str) -> bool:
        """The tenant could pay the lease's hold all through the window (no credit record:
        an unpriced pool, or a tenant never funded: nothing to pay)."""
        q = funds.get(tenant)
        if not q:
            return True
        while len(q) > 1 and q[1][0] <= since:
            q.popleft()  # the value in force at `since` stays first
        return min(a for _, a in q) >= holds.get(lease_id, 0)

    rivals = [u for u in names if u != tenant and any(
        key == shape_key and at <= since and afforded(u, lid)
        for lid, (key, at) in waiting[u].items())]
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


@dataclass
class PoolRecords:
    """One pool's records from the log, and what the audit needs to know besides."""

    records: list[Record] = field(default_factory=list)
    ran: set[str] = field(default_factory=set)  # leases placed at some time
    holds: dict[str, int] = field(default_factory=dict)  # lease → its credit hold when placed
    quotas: bool = False  # a tenant has a quota, borrow limit or cohort: quotas decide there
    # gang members and leases bound to an advance reservation: their waits are their own
    exempt: set[str] = field(default_factory=set)


def records_by_pool(app: Any, *, page: int = 5000) -> dict[str, PoolRecords]:
    """Every pool's queue entries, placements, releases, node changes and tenant weights from
    `app`'s whole log, in order, in one pass."""
    pools: dict[str, PoolRecords] = defaultdict(PoolRecords)
    lease_pool: dict[str, str] = {}
    requested: dict[str, Requested] = {}
    held: set[str] = set()  # held leases (dependencies, a retry's backoff): not waiting
    node_pool: dict[str, str] = {}
    policy_of: dict[str, tuple[str, str]] = {}  # tenant policy → (pool, tenant)
    accounts: dict[str, _Account] = {}
    pool_of: dict[str, str] = {}  # pool aggregate → its name
    for n in notifications(app, page=page):
        name = n.topic.rsplit(".", 1)[-1]
        oid = str(n.originator_id)
        if name == "LeaseRequested":
            st = json.loads(n.state)
            pool = lease_pool[oid] = str(st["pool_id"])
            klass = str(st.get("priority_class") or "")
            flow = st.get("workflow") or {}
            if flow.get("array_id") and flow.get("max_running"):
                # its waits are its array's throttle's, not fair share's: a class of its own
                # array, so it is never another tenant's rival nor judged against one
                klass = f"{klass}@array:{flow['array_id']}"
            req = requested[oid] = Requested(
                oid, str(st["tenant_id"]), _key(st["shape"]),
                float(st.get("requested_at") or 0.0), klass)
            if st.get("gang") or st.get("advance_reservation_id"):
                pools[pool].exempt.add(oid)
            if flow.get("after"):
                held.add(oid)  # waits for other leases: in the queue from its LeaseQueued
            else:
                pools[pool].records.append(req)
        elif (name == "LeaseRequeued" or (name == "LeaseQueued" and oid in held)
              or name == "LeaseRetried") and oid in lease_pool:
            st = json.loads(n.state)
            held.discard(oid)
            if name == "LeaseRetried" and st.get("held_until") is not None:
                held.add(oid)  # back in the queue when its backoff ends (a LeaseQueued)
                continue
            first = requested[oid]
            pools[lease_pool[oid]].records.append(Requested(
                oid, first.tenant, first.shape_key, float(st.get("at") or 0),
                first.priority_class))
        elif name == "LeaseReserved" and oid in lease_pool:
            st = json.loads(n.state)
            shape = st.get("shape") or json.loads(requested[oid].shape_key)
            into = pools[lease_pool[oid]]
            into.records.append(Placed(oid, Resources.from_dict(shape["resources"]),
                                       float(st["at"]), n.id))
            into.ran.add(oid)
            into.holds.setdefault(oid, int(st.get("hold_microcredits") or 0))
        elif name == "CapacityFreed":
            st = json.loads(n.state)
            lid = str(st["lease_id"])
            if lid in lease_pool:
                pools[lease_pool[lid]].records.append(Freed(lid, float(st["at"])))
        elif name in _ENDS_WAITING and oid in lease_pool:
            pools[lease_pool[oid]].records.append(Left(oid))
        elif name == "NodeRegistered":
            st = json.loads(n.state)
            pool = node_pool[oid] = str(st["pool_id"])
            pools[pool].records.append(NodeChanged(
                oid, Resources.from_dict(st["capabilities"]["allocatable"]), True))
        elif name in _NODE_READY and oid in node_pool:
            caps = json.loads(n.state).get("capabilities")
            pools[node_pool[oid]].records.append(NodeChanged(oid, Resources.from_dict(
                caps["allocatable"]) if caps else None, _NODE_READY[name]))
        elif name in ("TenantPolicySet", "TenantPolicyUpdated"):
            st = json.loads(n.state)
            if name == "TenantPolicySet":
                policy_of[oid] = (str(st["pool_id"]), str(st["tenant_id"]))
            if oid not in policy_of:
                continue
            pool, tenant = policy_of[oid]
            pools[pool].records.append(Weighted(tenant, float(st.get("weight") or 1)))
            if st.get("quota") or st.get("borrow_limit") or st.get("cohort"):
                pools[pool].quotas = True
        elif name in ("PoolCreated", "PoolConfigured"):
            st = json.loads(n.state)
            if name == "PoolCreated":
                pool_of[oid] = str(st["pool_id"])
            if oid in pool_of:
                config = st.get("config") or {}
                pools[pool_of[oid]].records.append(Configured(
                    {str(k): int(v) for k, v in dict(config.get("priority_classes") or {}).items()},
                    float(config.get("aging_seconds_per_rank") or 0)))
        elif name in _CREDIT_EVENTS:
            st = json.loads(n.state)
            if name == "AccountOpened":
                accounts[oid] = _Account(str(st["tenant_id"]))
            acc = accounts.get(oid)
            if acc is None:
                continue
            acc.apply(name, st)
            for into in pools.values():
                into.records.append(Funds(acc.tenant, acc.available, float(
                    st.get("at") or st.get("opened_at") or 0.0), n.id))
    return dict(pools)


_CREDIT_EVENTS = frozenset({"AccountOpened", "CreditsGranted", "CreditsHeld", "CreditsHeldBatch",
                            "CreditsSettled", "HoldReleased"})


@dataclass
class _Account:
    """A tenant's available credits, folded as domain.account folds them."""

    tenant: str
    granted: int = 0
    spent: int = 0
    holds: dict[str, int] = field(default_factory=dict)

    @property
    def available(self) -> int:
        return self.granted - self.spent - sum(self.holds.values())

    def apply(self, name: str, st: Mapping[str, Any]) -> None:
        if name == "CreditsGranted":
            self.granted += int(st["amount"])
        elif name == "CreditsHeld":
            self.holds[str(st["lease_id"])] = (self.holds.get(str(st["lease_id"]), 0)
                                               + int(st["amount"]))
        elif name == "CreditsHeldBatch":
            for _transfer, lease, amount in st["holds"]:
                self.holds[str(lease)] = self.holds.get(str(lease), 0) + int(amount)
        elif name == "CreditsSettled":
            self.holds.pop(str(st["lease_id"]), None)
            self.spent += int(st["charged"])
        elif name == "HoldReleased":
            self.holds.pop(str(st["lease_id"]), None)


def records_from_log(app: Any, pool_id: str, *, page: int = 5000) -> list[Record]:
    """One pool's records (`records_by_pool`), without its weights: the caller gives them."""
    found = records_by_pool(app, page=page).get(pool_id)
    return [r for r in found.records if not isinstance(r, Weighted)] if found else []


def _key(shape: Mapping[str, Any]) -> str:
    return json.dumps(shape, sort_keys=True)
