"""The log's decisions audited: placements against capacity, devices, quotas, gangs and fair
share, from the log alone; the fault suite, the tests and `pool audit decisions` share them.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from domain.quota import CohortQuota, QuotaBook, TenantQuota, holding_past_limits, limits_from_event
from domain.resources import Resources
from projections.replay import event_name, notifications, state_of


@dataclass
class PlacementReport:
    """What a replay of node capacity found: overcommits and leases held twice at once."""

    placements: int = 0
    device_placements: int = 0  # placements bound to GPU devices
    over_allocations: list[str] = field(default_factory=list)
    double_holds: list[str] = field(default_factory=list)
    # a GPU device held by two leases at once, and devices a lease holds that are not its node's
    device_conflicts: list[str] = field(default_factory=list)
    foreign_devices: list[str] = field(default_factory=list)

    @property
    def double_placements(self) -> int:
        return len(self.over_allocations) + len(self.double_holds) + len(self.device_conflicts)

    @property
    def device_violations(self) -> int:
        return len(self.device_conflicts) + len(self.foreign_devices)


def check_placements(app: Any, seqs: range | None = None) -> PlacementReport:
    """Fold the whole log: at every event, each node's leases must fit in its allocatable, no
    lease may hold capacity on two nodes (or twice on one) at the same time, no GPU device may
    be held by two leases, and every device a lease holds or is reserved must be its node's.
    `seqs`: judge only the placements at these events (the state before them still folded)."""
    report = PlacementReport()
    allocatable: dict[UUID, Resources] = {}
    inventory: dict[str, set[str]] = {}  # node id (the agent's) → its device ids
    node_name: dict[UUID, str] = {}
    held: dict[UUID, dict[str, Resources]] = defaultdict(dict)
    holder: dict[str, UUID] = {}
    device_holder: dict[UUID, dict[str, str]] = defaultdict(dict)  # node → device → lease
    devices_of: dict[str, tuple[str, ...]] = {}
    for n in notifications(app):
        if seqs is not None and n.id >= seqs.stop:
            break
        name = event_name(n.topic)
        judged = seqs is None or n.id in seqs
        if name in ("NodeRegistered", "NodeReregistered"):
            ev = app.mapper.to_domain_event(n)
            caps = ev.capabilities
            allocatable[ev.originator_id] = Resources.from_dict(caps["allocatable"])
            if name == "NodeRegistered":
                node_name[ev.originator_id] = str(ev.node_id)
            if ev.originator_id in node_name:
                inventory[node_name[ev.originator_id]] = {
                    str(d["id"]) for d in caps.get("devices", ())}
        elif name in ("CapacityAllocated", "CapacityAllocatedBatch"):
            ev = app.mapper.to_domain_event(n)
            node = ev.originator_id
            # one lease, or several placed on the node in one scheduler batch: each in turn
            items = ([[ev.lease_id, ev.resources, getattr(ev, "devices", None) or []]]
                     if name == "CapacityAllocated" else ev.allocations)
            for item in items:
                lease = str(item[0])
                report.placements += judged
                if lease in holder and judged:
                    report.double_holds.append(
                        f"lease {lease} allocated on node {node} at {n.id} while held on "
                        f"node {holder[lease]}")
                holder[lease] = node
                held[node][lease] = Resources.from_dict(item[1])
                total = sum(held[node].values(), Resources())
                if judged and (node not in allocatable or not total.fits_in(allocatable[node])):
                    report.over_allocations.append(f"node {node} over-allocated at {n.id}")
                devices = tuple(str(d) for d in (item[2] if len(item) > 2 else None) or ())
                report.device_placements += bool(devices) and judged
                own = inventory.get(node_name.get(node, ""), set())
                for d in devices:
                    other = device_holder[node].get(d)
                    if other is not None and other != lease and judged:
                        report.device_conflicts.append(
                            f"device {d} of node {node} given to lease {lease} at {n.id} while "
                            f"lease {other} holds it")
                    device_holder[node][d] = lease
                    if d not in own and judged:
                        report.foreign_devices.append(
                            f"lease {lease} holds device {d}, not on node {node} (at {n.id})")
                devices_of[lease] = devices
        elif name == "CapacityFreed":
            ev = app.mapper.to_domain_event(n)
            lease = str(ev.lease_id)
            held[ev.originator_id].pop(lease, None)
            for d in devices_of.pop(lease, ()):
                if device_holder[ev.originator_id].get(d) == lease:
                    del device_holder[ev.originator_id][d]
            if holder.get(lease) == ev.originator_id:
                del holder[lease]
        elif name == "LeaseReserved" and judged:
            st = state_of(n)
            own = inventory.get(str(st.get("node_id")), set())
            for d in st.get("devices") or ():
                if d not in own:
                    report.foreign_devices.append(
                        f"lease {n.originator_id} reserved device {d}, not on node "
                        f"{st.get('node_id')} (at {n.id})")
    return report


def count_events(app: Any, names: set[str], key: str | None = None,
                 start: int = 1) -> Counter[Any]:
    """How many events of the given names the log holds, per `key` field (or per originator)."""
    out: Counter[Any] = Counter()
    for n in notifications(app, start):
        name = event_name(n.topic)
        if name not in names:
            continue
        if key is None:
            out[(name, str(n.originator_id))] += 1
        else:
            out[(name, str(state_of(n).get(key)))] += 1
    return out


@dataclass
class QuotaReport:
    """What a replay of quotas found: placements checked, and each one that took a tenant past
    its nominal quota plus what it could borrow (or its cohort past its shared quota)."""

    placements: int = 0
    breaches: list[str] = field(default_factory=list)


def check_quotas(app: Any, seqs: range | None = None) -> QuotaReport:
    """Fold the whole log: at every placement, the tenant it placed must hold no more than its
    nominal quota plus what it could borrow then (its borrow limit, and what its cohort had
    unused), as the quota settings stood at that event. Holding is counted as the nodes count
    it, from allocation until the capacity is freed. A later cut of a quota below what is
    already held is not a breach: only placements are judged (with `seqs`, only those at
    these events)."""
    report = QuotaReport()
    books: dict[str, QuotaBook] = defaultdict(QuotaBook)
    policy_of: dict[UUID, tuple[str, str]] = {}  # tenant policy → (pool, tenant)
    cohort_of: dict[UUID, tuple[str, str]] = {}  # cohort → (pool, name)
    owner: dict[str, tuple[str, str]] = {}  # lease → (pool, tenant)
    usage: dict[str, dict[str, Resources]] = defaultdict(dict)
    held: dict[str, Resources] = {}
    for n in notifications(app):
        if seqs is not None and n.id >= seqs.stop:
            break
        name = event_name(n.topic)
        if name in ("TenantPolicySet", "TenantPolicyUpdated"):
            st = state_of(n)
            if name == "TenantPolicySet":
                policy_of[n.originator_id] = (str(st["pool_id"]), str(st["tenant_id"]))
            if n.originator_id not in policy_of:
                continue
            pool, tenant = policy_of[n.originator_id]
            books[pool].set_tenant(TenantQuota(
                tenant, limits_from_event(st.get("quota")),
                limits_from_event(st.get("borrow_limit")),
                limits_from_event(st.get("lend_limit")), st.get("cohort")))
        elif name in ("CohortCreated", "CohortSet"):
            st = state_of(n)
            if name == "CohortCreated":
                cohort_of[n.originator_id] = (str(st["pool_id"]), str(st["name"]))
            if n.originator_id not in cohort_of:
                continue
            pool, cohort = cohort_of[n.originator_id]
            books[pool].set_cohort(CohortQuota(cohort, limits_from_event(st.get("nominal")) or (),
                                               str(st.get("reclaim", "any"))))
        elif name == "LeaseRequested":
            st = state_of(n)
            owner[str(n.originator_id)] = (str(st["pool_id"]), str(st["tenant_id"]))
        elif name in ("CapacityAllocated", "CapacityAllocatedBatch"):
            ev = app.mapper.to_domain_event(n)
            items = ([[ev.lease_id, ev.resources]] if name == "CapacityAllocated"
                     else ev.allocations)
            for item in items:
                lease = str(item[0])
                if lease not in owner or lease in held:
                    continue  # the placement check reports leases held twice
                pool, tenant = owner[lease]
                amount = held[lease] = Resources.from_dict(item[1])
                mine = usage[pool]
                mine[tenant] = mine.get(tenant, Resources()) + amount
                if seqs is not None and n.id not in seqs:
                    continue
                report.placements += 1
                for breach in holding_past_limits(books[pool], mine, [tenant]):
                    report.breaches.append(f"{breach} after placing lease {lease} at {n.id}")
        elif name == "CapacityFreed":
            ev = app.mapper.to_domain_event(n)
            lease = str(ev.lease_id)
            if lease in held and lease in owner:
                pool, tenant = owner[lease]
                usage[pool][tenant] = usage[pool][tenant] - held.pop(lease)
    return report


@dataclass
class GangReport:
    """What a replay of gang leases found: gangs requested, whole placements, and every
    instant at which a gang was partly reserved."""

    gangs: int = 0
    placements: int = 0  # rounds in which every member of a gang was reserved
    partial: list[str] = field(default_factory=list)


_LEASE_QUEUED = frozenset({"LeaseQueued", "LeaseRequeued"})
_LEASE_ENDED = frozenset({"LeaseRejected", "LeaseCancelled", "ReservationVoided",
                          "LeaseReleased", "LeasePreempted"})


def check_gangs(app: Any, seqs: range | None = None) -> GangReport:
    """Fold the whole log: a gang's members are reserved all in one save or not at all. A save
    is contiguous in the log and the scheduler writes a gang's members one after another, so
    from a member's LeaseReserved until every member is reserved only that gang's members may
    write; and when a round starts every other member must be queued (not still holding an
    earlier placement, not ended). A round left open at the end of the log is partial too.
    `seqs`: only rounds begun at these events are judged and counted."""
    report = GangReport()
    gang_of: dict[UUID, str] = {}
    members: dict[str, set[UUID]] = {}
    sizes: dict[str, int] = {}
    state: dict[UUID, str] = {}  # member → queued | holding | ended | requested
    open_round: dict[str, set[UUID]] = {}  # gang → members still to be reserved this round
    judged: set[str] = set()  # gangs whose open round began in the window
    for n in notifications(app):
        name = event_name(n.topic)
        oid = n.originator_id
        for gang, waiting in list(open_round.items()):
            if oid not in members[gang]:
                if gang in judged:
                    report.partial.append(
                        f"gang {gang}: {len(waiting)} of {sizes[gang]} member(s) not reserved "
                        f"when {name} of {oid} was written (at {n.id})")
                del open_round[gang]
        if name == "LeaseRequested":
            requested = state_of(n)
            info = requested.get("gang")
            if isinstance(info, dict):
                gang = str(info["gang_id"])
                if gang not in members:
                    report.gangs += 1
                    members[gang] = set()
                    sizes[gang] = int(info["size"])
                members[gang].add(oid)
                gang_of[oid] = gang
                # queued by the request itself (one event), or by a LeaseQueued to follow
                state[oid] = "requested" if requested.get("queued_at") is None else "queued"
            continue
        gang_id = gang_of.get(oid)
        if gang_id is None:
            continue
        if name in _LEASE_QUEUED:
            state[oid] = "queued"
        elif name in _LEASE_ENDED:
            state[oid] = "ended"
        elif name == "LeaseReserved":
            state[oid] = "holding"
            round_left = open_round.get(gang_id)
            if round_left is None:
                if seqs is None or n.id in seqs:
                    judged.add(gang_id)
                else:
                    judged.discard(gang_id)
                others = members[gang_id] - {oid}
                wrong = sorted(f"{m} {state.get(m)}" for m in others if state.get(m) != "queued")
                if len(members[gang_id]) < sizes[gang_id] or wrong:
                    if gang_id in judged:
                        report.partial.append(
                            f"gang {gang_id}: member {oid} reserved at {n.id} while "
                            f"{len(members[gang_id])} of {sizes[gang_id]} member(s) were "
                            "requested" + (f" and {', '.join(wrong)}" if wrong else ""))
                    continue
                round_left = open_round[gang_id] = set(others)
            else:
                round_left.discard(oid)
            if not round_left:
                del open_round[gang_id]
                report.placements += gang_id in judged
    for gang, waiting in open_round.items():
        if gang in judged:
            report.partial.append(f"gang {gang}: {len(waiting)} of {sizes[gang]} member(s) "
                                  "never reserved in the round the log ends in")
    return report


# -- `pool audit decisions`: every check above, and fair share, over one log ------------------


@dataclass
class DecisionReport:
    """What `pool audit decisions` found: one line a check, and every violation."""

    checks: dict[str, str] = field(default_factory=dict)  # check → its summary
    violations: dict[str, list[str]] = field(default_factory=dict)  # check → what broke
    window: Any = None  # the audit_window.Window judged (None: the whole log)

    @property
    def ok(self) -> bool:
        return not any(self.violations.values())

    def lines(self, *, shown: int = 20) -> list[str]:
        out = [self.window.text()] if self.window is not None else []
        for name, summary in self.checks.items():
            bad = self.violations.get(name, [])
            out.append(f"{'✗' if bad else '✓'} {name:<12} {summary}")
            out += [f"    {v}" for v in bad[:shown]]
            if len(bad) > shown:
                out.append(f"    … and {len(bad) - shown} more")
        out.append("decisions ok" if self.ok else
                   f"decisions FAILED: {sum(map(len, self.violations.values()))} violation(s)")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "checks": self.checks, "violations": self.violations,
                "window": self.window.to_dict() if self.window is not None else None}


def audit_decisions(app: Any, *, pool: str | None = None, tolerance: float = 0.0,
                    lag_seconds: float | None = None, window: Any = None) -> DecisionReport:
    """Re-derive every placement's soundness from the log: capacity and devices never
    over-committed, no lease held twice, no tenant past its quota or cohort, every gang
    placed whole, and in each pool without quotas every placement made while another tenant
    of the same class waited with the same shape going to the one further below its weighted
    dominant share (`tolerance`: the share of such placements allowed to miss). `pool`
    limits the fair-share check to one pool; the others look at the whole log. `window` (an
    audit_window.Window): judge only the placements made in it, the log before it still folded
    so that capacity, quotas and shares stand as they did at its start."""
    from projections.fair_share import DEFAULT_LAG_SECONDS, check_fair_share, records_by_pool

    report = DecisionReport(window=window)
    seqs = None if window is None else window.seqs
    placed = check_placements(app, seqs)
    report.checks["placements"] = (f"{placed.placements} placements, "
                                   f"{placed.device_placements} bound to GPU devices")
    report.violations["placements"] = (placed.over_allocations + placed.double_holds
                                       + placed.device_conflicts + placed.foreign_devices)
    quotas = check_quotas(app, seqs)
    report.checks["quotas"] = f"{quotas.placements} placements checked against quotas"
    report.violations["quotas"] = list(quotas.breaches)
    gangs = check_gangs(app, seqs)
    report.checks["gangs"] = f"{gangs.gangs} gangs, {gangs.placements} whole placements"
    report.violations["gangs"] = list(gangs.partial)
    from projections.workflow_checks import check_workflows

    flows = check_workflows(app, seqs)
    report.checks["workflows"] = (f"{flows.arrays} throttled arrays, "
                                  f"{flows.dependents_placed} dependent placements")
    report.violations["workflows"] = flows.over_throttle + flows.early_starts
    lag = DEFAULT_LAG_SECONDS if lag_seconds is None else lag_seconds
    pools = records_by_pool(app)
    _priority_and_credits(report, pools, pool=pool, lag=lag, seqs=seqs)
    judged, skipped, contended, unfair = [], [], 0, []
    for name, found in sorted(pools.items()):
        if pool is not None and name != pool:
            continue
        if found.quotas:
            skipped.append(name)  # nominal quotas and borrowing decide there, not shares
            continue
        fair = check_fair_share(found.records, lag_seconds=lag, ran=found.ran,
                                holds=found.holds, seqs=seqs)
        judged.append(name)
        contended += fair.contended
        if len(fair.violations) > tolerance * fair.contended:
            unfair += [f"pool {name}: {v}" for v in fair.violations]
    report.checks["fair_share"] = (
        f"{contended} contended placements in {len(judged)} pool(s)"
        + (f"; not judged where quotas decide: {', '.join(skipped)}" if skipped else ""))
    report.violations["fair_share"] = unfair
    return report


def _priority_and_credits(report: DecisionReport, pools: dict[str, Any], *, pool: str | None,
                          lag: float, seqs: range | None = None) -> None:
    """The priority check in each pool without quotas (a quota may hold the higher class
    back), and no tenant's available credits below zero at any credit event."""
    from projections.fair_share import Funds
    from projections.priority import check_priority

    judged, passed_over = 0, []
    for name, found in sorted(pools.items()):
        if (pool is not None and name != pool) or found.quotas:
            continue
        got = check_priority(found.records, lag_seconds=lag, holds=found.holds,
                             exempt=found.exempt, seqs=seqs)
        judged += got.placements
        passed_over += [f"pool {name}: {v}" for v in got.violations]
    report.checks["priority"] = (f"{judged} placements made while another class waited, none "
                                 "past a higher class of the same shape" if not passed_over
                                 else f"{judged} placements made while another class waited")
    report.violations["priority"] = passed_over
    funds = {(f.tenant, f.at, f.available) for found in pools.values()
             for f in found.records
             if isinstance(f, Funds) and (seqs is None or f.seq in seqs)}
    report.checks["credits"] = (f"{len({t for t, _, _ in funds})} accounts, "
                                f"{len(funds)} balances, none below zero")
    report.violations["credits"] = [
        f"tenant {t}: {available} credits available at {at:.3f}"
        for t, at, available in sorted(funds) if available < 0]
