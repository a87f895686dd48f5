"""What the dashboard's lease page tells in one read: the lease, its views row (credits, end),
its flight recorder and, while it waits, why (gateway/static/lease.js tells it as a story).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from bus.subjects import command_subject
from gateway.shared import Gateway, Refused
from gateway.tokens import Principal

log = logging.getLogger(__name__)
WAITING_STATES = frozenset({"requested", "held", "queued"})
WHY_TIMEOUT_SECONDS = 2.0


async def story(gw: Gateway, who: Principal, lease_id: str) -> dict[str, Any]:
    """The lease page's data for `who`: a tenant sees only its own leases (its own user's
    `get` decides, on the server), the admin any. Refused `lease_not_found` otherwise."""
    try:
        lease_id = str(uuid.UUID(lease_id))
    except ValueError:
        raise Refused("lease_not_found", f"no lease {lease_id[:64]!r}") from None
    row = await _row(gw, None if who.is_admin else who.tenant, lease_id)
    # the service answers a tenant's subject only on that tenant's own inbox, so the admin
    # asks as the lease's tenant (it may read every tenant's anyway)
    tenant = who.tenant if not who.is_admin else str(row.get("tenant") or "")
    lease: dict[str, Any] = {}
    if tenant:
        asker = Principal("tenant", tenant) if who.is_admin else who
        got = await gw.upstream.call(asker, command_subject(tenant, "lease", lease_id, "get"))
        if got.get("ok"):
            lease = got.get("lease") or {}
        elif not who.is_admin:
            err = got.get("error") or {}
            raise Refused(str(err.get("code") or "lease_not_found"),
                          str(err.get("message") or f"no lease {lease_id!r}"))
    if not lease and not row:
        raise Refused("lease_not_found", f"no lease {lease_id!r}")
    why: dict[str, Any] = {}
    if str(lease.get("state") or row.get("state")) in WAITING_STATES and tenant:
        asker = Principal("tenant", tenant) if who.is_admin else who
        got = await gw.upstream.call(asker, command_subject(tenant, "lease", lease_id, "why"),
                                     timeout=WHY_TIMEOUT_SECONDS)
        why = (got.get("result") or {}) if got.get("ok") else {}
    return {"lease": lease, "row": row, "why": why, "events": await _events(gw, lease_id)}


async def _row(gw: Gateway, tenant: str | None, lease_id: str) -> dict[str, Any]:
    """The leases view's row (credits held, charged, released; when it ended), or {}."""
    if not gw.database_url:
        return {}
    try:
        page = await asyncio.to_thread(gw.views, "leases", tenant=tenant,
                                       filters={"lease_id": lease_id}, limit=1)
    except Exception as e:  # noqa: BLE001 - the driver's errors stay behind the gateway
        log.warning("the leases view could not be read: %r", e)
        return {}
    rows: list[dict[str, Any]] = page.get("rows") or []
    return rows[0] if rows else {}


async def _events(gw: Gateway, lease_id: str) -> list[dict[str, Any]]:
    history = gw.history()
    if history is None:
        return []
    try:
        events: list[dict[str, Any]] = await asyncio.to_thread(history.events, lease_id)
    except Exception as e:  # noqa: BLE001 - the log's failures stay behind the gateway
        log.warning("history of %s unreadable: %r", lease_id, e)
        return []
    return events
