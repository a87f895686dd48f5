"""Read side: view queries, `pool projections …` and `pool audit credits`."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path
from typing import Any

from cli.connect import (
    close_app,
    context_of,
    database_url_of,
    db_opts,
    log_app,
    nats_url_of,
    views_schema_of,
)
from cli.output import (
    EXIT_FAILED,
    EXIT_OK,
    Subparsers,
    UsageError,
    table,
)

VIEW_TABLE_COLUMNS = {
    "queue": ("lease_id", "tenant", "pool", "priority_class", "state", "shape", "queued_at"),
    "balance": ("tenant", "granted", "held", "spent", "available", "shortfall"),
    "capacity": ("node_id", "pool", "state", "zone", "cpu_millis_allocated",
                 "cpu_millis_allocatable", "memory_mib_allocated", "memory_mib_allocatable",
                 "gpu_count_allocated", "gpu_count_allocatable", "last_heartbeat_at"),
    "leases": ("lease_id", "name", "tenant", "state", "node_id", "shape", "started_at",
               "exit_code", "end_reason"),
}
# `-o wide`: every column worth a glance
WIDE_COLUMNS = {
    "queue": (*VIEW_TABLE_COLUMNS["queue"], "attempts", "requested_at"),
    "balance": (*VIEW_TABLE_COLUMNS["balance"], "holds"),
    "capacity": (*VIEW_TABLE_COLUMNS["capacity"], "failure_domain", "gpu_model", "allocations"),
    "leases": ("lease_id", "name", "labels", "tenant", "pool", "priority_class", "state",
               "node_id", "shape", "attempts", "requested_at", "started_at", "ended_at",
               "exit_code", "end_reason", "credits_held", "credits_charged"),
}
# newest first where a view has a time to order by (within the page read)
NEWEST_FIRST = {"queue": "requested_at", "leases": "requested_at"}


def _filters(args: argparse.Namespace) -> dict[str, str]:
    """`--filter COLUMN=VALUE …` checked against the columns the view offers."""
    from projections.catalog import FILTERS

    filters: dict[str, str] = {}
    offered = FILTERS[args.view]
    for text in args.filter or []:
        name, sep, value = text.partition("=")
        if not sep or not name:
            raise UsageError(f"--filter wants COLUMN=VALUE, not {text!r}")
        if name not in offered:
            raise UsageError(f"--filter: {args.view} cannot be filtered on {name!r}; it offers "
                             f"{', '.join(offered) or 'no filters'}")
        if "\x00" in value:
            raise UsageError(f"--filter {name}: the value holds a NUL character")
        filters[name] = value
    if getattr(args, "name", None):
        filters["name"] = args.name
    labels = list(getattr(args, "label", None) or [])
    for item in labels:
        if "=" not in item or item.startswith("="):
            raise UsageError(f"--label wants KEY=VALUE, not {item!r}")
    if labels:
        filters["label"] = ",".join([*filter(None, [filters.get("label", "")]), *labels])
    return filters


def _page_size(text: str) -> int:
    from projections.catalog import MAX_LIMIT

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= n <= MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"must be from 1 to {MAX_LIMIT} rows, not {n}")
    return n


def cmd_view(args: argparse.Namespace) -> int:
    from projections.queries import query_url

    if getattr(args, "by", None):  # per topology domain, folded from the log (cli/capacity)
        if getattr(args, "at", None):
            raise UsageError("--at reads the capacity view as it was; leave out --by")
        from cli.capacity import cmd_capacity

        return cmd_capacity(args)

    filters = _filters(args)
    at = _at_of(args)
    ctx = _tenant_context(args)
    if ctx is not None:
        page = _http_page(args, ctx, filters, at)
    else:
        page = query_url(database_url_of(args), args.view, tenant=args.tenant or None,
                         filters=filters, limit=args.limit, cursor=args.cursor,
                         schema=views_schema_of(args), at=at)
    if at is not None and not args.json:
        print(f"as it was at {when_text(at)}"
              + (f" (the last event by then: {page['as_of_seq']})" if "as_of_seq" in page
                 else ""))
    if args.json:
        print(json.dumps({"ok": True, "result": page}, default=str))
    else:
        rows = page["rows"]
        order = NEWEST_FIRST.get(args.view)
        if order:
            rows = sorted(rows, key=lambda r: r.get(order) or 0.0, reverse=True)
        columns = WIDE_COLUMNS if args.output == "wide" else VIEW_TABLE_COLUMNS
        print(table(rows, columns[args.view]))
        if page["next_cursor"]:
            print(f"more: --cursor {page['next_cursor']}")
    return EXIT_OK


def _at_of(args: argparse.Namespace) -> float | None:
    """`--at TIME` as epoch seconds (None: now)."""
    if not getattr(args, "at", None):
        return None
    from cli.whatif import parse_when

    return parse_when("--at", args.at, time.time())


def when_text(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _tenant_context(args: argparse.Namespace) -> Any:
    """The HTTP context a tenant's view is read through (None: the database), when no
    --database-url or $POOL_DATABASE_URL names the database."""
    from client.http import VIEW_PATHS

    if args.view not in VIEW_PATHS:
        return None  # capacity: the operator's, from the database
    return context_of(args, flag="database_url", env="POOL_DATABASE_URL")


def _http_page(args: argparse.Namespace, ctx: Any, filters: dict[str, str],
               at: float | None = None) -> dict[str, Any]:
    """A page of the token's tenant's view from the gateway, as the database read gives it."""
    from cli.connect import http_client
    from cli.run import Refused
    from client.http import VIEW_FILTERS

    offered = VIEW_FILTERS[args.view]
    for name in filters:
        if name not in offered:
            raise UsageError(f"--filter: over HTTP, {args.view} is filtered only on "
                             f"{', '.join(offered) or 'nothing'}, not {name!r}")
    if args.tenant and args.tenant != ctx.tenant:
        raise UsageError(f"--tenant {args.tenant}: context {ctx.name!r} reads only "
                         f"{ctx.tenant!r}'s rows")
    with http_client(ctx) as c:
        reply = c.view(args.view, filters=filters, limit=args.limit, cursor=args.cursor, at=at)
    if not reply.get("ok"):
        raise Refused(reply)
    page: dict[str, Any] = reply["result"]
    return page


def log_strays(app: Any, top: int, page: int = 10_000) -> list[tuple[int, str]]:
    """The stray messages (no event headers) on the log up to `top`, by sequence: every fold
    skips them; reading the log through the recorder names them (bus.jetstream.strays)."""
    from bus.jetstream.strays import strays

    position = 0
    while position < top:
        notes = app.recorder.select_notifications(start=position + 1, limit=page, stop=top)
        if not notes:
            break
        position = notes[-1].id
    return sorted(x for x in strays().seen if x[0] <= top)


def cmd_projections_status(args: argparse.Namespace) -> int:
    from projections.views import status

    app = log_app(args)
    try:
        top = app.recorder.max_notification_id() or 0
        skipped = log_strays(app, top) if args.strays else None
    finally:
        close_app(app, args)
    rows = status(database_url_of(args), top, schema=views_schema_of(args))
    if args.json:
        result: dict[str, Any] = {"views": rows}
        if skipped is not None:
            result["strays"] = [{"seq": seq, "subject": subject} for seq, subject in skipped]
        print(json.dumps({"ok": True, "result": result}))
    else:
        print(table(rows, ("view", "position", "max_notification_id", "lag", "events_applied",
                            "exists")))
        if skipped is not None:
            print(f"strays: {len(skipped)} message(s) without event headers on the log, "
                  "skipped by every fold" + (":" if skipped else ""))
            for seq, subject in skipped:
                print(f"  sequence {seq} on {subject!r}")
    return EXIT_OK


def cmd_projections_rebuild(args: argparse.Namespace) -> int:
    from projections.views import VIEWS, rebuild

    names = [args.name] if args.name else list(VIEWS)
    app = log_app(args)
    try:
        n = rebuild(app, database_url_of(args), schema=views_schema_of(args), views=names,
                    batch_size=args.batch_size)
        top = app.recorder.max_notification_id() or 0
    finally:
        close_app(app, args)
    msg = {"rebuilt": names, "events_applied": n, "position": top}
    print(json.dumps({"ok": True, "result": msg}) if args.json else
          f"rebuilt {', '.join(names)} from the first event: {n} events, position {top}")
    return EXIT_OK


def cmd_projections_run(args: argparse.Namespace) -> int:
    from workers.projector import run

    run(nats_url_of(args), database_url_of(args), views_schema_of(args), args.batch_size,
        announce=lambda s: print(s, flush=True),
        history_max_age_s=args.history_days and args.history_days * 86400)
    return EXIT_OK


def cmd_audit_credits(args: argparse.Namespace) -> int:
    from projections.audit import audit_credits

    db = None if args.no_views else database_url_of(args)
    if args.checkpoint and args.tenant:
        raise UsageError("--checkpoint: a checkpoint covers every tenant; leave out --tenant")
    app = log_app(args)
    try:
        if args.checkpoint:
            from projections.audit_checkpoint import audit_from_checkpoint
            from projections.errors import CheckpointInvalid, CheckpointMismatch

            try:
                report, _start = audit_from_checkpoint(app, Path(args.checkpoint),
                                                       database_url=db,
                                                       schema=views_schema_of(args))
            except (CheckpointInvalid, CheckpointMismatch) as e:
                print(f"error: --checkpoint {args.checkpoint}: {e} ({e.code})", file=sys.stderr)
                return EXIT_FAILED
        else:
            report = audit_credits(app, tenant=args.tenant or None, database_url=db,
                                   schema=views_schema_of(args))
    finally:
        close_app(app, args)
    return _printed(report, args)


def _printed(report: Any, args: argparse.Namespace) -> int:
    """An audit's report as JSON or lines; exit 1 unless it is clean."""
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print("\n".join(report.lines()))
    return EXIT_OK if report.ok else EXIT_FAILED


