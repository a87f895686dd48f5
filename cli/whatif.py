"""`pool whatif`: a window of a pool's real requests replayed under another policy, beside
what the log says happened (bench/whatif.py holds the replay)."""

from __future__ import annotations

import argparse
import re
import time
from typing import Any

from cli.output import Subparsers, UsageError, print_result

# `2h ago`, `30m ago`, `1.5d ago`
_AGO = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s+ago\s*$")
_UNIT = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0}
MAX_WEIGHT = 1_000_000.0


def parse_when(flag: str, text: str, now: float) -> float:
    """An ISO time, seconds since the epoch, or `N{s,m,h,d} ago`."""
    from cli.report import parse_time

    m = _AGO.match(text)
    if m:
        return now - float(m.group(1)) * _UNIT[m.group(2)]
    return parse_time(flag, text)


def parse_weight(text: str) -> tuple[str, float]:
    """`TENANT=WEIGHT`, a weight above 0."""
    tenant, sep, value = text.partition("=")
    try:
        weight = float(value)
    except ValueError:
        weight = float("nan")
    if not sep or not tenant.strip() or not 0 < weight <= MAX_WEIGHT:
        raise UsageError(f"--weight {text!r}: want TENANT=WEIGHT with a weight above 0 and at "
                         f"most {MAX_WEIGHT:g} (e.g. --weight acme=5)")
    return tenant.strip(), weight


def cmd_whatif(args: argparse.Namespace) -> int:
    from bench.policy import NothingToReplay
    from bench.whatif import BadPolicy, parse_policy, whatif_from_log
    from cli.connect import close_app, log_app

    try:
        policy = parse_policy(args.policy)
    except BadPolicy as e:
        raise UsageError(f"--policy: {e}") from None
    weights = dict(parse_weight(w) for w in args.weight or ())
    if not 0 < args.cycle_seconds <= 3600:
        raise UsageError("--cycle-seconds must be above 0 and at most 3600")
    now = time.time()
    start = parse_when("--from", args.from_, now) if args.from_ else None
    end = parse_when("--to", args.to, now) if args.to else None
    if start is not None and end is not None and not end > start:
        raise UsageError("--to must be after --from")
    app = log_app(args)
    try:
        found = whatif_from_log(app, policy, pool_id=args.pool, start=start, end=end,
                                weights=weights, cycle_seconds=args.cycle_seconds)
    except NothingToReplay as e:
        flag = "--from/--to" if "window" in str(e) else "--pool"
        raise UsageError(f"{flag}: {e}") from None
    except BadPolicy as e:
        raise UsageError(f"--weight: {e}") from None
    finally:
        close_app(app, args)
    result: dict[str, Any] = found.to_dict()
    return print_result(result, args.json, found.table())


def register(sub: Subparsers) -> None:
    """Add `whatif`."""
    from bench.whatif import NAMED, NOT_MODELLED

    wi = sub.add_parser(
        "whatif", help="replay a window of a pool's real requests under another policy, "
        "beside what happened",
        description="Replays the requests made in a window of the log (default: all of it) "
        "in one pool through the policy simulator under another policy, with the observed "
        "runtimes, and prints per-tenant waits (p50 / p99) and utilisation beside the real "
        "outcome read from the log, and the leases whose start moved most. The real column is "
        "the log's own: each lease's first placement. Not modelled by the replay: "
        + "; ".join(NOT_MODELLED) + ".")
    wi.add_argument("--policy", required=True, metavar="SPEC",
                    help=f"the policy to replay under: {', '.join(NAMED)} (fifo+backfill too)")
    wi.add_argument("--weight", action="append", metavar="TENANT=WEIGHT",
                    help="another weight for a tenant in the replay (repeatable)")
    wi.add_argument("--from", dest="from_", metavar="WHEN",
                    help="requests made at or after: ISO time, epoch seconds, or `2h ago` "
                    "(default: the log's first)")
    wi.add_argument("--to", metavar="WHEN", help="requests made before (default: the last)")
    wi.add_argument("--pool", help="the pool (default: the one with the most leases)")
    wi.add_argument("--cycle-seconds", type=float, default=1.0,
                    help="simulated seconds between scheduling cycles (default 1)")
    wi.add_argument("--nats-url", help="default: $POOL_NATS_URL or the `pool up` endpoints")
    wi.add_argument("--json", action="store_true")
    wi.set_defaults(func=cmd_whatif)
