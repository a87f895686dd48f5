"""The `pool` command: builds the parser from the verb groups' modules and runs one verb.

Output for people or `--json`, and the exit codes: cli/output.py.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from cli import (
    admin,
    agent,
    bench,
    chaos,
    completion,
    gateway,
    images,
    lease,
    overview,
    quotas,
    report,
    schemas,
    telemetry,
    up,
    views,
)
from cli.output import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, Parser, UsageError, fail


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP: unwind as Ctrl-C does, so every `finally` stops what this process
    started (servers, children) before it exits."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _terminate(signum: int, _frame: Any) -> None:
    raise Terminated(signum)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("computepool")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="pool",
        description="computepool: an event-sourced control plane for pooled compute.",
    )
    p.add_argument("--version", action="version", version=f"pool {version()} (computepool)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    # the order of `pool --help`
    for register in (up.register, schemas.register, bench.register, chaos.register,
                     up.register_serve, gateway.register, lease.register, admin.register,
                     images.register,
                     admin.register_node_credits, views.register, report.register,
                     agent.register,
                     telemetry.register, quotas.register, overview.register,
                     completion.register):
        register(sub)
    p.set_defaults(root_parser=p)  # for `pool completion`, which walks the whole tree
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    # `pool lease commit ID … -- sh -c '…'`: argparse (3.11) mishandles `--` under
    # subcommands, so the job's command after it is split off here
    tail: list[str] | None = None
    if "--" in words:
        cut = words.index("--")
        words, tail = words[:cut], words[cut + 1:]
    try:
        args = parser.parse_args(words)
        if tail is not None:
            if not hasattr(args, "job_command"):
                parser.error("`-- COMMAND` is only taken by `pool lease run` and `lease commit`")
            args.job_command = tail
    except SystemExit as e:  # --help (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    func: Callable[[argparse.Namespace], int] = args.func
    from bus import observability

    observability.setup()  # POOL_OTEL_EXPORTER=none|console|otlp; none by default
    # verbs that run until told to stop (up, serve, agent) install their own handlers
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, _terminate)
    try:
        return func(args)
    except UsageError as e:
        if getattr(args, "json", False):  # the envelope every command prints with --json
            print(json.dumps({"ok": False, "error": {"code": e.code, "message": str(e),
                                                     "reasons": {}}}))
        print(f"pool: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Terminated as e:
        print(f"pool: stopped by {e}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("pool: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `pool … | head`: the reader has all it wanted
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as e:  # noqa: BLE001 - the edge: every failure leaves as one clear line
        code = getattr(e, "code", type(e).__name__)
        return fail(str(e) or type(e).__name__, str(code), as_json=getattr(args, "json", False))
    finally:
        observability.shutdown()  # export what is still queued
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
