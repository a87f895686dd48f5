"""The verbs that start things: `pool up`, `pool cluster` and `pool demo` (serve: cli/serve.py)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from cli.connect import (
    nats_url_of,
)
from cli.output import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    Subparsers,
    UsageError,
    fail,
)


def _make_buckets(home: Path, service_url: str, replicas: int) -> None:
    """Every tenant's file buckets (work directories, artifacts) and telemetry stream: the
    operator makes them (on a store from before tenants had telemetry streams, this splits
    POOL_TELEMETRY, whose samples stay readable until they age out)."""
    from bus.errors import BucketQuotaUnreservable, TelemetryRetentionUnreservable
    from bus.local.auth import AuthConfig
    from bus.objects import ensure_tenant_buckets_sync
    from bus.telemetry_streams import ensure_tenant_telemetry_sync
    from local import embedded

    tenants = sorted((embedded.local_auth(home) or AuthConfig()).tenants)
    if tenants:
        try:
            ensure_tenant_buckets_sync(service_url, tenants, replicas=replicas)
        except BucketQuotaUnreservable as e:  # the plane still runs; files wait for room
            print(f"pool: warning [{e.code}]: {e}", file=sys.stderr)
        try:
            ensure_tenant_telemetry_sync(service_url, tenants, replicas=replicas)
        except TelemetryRetentionUnreservable as e:  # jobs run; their output is not kept
            print(f"pool: warning [{e.code}]: {e}", file=sys.stderr)


def cmd_up(args: argparse.Namespace) -> int:
    from bus.admin import describe_streams, ensure_all_streams
    from bus.local.auth import redact
    from local import embedded

    home = Path(args.home).resolve() if args.home else embedded.pool_home()
    stop = threading.Event()

    def _on_signal(signum: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    from cli.gateway import listen_of

    listen = listen_of(args.http)
    emb = embedded.start(home, with_postgres=not args.no_postgres)
    _webhook_key(home)
    _secret_keys(home)
    plane = None
    child = None
    http = None
    try:
        # the control plane in this process connects as the service user (credentials in the URL)
        service_url = emb.service_url or emb.nats_url
        ensure_all_streams(service_url, replicas=args.replicas)
        _make_buckets(home, service_url, args.replicas)
        if not args.no_workers:
            import dataclasses

            from workers.bootstrap import build, served
            from workers.plane import ROLES, ControlPlane
            from workers.processes import PARENT_ROLES, RoleProcess, split_by_default

            config = _plane_config(emb, service_url, args)
            if not args.one_process and split_by_default():
                # the scheduler's roles in a process of their own (workers/processes.py)
                child = RoleProcess(dataclasses.replace(
                    config, database_url=None, metrics_port=(
                        None if args.metrics_port is None else args.metrics_port + 1))).start()
            names = PARENT_ROLES if child is not None else ROLES
            plane = ControlPlane(build(config, served(names))).start()
        http_notes: list[str] = []
        if listen is not None:
            from cli.gateway import start_beside

            http, http_notes = start_beside(emb, listen, home)
        streams = describe_streams(service_url)
        info = {
            "home": str(home),
            "nats_url": emb.nats_url,
            "database_url": redact(emb.database_url),  # endpoints.json (0600) holds it whole
            "auth": emb.secured,
            "endpoints": str(home / "endpoints.json"),
            "streams": streams,
            "http_url": http.url if http is not None else None,
            "scheduler_pid": child.pid if child is not None else None,
            "tenant_caps": vars(emb.caps) if emb.caps is not None else None,
            "node_caps": vars(emb.node_caps) if emb.node_caps is not None else None,
        }
        token = next((n.split()[3] for n in http_notes if n.startswith("http: admin token")),
                     None)
        if token:
            info["http_admin_token"] = token  # made just now, shown this once
        if args.json:
            print(json.dumps(info), flush=True)
        else:
            for note in emb.notes + http_notes:
                print(note)
            for s in streams:
                print(f"stream: {s['name']} ({s['messages']} messages, {s['subjects']})")
            print(f"endpoints: {home / 'endpoints.json'}")
            if plane is not None:
                where = (f"in process {child.pid}" if child is not None else "in this process")
                print("control plane: commands on pool.cmd.<tenant>.lease.…, admin on "
                      f"pool.admin.…, scheduler running {where} (try `pool lease --help`)")
            print("ready: Ctrl-C to stop (data is kept for the next start)", flush=True)
        if args.exit_when_ready:
            return EXIT_OK
        while not stop.wait(0.5):
            emb.reload_if_changed()  # auth.json edited (new tenant or node user): SIGHUP the server
            if child is not None:
                child.ensure()  # a scheduler process that died is started again
        print("stopping…", file=sys.stderr)
        return EXIT_OK
    finally:
        if http is not None:
            http.stop()
        if plane is not None:
            plane.stop()
        if child is not None:
            child.stop()
        emb.stop()
        if not args.json:
            print(f"stopped; data kept in {home}", file=sys.stderr)


def _plane_config(emb: Any, service_url: str, args: argparse.Namespace) -> Any:
    """`pool up`'s control plane's config: each role as its own user (the operator, the
    service user, only made the streams)."""
    from workers.bootstrap import PlaneConfig

    return PlaneConfig(emb.role_urls.get("commands", service_url),
                       database_url=emb.database_url or None,
                       responder_url=emb.responder_url or None,
                       role_urls=dict(emb.role_urls), metrics_port=args.metrics_port)


def _webhook_key(home: Path) -> None:
    """POOL_WEBHOOK_KEY for this `pool up` and its scheduler's process: the one given, else
    one made once and kept in the home (mode 0600), so endpoints' secrets open after a
    restart."""
    import os
    import secrets

    if os.environ.get("POOL_WEBHOOK_KEY"):
        return
    path = home / "webhook.key"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
    os.environ["POOL_WEBHOOK_KEY"] = path.read_text().strip()


def _secret_keys(home: Path) -> None:
    """POOL_SECRET_KEYS for this `pool up` and its scheduler's process: the ring given, else
    one key (`k1`) made once and kept in the home (mode 0600), so tenants' secrets open after
    a restart. To rotate, an operator sets `k2=<new>,k1=<old>` (docs/operations.md)."""
    import os
    import secrets

    if os.environ.get("POOL_SECRET_KEYS"):
        return
    path = home / "secret.keys"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("k1=" + secrets.token_urlsafe(32))
    os.environ["POOL_SECRET_KEYS"] = path.read_text().strip()


def _cluster_ports(state: Path, nodes: int) -> list[int] | None:
    """The client ports of the last `pool cluster up` in this home, so URLs stay the same;
    None (fresh ports) when there was none or one of them is taken now."""
    import socket

    try:
        ports = [int(p) for p in json.loads(state.read_text()).get("ports", [])]
    except (OSError, ValueError, AttributeError):
        return None
    if len(ports) != nodes:
        return None
    for port in ports:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", port))
        except OSError:
            return None
    return ports


def cmd_cluster_up(args: argparse.Namespace) -> int:
    import os

    from bus.admin import describe_streams
    from bus.caps import Caps
    from bus.connguard import ConnectionGuard, user_caps
    from bus.local import auth as bus_auth
    from bus.local.auth import redact
    from bus.local.cluster import NatsCluster
    from local import embedded

    if args.nats_nodes < 1:
        raise UsageError("--nats-nodes must be at least 1 (3 or 5 for a quorum that survives loss)")
    home = Path(args.home).resolve() if args.home else embedded.pool_home()
    root = home / "cluster"
    # a bad cap is refused before anything starts
    caps, node_caps = Caps.from_env(), Caps.nodes_from_env()
    lock_fd = embedded.hold_instance_lock(root)  # one `pool cluster up` per home
    state = root / "cluster.json"
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # the same users as `pool up`: every role its own, passwords kept in auth.json (0600)
    auth = bus_auth.load_or_create(root / embedded.AUTH_FILE)
    if (auth.tenant_caps, auth.node_caps) != (caps, node_caps):  # the accounts' limits too
        auth.tenant_caps, auth.node_caps = caps, node_caps
        bus_auth.save(auth, root / embedded.AUTH_FILE)
    cluster = NatsCluster(root, nodes=args.nats_nodes,
                          ports=_cluster_ports(state, args.nats_nodes), auth=auth)
    plane: Any = None
    guard: Any = None
    pg: Any = None
    try:
        cluster.start()
        guard = ConnectionGuard(bus_auth.guard_url(cluster.url, auth),
                                user_caps(caps, node_caps)).start()
        state.write_text(json.dumps({"urls": cluster.urls, "ports": [s.port for s in
                                                                     cluster.servers]}) + "\n")
        replicas = min(args.replicas, args.nats_nodes)
        cluster.ensure_streams(replicas=replicas)
        database_url = os.environ.get("POOL_DATABASE_URL", "")
        if not database_url and not args.no_postgres and not args.no_workers:
            from projections.postgres.embedded import start_embedded_postgres

            pg = start_embedded_postgres(root / "pg")
            database_url = pg.url
        if not args.no_workers:
            from workers.bootstrap import PlaneConfig, build, served
            from workers.plane import ROLES, ControlPlane

            roles = bus_auth.role_urls(cluster.url, auth)
            config = PlaneConfig(roles["commands"], database_url=database_url or None,
                                 role_urls=roles, responder_url=bus_auth.url_with_credentials(
                                     cluster.url, auth.responder))
            plane = ControlPlane(build(config, served(ROLES))).start()
        streams = describe_streams(cluster.service_url)
        info = {
            "home": str(root),
            "nats_urls": cluster.urls,
            "nats_url": cluster.url,
            "database_url": redact(database_url),
            "auth": True,
            "auth_file": str(root / embedded.AUTH_FILE),
            "meta_leader": cluster.meta_leader(),
            "control_plane": plane is not None,
            "streams": streams,
            "tenant_caps": vars(caps),
            "node_caps": vars(node_caps),
        }
        if args.json:
            print(json.dumps(info), flush=True)
        else:
            _print_cluster_ready(info, cluster, caps, streams, auth, root, pg, plane)
        if args.exit_when_ready:
            return EXIT_OK
        while not stop.wait(0.5):
            pass
        print("stopping…", file=sys.stderr)
        return EXIT_OK
    finally:
        if plane is not None:
            plane.stop()
        if guard is not None:
            guard.stop()
        cluster.stop()
        if pg is not None:
            pg.stop()
        embedded.release_instance_lock(lock_fd)
        if not args.json:
            print(f"stopped; data kept in {root}", file=sys.stderr)


def _print_cluster_ready(info: dict[str, Any], cluster: Any, caps: Any, streams: list[Any],
                         auth: Any, root: Path, pg: Any, plane: Any) -> None:
    """`pool cluster up`'s lines once every server, stream and role is up."""
    for s in cluster.servers:
        print(f"nats: {s.url} ({s.server_name}, JetStream in {s.store_dir})")
    print(f"cluster: {cluster.cluster_name}, {len(cluster.servers)} servers, meta leader "
          f"{info['meta_leader']}; users required (loopback only)")
    print(f"limits: {caps.describe()}; {auth.node_caps.describe('node')}; kept by the "
          "connection guard")
    for st in streams:
        print(f"stream: {st['name']} (R{st['replicas']}, {st['messages']} messages)")
    if info["database_url"]:
        print(f"postgres: {info['database_url']}"
              + (f" (password in {root / 'pg.password'})" if pg is not None else ""))
    if plane is not None:
        print("control plane: commands, scheduler, reconciler"
              + (", projector" if plane.projector is not None else "") + " running")
    print(f"export POOL_NATS_URL={cluster.url}")
    print(f"export POOL_NATS_USER={auth.roles['admin'].user}  # and POOL_NATS_PASSWORD: "
          f"its password in {info['auth_file']}")
    if info["database_url"]:
        print(f"export POOL_DATABASE_URL={info['database_url']}  # *** is the password")
    print("ready: Ctrl-C to stop (data is kept for the next start)", flush=True)


