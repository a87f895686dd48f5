"""`pool chaos`: the fault suite against real processes."""

from __future__ import annotations

import argparse
import sys

from cli.output import (
    Subparsers,
    UsageError,
    print_result,
)


def cmd_chaos(args: argparse.Namespace) -> int:
    from chaos.suite import NAMES, run_suite, summary

    try:
        only = sorted({int(x) for x in args.only.split(",") if x.strip()}) if args.only else None
    except ValueError:
        raise UsageError(f"--only takes scenario numbers like 1,3 (got {args.only!r})") from None
    if only and not set(only) <= set(NAMES):
        raise UsageError(f"--only: scenarios are {min(NAMES)}..{max(NAMES)}")
    results = run_suite(
        quick=args.quick, only=only, keep=args.keep,
        progress=lambda s: print(s, file=sys.stderr, flush=True),
        on_result=None if args.json else (lambda o: print(o.line(), flush=True)),
    )
    line = summary(results)
    failed = [o.name for o in results if not (o.passed or o.skipped)]
    return print_result(
        {"quick": args.quick, "results": [o.to_dict() for o in results], "summary": line},
        args.json, line,
        error=("faults_failed", f"{line} ({', '.join(failed)})") if failed else None)


def register(sub: Subparsers) -> None:
    """Add `chaos`."""
    chaos = sub.add_parser(
        "chaos", help="the fault suite: kill, stop and garble a pool, check the log",
        description="Runs each fault scenario against real processes on loopback ports and "
        "prints one line of figures per scenario, then `faults: N passed, M failed`; exit 1 "
        "if any failed. 1 NATS node kills (R3), 2 quorum loss, 3 scheduler failover, "
        "4 projector kills, 5 idempotent retries, 6 agent stopped past grace, 7 PostgreSQL "
        "restart, 8 bad input, 9 malicious tenant.")
    chaos.add_argument("--quick", action="store_true", help="CI sizes (a few minutes in all)")
    chaos.add_argument("--only", metavar="N,…", help="run only these scenarios")
    chaos.add_argument("--keep", action="store_true",
                       help="keep every scenario's directory (logs, stores); failed ones are "
                       "always kept")
    chaos.add_argument("--json", action="store_true")
    chaos.set_defaults(func=cmd_chaos)
