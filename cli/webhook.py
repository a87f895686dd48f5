"""`pool webhook`: a tenant's endpoints for its lease-feed records (add, list, delete, test)
and the state of their deliveries."""

from __future__ import annotations

import argparse
from typing import Any

from cli.connect import client_opts, pool_client, tenant_of
from cli.output import EXIT_FAILED, Subparsers, print_envelope, table, when

EVENTS_HELP = ("lease states to deliver, comma-separated: ended (any final one), requested, "
               "queued, reserved, running, stopping, preempting, expired, released, cancelled, "
               "voided, preempted, rejected")


def _call(args: argparse.Namespace, verb: str, body: dict[str, Any]) -> dict[str, Any]:
    tenant = tenant_of(args)
    with pool_client(args, tenant) as c:
        reply: dict[str, Any] = c.call(f"pool.cmd.{tenant}.webhook.{verb}", body)
        return reply


def cmd_add(args: argparse.Namespace) -> int:
    events = [e.strip() for e in args.events.split(",") if e.strip()]
    reply = _call(args, "add", {"url": args.url, "events": events})
    if args.json or not reply.get("ok"):
        return print_envelope(reply, args.json)
    result = reply["result"]
    endpoint = result["endpoint"]
    print(f"endpoint  {endpoint['endpoint_id']}")
    print(f"url       {endpoint['url']}")
    print(f"events    {','.join(endpoint['events'])}")
    print(f"secret    {result['secret']}")
    print("(the secret is shown this once: verify each delivery's webhook-signature with it)")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    reply = _call(args, "list", {})
    if args.json or not reply.get("ok"):
        return print_envelope(reply, args.json)
    rows = [{**e, "events": ",".join(e["events"]), "created_at": when(e["created_at"])}
            for e in reply["result"]["endpoints"]]
    print(table(rows, ("endpoint_id", "url", "events", "created_at")) if rows
          else "no webhook endpoints")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    return print_envelope(_call(args, "delete", {"endpoint_id": args.endpoint_id}), args.json)


def cmd_test(args: argparse.Namespace) -> int:
    reply = _call(args, "test", {"endpoint_id": args.endpoint_id})
    code = print_envelope(reply, args.json)
    if reply.get("ok") and not reply["result"].get("ok"):
        return EXIT_FAILED  # the endpoint did not answer 2xx
    return code


def cmd_deliveries(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"limit": args.limit}
    if args.endpoint:
        body["endpoint_id"] = args.endpoint
    reply = _call(args, "deliveries", body)
    if args.json or not reply.get("ok"):
        return print_envelope(reply, args.json)
    rows = [{**d, "next_at": when(d.get("next_at")), "updated_at": when(d.get("updated_at"))}
            for d in reply["result"]["deliveries"]]
    print(table(rows, ("endpoint_id", "webhook_id", "lease_id", "record_state", "state",
                       "attempts", "last_status", "next_at", "updated_at", "last_error"))
          if rows else "no deliveries")
    return 0


def register(sub: Subparsers) -> None:
    """Add `webhook`."""
    wh = sub.add_parser("webhook", help="POST your lease-feed records to your endpoints",
                        description="Endpoints of your tenant that the pool POSTs the records "
                        "of your lease feed to, signed as Standard Webhooks says "
                        "(webhook-id: the feed sequence), retried with backoff for up to a "
                        "day; see docs/operations.md#webhooks.")
    verbs = wh.add_subparsers(dest="verb", metavar="VERB", required=True)
    add = verbs.add_parser("add", help="register an endpoint (its secret is shown once)")
    add.add_argument("url", help="http(s) URL the records are POSTed to")
    add.add_argument("--events", default="ended", help=EVENTS_HELP + " (default: ended)")
    client_opts(add, tenant=True)
    add.set_defaults(func=cmd_add)
    ls = verbs.add_parser("list", help="your endpoints")
    client_opts(ls, tenant=True)
    ls.set_defaults(func=cmd_list)
    rm = verbs.add_parser("delete", help="delete an endpoint")
    rm.add_argument("endpoint_id")
    client_opts(rm, tenant=True)
    rm.set_defaults(func=cmd_delete)
    tst = verbs.add_parser("test", help="POST a signed test message to an endpoint now")
    tst.add_argument("endpoint_id")
    client_opts(tst, tenant=True)
    tst.set_defaults(func=cmd_test)
    dl = verbs.add_parser("deliveries", help="the latest deliveries' state")
    dl.add_argument("--endpoint", metavar="ID", help="one endpoint's only")
    dl.add_argument("--limit", type=int, default=50, help="how many, the latest (default 50)")
    client_opts(dl, tenant=True)
    dl.set_defaults(func=cmd_deliveries)
