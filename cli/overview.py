"""`pool status|pools|nodes|tenants`: how the whole system and its fleet are doing, at a glance."""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from typing import Any

from cli.connect import database_url_of, db_opts, nats_url_of, views_schema_of
from cli.output import EXIT_FAILED, EXIT_OK, Subparsers, ago, table

DIMENSIONS = ("cpu_millis", "memory_mib", "gpu_count")
PAGE = 1000  # rows per view page read


def _rows(args: argparse.Namespace, view: str) -> list[dict[str, Any]]:
    """Every row of a view, page by page."""
    from projections.queries import query_url

    rows: list[dict[str, Any]] = []
    cursor = None
    while True:
        page = query_url(database_url_of(args), view, tenant=None, limit=PAGE, cursor=cursor,
                         schema=views_schema_of(args))
        rows += page["rows"]
        cursor = page["next_cursor"]
        if not cursor:
            return rows


def _free(total: dict[str, int], used: dict[str, int], d: str) -> str:
    scale = {"cpu_millis": 1000, "memory_mib": 1024, "gpu_count": 1}[d]
    unit = {"cpu_millis": "CPU", "memory_mib": "GiB", "gpu_count": "GPU"}[d]
    free = max(0, total[d] - used[d]) / scale
    return f"{round(free, 1):g}/{round(total[d] / scale, 1):g} {unit}"


