"""The `pool` command: the single entry point for operators, tenants and tests.

Each verb parses its flags, calls one function of the layer it belongs to, and prints a table
for people or JSON (`--json`) for machines. Errors go to stderr in one line; exit codes mean:
0 ok, 1 the operation failed, 2 bad usage, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def _fail(message: str, code: str = "error", *, as_json: bool = False) -> int:
    if as_json:
        print(json.dumps({"ok": False, "error": {"code": code, "message": message}}))
    print(f"pool: error [{code}]: {message}", file=sys.stderr)
    return EXIT_FAILED


# -- pool up -------------------------------------------------------------------------------


def cmd_up(args: argparse.Namespace) -> int:
    from bus.admin import describe_streams, ensure_all_streams
    from workers import embedded

    home = Path(args.home).resolve() if args.home else embedded.pool_home()
    stop = threading.Event()

    def _on_signal(signum: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    emb = embedded.start(home, with_postgres=not args.no_postgres)
    try:
        ensure_all_streams(emb.nats_url, replicas=args.replicas)
        streams = describe_streams(emb.nats_url)
        info = {
            "home": str(home),
            "nats_url": emb.nats_url,
            "database_url": emb.database_url,
            "streams": streams,
        }
        if args.json:
            print(json.dumps(info), flush=True)
        else:
            for note in emb.notes:
                print(note)
            for s in streams:
                print(f"stream: {s['name']} ({s['messages']} messages, {s['subjects']})")
            print(f"endpoints: {home / 'endpoints.json'}")
            print("ready: Ctrl-C to stop (data is kept for the next start)", flush=True)
        if args.exit_when_ready:
            return EXIT_OK
        while not stop.wait(0.5):
            pass
        print("stopping…", file=sys.stderr)
        return EXIT_OK
    finally:
        emb.stop()
        if not args.json:
            print(f"stopped; data kept in {home}", file=sys.stderr)


# -- pool schemas --------------------------------------------------------------------------


def cmd_schemas_export(args: argparse.Namespace) -> int:
    from schemas.export import export

    out = Path(args.dir)
    paths = export(out)
    if args.json:
        print(json.dumps({"ok": True, "files": [str(p) for p in paths]}))
    else:
        for p in paths:
            print(p)
        print(f"{len(paths)} schema files written to {out}")
    return EXIT_OK


# -- pool bench ----------------------------------------------------------------------------


def cmd_bench_eventlog(args: argparse.Namespace) -> int:
    from bus.bench import run_eventlog_bench

    result = run_eventlog_bench(
        nats_url=args.nats_url,
        messages=args.messages,
        saves=args.saves,
        quick=args.quick,
        progress=None if args.json else (lambda s: print(s, file=sys.stderr, flush=True)),
    )
    if args.json:
        print(json.dumps(result))
    else:
        print(result["table"])
    return EXIT_OK


# -- wiring --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pool",
        description="computepool: an event-sourced control plane for pooled compute.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    up = sub.add_parser(
        "up",
        help="start the embedded NATS and PostgreSQL and create the streams",
        description="Start the embedded default under $POOL_HOME (default ./.pool): nats-server "
        "2.15 with JetStream (sync_interval always) and PostgreSQL via pgserver, unless "
        "POOL_NATS_URL / POOL_DATABASE_URL name existing servers.",
    )
    up.add_argument("--home", help="data directory (default: $POOL_HOME or ./.pool)")
    up.add_argument("--replicas", type=int, default=1, help="stream replicas (1 embedded)")
    up.add_argument("--no-postgres", action="store_true", help="start NATS only")
    up.add_argument("--exit-when-ready", action="store_true", help="start, report, stop")
    up.add_argument("--json", action="store_true", help="print endpoints as JSON")
    up.set_defaults(func=cmd_up)

    sch = sub.add_parser("schemas", help="wire schemas").add_subparsers(dest="sub", metavar="VERB")
    sch.required = True
    exp = sch.add_parser("export", help="write JSON Schema and AsyncAPI files")
    exp.add_argument("--dir", default=str(Path(__file__).resolve().parent.parent / "schemas" / "json"))
    exp.add_argument("--json", action="store_true")
    exp.set_defaults(func=cmd_schemas_export)

    bench = sub.add_parser("bench", help="benchmarks that print figures").add_subparsers(
        dest="sub", metavar="BENCH"
    )
    bench.required = True
    ev = bench.add_parser(
        "eventlog",
        help="raw JetStream publish vs eventsourcing saves vs atomic multi-aggregate saves",
    )
    ev.add_argument("--nats-url", help="use this server (default: start a fresh embedded one)")
    ev.add_argument("--messages", type=int, default=20000, help="raw publishes per mode")
    ev.add_argument("--saves", type=int, default=2000, help="application saves per mode")
    ev.add_argument("--quick", action="store_true", help="a small size for CI")
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(func=cmd_bench_eventlog)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        print("pool: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # the edge: every failure leaves as one clear line
        code = getattr(e, "code", type(e).__name__)
        return _fail(str(e) or type(e).__name__, str(code), as_json=getattr(args, "json", False))


if __name__ == "__main__":
    sys.exit(main())
