"""`pool serve`: run some or all of the control plane's roles against a NATS server."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from cli.connect import nats_url_of
from cli.output import EXIT_OK, Subparsers, UsageError


def cmd_serve(args: argparse.Namespace) -> int:
    from workers.bootstrap import PlaneConfig, build, served
    from workers.plane import ControlPlane, parse_roles

    url = nats_url_of(args)
    try:
        roles = parse_roles(args.role)
    except ValueError as e:
        raise UsageError(str(e)) from e
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    from local import embedded

    db_url = getattr(args, "database_url", None) or embedded.endpoints()[1] or None
    named = {r.strip() for value in args.role or [] for r in value.split(",")}
    if "projector" in named and not db_url:
        raise UsageError("the projector role needs a database: set POOL_DATABASE_URL / "
                         "--database-url")
    views = tuple(v for v in (args.views or "").split(",") if v) or None
    # against this machine's `pool up`, the responders answer as their own user
    responder = None if getattr(args, "nats_url", None) else embedded.responder_url() or None
    # and each role as its own user: this machine's `pool up`'s, or those whose passwords the
    # environment holds (compose.yaml)
    import os

    from bus.local.auth import role_urls_from_env

    from_env = role_urls_from_env(url, os.environ)
    responder = from_env.pop("responder", None) or responder
    if from_env and responder is None and roles & {"commands", "scheduler"}:
        raise UsageError("the commands and scheduler roles answer requests as the responders' "
                         "user: set POOL_RESPONDER_PASSWORD beside the roles' passwords")
    role_urls: dict[str, str] | None = from_env or None
    if role_urls is None and not getattr(args, "nats_url", None):
        role_urls = embedded.role_urls() or None
    checkpoint_every = (None if getattr(args, "no_checkpoint", False) else
                        (args.checkpoint_every, args.checkpoint_seconds))
    config = PlaneConfig(url, database_url=db_url, projector_views=views,
                         leader_ttl_seconds=getattr(args, "leader_ttl", 3.0),
                         responder_url=responder, role_urls=role_urls or {},
                         checkpoint_every=checkpoint_every,
                         metrics_port=getattr(args, "metrics_port", None),
                         metrics_host=getattr(args, "metrics_host", "127.0.0.1"))
    cp = ControlPlane(build(config, served(roles))).start()
    from bus.local.auth import redact

    running = [r for r in ("commands", "scheduler", "reconciler", "projector")
               if r in roles and (r != "projector" or cp.projector is not None)]
    print(f"serving {', '.join(running)} on {redact(url)}: Ctrl-C to stop", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        cp.stop()
        print("stopped", file=sys.stderr)
    return EXIT_OK


def register_serve(sub: Subparsers) -> None:
    """Add `serve`."""
    srv = sub.add_parser(
        "serve", help="run the command service and the scheduler (or some of the roles)",
        description="Run control-plane roles against POOL_NATS_URL (a comma-separated list names "
        "the servers of a cluster). commands: command, admin and node subjects (queue group "
        "pool-commands: run any number); scheduler: placements and agent orders (leader elections "
        "in JetStream KV: one scheduler per pool, pools spread over the scheduler processes, "
        "one of them dispatching; the others take over when one dies); reconciler: fired deadline "
        "timers (one shared durable consumer: any number); projector: the PostgreSQL views "
        "(needs POOL_DATABASE_URL).")
    srv.add_argument("--role", action="append", metavar="ROLE",
                     help="commands|scheduler|reconciler|projector|all; repeat it or give a "
                     "comma list (default: all)")
    srv.add_argument("--views", metavar="VIEW,…",
                     help="the projector's views (default: all of queue,balance,capacity,leases)")
    srv.add_argument("--nats-url", help="NATS server (default: POOL_NATS_URL or `pool up`)")
    srv.add_argument("--database-url",
                     help="PostgreSQL for the views (default: POOL_DATABASE_URL or `pool up`)")
    srv.add_argument("--leader-ttl", type=float, default=3.0, metavar="SECONDS",
                     help="the schedulers' leader leases (per pool, and the dispatcher's): "
                     "another scheduler takes over this long after one dies (default 3)")
    from workers.scheduler.checkpoint import EVERY_EVENTS, EVERY_SECONDS

    srv.add_argument("--checkpoint-every", type=int, default=EVERY_EVENTS, metavar="EVENTS",
                     help="the scheduler checkpoints its fold after this many events "
                     f"(default {EVERY_EVENTS:,}) …")
    srv.add_argument("--checkpoint-seconds", type=float, default=EVERY_SECONDS,
                     metavar="SECONDS", help="… or this many seconds, whichever comes first "
                     f"(default {EVERY_SECONDS:g})")
    srv.add_argument("--no-checkpoint", action="store_true",
                     help="neither read nor write the scheduler's checkpoint: its start-up "
                     "replays the whole log")
    import os

    port = os.environ.get("POOL_METRICS_PORT", "")
    srv.add_argument("--metrics-port", type=int, metavar="PORT",
                     default=int(port) if port.isdigit() else None,
                     help="Prometheus /metrics on PORT (default: $POOL_METRICS_PORT, else none)")
    srv.add_argument("--metrics-host", default=os.environ.get("POOL_METRICS_HOST", "127.0.0.1"),
                     metavar="HOST", help="the address /metrics listens on (default "
                     "$POOL_METRICS_HOST or 127.0.0.1; in a container: 0.0.0.0)")
    srv.set_defaults(func=cmd_serve)