def cmd_audit_decisions(args: argparse.Namespace) -> int:
    from projections.decisions import audit_decisions

    if not 0.0 <= args.tolerance <= 1.0:
        raise UsageError(f"--tolerance: {args.tolerance} is not a share between 0 and 1")
    from cli.whatif import parse_when
    from projections.audit_window import window_of

    now = time.time()
    start = parse_when("--from", args.start, now) if args.start else None
    end = parse_when("--to", args.end, now) if args.end else None
    if start is not None and end is not None and end < start:
        raise UsageError(f"--to {args.end!r} is before --from {args.start!r}")
    app = log_app(args)
    try:
        window = None if start is None and end is None else window_of(app, start, end)
        report = audit_decisions(app, pool=args.pool, tolerance=args.tolerance,
                                 lag_seconds=args.lag, window=window)
    finally:
        close_app(app, args)
    return _printed(report, args)



def _history_days(text: str) -> float:
    """`--history-days`, parsed only when given: the views' package is not imported by
    `pool --help` and the other commands' parsers (tests/unit/test_cli_start.py)."""
    from projections.views.retention import history_days

    return history_days(text)

def register(sub: Subparsers) -> None:
    """Add the view commands, `projections` and `audit`."""
    from projections.catalog import FILTERS, MAX_LIMIT, TENANT_VIEWS

    for view, help_text in (("queue", "waiting requests"), ("balance", "tenant credits"),
                            ("capacity", "node capacity"), ("leases", "every lease")):
        vp = sub.add_parser(view, help=f"{help_text}, from the PostgreSQL views")
        db_opts(vp, nats=False)
        if view in TENANT_VIEWS:
            vp.add_argument("--tenant", help="only this tenant's rows")
        vp.add_argument("--filter", action="append", metavar="COLUMN=VALUE",
                        help=f"only rows where COLUMN is VALUE; columns: "
                        f"{', '.join(FILTERS[view]) or 'none'} (repeatable)")
        vp.add_argument("--limit", type=_page_size, default=100, metavar="ROWS",
                        help=f"rows per page, 1 to {MAX_LIMIT} (default 100)")
        vp.add_argument("--cursor", help="where the previous page ended (its `more:` line)")
        vp.add_argument("--output", "-o", choices=["table", "wide"], default="table",
                        help="wide: every column worth a glance")
        if view != "balance":
            vp.add_argument("--at", metavar="TIME", help="as it was at TIME: ISO "
                            "(2026-12-06T14:03), epoch seconds, or `2h ago`")
        if view == "leases":
            vp.add_argument("--name", help="only leases of this name (`lease run --name`)")
            vp.add_argument("--label", "-l", action="append", metavar="KEY=VALUE",
                            help="only leases with this label (repeatable: every one)")
        if view == "capacity":
            from cli.capacity import add_by_options

            add_by_options(vp)
        vp.set_defaults(func=cmd_view, view=view, tenant=None)
    prj = sub.add_parser("projections", help="the PostgreSQL views").add_subparsers(
        dest="verb", metavar="VERB", required=True)
    pst = prj.add_parser("status", help="each view's position and lag behind the log, and the "
                         "stray messages every fold skipped")
    db_opts(pst)
    pst.add_argument("--no-strays", dest="strays", action="store_false",
                     help="skip the read of the whole log that names the stray messages (those "
                     "without event headers) by sequence")
    pst.set_defaults(func=cmd_projections_status)
    prb = prj.add_parser("rebuild", help="drop a view (or all) and fold it again from event 1")
    prb.add_argument("name", nargs="?", choices=("queue", "balance", "capacity", "leases"))
    prb.add_argument("--batch-size", type=int, default=1000)
    db_opts(prb)
    prb.set_defaults(func=cmd_projections_rebuild)
    prr = prj.add_parser("run", help="run the projector until Ctrl-C")
    prr.add_argument("--batch-size", type=int, default=1000)
    prr.add_argument("--history-days", type=_history_days, default=None, metavar="DAYS",
                     help="how long the views keep their past for --at; older row versions "
                     "are pruned while idle (default $POOL_HISTORY_DAYS or 30)")
    db_opts(prr)
    prr.set_defaults(func=cmd_projections_run)
    aud = sub.add_parser("audit", help="check the books against the log").add_subparsers(
        dest="verb", metavar="VERB", required=True)
    ac = aud.add_parser("credits", help="replay credit events; check charges and the balance view")
    ac.add_argument("--tenant")
    ac.add_argument("--no-views", action="store_true", help="skip the balance view cross-check")
    ac.add_argument("--checkpoint", metavar="FILE",
                    help="start after the verified checkpoint in FILE (from sequence 1 if it "
                    "does not exist yet) and, if the audit is clean, write the new one there")
    db_opts(ac)
    ac.set_defaults(func=cmd_audit_credits)
    ad = aud.add_parser(
        "decisions", help="replay every placement: capacity, devices, quotas, gangs, fair share",
        description="Re-derives from the log that no node or GPU device was over-committed, no "
        "lease held twice, no tenant placed past its quota or cohort, every gang placed whole, "
        "no array past its max_running, no lease reserved before the leases it waits for ended "
        "as it asked, and (in pools without quotas) every placement made while another tenant of the same "
        "class waited with the same shape went to the one further below its weighted share. "
        "Exit 1 on any violation.")
    ad.add_argument("--from", dest="start", metavar="TIME", help="judge only the placements "
                    "made from TIME (ISO, epoch seconds or `2h ago`); the log before it is "
                    "still folded, so capacity and quotas stand as they did then")
    ad.add_argument("--to", dest="end", metavar="TIME", help="… and up to TIME (default now)")
    ad.add_argument("--pool", help="judge fair share in this pool only")
    ad.add_argument("--tolerance", type=float, default=0.0, metavar="SHARE",
                    help="share of contended placements allowed to miss fair share (default 0)")
    ad.add_argument("--lag", type=float, default=None, metavar="SECONDS",
                    help="how far behind the log the scheduler may have been (default 1 s)")
    ad.add_argument("--nats-url", help="default: $POOL_NATS_URL or the `pool up` endpoints")
    ad.add_argument("--json", action="store_true")
    ad.set_defaults(func=cmd_audit_decisions)
