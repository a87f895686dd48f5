"""`pool report usage`: who used what, from the PostgreSQL views."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time

from cli.connect import database_url_of, db_opts, views_schema_of
from cli.output import EXIT_OK, Subparsers, UsageError, table

DEFAULT_DAYS = 30
COLUMNS = ("key", "cpu_core_hours", "memory_gib_hours", "gpu_hours", "leases_started",
           "leases_ended", "credits_charged_microcredits", "wait_p50_seconds",
           "wait_p99_seconds", "end_reasons")


LATEST = 253_402_300_799.0  # 9999-12-31T23:59:59Z: what an ISO time can spell


def parse_time(flag: str, text: str) -> float:
    """An ISO 8601 date or time (UTC unless it says otherwise) or seconds since the epoch,
    from 1970 to the year 9999."""
    value = text.strip()
    try:
        at = float(value)
    except ValueError:
        try:
            when = dt.datetime.fromisoformat(value)
        except ValueError:
            raise UsageError(f"{flag} {text!r}: not an ISO date or time (2026-12-01, "
                             "2026-12-01T08:00) nor seconds since the epoch") from None
        at = (when if when.tzinfo else when.replace(tzinfo=dt.UTC)).timestamp()
    if not 0.0 <= at <= LATEST:  # also refuses nan and inf
        raise UsageError(f"{flag} {text!r}: outside 1970-01-01 to 9999-12-31")
    return at


def cmd_report_usage(args: argparse.Namespace) -> int:
    from projections.usage import UsageError as BadReport
    from projections.usage import to_csv, usage_report_url

    now = time.time()
    end = parse_time("--to", args.to) if args.to else now
    start = parse_time("--from", args.from_) if args.from_ else end - DEFAULT_DAYS * 86_400
    if not end > start:
        raise UsageError("--to must be after --from")
    try:
        rows = usage_report_url(database_url_of(args), by=args.by, start=start, end=end,
                                now=now, schema=views_schema_of(args),
                                tenant=args.tenant or None)
    except BadReport as e:
        raise UsageError(str(e)) from None
    if args.json:
        print(json.dumps({"by": args.by, "from": start, "to": end,
                          "rows": [r.to_dict() for r in rows]}))
    elif args.csv:
        print(to_csv(rows), end="")
    else:
        print(table([r.to_dict() for r in rows], COLUMNS))
    return EXIT_OK


USAGE_COLUMNS = ("pool", "leases", "by_state", "run_seconds", "cpu_core_seconds",
                 "memory_gib_seconds", "gpu_seconds", "credits_charged_microcredits")


def cmd_usage(args: argparse.Namespace) -> int:
    """`pool usage`: the token's tenant's use per pool, from the gateway (GET /v1/usage)."""
    from cli.connect import context_of, http_client
    from cli.output import print_envelope

    ctx = context_of(args)
    if ctx is None:
        raise UsageError("`pool usage` asks the gateway: `pool login URL` first (an operator's "
                         "report of every tenant: `pool report usage`)")
    with http_client(ctx, args.timeout) as c:
        reply = c.usage(args.pool)
    if args.json or not reply.get("ok"):
        return print_envelope(reply, args.json)
    result = reply["result"]
    rows = [{"pool": pool, **row} for pool, row in (result.get("pools") or {}).items()]
    print(table(rows, USAGE_COLUMNS))
    if result.get("truncated"):
        print(f"(the first {result.get('leases_read')} leases only)")
    return EXIT_OK


def register_usage(sub: Subparsers) -> None:
    """Add `usage`."""
    us = sub.add_parser("usage", help="your tenant's use per pool, from the gateway: leases, "
                        "resource-seconds, credits")
    us.add_argument("--pool", help="only this pool")
    us.add_argument("--timeout", type=float, default=10.0)
    us.add_argument("--json", action="store_true")
    us.set_defaults(func=cmd_usage)


def register(sub: Subparsers) -> None:
    """Add `report` and its reports."""
    from projections.usage import GROUPINGS

    rep = sub.add_parser("report", help="usage reports from the views").add_subparsers(
        dest="verb", metavar="REPORT", required=True)
    use = rep.add_parser("usage", help="resource-hours, credits charged, leases by end reason "
                         "and queue waits per tenant, pool, GPU model or day")
    use.add_argument("--by", choices=GROUPINGS, default="tenant",
                     help="what to group by (default tenant)")
    use.add_argument("--from", dest="from_", metavar="WHEN",
                     help=f"start of the window, ISO date/time (UTC) or epoch seconds "
                     f"(default {DEFAULT_DAYS} days before --to)")
    use.add_argument("--to", metavar="WHEN", help="end of the window (default now)")
    use.add_argument("--tenant", help="only this tenant's leases")
    db_opts(use, nats=False)
    use.add_argument("--csv", action="store_true", help="CSV with a header row")
    use.set_defaults(func=cmd_report_usage)
