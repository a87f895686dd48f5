"""`pool guard`: the connection guard as a process of its own, for servers `pool up` did not
start (compose.yaml); `pool up` and `pool cluster up` run one beside their own servers.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading

from cli.output import EXIT_OK, Subparsers, UsageError


def cmd_guard(args: argparse.Namespace) -> int:
    from bus.caps import Caps
    from bus.connection import USER_ENV
    from bus.connguard import ConnectionGuard, user_caps
    from bus.local.auth import GUARD_USER, redact

    url = args.nats_url or os.environ.get("POOL_NATS_URL", "")
    if not url:
        raise UsageError("no NATS server: set POOL_NATS_URL / --nats-url (with the guard's "
                         f"user, {GUARD_USER}, in the URL or POOL_NATS_USER and its password)")
    caps, node_caps = Caps.from_env(), Caps.nodes_from_env()
    if not args.sweep_seconds > 0:
        raise UsageError("--sweep-seconds must be more than 0")
    if "@" not in url and not os.environ.get(USER_ENV):
        raise UsageError(f"the guard speaks as the server's system account user ({GUARD_USER}): "
                         f"name it in the URL or in {USER_ENV} and POOL_NATS_PASSWORD")
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    guard = ConnectionGuard(url, user_caps(caps, node_caps),
                            sweep_seconds=args.sweep_seconds).start()
    print(f"guarding {redact(url)}: {caps.describe()}; {node_caps.describe('node')}; Ctrl-C to "
          "stop", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        guard.stop()
    return EXIT_OK


def register(sub: Subparsers) -> None:
    """Add `guard`."""
    from bus.connguard import SWEEP_SECONDS

    g = sub.add_parser(
        "guard",
        help="hold each tenant's and node's NATS user to its connection and subscription caps",
        description="Close a tenant's NATS connections past POOL_TENANT_MAX_CONNECTIONS (the "
        "newest go) and, counted every --sweep-seconds, past POOL_TENANT_MAX_SUBSCRIPTIONS "
        "(the connection holding the most goes), on every server of POOL_NATS_URL; a node "
        "agent's past POOL_NODE_MAX_CONNECTIONS and POOL_NODE_MAX_SUBSCRIPTIONS. Speaks as "
        "the servers' system account user, pool-guard (`pool cluster auth` writes its "
        "password to .env as POOL_GUARD_PASSWORD). `pool up` and `pool cluster up` run one "
        "themselves. docs/adr/023-connection-caps-by-a-guard.md")
    g.add_argument("--nats-url", help="the servers (default: POOL_NATS_URL)")
    g.add_argument("--sweep-seconds", type=float, default=SWEEP_SECONDS, metavar="SECONDS",
                   help="how often every tenant's and node's connections and subscriptions are "
                   f"counted again from the servers (default {SWEEP_SECONDS:g})")
    g.set_defaults(func=cmd_guard)
