"""The `pool` command: builds the parser from the verb groups' modules and runs one verb.

Output for people or `--json`, and the exit codes: cli/output.py.
"""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from cli.output import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    Parser,
    Subparsers,
    UsageError,
    fail,
)


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


# Every command of `pool --help`, in its order: the name, the `module:function` that adds its
# parser (and those of its verbs), and its help line. Only the module of the command at hand is
# imported, so a command starts without the others' imports nor their parsers; the table is
# checked against the modules by tests/unit/test_cli_start.py.
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("up", "cli.up:register",
     "start the embedded NATS and PostgreSQL and create the streams"),
    ("cluster", "cli.up:register",
     "the clustered topology: NATS servers as one JetStream cluster"),
    ("demo", "cli.up:register", "run the whole system on the embedded default, live"),
    ("schemas", "cli.schemas:register", "wire schemas"),
    ("bench", "cli.bench:register", "benchmarks that print figures"),
    ("chaos", "cli.chaos:register",
     "the fault suite: kill, stop and garble a pool, check the log"),
    ("serve", "cli.serve:register_serve",
     "run the command service and the scheduler (or some of the roles)"),
    ("guard", "cli.guard:register",
     "hold each tenant's and node's NATS user to its connection and subscription caps"),
    ("gateway", "cli.gateway:register",
     "serve the HTTP API, its OpenAPI document and the web dashboard"),
    ("login", "cli.contexts:register",
     "check a token against a gateway and save it as the current context"),
    ("context", "cli.contexts:register", "saved contexts: list, use, delete"),
    ("whoami", "cli.contexts:register", "who tenant commands speak as, asked of the gateway"),
    ("lease", "cli.lease:register", "request and manage leases"),
    ("admin", "cli.admin:register", "configure pools, tenants and nodes"),
    ("image", "cli.images:register", "image signing keys and signatures"),
    ("node", "cli.admin:register_node_credits", "node maintenance"),
    ("credits", "cli.admin:register_node_credits", "tenant credits"),
    ("queue", "cli.views:register", "waiting requests, from the PostgreSQL views"),
    ("balance", "cli.views:register", "tenant credits, from the PostgreSQL views"),
    ("capacity", "cli.views:register", "node capacity, from the PostgreSQL views"),
    ("leases", "cli.views:register", "every lease, from the PostgreSQL views"),
    ("projections", "cli.views:register", "the PostgreSQL views"),
    ("audit", "cli.views:register", "check the books against the log"),
    ("whatif", "cli.whatif:register",
     "replay a window of a pool's real requests under another policy, beside what happened"),
    ("report", "cli.report:register", "usage reports from the views"),
    ("usage", "cli.report:register_usage",
     "your tenant's use per pool, from the gateway: leases, resource-seconds, credits"),
    ("agent", "cli.agent:register", "run this machine as a node"),
    ("telemetry", "cli.telemetry:register", "samples from node agents"),
    ("webhook", "cli.webhook:register", "POST your lease-feed records to your endpoints"),
    ("secret", "cli.secret:register", "your secrets: kept sealed, handed to jobs by name"),
    ("shares", "cli.quotas:register",
     "each tenant's weight, current share, decayed usage and rank in a pool's fair share"),
    ("status", "cli.overview:register", ("every component: NATS, streams, scheduler leader, "
                                         "projector lag, agents seen (exit 1 if one fails)")),
    ("pools", "cli.overview:register",
     "pools with their nodes, free capacity and leases, from the PostgreSQL views"),
    ("nodes", "cli.overview:register",
     "nodes: state, free capacity, leases, last heartbeat, from the PostgreSQL views"),
    ("tenants", "cli.overview:register", "tenants: credits and leases, from the PostgreSQL views"),
    ("completion", "cli.completion:register", "print a shell completion script (bash or zsh)"),
)


def _register(where: str) -> Callable[[Subparsers], None]:
    module, _, name = where.partition(":")
    register: Callable[[Subparsers], None] = getattr(importlib.import_module(module), name)
    return register


