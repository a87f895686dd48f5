"""`pool telemetry follow`: agents' samples, live or replayed."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cli.connect import (
    nats_url_of,
)
from cli.output import (
    EXIT_OK,
    Subparsers,
    fail,
    parse_since,
    print_item,
)
from cli.terminal import terminal_safe


def _format_sample(sample: Any) -> str:
    import datetime as dt

    ev = sample.event
    if ev is None:
        return terminal_safe(f"{'?':<12}  {sample.kind:<11}  {sample.node}  "
                             f"{sample.tenant}/{sample.lease}  undecodable: {sample.error}",
                             one_line=True)
    at = dt.datetime.fromtimestamp(ev.at, dt.UTC).strftime("%H:%M:%S.%f")[:-3]
    details = []
    if ev.utilization is not None:
        details += [f"{k}={v}" for k, v in
                    ((f, getattr(ev.utilization, f)) for f in ev.utilization.__struct_fields__)
                    if v is not None]
    details += [f"{k}={v}" for k, v in ev.attrs.items()]
    # one line a sample, whatever a node or job put in it
    return terminal_safe(f"{at:<12}  {sample.kind:<11}  {sample.pool}/{sample.node}  "
                         f"{sample.tenant}/{sample.lease}  {' '.join(details)}".rstrip(),
                         one_line=True)


def cmd_telemetry_follow(args: argparse.Namespace) -> int:
    import os

    import msgspec

    from bus import telemetry_follow
    from cli.connect import tenant_connection

    tenant = args.tenant or os.environ.get("POOL_TENANT", "")
    since = parse_since(args.since)
    # as the tenant's own user, the server limits it to pool.tel.*.*.<tenant>.>
    url, options = (tenant_connection(args, tenant) if tenant
                    else (nats_url_of(args), {}))

    def on_sample(sample: Any) -> None:
        if args.json:
            print_item({
                "subject": sample.subject, "pool": sample.pool, "node": sample.node,
                "tenant": sample.tenant, "lease": sample.lease, "kind": sample.kind,
                "stream_seq": sample.stream_seq, "headers": sample.headers,
                "event": msgspec.to_builtins(sample.event) if sample.event else None,
                "error": sample.error,
            })
        else:
            print(_format_sample(sample), flush=True)

    def on_ready() -> None:
        what = "replaying from " + since.isoformat() + ", then following" if since else "following"
        print(f"{what} telemetry (Ctrl-C to stop)", file=sys.stderr, flush=True)

    try:
        telemetry_follow.follow(
            url, on_sample, pool=args.pool, node=args.node, tenant=tenant or None,
            lease=args.lease, kind=args.kind, since=since, max_samples=args.count,
            duration_s=args.duration, on_ready=on_ready, **options,
        )
    except KeyboardInterrupt:
        return EXIT_OK
    except Exception as e:
        if getattr(e, "code", "") == "permission_denied" and tenant:
            return fail(f"{e} (a tenant may follow only its own leases: pool.tel.*.*.{tenant}.>)",
                         "permission_denied", as_json=args.json)
        raise
    return EXIT_OK


def register(sub: Subparsers) -> None:
    """Add `telemetry`."""
    tel = sub.add_parser("telemetry", help="samples from node agents").add_subparsers(
        dest="verb", metavar="VERB", required=True)
    tf = tel.add_parser("follow", help="print telemetry live; with --since, replay it first")
    tf.add_argument("--nats-url", help="NATS server (default: POOL_NATS_URL or `pool up`)")
    tf.add_argument("--tenant", help="follow as this tenant's user, only its leases "
                    "(default: $POOL_TENANT; none: as the operator)")
    tf.add_argument("--pool", help="only this pool")
    tf.add_argument("--node", help="only this node")
    tf.add_argument("--lease", help="only this lease")
    tf.add_argument("--kind", choices=("queue", "startup", "execution", "utilization", "failure"))
    tf.add_argument("--since", metavar="T", help="replay from T first: a duration back from now "
                    "(30s, 10m, 2h, 1d) or an ISO 8601 time (UTC unless it has an offset)")
    tf.add_argument("--count", type=int, metavar="N", help="exit after N samples")
    tf.add_argument("--duration", type=float, metavar="SECONDS", help="exit after SECONDS")
    tf.add_argument("--json", action="store_true",
                    help='one envelope per sample and line: {"ok": true, "result": {…}}')
    tf.set_defaults(func=cmd_telemetry_follow)
