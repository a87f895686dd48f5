"""`--at TIME` where the answer is not a view's page: `pool lease get --at` (the lease's row
of the leases view as it was) and `pool shares --at` (the pool's log folded up to then)."""

from __future__ import annotations

import argparse
from typing import Any

from cli.connect import pool_client
from cli.output import print_envelope


def lease_at(args: argparse.Namespace, tenant: str, at: float) -> int:
    """The lease as the leases view held it at `at`: the tenant's own row, read over HTTP or
    the tenant's query subject (another tenant's lease reads as not found)."""
    with pool_client(args, tenant) as c:
        if hasattr(c, "view"):  # a context: the gateway's ?at=
            reply = c.view("leases", filters={"lease_id": args.lease_id}, limit=1, at=at)
        else:
            reply = c.call(f"pool.cmd.{tenant}.query.leases",
                           {"filters": {"lease_id": args.lease_id}, "limit": 1, "at": at})
    if not reply.get("ok"):
        return print_envelope(reply, args.json)
    rows = (reply.get("result") or {}).get("rows") or []
    if not rows:
        return print_envelope({"ok": False, "error": {
            "code": "lease_not_found",
            "message": f"no lease {args.lease_id!r} of {tenant!r} at that time (not requested "
                       "yet, or not this tenant's)"}}, args.json)
    return print_envelope({"ok": True, "lease": {**rows[0], "as_of": at}}, args.json)


def shares_at(nats_url: str, pool_id: str, at: float) -> dict[str, Any] | None:
    """The pool's fair shares as the scheduler saw them at `at`: the log folded up to the last
    event made by then, the shares read at that time."""
    from workers.bootstrap import PlaneConfig, Role, build
    from workers.quotas import fair_shares

    replay = build(PlaneConfig(nats_url, clock=lambda: at), {Role.REPLAY})
    scheduler = replay.scheduler
    assert scheduler is not None
    try:
        scheduler.stop_after = at
        scheduler.catch_up()
        ps = scheduler.pools.get(pool_id)
        if ps is None:
            return None
        ps.refresh_totals()
        return fair_shares(ps, at)
    finally:
        replay.close()