def build_parser(words: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of `pool`: whole (every command's flags) when `words` is None, else the
    parser `words` need: the commands they name in full, every other one as its help line."""
    p = Parser(
        prog="pool",
        description="computepool: an event-sourced control plane for pooled compute.",
    )
    p.add_argument("--version", action=_VersionAction)
    p.add_argument("--context", metavar="NAME",
                   help="the saved context tenant commands speak through (default: "
                   "$POOL_CONTEXT, else the current one; `pool context list`)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    sub.command_words = None if words is None else list(words)  # type: ignore[attr-defined]
    wanted = None if words is None else _command_word(words)
    # the module that adds the command at hand (None: every module, as `completion` needs)
    module = None if wanted in (None, "completion") else \
        next((where for name, where, _ in COMMANDS if name == wanted), "")
    for command, where, help_text in COMMANDS:
        if command in sub.choices:
            continue  # added with an earlier command of its module (up: cluster, demo)
        if module is None or where == module:
            _register(where)(sub)
        else:
            sub.add_parser(command, help=help_text, add_help=False)  # listed, not parsed
    p.set_defaults(root_parser=p)  # for `pool completion`, which walks the whole tree
    return p


def _command_word(words: Sequence[str]) -> str:
    """The command `words` name: the first word that is neither a flag of `pool` itself nor
    the value of one (`pool --context lab leases`)."""
    it = iter(words)
    for w in it:
        if w == "--context":
            next(it, None)
        elif not w.startswith("-"):
            return w
    return ""


class _VersionAction(argparse.Action):
    """`--version`: the installed version, looked up only when asked (importlib.metadata is
    slow to load)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0,
                         help=help or "show program's version number and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(f"pool {version()} (computepool)")
        parser.exit()


# A command's first second runs without the cyclic garbage collector: its passes over what the
# imports allocate (none of it garbage) were a tenth of `pool lease run -- true`; a command that
# runs longer gets it back (docs/performance-log.md, 2026-12-06).
GC_PAUSE_SECONDS = 1.0


def _pause_gc() -> None:
    import gc

    gc.disable()
    timer = threading.Timer(GC_PAUSE_SECONDS, gc.enable)
    timer.daemon = True
    timer.start()


def _observability() -> Any:
    """bus.observability set up, when POOL_OTEL_EXPORTER asks for an exporter (none|console|
    otlp; none by default); else None, and OpenTelemetry is not even loaded: with no provider
    set, a span is its API's no-op wherever one is made."""
    import os

    if os.environ.get("POOL_OTEL_EXPORTER", "").strip().lower() in ("", "none"):
        return None
    from bus import observability

    observability.setup()
    return observability


def main(argv: Sequence[str] | None = None) -> int:
    """Run `pool ARGV`; with no `argv`, as the program (sys.argv), its garbage collector paused
    for a short command's life and its objects left alone at exit."""
    if argv is None:
        _pause_gc()
        try:
            return _main(sys.argv[1:])
        finally:
            import gc

            gc.freeze()  # the interpreter's exit need not walk them: the process ends
    return _main(argv)


def _main(argv: Sequence[str]) -> int:
    words = list(argv)
    # `pool lease commit ID … -- sh -c '…'`: argparse (3.11) mishandles `--` under
    # subcommands, so the job's command after it is split off here
    tail: list[str] | None = None
    if "--" in words:
        cut = words.index("--")
        words, tail = words[:cut], words[cut + 1:]
    parser = build_parser(words)
    try:
        args = parser.parse_args(words)
        if tail is not None:
            if not hasattr(args, "job_command"):
                parser.error("`-- COMMAND` is only taken by `pool lease run`, `lease commit` "
                             "and `lease exec`")
            args.job_command = tail
    except SystemExit as e:  # --help (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    func: Callable[[argparse.Namespace], int] = args.func
    observability = _observability()
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
        if observability is not None:
            observability.shutdown()  # export what is still queued
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