def node_rows(capacity: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    out = []
    for n in sorted(capacity, key=lambda r: (str(r.get("pool")), str(r.get("node_id")))):
        total = {d: int(n.get(f"{d}_allocatable") or 0) for d in DIMENSIONS}
        used = {d: int(n.get(f"{d}_allocated") or 0) for d in DIMENSIONS}
        beat = n.get("last_heartbeat_at")
        out.append({"node": n.get("node_id"), "pool": n.get("pool"), "state": n.get("state"),
                    "cpu free": _free(total, used, "cpu_millis"),
                    "memory free": _free(total, used, "memory_mib"),
                    "gpus free": _free(total, used, "gpu_count") if total["gpu_count"] else "-",
                    "leases": n.get("allocations"),
                    "last heartbeat": "-" if beat is None else ago(float(beat), now)})
    return out


def pool_rows(capacity: list[dict[str, Any]], queue: list[dict[str, Any]],
              leases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    totals: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    used: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    nodes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for n in capacity:
        pool = str(n.get("pool"))
        nodes[pool][str(n.get("state"))] += 1
        for d in DIMENSIONS:
            totals[pool][d] += int(n.get(f"{d}_allocatable") or 0)
            used[pool][d] += int(n.get(f"{d}_allocated") or 0)
    waiting: dict[str, int] = defaultdict(int)
    for q in queue:
        waiting[str(q.get("pool"))] += 1
    running: dict[str, int] = defaultdict(int)
    for lease in leases:
        if lease.get("state") in ("reserved", "running", "stopping", "preempting"):
            running[str(lease.get("pool"))] += 1
    out = []
    for pool in sorted(set(nodes) | set(waiting) | set(running)):
        out.append({"pool": pool,
                    "nodes": ", ".join(f"{k} {v}" for k, v in sorted(nodes[pool].items()))
                    or "-",
                    "cpu free": _free(totals[pool], used[pool], "cpu_millis"),
                    "memory free": _free(totals[pool], used[pool], "memory_mib"),
                    "gpus free": _free(totals[pool], used[pool], "gpu_count")
                    if totals[pool]["gpu_count"] else "-",
                    "active leases": running[pool], "waiting": waiting[pool]})
    return out


def tenant_rows(balance: list[dict[str, Any]],
                leases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    active: dict[str, int] = defaultdict(int)
    ended: dict[str, int] = defaultdict(int)
    for lease in leases:
        t = str(lease.get("tenant"))
        if lease.get("state") in ("released", "cancelled", "voided", "preempted", "rejected"):
            ended[t] += 1
        else:
            active[t] += 1
    credits = {str(b.get("tenant")): b for b in balance}
    out = []
    for t in sorted(set(credits) | set(active) | set(ended)):
        b = credits.get(t, {})
        out.append({"tenant": t, "available": b.get("available"), "held": b.get("held"),
                    "spent": b.get("spent"), "active leases": active[t], "ended leases": ended[t]})
    return out


def _show(rows: list[dict[str, Any]], args: argparse.Namespace, empty: str) -> int:
    if args.json:
        print(json.dumps({"ok": True, "result": {"rows": rows}}, default=str))
    elif rows:
        print(table(rows, list(rows[0])))
    else:
        print(empty)
    return EXIT_OK


def cmd_nodes(args: argparse.Namespace) -> int:
    return _show(node_rows(_rows(args, "capacity"), time.time()), args,
                 "no nodes yet: `pool agent run --node-id NODE --pool POOL`")


def cmd_pools(args: argparse.Namespace) -> int:
    return _show(pool_rows(_rows(args, "capacity"), _rows(args, "queue"), _rows(args, "leases")),
                 args, "no pool with nodes or leases yet: `pool admin pool create POOL`")


def cmd_tenants(args: argparse.Namespace) -> int:
    return _show(tenant_rows(_rows(args, "balance"), _rows(args, "leases")), args,
                 "no tenant with credits or leases yet: `pool admin tenant set TENANT --pool P`")


def status(args: argparse.Namespace) -> dict[str, Any]:
    """Each component and what it says, or the error that stood for it."""
    from bus.admin import describe_streams, leaders
    from bus.local.auth import redact

    out: dict[str, Any] = {}
    url = nats_url_of(args)
    try:
        streams = describe_streams(url)
        out["nats"] = {"ok": True, "url": redact(url)}
        out["streams"] = {"ok": True, "streams": streams}
    except Exception as e:  # noqa: BLE001 - each component reports its own failure
        out["nats"] = {"ok": False, "url": redact(url), "error": str(e)}
        return out
    try:
        held = leaders(url)
        out["scheduler"] = {"ok": bool(held), "leaders": held} if held else {
            "ok": False, "error": "no scheduler holds the leadership (is `pool up` or "
            "`pool serve --role scheduler` running?)"}
    except Exception as e:  # noqa: BLE001
        out["scheduler"] = {"ok": False, "error": str(e)}
    try:
        from cli.connect import close_app, log_app
        from projections.views import status as view_status

        app = log_app(args)
        try:
            top = app.recorder.max_notification_id() or 0
        finally:
            close_app(app, args)
        views = view_status(database_url_of(args), top, schema=views_schema_of(args))
        lag = max((int(v.get("lag") or 0) for v in views), default=0)
        out["projector"] = {"ok": all(v.get("exists") for v in views), "lag_events": lag,
                            "views": views}
        now = time.time()
        nodes = _rows(args, "capacity")
        states: dict[str, int] = defaultdict(int)
        for n in nodes:
            states[str(n.get("state"))] += 1
        beats = [float(n["last_heartbeat_at"]) for n in nodes if n.get("last_heartbeat_at")]
        out["agents"] = {"ok": bool(nodes), "nodes": dict(states),
                         "last_heartbeat": ago(max(beats), now) if beats else None}
    except Exception as e:  # noqa: BLE001
        out["projector"] = {"ok": False, "error": str(e)}
    return out


def _status_lines(s: dict[str, Any]) -> list[str]:
    def mark(part: dict[str, Any]) -> str:
        return "ok  " if part.get("ok") else "FAIL"

    lines = []
    n = s["nats"]
    lines.append(f"{mark(n)}  nats        {n.get('url')}" + (f": {n['error']}" if not n["ok"]
                                                             else ""))
    if "streams" in s:
        st = s["streams"]["streams"]
        lines.append(f"{mark(s['streams'])}  streams     " + ", ".join(
            f"{x['name']} R{x['replicas']} ({x['messages']:,} msgs)" for x in st))
    if "scheduler" in s:
        sch = s["scheduler"]
        lines.append(f"{mark(sch)}  scheduler   " + (", ".join(
            f"{k}: {v.get('holder') or v.get('holder_id') or v}"
            for k, v in sch.get("leaders", {}).items()) or sch.get("error", "")))
    if "projector" in s:
        p = s["projector"]
        lines.append(f"{mark(p)}  projector   " + (f"lag {p['lag_events']:,} events behind "
                                                   "the log" if "lag_events" in p
                                                   else p.get("error", "")))
    if "agents" in s:
        a = s["agents"]
        lines.append(f"{mark(a)}  agents      " + (", ".join(
            f"{v} {k}" for k, v in sorted(a["nodes"].items())) or "none seen")
            + (f"; last heartbeat {a['last_heartbeat']}" if a.get("last_heartbeat") else ""))
    return lines


def cmd_status(args: argparse.Namespace) -> int:
    s = status(args)
    ok = all(part.get("ok") for part in s.values())
    if args.json:
        print(json.dumps({"ok": ok, "result": s}, default=str))
    else:
        print("\n".join(_status_lines(s)))
    return EXIT_OK if ok else EXIT_FAILED


def register(sub: Subparsers) -> None:
    """Add `status`, `pools`, `nodes` and `tenants`."""
    st = sub.add_parser("status", help="every component: NATS, streams, scheduler leader, "
                        "projector lag, agents seen (exit 1 if one fails)")
    db_opts(st)
    st.set_defaults(func=cmd_status)
    for name, func, help_text in (
            ("pools", cmd_pools, "pools with their nodes, free capacity and leases"),
            ("nodes", cmd_nodes, "nodes: state, free capacity, leases, last heartbeat"),
            ("tenants", cmd_tenants, "tenants: credits and leases")):
        sp = sub.add_parser(name, help=f"{help_text}, from the PostgreSQL views")
        db_opts(sp, nats=False)
        sp.set_defaults(func=func)
