"""What the dashboard shows, as one JSON snapshot for one caller: fleet, queue, shares, credits.
What the admin and a tenant each see: docs/api-http.md#the-dashboard.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from typing import Any

from bus.subjects import admin_subject, command_subject
from gateway.shared import Gateway
from gateway.tokens import Principal

log = logging.getLogger(__name__)

DIMENSIONS = ("cpu_millis", "memory_mib", "gpu_count", "local_disk_gib")
ACTIVE_STATES = ("queued", "reserved", "running", "stopping", "preempting", "expired",
                 "reconciling")
HOLDING_STATES = frozenset({"reserved", "running", "stopping", "preempting", "expired",
                            "reconciling"})
WHY_LIMIT = 20  # waiting requests explained per snapshot (the oldest first)
ROWS = 500
WHY_TIMEOUT_SECONDS = 2.0  # a snapshot does not wait longer for the scheduler's reasons


def _amounts(shape: Any) -> dict[str, int]:
    """A lease's requested amounts from its view row's `shape` (as Shape.to_dict writes it)."""
    if not isinstance(shape, dict):
        return {}
    res = shape.get("resources", shape)
    return {d: int(res.get(d) or 0) for d in DIMENSIONS if isinstance(res, dict)}


def fleet_of(nodes: list[dict[str, Any]], *, detail: bool) -> dict[str, Any]:
    """Nodes by state, capacity and free by dimension and by zone, GPUs by model."""
    totals = {d: {"allocatable": 0, "allocated": 0} for d in DIMENSIONS}
    zones: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    gpus: dict[str, dict[str, int]] = defaultdict(lambda: {"total": 0, "free": 0})
    states: Counter[str] = Counter()
    for n in nodes:
        states[str(n.get("state"))] += 1
        z = zones[f"{n.get('zone')}"]
        z["nodes"] += 1
        for d in DIMENSIONS:
            alloc = int(n.get(f"{d}_allocatable") or 0)
            used = int(n.get(f"{d}_allocated") or 0)
            totals[d]["allocatable"] += alloc
            totals[d]["allocated"] += used
            z[f"{d}_free"] += max(0, alloc - used)
            z[f"{d}_allocatable"] += alloc
        if n.get("gpu_model") and int(n.get("gpu_count_allocatable") or 0):
            g = gpus[str(n["gpu_model"])]
            g["total"] += int(n.get("gpu_count_allocatable") or 0)
            g["free"] += max(0, int(n.get("gpu_count_allocatable") or 0)
                             - int(n.get("gpu_count_allocated") or 0))
    for t in totals.values():
        t["free"] = max(0, t["allocatable"] - t["allocated"])
    out: dict[str, Any] = {"nodes": sum(states.values()), "by_state": dict(states),
                           "totals": totals, "by_zone": {k: dict(v) for k, v in zones.items()},
                           "gpus_by_model": dict(gpus)}
    if detail:
        out["node_rows"] = [{k: n.get(k) for k in (
            "node_id", "pool", "state", "zone", "gpu_model", "cpu_millis_allocatable",
            "cpu_millis_allocated", "memory_mib_allocatable", "memory_mib_allocated",
            "gpu_count_allocatable", "gpu_count_allocated")} for n in nodes[:ROWS]]
    return out


def shares_of(leases: list[dict[str, Any]], totals: dict[str, dict[str, int]],
              weights: dict[str, float]) -> dict[str, dict[str, float]]:
    """Each tenant's dominant share (its largest share of any dimension it holds) and that
    share over its weight, from the leases that hold capacity."""
    held: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(DIMENSIONS, 0))
    for lease in leases:
        if lease.get("state") in HOLDING_STATES:
            for d, v in _amounts(lease.get("shape")).items():
                held[str(lease.get("tenant"))][d] += v
    out: dict[str, dict[str, float]] = {}
    for tenant in sorted(set(held) | set(weights)):
        amounts = held.get(tenant, {})
        share = max((amounts.get(d, 0) / totals[d]["allocatable"]
                     for d in DIMENSIONS if totals[d]["allocatable"]), default=0.0)
        weight = weights.get(tenant, 1.0) or 1.0
        out[tenant] = {"dominant_share": round(share, 4), "weight": weight,
                       "weighted_share": round(share / weight, 4)}
    return out


async def _db(gw: Gateway, view: str, **kw: Any) -> list[dict[str, Any]]:
    if not gw.database_url:
        return []
    try:
        page = await asyncio.to_thread(gw.views, view, limit=ROWS, **kw)
    except Exception as e:  # noqa: BLE001 - a view not built yet shows as empty, not as a 5xx
        log.debug("view %s unreadable: %r", view, e)
        return []
    rows: list[dict[str, Any]] = page.get("rows") or []
    return rows


async def _tenant_view(gw: Gateway, who: Principal, view: str,
                       filters: dict[str, str] | None = None) -> list[dict[str, Any]]:
    import msgspec

    reply = await gw.upstream.call(who, command_subject(who.tenant, "query", view),
                                   msgspec.json.encode({"filters": filters or {},
                                                        "limit": ROWS}))
    if not reply.get("ok"):
        return []
    rows: list[dict[str, Any]] = (reply.get("result") or {}).get("rows") or []
    return rows


async def _why(gw: Gateway, who: Principal, row: dict[str, Any]) -> dict[str, Any]:
    tenant = str(row.get("tenant"))
    # the service answers a tenant's subject only on that tenant's own inbox, so the admin's
    # dashboard asks as the lease's tenant (it may read every tenant's anyway)
    asker = Principal("tenant", tenant) if who.is_admin else who
    subject = command_subject(tenant, "lease", str(row["lease_id"]), "why")
    reply = await gw.upstream.call(asker, subject, timeout=WHY_TIMEOUT_SECONDS)
    return (reply.get("result") or {}) if reply.get("ok") else {}


async def _weights(gw: Gateway, pools: set[str]) -> dict[str, float]:
    import msgspec

    weights: dict[str, float] = {}
    for pool in sorted(pools)[:8]:
        reply = await gw.upstream.call(Principal("admin"), admin_subject("pool.show"),
                                       msgspec.json.encode({"pool_id": pool}))
        tenants = ((reply.get("result") or {}).get("quotas") or {}).get("tenants") or {}
        for name, row in tenants.items():
            if isinstance(row, dict) and isinstance(row.get("weight"), int | float):
                weights[str(name)] = float(row["weight"])
    return weights


_SHARED_SECONDS = 0.4  # viewers of one principal within this long share one snapshot
_recent: dict[tuple[int, Principal], tuple[float, asyncio.Future[dict[str, Any]]]] = {}


async def snapshot(gw: Gateway, who: Principal) -> dict[str, Any]:
    """The caller's snapshot; dashboards open for the same principal share one read."""
    now = time.monotonic()
    key = (id(gw), who)
    known = _recent.get(key)
    if known is not None and now - known[0] < _SHARED_SECONDS:
        return await asyncio.shield(known[1])
    fut: asyncio.Future[dict[str, Any]] = asyncio.ensure_future(_snapshot(gw, who))
    _recent[key] = (now, fut)
    return await asyncio.shield(fut)


