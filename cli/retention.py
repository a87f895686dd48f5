"""`pool admin tenant telemetry-retention TENANT [--bytes N] [--max-age-seconds S]`: how much
of a tenant's telemetry its own stream keeps, as that stream's max_bytes and max_age."""

from __future__ import annotations

import argparse
import json

from cli.output import EXIT_OK, Subparsers, UsageError, fail


def cmd_telemetry_retention(args: argparse.Namespace) -> int:
    """Show, or with --bytes / --max-age-seconds set, the retention of the tenant's telemetry
    stream (made with the defaults when missing) and what it holds."""
    from bus.errors import BusError
    from bus.subjects import is_token
    from bus.telemetry_streams import ensure_tenant_telemetry_sync
    from local import embedded

    if not is_token(args.tenant_id):
        raise UsageError(f"{args.tenant_id!r} is not a tenant name")
    if args.bytes is not None and args.bytes <= 0:
        raise UsageError("--bytes must be positive: a tenant's telemetry is never unbounded")
    if args.max_age_seconds is not None and args.max_age_seconds <= 0:
        raise UsageError("--max-age-seconds must be positive")
    url = args.nats_url or embedded.service_url()
    if not url:
        raise UsageError("no running `pool up` here: pass --nats-url with the operator's user")
    try:
        made = ensure_tenant_telemetry_sync(url, [args.tenant_id], max_bytes=args.bytes,
                                            max_age_seconds=args.max_age_seconds)
    except BusError as e:
        return fail(str(e), e.code, as_json=args.json)
    (stream, (held, max_bytes, max_age)), = made.items()
    row = {"tenant": args.tenant_id, "stream": stream, "bytes_held": held,
           "max_bytes": max_bytes, "max_age_seconds": max_age}
    if args.json:
        print(json.dumps({"ok": True, "result": row}))
    else:
        print(f"{stream:<32}  {held:>14} of {max_bytes} bytes, kept {max_age:g} s")
    return EXIT_OK


def register(aten: Subparsers) -> None:
    """Add `admin tenant telemetry-retention`."""
    tr = aten.add_parser("telemetry-retention", help="how much of a tenant's telemetry (its "
                         "jobs' output among it) its own stream keeps (default 256 MiB, 7 days); "
                         "past it the tenant's own oldest samples go, never another's")
    tr.add_argument("tenant_id")
    tr.add_argument("--bytes", type=int, help="set the most bytes kept; lowering it under what "
                    "the stream holds discards the tenant's oldest samples")
    tr.add_argument("--max-age-seconds", type=float, help="set how long a sample is kept")
    tr.add_argument("--nats-url", help="the operator's NATS URL (default: this machine's "
                    "`pool up`)")
    tr.add_argument("--json", action="store_true")
    tr.set_defaults(func=cmd_telemetry_retention)
