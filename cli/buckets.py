"""`pool admin tenant bucket-quota TENANT [--bytes N]`: the operator's quota on each of a
tenant's file buckets (work directories, artifacts), kept as the buckets' own max_bytes."""

from __future__ import annotations

import argparse
import json

from cli.output import EXIT_OK, Subparsers, UsageError, fail


def cmd_bucket_quota(args: argparse.Namespace) -> int:
    """Show, or with --bytes set, the quota of the tenant's two buckets and what each holds."""
    from bus.errors import BusError
    from bus.objects import ensure_tenant_buckets_sync
    from bus.subjects import is_token
    from local import embedded

    if not is_token(args.tenant_id):
        raise UsageError(f"{args.tenant_id!r} is not a tenant name")
    if args.bytes is not None and args.bytes <= 0:
        raise UsageError("--bytes must be positive: a bucket is never without a quota")
    url = args.nats_url or embedded.service_url()
    if not url:
        raise UsageError("no running `pool up` here: pass --nats-url with the operator's user")
    try:
        usage = ensure_tenant_buckets_sync(url, [args.tenant_id], quota_bytes=args.bytes)
    except BusError as e:
        return fail(str(e), e.code, as_json=args.json)
    rows = [{"bucket": b, "bytes_held": held, "quota_bytes": quota}
            for b, (held, quota) in usage.items()]
    if args.json:
        print(json.dumps({"ok": True, "result": {"tenant": args.tenant_id, "buckets": rows}}))
    else:
        for r in rows:
            print(f"{r['bucket']:<32}  {r['bytes_held']:>14} of {r['quota_bytes']} bytes")
    return EXIT_OK


def register(aten: Subparsers) -> None:
    """Add `admin tenant bucket-quota`."""
    bq = aten.add_parser("bucket-quota", help="the most bytes each of a tenant's file buckets "
                         "(work directories, artifacts) may hold (default 1 GiB); a full "
                         "bucket refuses new objects and removes none")
    bq.add_argument("tenant_id")
    bq.add_argument("--bytes", type=int, help="set the quota (bytes, per bucket); lowering it "
                    "under what a bucket holds removes nothing")
    bq.add_argument("--nats-url", help="the operator's NATS URL (default: this machine's "
                    "`pool up`)")
    bq.add_argument("--json", action="store_true")
    bq.set_defaults(func=cmd_bucket_quota)
