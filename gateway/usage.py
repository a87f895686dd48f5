"""`GET /v1/usage`: what a tenant has used, folded from its own rows of the leases view (read
through its NATS user): leases by state, resource-seconds run, and credits charged, per pool."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import msgspec

from bus.subjects import command_subject
from gateway.shared import Gateway
from gateway.tokens import Principal

PAGE = 1000
MAX_PAGES = 20  # a bound on one answer's work; `truncated` says when it was reached


def _seconds(row: dict[str, Any]) -> float:
    start = row.get("started_at")
    end = row.get("run_ended_at") or row.get("ended_at")
    if not isinstance(start, int | float) or not isinstance(end, int | float):
        return 0.0
    return max(0.0, float(end) - float(start))


def fold(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    pools: dict[str, dict[str, Any]] = defaultdict(lambda: {
        "leases": 0, "by_state": defaultdict(int), "run_seconds": 0.0, "cpu_core_seconds": 0.0,
        "memory_gib_seconds": 0.0, "gpu_seconds": 0.0, "credits_charged_microcredits": 0})
    for row in rows:
        p = pools[str(row.get("pool"))]
        p["leases"] += 1
        p["by_state"][str(row.get("state"))] += 1
        ran = _seconds(row)
        shape = row.get("shape") if isinstance(row.get("shape"), dict) else {}
        res = shape.get("resources", shape) if isinstance(shape, dict) else {}
        p["run_seconds"] += ran
        p["cpu_core_seconds"] += ran * int(res.get("cpu_millis") or 0) / 1000
        p["memory_gib_seconds"] += ran * int(res.get("memory_mib") or 0) / 1024
        p["gpu_seconds"] += ran * int(res.get("gpu_count") or 0)
        p["credits_charged_microcredits"] += int(row.get("credits_charged") or 0)
    return {k: {**v, "by_state": dict(v["by_state"]),
                **{f: round(v[f], 3) for f in ("run_seconds", "cpu_core_seconds",
                                                "memory_gib_seconds", "gpu_seconds")}}
            for k, v in sorted(pools.items())}


async def usage(gw: Gateway, who: Principal, filters: dict[str, str]) -> dict[str, Any]:
    """The tenant's usage, or the reply envelope's error (`{"error": …}`) when a page fails."""
    rows: list[dict[str, Any]] = []
    cursor: str | None = None
    truncated = False
    for page in range(MAX_PAGES):
        body: dict[str, Any] = {"filters": filters, "limit": PAGE}
        if cursor:
            body["cursor"] = cursor
        reply = await gw.upstream.call(who, command_subject(who.tenant, "query", "leases"),
                                       msgspec.json.encode(body))
        if not reply.get("ok"):
            return {"error": reply.get("error")}
        result = reply.get("result") or {}
        rows.extend(result.get("rows") or [])
        cursor = result.get("next_cursor")
        if not cursor:
            break
        truncated = page == MAX_PAGES - 1
    return {"tenant": who.tenant, "pools": fold(rows), "leases_read": len(rows),
            "truncated": truncated}