def cmd_cluster_init(args: argparse.Namespace) -> int:
    """Create every stream at --replicas on a running cluster, waiting for it to answer."""
    import time

    from bus.admin import describe_streams, ensure_all_streams

    url = nats_url_of(args)
    deadline = time.monotonic() + args.wait
    while True:
        try:
            ensure_all_streams(url, replicas=args.replicas)
            break
        except Exception as e:  # noqa: BLE001 - servers still starting, or no meta leader yet
            if time.monotonic() >= deadline:
                return fail(f"streams not created within {args.wait:g}s: {e}",
                             getattr(e, "code", "bus_unavailable"), as_json=args.json)
            time.sleep(1.0)
    streams = describe_streams(url)
    if args.json:
        print(json.dumps({"ok": True, "result": {"streams": streams}}))
    else:
        for st in streams:
            print(f"stream: {st['name']} (R{st['replicas']}, {st['messages']} messages)")
    return EXIT_OK


def cmd_cluster_auth(args: argparse.Namespace) -> int:
    """The secrets of compose.yaml: the servers' auth.conf (bcrypt hashes) and cluster.conf
    (the routes' password), and a .env holding each NATS user's password (from one auth.json
    kept beside auth.conf) and PostgreSQL's, Grafana's and the routes' (all 0600)."""
    from bus.local import auth as bus_auth
    from local import compose_secrets

    folder = Path(args.dir)
    env_path = Path(args.env_file)
    # PostgreSQL's, Grafana's and the routes' passwords: those of the .env written before
    extra = compose_secrets.kept_or_made(compose_secrets.read_env(env_path))
    auth = bus_auth.load_or_create(folder / "auth.json")
    for node in args.node or ["agent-1", "agent-2"]:
        if bus_auth.checked_name("node", node) not in auth.nodes:
            auth.add_node(node)
    for tenant in args.tenant or []:
        if bus_auth.checked_name("tenant", tenant) not in auth.tenants:
            auth.add_tenant(tenant)
    bus_auth.save(auth, folder / "auth.json")
    bus_auth.write_server_include(auth, folder / "auth.conf")
    bus_auth.write_private(env_path, bus_auth.env_file(auth)
                           + compose_secrets.env_lines(extra))
    bus_auth.write_private(folder / "cluster.conf",
                           compose_secrets.route_include(extra[compose_secrets.ROUTE]))
    users = [auth.service, auth.responder, auth.guard, *auth.roles.values(),
             *auth.nodes.values()]
    if args.json:
        print(json.dumps({"ok": True, "result": {"users": [c.user for c in users],
                                                 "auth_conf": str(folder / "auth.conf"),
                                                 "cluster_conf": str(folder / "cluster.conf"),
                                                 "env_file": args.env_file}}))
    else:
        print(f"users: {', '.join(c.user for c in users)}")
        print(f"server include: {folder / 'auth.conf'} (bcrypt hashes)")
        print(f"routes: {folder / 'cluster.conf'} (the servers' route user and password)")
        print(f"passwords: {args.env_file} (compose reads it; PostgreSQL's, Grafana's and the "
              "routes' too, kept by every later run)")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    """`pool demo`: the whole system on the embedded default, shown live, then judged."""
    import logging
    import os

    from local.demo import Demo

    logging.basicConfig(level=logging.ERROR if not args.verbose else logging.INFO)
    home = Path(args.home or os.path.join(os.environ.get("POOL_HOME", ".pool"), "demo"))
    demo = Demo(home.resolve(), nodes=args.nodes, flood=args.flood, keep=args.keep,
                live=False if args.plain else None)
    started = __import__("time").monotonic()
    try:
        rc = demo.run()
    except KeyboardInterrupt:
        print("pool demo: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"demo {'passed' if rc == 0 else 'FAILED'} in "
          f"{__import__('time').monotonic() - started:.1f} s")
    return rc