async def _snapshot(gw: Gateway, who: Principal) -> dict[str, Any]:
    nodes = await _db(gw, "capacity", tenant=None)
    fleet = fleet_of(nodes, detail=who.is_admin)
    if who.is_admin:
        leases = [r for state in ACTIVE_STATES
                  for r in await _db(gw, "leases", tenant=None, filters={"state": state})]
        queue = await _db(gw, "queue", tenant=None)
        balances = await _db(gw, "balance", tenant=None)
        weights = await _weights(gw, {str(n.get("pool")) for n in nodes if n.get("pool")})
    else:
        leases = [r for state in ACTIVE_STATES
                  for r in await _tenant_view(gw, who, "leases", {"state": state})]
        queue = await _tenant_view(gw, who, "queue")
        balances = await _tenant_view(gw, who, "balance")
        weights = {}
    waiting = sorted(queue, key=lambda r: r.get("queued_at") or r.get("requested_at") or 0)
    whys = await asyncio.gather(*(_why(gw, who, r) for r in waiting[:WHY_LIMIT]))
    for row, why in zip(waiting, whys, strict=False):
        row["why"] = why
    shares = shares_of(leases, fleet["totals"], weights)
    if not who.is_admin:
        shares = {k: v for k, v in shares.items() if k == who.tenant}
    return {"who": {"kind": who.kind, "tenant": who.tenant}, "fleet": fleet,
            "queue": waiting, "leases": leases, "balances": balances, "shares": shares}
