"""`pool lease exec`, `attach` and `port-forward`: into a running lease's sandbox, over NATS
or, with an HTTP context, the gateway's WebSocket."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from cli.connect import client_opts, context_of, tenant_connection, tenant_of
from cli.output import EXIT_INTERRUPTED, EXIT_OK, Subparsers, UsageError, fail

_FORWARD = re.compile(r"^(?:(\d{1,5}):)?(\d{1,5})$")


def _opener(args: argparse.Namespace) -> Any:
    """How this command opens its session: the HTTP context's gateway (its token decides the
    tenant), or NATS as the tenant's own user."""
    ctx = context_of(args)
    if ctx is not None:
        from client.wssession import over_gateway

        tenant_of(args)  # an admin's context, or a --tenant it does not speak for: refused
        return over_gateway(ctx.url, ctx.token, args.lease_id)
    from client.sessions import over_nats

    tenant = tenant_of(args)
    url, options = tenant_connection(args, tenant)
    return over_nats(url, tenant, args.lease_id, options)


def cmd_lease_exec(args: argparse.Namespace) -> int:
    """Run a command in the lease's sandbox; exit with its code."""
    import asyncio

    from bus.errors import BusError
    from client.sessions import run_exec

    command = list(getattr(args, "job_command", None) or [])
    if not command:
        raise UsageError("the command to run goes after `--` (pool lease exec ID -- CMD …)")
    if args.tty and not sys.stdin.isatty():
        raise UsageError("-t needs a terminal on stdin (leave out -t to pipe)")
    opener = _opener(args)
    try:
        return asyncio.run(run_exec(opener, command, stdin=args.stdin, tty_mode=args.tty,
                                    timeout=max(args.timeout, 1.0)))
    except BusError as e:
        return fail(str(e), e.code, as_json=args.json)


def cmd_lease_attach(args: argparse.Namespace) -> int:
    """Follow the job's output (and feed its stdin with -i); exit with the job's code."""
    import asyncio

    from bus.errors import BusError
    from client.sessions import run_attach

    opener = _opener(args)
    try:
        return asyncio.run(run_attach(opener, stdin=args.stdin,
                                      timeout=max(args.timeout, 1.0)))
    except KeyboardInterrupt:  # detached; the job runs on
        return EXIT_INTERRUPTED
    except BusError as e:
        return fail(str(e), e.code, as_json=args.json)


def _ports(spec: str) -> tuple[int, int]:
    m = _FORWARD.match(spec)
    if m is None:
        raise UsageError(f"[LOCAL:]REMOTE: {spec!r} is not a port or two (8888:8000)")
    remote = int(m.group(2))
    local = int(m.group(1)) if m.group(1) is not None else remote
    if not 1 <= remote <= 65535 or not 0 <= local <= 65535:
        raise UsageError(f"[LOCAL:]REMOTE: ports are 1-65535 (LOCAL 0: any free one): {spec!r}")
    return local, remote


def cmd_lease_port_forward(args: argparse.Namespace) -> int:
    """Forward a local port to a port in the lease's sandbox, until Ctrl-C."""
    import asyncio

    from bus.errors import BusError
    from client.sessions import run_forward

    local, remote = _ports(args.ports)
    opener = _opener(args)

    def listening(port: int) -> None:
        info: dict[str, Any] = {"lease_id": args.lease_id, "local": f"{args.address}:{port}",
                                "remote": remote}
        if args.json:
            print(json.dumps({"ok": True, "result": info}), flush=True)
        else:
            print(f"Forwarding from {args.address}:{port} -> {remote} (Ctrl-C to stop)",
                  file=sys.stderr, flush=True)

    try:
        asyncio.run(run_forward(opener, remote, local=local, host=args.address,
                                on_listening=listening, timeout=max(args.timeout, 1.0)))
    except KeyboardInterrupt:
        return EXIT_OK
    except BusError as e:
        return fail(str(e), e.code, as_json=args.json)
    except OSError as e:  # the local port
        return fail(f"cannot listen on {args.address}:{local}: {e.strerror}", "listen_failed",
                    as_json=args.json)
    return EXIT_OK


def add_run_flags(run: argparse.ArgumentParser) -> None:
    """`pool lease run --stdin`."""
    run.add_argument("--stdin", action="store_true",
                     help="give the job a stdin that `pool lease attach -i ID` writes to "
                     "(otherwise it reads /dev/null)")


def register(lease: Subparsers) -> None:
    """Add `lease exec`, `lease attach` and `lease port-forward`."""
    ex = lease.add_parser(
        "exec", help="run a command inside a running lease's sandbox",
        description="Runs the command after `--` in the lease's sandbox (its namespaces, user, "
        "root and cgroup), streams its output and exits with its code. -i sends stdin; -t "
        "gives a terminal (resize, Ctrl-C and Ctrl-D as a terminal expects). Each exec is an "
        "event in the lease's log (who, when, the command; not the bytes).",
        epilog="examples: pool lease exec ID -- sh -c 'echo in; exit 4'   "
        "pool lease exec -it ID -- sh")
    client_opts(ex, tenant=True)
    ex.add_argument("lease_id")
    ex.add_argument("-i", "--stdin", action="store_true", help="pass this process's stdin on")
    ex.add_argument("-t", "--tty", action="store_true",
                    help="an interactive terminal (needs one on stdin)")
    ex.set_defaults(func=cmd_lease_exec, job_command=[])
    at = lease.add_parser(
        "attach", help="follow a running job's own output, and feed its stdin with -i",
        description="Prints what the job writes from now on (`pool lease logs` has what came "
        "before) until it ends, then exits with its code; Ctrl-C detaches and leaves it "
        "running. With -i, this process's stdin goes to the job's (a job started with "
        "--stdin), and its end is the job's end of input. Each attach is an event in the "
        "lease's log.",
        epilog="example: pool lease run -d --stdin -- sh -c 'while read l; do echo $l; done'; "
        "pool lease attach -i ID")
    client_opts(at, tenant=True)
    at.add_argument("lease_id")
    at.add_argument("-i", "--stdin", action="store_true",
                    help="pass this process's stdin on to the job's")
    at.set_defaults(func=cmd_lease_attach)
    pf = lease.add_parser(
        "port-forward", help="forward a local port to a port inside a running lease's sandbox",
        description="Listens on --address:LOCAL and relays each connection to 127.0.0.1:REMOTE "
        "inside the lease's own network namespace, many at once, until Ctrl-C. LOCAL defaults "
        "to REMOTE; 0 picks a free port (printed).",
        epilog="example: pool lease port-forward ID 8888:8888")
    client_opts(pf, tenant=True)
    pf.add_argument("lease_id")
    pf.add_argument("ports", metavar="[LOCAL:]REMOTE")
    pf.add_argument("--address", default="127.0.0.1",
                    help="the local address to listen on (default 127.0.0.1)")
    pf.set_defaults(func=cmd_lease_port_forward)