def register(sub: Subparsers) -> None:
    """Add `up`, `cluster` and `demo`."""
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
    up.add_argument("--no-workers", action="store_true",
                    help="servers only: no command service or scheduler")
    up.add_argument("--one-process", action="store_true",
                    help="run the scheduler in this process too (default: a process of its own "
                    "when the machine has two or more cores)")
    up.add_argument("--exit-when-ready", action="store_true", help="start, report, stop")
    up.add_argument("--json", action="store_true", help="print endpoints as JSON")
    up.add_argument("--http", metavar="HOST:PORT",
                    help="the HTTP API and dashboard (default $POOL_HTTP or 127.0.0.1:8080; "
                    "`off` for none)")
    up.add_argument("--metrics-port", type=int, metavar="PORT",
                    help="Prometheus /metrics on 127.0.0.1:PORT (the scheduler's process, "
                    "when it runs apart, on PORT+1; default: none)")
    up.set_defaults(func=cmd_up)

    clu = sub.add_parser("cluster", help="the clustered topology: NATS servers as one JetStream "
                         "cluster").add_subparsers(dest="verb", metavar="VERB", required=True)
    cup = clu.add_parser(
        "up", help="start N nats-servers on loopback as one cluster, R3 streams, a control plane",
        description="The clustered deployment as local processes, for tests and trying it on one "
        "machine: N nats-servers from the wheel on loopback ports as one JetStream cluster "
        "(sync_interval always; data under $POOL_HOME/cluster, kept across restarts), every "
        "stream at --replicas, and a control plane (commands, scheduler, reconciler, projector "
        "with an embedded PostgreSQL unless POOL_DATABASE_URL is set) against it. Prints the "
        "client URLs and POOL_NATS_URL to export. The servers require the same users as `pool "
        "up` (each role its own, passwords in $POOL_HOME/cluster/auth.json) and listen on "
        "127.0.0.1 only (compose.yaml is the multi-machine topology).")
    cup.add_argument("--nats-nodes", type=int, default=3, metavar="N",
                     help="nats-servers in the cluster (default 3; 3 or 5 for a quorum)")
    cup.add_argument("--replicas", type=int, default=3, help="stream replicas (default 3, at "
                     "most N)")
    cup.add_argument("--home", help="data directory (default: $POOL_HOME or ./.pool)")
    cup.add_argument("--no-postgres", action="store_true",
                     help="no embedded PostgreSQL (no projector, no queries)")
    cup.add_argument("--no-workers", action="store_true", help="the NATS cluster only")
    cup.add_argument("--exit-when-ready", action="store_true", help="start, report, stop")
    cup.add_argument("--json", action="store_true", help="print the endpoints as JSON")
    cup.set_defaults(func=cmd_cluster_up)
    cin = clu.add_parser(
        "init", help="create every stream at --replicas on a running cluster (compose's init)",
        description="Wait until POOL_NATS_URL answers with a JetStream meta leader, then create "
        "or update the event log, agent work queue, timers (with the reconciler's consumer), "
        "telemetry and the KV buckets at --replicas. Idempotent; never lowers replicas.")
    cin.add_argument("--nats-url", help="NATS servers, comma-separated (default: POOL_NATS_URL)")
    cin.add_argument("--replicas", type=int, default=3, help="stream replicas (default 3)")
    cin.add_argument("--wait", type=float, default=60.0, metavar="SECONDS",
                     help="how long to wait for the cluster (default 60)")
    cin.add_argument("--json", action="store_true")
    cin.set_defaults(func=cmd_cluster_init)

    cau = clu.add_parser(
        "auth", help="make compose.yaml's secrets: the servers' auth.conf and cluster.conf, and "
        "the .env of passwords",
        description="Create (or keep) the NATS users of the clustered deployment, the same as "
        "`pool up`'s: the operator, the responders, one per control-plane role and the admin "
        "CLI, and one per --node agent. Writes DIR/auth.json (the passwords), DIR/auth.conf "
        "(bcrypt hashes, included by deploy/nats/nats.conf) and ENV_FILE (each password as "
        "POOL_<USER>_PASSWORD, which compose.yaml passes to its services), all mode 0600. "
        "ENV_FILE also gets POOL_POSTGRES_PASSWORD, POOL_GRAFANA_PASSWORD and "
        "POOL_ROUTE_PASSWORD, and DIR/cluster.conf the routes with that password: made once, "
        "kept when ENV_FILE already has them (PostgreSQL's volume keeps the first).")
    cau.add_argument("--dir", default="deploy/nats", help="where auth.json and auth.conf go "
                     "(default deploy/nats)")
    cau.add_argument("--env-file", default=".env", help="the passwords for compose "
                     "(default .env)")
    cau.add_argument("--node", action="append", metavar="NODE",
                     help="a node agent's user (repeat; default agent-1 and agent-2)")
    cau.add_argument("--tenant", action="append", metavar="TENANT",
                     help="a tenant's user (repeat; its password stays in auth.json)")
    cau.add_argument("--json", action="store_true")
    cau.set_defaults(func=cmd_cluster_auth)

    dm = sub.add_parser("demo", help="run the whole system on the embedded default, live",
                        description="Start embedded NATS and PostgreSQL, the control plane, a "
                        "simulated fleet plus one real sandboxed agent, and three tenants' "
                        "work (fair share, preemption, cancellation, an unsatisfiable request, "
                        "a silent agent, a tenant out of credit); end with the credit audit. "
                        "Data under $POOL_HOME/demo, wiped at each start.")
    dm.add_argument("--nodes", type=int, default=200, help="simulated nodes (default 200)")
    dm.add_argument("--flood", type=int, default=150,
                    help="whole-node jobs submitted at once by the three tenants")
    dm.add_argument("--home", help="data directory (default $POOL_HOME/demo)")
    dm.add_argument("--keep", action="store_true", help="keep running after the summary")
    dm.add_argument("--plain", action="store_true", help="progress lines, no live dashboard")
    dm.add_argument("--verbose", "-v", action="store_true")
    dm.set_defaults(func=cmd_demo)

