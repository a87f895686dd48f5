"""`pool admin reservation create|list|delete`: advance reservations of capacity for a tenant,
and maintenance windows of whole nodes."""

from __future__ import annotations

import argparse
import datetime as dt
import re
import time
import uuid
from typing import Any

from cli.connect import client_opts, pool_client
from cli.output import EXIT_OK, UsageError, print_envelope, table

Subparsers = Any  # argparse's _SubParsersAction

_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(flag: str, text: str) -> int:
    """`90s`, `10m`, `4h`, `1d`, `1h30m` or plain seconds, as whole seconds ≥ 1."""
    t = text.strip().lower()
    if t.isdigit():
        seconds = int(t)
    else:
        parts = re.findall(r"(\d+(?:\.\d+)?)([smhd])", t)
        if not parts or "".join(n + u for n, u in parts) != t:
            raise UsageError(f"{flag} {text!r}: not a duration (90s, 10m, 4h, 1d, 1h30m)")
        seconds = round(sum(float(n) * _UNIT[u] for n, u in parts))
    if seconds < 1:
        raise UsageError(f"{flag} {text!r}: must be at least one second")
    return seconds


def parse_start(flag: str, text: str, now: float) -> float:
    """`now`, `+2h` (from now) or an ISO 8601 time (UTC when it names no zone), in Unix
    seconds."""
    t = text.strip()
    if t.lower() == "now":
        return now
    if t.startswith("+"):
        return now + parse_duration(flag, t[1:])
    try:
        when = dt.datetime.fromisoformat(t)
    except ValueError:
        raise UsageError(f"{flag} {text!r}: not now, +DURATION (+2h) nor an ISO time") from None
    return (when if when.tzinfo else when.replace(tzinfo=dt.UTC)).timestamp()


def create_body(args: argparse.Namespace, now: float) -> dict[str, Any]:
    """`reservation create`'s flags as a ReservationCreate body."""
    shape = {k: v for k, v in (("cpu_millis", args.cpu_millis), ("memory_mib", args.memory_mib),
                               ("gpu_count", args.gpus), ("local_disk_gib", args.disk_gib))
             if v}
    if args.tenant is None and not args.node:
        raise UsageError("--tenant (a reservation) or --node (a maintenance window) is needed")
    if args.tenant is not None and args.node:
        raise UsageError("--node is for maintenance windows, which have no --tenant")
    if args.tenant is not None and not shape:
        raise UsageError("--tenant needs a shape: --cpu-millis, --memory-mib, --gpus or "
                         "--disk-gib")
    if args.tenant is None and (shape or args.count != 1):
        raise UsageError("a maintenance window (--node) takes whole nodes: no shape or --count")
    body: dict[str, Any] = {
        "pool_id": args.pool, "reservation_id": args.id or f"r-{uuid.uuid4().hex[:10]}",
        "start_at": parse_start("--start", args.start, now),
        "duration_seconds": parse_duration("--duration", args.duration),
    }
    if args.tenant is not None:
        body.update(tenant=args.tenant, shape=shape, count=args.count)
    else:
        body["node_ids"] = list(args.node)
    return body


def cmd_create(args: argparse.Namespace) -> int:
    body = create_body(args, time.time())
    with pool_client(args) as c:
        return print_envelope(c.admin("reservation.create", body), args.json)


def cmd_delete(args: argparse.Namespace) -> int:
    with pool_client(args) as c:
        return print_envelope(c.admin("reservation.delete", {
            "pool_id": args.pool, "reservation_id": args.reservation_id}), args.json)


def cmd_list(args: argparse.Namespace) -> int:
    with pool_client(args) as c:
        reply = c.admin("reservation.list", {"pool_id": args.pool, "all": args.all})
    if args.json or not reply.get("ok"):
        return print_envelope(reply, args.json)
    rows = []
    for r in reply["result"]["reservations"]:
        res = r.get("resources") or {}
        what = ",".join(f"{k}={v}" for k, v in res.items() if v and k != "extended")
        rows.append({"id": r["reservation_id"], "tenant": r.get("tenant") or "(maintenance)",
                     "takes": f"{r['count']} x {what}" if r.get("tenant")
                     else ",".join(r.get("node_ids") or ()),
                     "start_at": r["start_at"], "end_at": r["end_at"], "status": r["status"]})
    if not rows:
        print(f"pool {args.pool}: no reservations" + ("" if args.all else " in force"))
        return EXIT_OK
    print(table(rows, ("id", "tenant", "takes", "start_at", "end_at", "status")))
    return EXIT_OK


def register_admin(adm: Subparsers) -> None:
    """Add `admin reservation create|list|delete`."""
    res = adm.add_parser("reservation", help="advance reservations and maintenance windows"
                         ).add_subparsers(dest="verb", metavar="VERB")
    res.required = True
    cr = res.add_parser(
        "create", help="withhold capacity over a window",
        description="Withhold capacity of a pool over [start, start + duration): COUNT units "
        "of a shape for one tenant, used only by its leases that name the reservation "
        "(`reservation_id` in the request), or with --node and no --tenant, whole nodes for "
        "maintenance. Other leases are placed there only if they end before it starts or fit "
        "beside it.")
    client_opts(cr)
    cr.add_argument("--pool", required=True)
    cr.add_argument("--id", help="the reservation's id (default: a new one)")
    cr.add_argument("--tenant", help="the tenant the capacity is kept for")
    cr.add_argument("--start", required=True, metavar="ISO|+2h|now",
                    help="when the window begins: an ISO 8601 time (UTC unless it says), "
                    "+DURATION from now, or now")
    cr.add_argument("--duration", required=True, metavar="4h", help="how long it lasts")
    cr.add_argument("--cpu-millis", type=int, default=0)
    cr.add_argument("--memory-mib", type=int, default=0)
    cr.add_argument("--gpus", type=int, default=0)
    cr.add_argument("--disk-gib", type=int, default=0)
    cr.add_argument("--count", type=int, default=1, help="units of the shape (default 1)")
    cr.add_argument("--node", action="append", default=[],
                    help="a node a maintenance window takes whole (repeat for more)")
    cr.set_defaults(func=cmd_create)
    ls = res.add_parser("list", help="a pool's reservations in force (--all: ended too)")
    client_opts(ls)
    ls.add_argument("--pool", required=True)
    ls.add_argument("--all", action="store_true", help="ended and deleted ones too")
    ls.set_defaults(func=cmd_list)
    de = res.add_parser("delete", help="withdraw a reservation: its capacity returns at once")
    client_opts(de)
    de.add_argument("reservation_id")
    de.add_argument("--pool", required=True)
    de.set_defaults(func=cmd_delete)
