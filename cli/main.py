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
    from local import embedded

    home = Path(args.home).resolve() if args.home else embedded.pool_home()
    stop = threading.Event()

    def _on_signal(signum: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    emb = embedded.start(home, with_postgres=not args.no_postgres)
    plane = None
    try:
        # the control plane in this process connects as the service user (credentials in the URL)
        service_url = emb.service_url or emb.nats_url
        ensure_all_streams(service_url, replicas=args.replicas)
        if not args.no_workers:
            from control.plane import ControlPlane

            plane = ControlPlane(service_url, database_url=emb.database_url or None).start()
        streams = describe_streams(service_url)
        info = {
            "home": str(home),
            "nats_url": emb.nats_url,
            "database_url": emb.database_url,
            "auth": emb.secured,
            "endpoints": str(home / "endpoints.json"),
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
            if plane is not None:
                print("control plane: commands on pool.cmd.<tenant>.lease.…, admin on "
                      "pool.admin.…, scheduler running (try `pool lease --help`)")
            print("ready: Ctrl-C to stop (data is kept for the next start)", flush=True)
        if args.exit_when_ready:
            return EXIT_OK
        while not stop.wait(0.5):
            emb.reload_if_changed()  # auth.json edited (new tenant or node user): SIGHUP the server
        print("stopping…", file=sys.stderr)
        return EXIT_OK
    finally:
        if plane is not None:
            plane.stop()
        emb.stop()
        if not args.json:
            print(f"stopped; data kept in {home}", file=sys.stderr)


# -- pool cluster --------------------------------------------------------------------------


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
    from bus.local.cluster import NatsCluster
    from local import embedded

    if args.nats_nodes < 1:
        raise _Usage("--nats-nodes must be at least 1 (3 or 5 for a quorum that survives loss)")
    home = Path(args.home).resolve() if args.home else embedded.pool_home()
    root = home / "cluster"
    root.mkdir(parents=True, exist_ok=True)
    state = root / "cluster.json"
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    cluster = NatsCluster(root, nodes=args.nats_nodes,
                          ports=_cluster_ports(state, args.nats_nodes))
    plane: Any = None
    pg: Any = None
    try:
        cluster.start()
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
            from control.plane import ControlPlane

            plane = ControlPlane(cluster.url, database_url=database_url or None).start()
        streams = describe_streams(cluster.url)
        info = {
            "home": str(root),
            "nats_urls": cluster.urls,
            "nats_url": cluster.url,
            "database_url": database_url,
            "auth": False,
            "meta_leader": cluster.meta_leader(),
            "control_plane": plane is not None,
            "streams": streams,
        }
        if args.json:
            print(json.dumps(info), flush=True)
        else:
            for s in cluster.servers:
                print(f"nats: {s.url} ({s.server_name}, JetStream in {s.store_dir})")
            print(f"cluster: {cluster.cluster_name}, {len(cluster.servers)} servers, meta leader "
                  f"{info['meta_leader']}; no auth (loopback only)")
            for st in streams:
                print(f"stream: {st['name']} (R{st['replicas']}, {st['messages']} messages)")
            if database_url:
                print(f"postgres: {database_url}")
            if plane is not None:
                print("control plane: commands, scheduler, reconciler"
                      + (", projector" if plane.projector is not None else "") + " running")
            print(f"export POOL_NATS_URL={cluster.url}")
            if database_url:
                print(f"export POOL_DATABASE_URL={database_url}")
            print("ready: Ctrl-C to stop (data is kept for the next start)", flush=True)
        if args.exit_when_ready:
            return EXIT_OK
        while not stop.wait(0.5):
            pass
        print("stopping…", file=sys.stderr)
        return EXIT_OK
    finally:
        if plane is not None:
            plane.stop()
        cluster.stop()
        if pg is not None:
            pg.stop()
        if not args.json:
            print(f"stopped; data kept in {root}", file=sys.stderr)


def cmd_cluster_init(args: argparse.Namespace) -> int:
    """Create every stream at --replicas on a running cluster, waiting for it to answer."""
    import time

    from bus.admin import describe_streams, ensure_all_streams

    url = _nats_url(args)
    deadline = time.monotonic() + args.wait
    while True:
        try:
            ensure_all_streams(url, replicas=args.replicas)
            break
        except Exception as e:  # noqa: BLE001 - servers still starting, or no meta leader yet
            if time.monotonic() >= deadline:
                return _fail(f"streams not created within {args.wait:g}s: {e}",
                             getattr(e, "code", "bus_unavailable"), as_json=args.json)
            time.sleep(1.0)
    streams = describe_streams(url)
    if args.json:
        print(json.dumps({"ok": True, "result": {"streams": streams}}))
    else:
        for st in streams:
            print(f"stream: {st['name']} (R{st['replicas']}, {st['messages']} messages)")
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


# -- control plane and clients -------------------------------------------------------------


def _nats_url(args: argparse.Namespace) -> str:
    from local import embedded

    # the service user's URL of a local `pool up` (admin commands need it), or POOL_NATS_URL as given
    url = getattr(args, "nats_url", None) or embedded.service_url()
    if not url:
        raise _Usage("no NATS server: run `pool up` first, or set POOL_NATS_URL / --nats-url")
    return str(url)


class _Usage(Exception):
    code = "usage"


def cmd_serve(args: argparse.Namespace) -> int:
    from control.plane import ControlPlane, parse_roles

    url = _nats_url(args)
    try:
        roles = parse_roles(args.role)
    except ValueError as e:
        raise _Usage(str(e)) from e
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    from local import embedded

    db_url = getattr(args, "database_url", None) or embedded.endpoints()[1] or None
    named = {r.strip() for value in args.role or [] for r in value.split(",")}
    if "projector" in named and not db_url:
        raise _Usage("the projector role needs a database: set POOL_DATABASE_URL / --database-url")
    views = [v for v in (args.views or "").split(",") if v] or None
    cp = ControlPlane(url, database_url=db_url, roles=roles, projector_views=views,
                      leader_ttl_seconds=getattr(args, "leader_ttl", 3.0)).start()
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


def _print_envelope(reply: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(reply))
    elif reply.get("ok"):
        body = reply.get("lease") or reply.get("result") or {}
        width = max((len(k) for k in body), default=0)
        for k, v in body.items():
            if v is None or v == {} or v == []:
                continue
            print(f"{k:<{width}}  {json.dumps(v) if isinstance(v, (dict, list)) else v}")
    if not reply.get("ok"):
        err = reply.get("error") or {}
        reasons = err.get("reasons") or {}
        extra = f" ({', '.join(f'{k}={v}' for k, v in reasons.items())})" if reasons else ""
        print(f"pool: error [{err.get('code')}]: {err.get('message')}{extra}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _client(args: argparse.Namespace, tenant: str = "") -> Any:
    from bus.local.auth import inbox_prefix
    from client.api import PoolClient
    from local import embedded

    if not tenant:
        return PoolClient(_nats_url(args), tenant, timeout=args.timeout)
    # a tenant speaks as its own user, so the server itself pins it to pool.cmd.<tenant>.> and
    # its replies to _INBOX_<tenant>.>; an explicit --nats-url / POOL_NATS_URL is used as given
    options: dict[str, Any] = {"inbox_prefix": inbox_prefix(tenant).encode()}
    url = getattr(args, "nats_url", None)
    auth = None if url else embedded.local_auth()
    if auth is None:
        return PoolClient(url or _nats_url(args), tenant, timeout=args.timeout, **options)
    creds = embedded.tenant_credentials(tenant)
    if creds is None:
        raise _Usage(f"no credentials for tenant {tenant!r} in this pool: run "
                     f"`pool admin tenant creds {tenant}` (or `pool admin tenant set`) first")
    plain = embedded.endpoints()[0]
    if not plain:
        raise _Usage("no NATS server: run `pool up` first, or set POOL_NATS_URL / --nats-url")
    return PoolClient(plain, tenant, timeout=args.timeout, user=creds.user,
                      password=creds.password, **options)


def _tenant(args: argparse.Namespace) -> str:
    import os

    t = args.tenant or os.environ.get("POOL_TENANT", "")
    if not t:
        raise _Usage("no tenant: pass --tenant or set POOL_TENANT")
    return str(t)


def cmd_lease_request(args: argparse.Namespace) -> int:
    import uuid

    shape: dict[str, Any] = {"cpu_millis": args.cpu_millis, "memory_mib": args.memory_mib}
    for name in ("gpu_count", "gpu_memory_gib_min", "gpu_model", "cpu_arch", "local_disk_gib",
                 "region", "zone"):
        v = getattr(args, name)
        if v not in (None, 0):
            shape[name] = v
    if args.gpu_partition:
        shape["gpu_partition"] = args.gpu_partition
    if args.runtime:
        shape["runtime"] = args.runtime
    if args.egress:
        shape["network"] = {"egress": args.egress}
    body: dict[str, Any] = {
        "pool_id": args.pool,
        "shape": shape,
        "maximum_runtime_seconds": args.max_runtime,
        "idempotency_key": args.key or uuid.uuid4().hex,
        "priority_class": args.priority,
        "checkpointable": args.checkpointable,
    }
    if args.image:
        body["image"] = args.image
    if args.image_signature:
        body["image_signature"] = args.image_signature
    if args.image_size is not None:
        body["image_size_bytes"] = args.image_size
    with _client(args, _tenant(args)) as c:
        return _print_envelope(c.request_lease(body), args.json)


def cmd_lease_verb(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {}
    if args.verb == "commit" and not args.cmd and getattr(args, "job_command", None):
        args.cmd = args.job_command
    if args.verb == "commit" and (args.image or args.cmd):
        body["job"] = {k: v for k, v in (("image", args.image), ("command", args.cmd),
                                         ("image_signature", args.image_signature)) if v}
        if args.image_size is not None:
            body["job"]["image_size_bytes"] = args.image_size
    if args.verb == "heartbeat":
        body["epoch"] = args.epoch
    if args.verb == "renew":
        body["extend_seconds"] = args.extend_seconds
    if args.verb == "release" and args.exit_code is not None:
        body["exit_code"] = args.exit_code
    if args.verb in ("release", "cancel") and args.reason:
        body["reason"] = args.reason
    with _client(args, _tenant(args)) as c:
        return _print_envelope(c.lease(args.lease_id, args.verb, body), args.json)


def _kv(text: str | None, cast: Callable[[str], Any] = int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in (text or "").split(","):
        if part.strip():
            k, _, v = part.partition("=")
            out[k.strip()] = cast(v.strip())
    return out


def cmd_admin(args: argparse.Namespace) -> int:
    path, body = args.build(args)
    with _client(args) as c:
        reply = c.admin(path, body)
    after = getattr(args, "after", None)
    if after is not None and reply.get("ok"):
        after(args)
    return _print_envelope(reply, args.json)


def _tenant_user_after_set(args: argparse.Namespace) -> None:
    """`pool admin tenant set` against this machine's `pool up` also gives the tenant a user."""
    from local import embedded

    if not args.nats_url and embedded.local_auth() is not None:
        creds = embedded.add_tenant(args.tenant_id)
        if not args.json:
            print(f"tenant user: {creds.user} (see `pool admin tenant creds {args.tenant_id}`)",
                  file=sys.stderr)


def cmd_creds(args: argparse.Namespace) -> int:
    """`pool admin tenant|node creds NAME`: the user of a tenant or node agent, created if new."""
    from bus.local.auth import inbox_prefix
    from local import embedded

    name = args.name
    if args.kind == "tenant":
        creds = embedded.add_tenant(name, rotate=args.rotate)
        prefix = inbox_prefix(name)
    else:
        creds = embedded.add_node(name, rotate=args.rotate)
        prefix = f"_INBOX_{creds.user.removeprefix('node-')}"
    result = {args.kind: name, "user": creds.user, "password": creds.password,
              "nats_url": embedded.endpoints()[0], "inbox_prefix": prefix}
    if args.json:
        print(json.dumps({"ok": True, "result": result}))
    else:
        for k, v in result.items():
            print(f"{k:<12}  {v}")
    return EXIT_OK


def _pool_set(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"pool_id": args.pool_id, "packing": args.packing,
                            "commit_timeout_seconds": args.commit_timeout,
                            "aging_seconds_per_rank": args.aging,
                            "heartbeat_timeout_seconds": args.heartbeat_timeout,
                            "default_lease_seconds": args.lease_term,
                            "node_timeout_seconds": args.node_timeout,
                            "lost_node_release_seconds": args.lost_node_release,
                            "preemption": {"enabled": args.preemption,
                                           "min_runtime_seconds": args.min_runtime,
                                           "grace_seconds": args.grace}}
    if args.priority_classes:
        body["priority_classes"] = _kv(args.priority_classes)
    return "pool.set", body


def _tenant_set(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"tenant": args.tenant_id, "pool_id": args.pool, "weight": args.weight}
    if args.quota:
        body["quota"] = _kv(args.quota)
    return "tenant.set", body


def _node_register(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    return "node.register", json.loads(Path(args.file).read_text())


def _credits_grant(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    import uuid

    return "credits.grant", {"tenant": args.tenant_id, "amount_microcredits": args.amount,
                             "transfer_id": args.transfer_id or uuid.uuid4().hex}


def _pool_images(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """`pool admin pool images`: the whole image policy from flags (keys from PEM files)."""
    keys = []
    for spec in args.key_file or ():
        key_id, sep, path = spec.partition("=")
        if not sep:
            key_id, path = Path(spec).stem.lower(), spec
        try:
            pem = Path(path).read_text()
        except OSError as e:
            raise _Usage(f"cannot read key file {path}: {e.strerror}") from None
        keys.append({"key_id": key_id, "public_key_pem": pem})
    tenant_registries: dict[str, list[str]] = {}
    for spec in args.tenant_registry or ():
        tenant, sep, registry = spec.partition("=")
        if not sep:
            raise _Usage(f"--tenant-registry wants TENANT=REGISTRY, not {spec!r}")
        tenant_registries.setdefault(tenant, []).append(registry)
    body: dict[str, Any] = {
        "pool_id": args.pool_id,
        "approved_registries": args.registry or ["*"],
        "tenant_registries": tenant_registries,
        "trusted_keys": keys,
        "require_signature": args.require_signature,
        "untrusted_tenants": args.untrusted_tenant or [],
        "untrusted_tenant_isolation": args.untrusted_isolation,
    }
    if args.max_image_size is not None:
        body["max_image_size_bytes"] = args.max_image_size
    if args.isolation:
        body["isolation_by_trust"] = _kv(args.isolation, str)
    return "pool.images", body


def cmd_image_keygen(args: argparse.Namespace) -> int:
    """`pool image keygen PREFIX`: PREFIX.key (private, 0600) and PREFIX.pub (public)."""
    import os

    from domain.policy.images import generate_key_pair

    private_pem, public_pem = generate_key_pair(args.kind)
    private_path, public_path = Path(f"{args.prefix}.key"), Path(f"{args.prefix}.pub")
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(private_pem)
    public_path.write_text(public_pem)
    result = {"private_key": str(private_path), "public_key": str(public_path), "kind": args.kind}
    print(json.dumps({"ok": True, "result": result}) if args.json
          else f"{private_path}  (private)\n{public_path}  (public: pool admin pool images "
               f"--key-file {public_path})")
    return EXIT_OK


def cmd_image_sign(args: argparse.Namespace) -> int:
    """`pool image sign IMAGE --key K.key`: the base64 simple-signing signature."""
    from domain.policy.images import InvalidReference, sign_image

    try:
        signature = sign_image(Path(args.key).read_bytes(), args.image)
    except OSError as e:
        raise _Usage(f"cannot read key file {args.key}: {e.strerror}") from None
    except InvalidReference as e:
        raise _Usage(f"{args.image}: {e}") from None
    print(json.dumps({"ok": True, "result": {"image": args.image, "signature": signature}})
          if args.json else signature)
    return EXIT_OK


def cmd_bench_schedule(args: argparse.Namespace) -> int:
    from bench.schedule import run_schedule_bench

    result = run_schedule_bench(
        nodes=args.nodes, requests=args.requests, quick=args.quick, rate=args.rate,
        steady_seconds=args.steady_seconds, priced=args.priced,
        progress=None if args.json else (lambda s: print(s, file=sys.stderr, flush=True)),
    )
    print(json.dumps({k: v for k, v in result.items() if k != "table"}) if args.json
          else result["table"])
    return EXIT_OK


def cmd_bench_agent(args: argparse.Namespace) -> int:
    from bench.agent import run_agent_bench

    result = run_agent_bench(
        starts=args.starts, quick=args.quick,
        progress=None if args.json else (lambda s: print(s, file=sys.stderr, flush=True)))
    print(json.dumps({k: v for k, v in result.items() if k != "table"}) if args.json
          else result["table"])
    return EXIT_OK


def cmd_bench_all(args: argparse.Namespace) -> int:
    from bench.all import run_all
    from local import embedded
    from projections.postgres.embedded import reachable_database_url

    db = args.database_url or embedded.endpoints()[1] or None
    if db and not reachable_database_url(db):
        raise _Usage(f"no PostgreSQL answers at {db}")
    result = run_all(quick=args.quick, database_url=db,
                     progress=None if args.json else (lambda s: print(s, file=sys.stderr,
                                                                        flush=True)))
    print(json.dumps({k: v for k, v in result.items() if k != "table"}, default=str)
          if args.json else result["table"])
    return EXIT_OK


def cmd_bench_projections(args: argparse.Namespace) -> int:
    from bench.projections import run_projections_bench
    from local import embedded
    from projections.postgres.embedded import reachable_database_url

    # a reachable PostgreSQL as given (or `pool up`'s), else the bench starts an embedded one
    db = args.database_url or embedded.endpoints()[1] or None
    if db and not reachable_database_url(db):
        raise _Usage(f"no PostgreSQL answers at {db}")
    result = run_projections_bench(
        database_url=db, events=args.events, quick=args.quick,
        progress=None if args.json else (lambda s: print(s, file=sys.stderr, flush=True)),
    )
    print(json.dumps({k: v for k, v in result.items() if k != "table"}) if args.json
          else result["table"])
    return EXIT_OK


# -- pool chaos ----------------------------------------------------------------------------


def cmd_chaos(args: argparse.Namespace) -> int:
    from chaos.suite import NAMES, run_suite, summary

    try:
        only = sorted({int(x) for x in args.only.split(",") if x.strip()}) if args.only else None
    except ValueError:
        raise _Usage(f"--only takes scenario numbers like 1,3 (got {args.only!r})") from None
    if only and not set(only) <= set(NAMES):
        raise _Usage(f"--only: scenarios are {min(NAMES)}..{max(NAMES)}")
    results = run_suite(
        quick=args.quick, only=only, keep=args.keep,
        progress=lambda s: print(s, file=sys.stderr, flush=True),
        on_result=None if args.json else (lambda o: print(o.line(), flush=True)),
    )
    if args.json:
        print(json.dumps({"quick": args.quick, "results": [o.to_dict() for o in results],
                          "summary": summary(results)}))
    else:
        print(summary(results))
    return EXIT_OK if all(o.passed or o.skipped for o in results) else EXIT_FAILED


# -- wiring --------------------------------------------------------------------------------


# -- views, projections and the credit audit -----------------------------------------------------


def _database_url(args: argparse.Namespace) -> str:
    from local import embedded

    url = getattr(args, "database_url", None) or embedded.endpoints()[1]
    if not url:
        raise _Usage("no database: run `pool up` first, or set POOL_DATABASE_URL / "
                     "--database-url")
    return str(url)


def _views_schema(args: argparse.Namespace) -> str:
    import os

    from projections.views import DEFAULT_SCHEMA

    return str(getattr(args, "schema", None) or os.environ.get("POOL_VIEWS_SCHEMA")
               or DEFAULT_SCHEMA)


def _log_app(args: argparse.Namespace) -> Any:
    from control.application import PoolApp
    from control.plane import app_env

    return PoolApp(env=app_env(_nats_url(args)))


def _close_app(app: Any, args: argparse.Namespace) -> None:
    app.close()  # the shared NATS connection closes at exit (bus.runtime's atexit hook)


def _table(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, dict):
            return ",".join(f"{k}={x}" for k, x in v.items()
                            if x not in (None, 0, {}, [], "")) or "-"
        if isinstance(v, float):
            return f"{v:.3f}"
        return str(v)

    grid = [list(columns)] + [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in grid) for i in range(len(columns))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in grid)


VIEW_TABLE_COLUMNS = {
    "queue": ("lease_id", "tenant", "pool", "priority_class", "state", "attempts", "queued_at"),
    "balance": ("tenant", "granted", "held", "spent", "available", "shortfall", "holds"),
    "capacity": ("node_id", "pool", "state", "zone", "failure_domain", "cpu_millis_allocated",
                 "cpu_millis_allocatable", "memory_mib_allocated", "memory_mib_allocatable",
                 "gpu_count_allocated", "gpu_count_allocatable", "last_heartbeat_at"),
    "leases": ("lease_id", "tenant", "pool", "state", "node_id", "started_at", "ended_at",
               "credits_held", "credits_charged"),
}


def cmd_view(args: argparse.Namespace) -> int:
    from projections.queries import query_url

    filters = dict(f.split("=", 1) for f in args.filter or [])
    page = query_url(_database_url(args), args.view, tenant=args.tenant or None,
                     filters=filters, limit=args.limit, cursor=args.cursor,
                     schema=_views_schema(args))
    if args.json:
        print(json.dumps(page, default=str))
    else:
        print(_table(page["rows"], VIEW_TABLE_COLUMNS[args.view]))
        if page["next_cursor"]:
            print(f"more: --cursor {page['next_cursor']}")
    return EXIT_OK


def cmd_projections_status(args: argparse.Namespace) -> int:
    from projections.views import status

    app = _log_app(args)
    try:
        top = app.recorder.max_notification_id() or 0
    finally:
        _close_app(app, args)
    rows = status(_database_url(args), top, schema=_views_schema(args))
    if args.json:
        print(json.dumps(rows))
    else:
        print(_table(rows, ("view", "position", "max_notification_id", "lag", "events_applied",
                            "exists")))
    return EXIT_OK


def cmd_projections_rebuild(args: argparse.Namespace) -> int:
    from projections.views import VIEWS, rebuild

    names = [args.name] if args.name else list(VIEWS)
    app = _log_app(args)
    try:
        n = rebuild(app, _database_url(args), schema=_views_schema(args), views=names,
                    batch_size=args.batch_size)
        top = app.recorder.max_notification_id() or 0
    finally:
        _close_app(app, args)
    msg = {"rebuilt": names, "events_applied": n, "position": top}
    print(json.dumps(msg) if args.json else
          f"rebuilt {', '.join(names)} from the first event: {n} events, position {top}")
    return EXIT_OK


def cmd_projections_run(args: argparse.Namespace) -> int:
    from control.projector import run

    run(_nats_url(args), _database_url(args), _views_schema(args), args.batch_size,
        announce=lambda s: print(s, flush=True))
    return EXIT_OK


def cmd_audit_credits(args: argparse.Namespace) -> int:
    from projections.audit import audit_credits

    db = None if args.no_views else _database_url(args)
    app = _log_app(args)
    try:
        report = audit_credits(app, tenant=args.tenant or None, database_url=db,
                               schema=_views_schema(args))
    finally:
        _close_app(app, args)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print("\n".join(report.lines()))
    return EXIT_OK if report.ok else EXIT_FAILED


# -- pool telemetry ------------------------------------------------------------------------


def _since(text: str | None) -> Any:
    """`--since`: a duration back from now (90s, 10m, 2h, 1d, 1h30m) or an ISO 8601 time."""
    import datetime as dt
    import re

    if not text:
        return None
    now = dt.datetime.now(dt.UTC)
    parts = re.findall(r"(\d+(?:\.\d+)?)([smhd])", text.strip().lower())
    if parts and "".join(n + u for n, u in parts) == text.strip().lower():
        unit = {"s": 1, "m": 60, "h": 3600, "d": 86400}
        return now - dt.timedelta(seconds=sum(float(n) * unit[u] for n, u in parts))
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise _Usage(f"--since {text!r}: not a duration (10m, 2h, 1d) nor an ISO time") from None
    return when if when.tzinfo else when.replace(tzinfo=dt.UTC)


def _format_sample(sample: Any) -> str:
    import datetime as dt

    ev = sample.event
    if ev is None:
        return f"{'?':<12}  {sample.kind:<11}  {sample.node}  {sample.tenant}/{sample.lease}  " \
               f"undecodable: {sample.error}"
    at = dt.datetime.fromtimestamp(ev.at, dt.UTC).strftime("%H:%M:%S.%f")[:-3]
    details = []
    if ev.utilization is not None:
        details += [f"{k}={v}" for k, v in
                    ((f, getattr(ev.utilization, f)) for f in ev.utilization.__struct_fields__)
                    if v is not None]
    details += [f"{k}={v}" for k, v in ev.attrs.items()]
    return (f"{at:<12}  {sample.kind:<11}  {sample.pool}/{sample.node}  "
            f"{sample.tenant}/{sample.lease}  {' '.join(details)}").rstrip()


def cmd_agent_run(args: argparse.Namespace) -> int:
    """`pool agent run`: this machine as a node of a pool, until Ctrl-C."""
    import logging
    import os

    from agents.agent import Agent
    from agents.probe import Reserve, probe_node
    from bus.agentbus import AgentLink
    from bus.errors import BusError
    from bus.local.auth import url_with_credentials
    from local import embedded

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    labels = dict(kv.split("=", 1) for kv in args.labels.split(",") if "=" in kv) \
        if args.labels else {}
    state = Path(args.state_dir or os.path.join(os.environ.get("POOL_HOME", ".pool"),
                                                "agents", args.node_id))
    if args.runtime == "docker":
        from agents.runtimes.docker import DockerRuntime

        runtime: Any = DockerRuntime(state, node_id=args.node_id)
        why = runtime.available()
        if why is not None:
            return _fail(why, "runtime_unavailable", as_json=args.json)
    else:
        from agents.runtimes.process import ProcessRuntime

        runtime = ProcessRuntime(state)
        why = runtime.available()
        if why is not None:
            return _fail(why, "runtime_unavailable", as_json=args.json)
    url = getattr(args, "nats_url", None)
    if not url:
        plain = embedded.endpoints()[0]
        if not plain:
            return _fail("no NATS server: run `pool up` first, or set POOL_NATS_URL / "
                         "--nats-url", "bus_unavailable", as_json=args.json)
        auth = embedded.local_auth()
        url = plain if auth is None else url_with_credentials(
            plain, embedded.add_node(args.node_id))
    probe = probe_node(state if state.exists() else Path("."))
    if probe.gpus.note:
        print(f"pool agent: {probe.gpus.note}", file=sys.stderr)
    try:
        link = AgentLink(url, args.node_id).connect()
    except BusError as e:
        return _fail(str(e), e.code, as_json=args.json)
    agent = Agent(link, runtime, node_id=args.node_id, pool_id=args.pool, probe=probe,
                  state_dir=state, labels=labels, trust_level=args.trust,
                  reserve=Reserve(cpu_millis=args.reserve_cpu_millis,
                                  memory_mib=args.reserve_memory_mib),
                  heartbeat_interval=args.heartbeat_interval)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    caps = agent.capabilities()
    if args.json:
        print(json.dumps({"ok": True, "result": {"node_id": args.node_id, "pool_id": args.pool,
                                                 "capabilities": caps,
                                                 "gpus": probe.gpus.to_dict()}}), flush=True)
    else:
        print(f"agent {args.node_id} in pool {args.pool}: runtime {runtime.name} "
              f"({', '.join(runtime.isolation_classes()) or 'no isolation class'}), "
              f"allocatable {json.dumps(caps['allocatable'])}; Ctrl-C to stop", flush=True)
    try:
        agent.run(stop)
    finally:
        link.close()
    print(f"agent stopped: {agent.stats.started} started, {len(agent.running)} still running "
          "(re-adopted on the next start)", file=sys.stderr)
    return EXIT_OK


def cmd_agent_simulate(args: argparse.Namespace) -> int:
    """`pool agent simulate`: a fleet of simulated nodes whose workloads are timed sleeps."""
    from agents.simulate import SimulatedFleet, fleet

    url = _nats_url(args)
    nodes = fleet(args.nodes, args.profile, prefix=args.prefix)
    sim = SimulatedFleet(url, nodes, pool_id=args.pool,
                         heartbeat_interval=args.heartbeat_interval).start()
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    kinds: dict[str, int] = {}
    for n in nodes:
        kinds[n.labels["kind"]] = kinds.get(n.labels["kind"], 0) + 1
    if args.json:
        print(json.dumps({"ok": True, "result": {"nodes": len(nodes), "kinds": kinds}}),
              flush=True)
    else:
        print(f"{len(nodes)} simulated nodes in pool {args.pool} "
              f"({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}); Ctrl-C to stop",
              flush=True)
    try:
        while not stop.wait(args.report_every or 3600):
            if args.report_every:
                print(json.dumps(sim.stats()), flush=True)
    finally:
        sim.stop()
    print(json.dumps(sim.stats()) if args.json else f"fleet stopped: {sim.stats()}",
          file=sys.stderr)
    return EXIT_OK


def cmd_agent_probe(args: argparse.Namespace) -> int:
    """`pool agent probe`: what this node would offer, without joining a pool."""
    from agents.probe import Reserve, probe_node

    probe = probe_node(".")
    caps = probe.capabilities(reserve=Reserve(), runtimes=(), labels={})
    out = {"capabilities": caps, "gpus": probe.gpus.to_dict()}
    print(json.dumps(out, indent=None if args.json else 2))
    return EXIT_OK


def cmd_telemetry_follow(args: argparse.Namespace) -> int:
    import os

    import msgspec

    from bus import telemetry
    from bus.local.auth import inbox_prefix
    from local import embedded

    tenant = args.tenant or os.environ.get("POOL_TENANT", "")
    since = _since(args.since)
    options: dict[str, Any] = {}
    url = getattr(args, "nats_url", None)
    if tenant:
        # as the tenant's own user: the server limits it to pool.tel.*.*.<tenant>.>
        options["inbox_prefix"] = inbox_prefix(tenant)
        auth = None if url else embedded.local_auth()
        if auth is not None:
            creds = embedded.tenant_credentials(tenant)
            if creds is None:
                raise _Usage(f"no credentials for tenant {tenant!r} in this pool: run "
                             f"`pool admin tenant creds {tenant}` first")
            url = embedded.endpoints()[0]
            options.update(user=creds.user, password=creds.password)
    url = url or _nats_url(args)

    def on_sample(sample: Any) -> None:
        if args.json:
            print(json.dumps({
                "subject": sample.subject, "pool": sample.pool, "node": sample.node,
                "tenant": sample.tenant, "lease": sample.lease, "kind": sample.kind,
                "stream_seq": sample.stream_seq, "headers": sample.headers,
                "event": msgspec.to_builtins(sample.event) if sample.event else None,
                "error": sample.error,
            }), flush=True)
        else:
            print(_format_sample(sample), flush=True)

    def on_ready() -> None:
        what = "replaying from " + since.isoformat() + ", then following" if since else "following"
        print(f"{what} telemetry (Ctrl-C to stop)", file=sys.stderr, flush=True)

    try:
        telemetry.follow(
            url, on_sample, pool=args.pool, node=args.node, tenant=tenant or None,
            lease=args.lease, kind=args.kind, since=since, max_samples=args.count,
            duration_s=args.duration, on_ready=on_ready, **options,
        )
    except KeyboardInterrupt:
        return EXIT_OK
    except Exception as e:
        if getattr(e, "code", "") == "permission_denied" and tenant:
            return _fail(f"{e} (a tenant may follow only its own leases: pool.tel.*.*.{tenant}.>)",
                         "permission_denied", as_json=args.json)
        raise
    return EXIT_OK


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
    up.add_argument("--no-workers", action="store_true",
                    help="servers only: no command service or scheduler")
    up.add_argument("--exit-when-ready", action="store_true", help="start, report, stop")
    up.add_argument("--json", action="store_true", help="print endpoints as JSON")
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
        "client URLs and POOL_NATS_URL to export. No auth: the servers require no users, so "
        "they listen on 127.0.0.1 only (compose.yaml is the multi-machine topology).")
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
    sb = bench.add_parser("schedule", help="placements/s, latency and RSS of the scheduler")
    sb.add_argument("--nodes", type=int, default=10000)
    sb.add_argument("--requests", type=int, default=100000)
    sb.add_argument("--rate", type=float, default=1000.0,
                    help="steady offered load for the latency figures (requests/s)")
    sb.add_argument("--steady-seconds", type=float, default=10.0)
    sb.add_argument("--quick", action="store_true",
                    help="500 nodes, 3,000 backlog requests, 500/s for 3 s")
    sb.add_argument("--priced", action="store_true",
                    help="give the pool a price list, so every placement also holds credits "
                         "(one more event each)")
    sb.add_argument("--json", action="store_true")
    sb.set_defaults(func=cmd_bench_schedule)
    bal = bench.add_parser("all", help="every benchmark in one run: one table of figures, "
                           "goals and ratios to the raw JetStream rate")
    bal.add_argument("--quick", action="store_true", help="the CI sizes")
    bal.add_argument("--database-url", help="PostgreSQL for the projections bench "
                     "(default: pool up's, else an embedded one)")
    bal.add_argument("--json", action="store_true")
    bal.set_defaults(func=cmd_bench_all)
    ba = bench.add_parser("agent", help="start overhead: start command → workload running, "
                          "process and docker runtimes, next to a plain docker run")
    ba.add_argument("--starts", type=int, default=30, help="starts per runtime")
    ba.add_argument("--quick", action="store_true", help="5 starts per runtime")
    ba.add_argument("--json", action="store_true")
    ba.set_defaults(func=cmd_bench_agent)
    bp = bench.add_parser("projections", help="events/s into the PostgreSQL views, lag, "
                          "rebuild time and credit-audit replay rate")
    bp.add_argument("--events", type=int, default=None,
                    help="events pre-written for the catch-up (default 200,000; --quick 5,000)")
    bp.add_argument("--quick", action="store_true",
                    help="5,000 events; lag at 1,000 events/s for 3 s")
    bp.add_argument("--database-url",
                    help="PostgreSQL to use (a fresh schema, dropped after; default: "
                    "POOL_DATABASE_URL or `pool up`, else an embedded one)")
    bp.add_argument("--json", action="store_true")
    bp.set_defaults(func=cmd_bench_projections)

    chaos = sub.add_parser(
        "chaos", help="the fault suite: kill, stop and garble a pool, check the log",
        description="Runs each fault scenario against real processes on loopback ports and "
        "prints one line of figures per scenario, then `faults: N passed, M failed`; exit 1 "
        "if any failed. 1 NATS node kills (R3), 2 quorum loss, 3 scheduler failover, "
        "4 projector kills, 5 idempotent retries, 6 agent stopped past grace, 7 PostgreSQL "
        "restart, 8 bad input.")
    chaos.add_argument("--quick", action="store_true", help="CI sizes (a few minutes in all)")
    chaos.add_argument("--only", metavar="N,…", help="run only these scenarios")
    chaos.add_argument("--keep", action="store_true",
                       help="keep every scenario's directory (logs, stores); failed ones are "
                       "always kept")
    chaos.add_argument("--json", action="store_true")
    chaos.set_defaults(func=cmd_chaos)

    def client_opts(sp: argparse.ArgumentParser, tenant: bool = False) -> None:
        sp.add_argument("--nats-url", help="NATS server (default: POOL_NATS_URL or `pool up`)")
        sp.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for a reply")
        sp.add_argument("--json", action="store_true", help="print the reply envelope as JSON")
        if tenant:
            sp.add_argument("--tenant", help="tenant to act as (default: $POOL_TENANT)")

    srv = sub.add_parser(
        "serve", help="run the command service and the scheduler (or some of the roles)",
        description="Run control-plane roles against POOL_NATS_URL (a comma-separated list names "
        "the servers of a cluster). commands: command, admin and node subjects (queue group "
        "pool-commands: run any number); scheduler: placements and agent orders (leader election "
        "in JetStream KV: one active, the others warm standbys); reconciler: fired deadline "
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
                     help="the scheduler's leader lease: a standby takes over this long after "
                     "the active one dies (default 3)")
    srv.set_defaults(func=cmd_serve)

    lease = sub.add_parser("lease", help="request and manage leases").add_subparsers(
        dest="sub", metavar="VERB")
    lease.required = True
    rq = lease.add_parser("request", help="ask for a lease on a resource shape")
    client_opts(rq, tenant=True)
    rq.add_argument("--pool", required=True, help="pool id")
    rq.add_argument("--cpu-millis", type=int, required=True)
    rq.add_argument("--memory-mib", type=int, required=True)
    rq.add_argument("--gpu-count", type=int, default=0)
    rq.add_argument("--gpu-memory-gib-min", type=int, default=0)
    rq.add_argument("--gpu-model")
    rq.add_argument("--gpu-partition", help="a MIG profile such as 1g.10gb, or time-slice")
    rq.add_argument("--cpu-arch", choices=["amd64", "arm64"])
    rq.add_argument("--local-disk-gib", type=int, default=0)
    rq.add_argument("--runtime", choices=["container", "sandboxed", "microvm", "dedicated-host"])
    rq.add_argument("--egress", choices=["none", "restricted", "open"])
    rq.add_argument("--region")
    rq.add_argument("--zone")
    rq.add_argument("--max-runtime", type=int, required=True, help="maximum_runtime_seconds")
    rq.add_argument("--priority", default="standard", help="priority class")
    rq.add_argument("--key", help="idempotency key (default: a new random one)")
    rq.add_argument("--image", help="image reference, pinned by digest")
    rq.add_argument("--image-signature", help="base64 signature (`pool image sign`)")
    rq.add_argument("--image-size", type=int, help="image size in bytes")
    rq.add_argument("--checkpointable", action="store_true")
    rq.set_defaults(func=cmd_lease_request)
    for verb, help_text in (("commit", "confirm a reservation and start its job"),
                            ("heartbeat", "prove the holder is alive"),
                            ("renew", "extend the deadline"),
                            ("release", "give the capacity back"),
                            ("cancel", "withdraw or stop a lease"),
                            ("get", "show a lease"),
                            ("why", "why a lease waits: reason codes and filter counts")):
        vp = lease.add_parser(verb, help=help_text)
        client_opts(vp, tenant=True)
        vp.add_argument("lease_id")
        vp.set_defaults(func=cmd_lease_verb, verb=verb)
        if verb == "commit":
            vp.add_argument("--image")
            vp.add_argument("--image-signature", help="base64 signature (`pool image sign`)")
            vp.add_argument("--image-size", type=int, help="image size in bytes")
            vp.add_argument("--cmd", nargs="+", help="the job's command (words that start "
                            "with '-' need the form: -- COMMAND …)")
            vp.set_defaults(job_command=[])  # the words after `--`: -- sh -c 'echo hi'
            vp.epilog = "The job's command may also follow `--`: … -- sh -c 'echo hi'"
        vp.add_argument("--epoch", type=int, default=1, help=argparse.SUPPRESS if verb != "heartbeat" else "placement epoch")
        vp.add_argument("--extend-seconds", type=int, default=300, help=argparse.SUPPRESS if verb != "renew" else "seconds")
        vp.add_argument("--exit-code", type=int, help=argparse.SUPPRESS if verb != "release" else "the workload's exit code")
        vp.add_argument("--reason", help=argparse.SUPPRESS if verb not in ("release", "cancel") else "why")

    adm = sub.add_parser("admin", help="configure pools, tenants and nodes").add_subparsers(
        dest="sub", metavar="WHAT")
    adm.required = True
    apool = adm.add_parser("pool", help="pool settings").add_subparsers(dest="verb", metavar="VERB")
    apool.required = True
    for verb in ("create", "set"):
        ps = apool.add_parser(verb, help=f"{verb} a pool's scheduling policy")
        client_opts(ps)
        ps.add_argument("pool_id")
        ps.add_argument("--packing", choices=["best-fit", "spread"], default="best-fit")
        ps.add_argument("--commit-timeout", type=int, default=30, help="seconds")
        ps.add_argument("--priority-classes", help="name=rank,… (higher rank first)")
        ps.add_argument("--aging", type=int, default=0, help="seconds of waiting per rank gained")
        ps.add_argument("--preemption", action="store_true", help="allow preemption")
        ps.add_argument("--min-runtime", type=int, default=0, help="victims' minimum runtime")
        ps.add_argument("--grace", type=int, default=30, help="preemption grace seconds")
        ps.add_argument("--heartbeat-timeout", type=int, default=30,
                        help="seconds a running lease may go without a heartbeat")
        ps.add_argument("--lease-term", type=int, default=300,
                        help="seconds a commit or renewal grants by default")
        ps.add_argument("--node-timeout", type=int, default=30,
                        help="seconds of agent silence before a node is lost")
        ps.add_argument("--lost-node-release", type=int, default=300,
                        help="seconds after which a lost node's leases are released")
        ps.set_defaults(func=cmd_admin, build=_pool_set)
    show = apool.add_parser("show", help="every setting in force")
    client_opts(show)
    show.add_argument("pool_id")
    show.set_defaults(func=cmd_admin, build=lambda a: ("pool.show", {"pool_id": a.pool_id}))
    pim = apool.add_parser("images", help="replace the pool's image policy (registries, signing "
                           "keys, size limit, isolation by trust level)")
    client_opts(pim)
    pim.add_argument("pool_id")
    pim.add_argument("--registry", action="append", metavar="R",
                     help="approved registry: host[:port], host/repo-prefix or * (repeatable; "
                     "default *)")
    pim.add_argument("--tenant-registry", action="append", metavar="TENANT=R",
                     help="a tenant's own approved registry, instead of the pool's (repeatable)")
    pim.add_argument("--key-file", action="append", metavar="[ID=]PEM",
                     help="trusted public key, ECDSA P-256 or Ed25519 (repeatable; id defaults "
                     "to the file's stem)")
    pim.add_argument("--require-signature", action="store_true",
                     help="refuse images without a signature from a trusted key")
    pim.add_argument("--max-image-size", type=int, metavar="BYTES")
    pim.add_argument("--isolation", metavar="TRUST=CLASS,…",
                     help="weakest isolation per node trust level (default "
                     "trusted=container,marketplace=sandboxed)")
    pim.add_argument("--untrusted-tenant", action="append", metavar="TENANT",
                     help="a tenant that needs --untrusted-isolation everywhere (repeatable)")
    pim.add_argument("--untrusted-isolation", default="sandboxed",
                     choices=["container", "sandboxed", "microvm", "dedicated-host"])
    pim.set_defaults(func=cmd_admin, build=_pool_images)
    aten = adm.add_parser("tenant", help="tenant settings").add_subparsers(dest="verb", metavar="VERB")
    aten.required = True
    ts = aten.add_parser("set", help="a tenant's weight and quota in a pool")
    client_opts(ts)
    ts.add_argument("tenant_id")
    ts.add_argument("--pool", required=True)
    ts.add_argument("--weight", type=float, default=1.0)
    ts.add_argument("--quota", help="dimension=amount,… e.g. cpu_millis=64000,gpu_count=4")
    ts.set_defaults(func=cmd_admin, build=_tenant_set, after=_tenant_user_after_set)
    tc = aten.add_parser("creds", help="the tenant's NATS user on this machine's `pool up` "
                         "(created and loaded into the running server if new)")
    tc.add_argument("name", metavar="tenant_id")
    tc.add_argument("--rotate", action="store_true", help="replace the password")
    tc.add_argument("--json", action="store_true")
    tc.set_defaults(func=cmd_creds, kind="tenant")
    anode = adm.add_parser("node", help="nodes").add_subparsers(dest="verb", metavar="VERB")
    anode.required = True
    nr = anode.add_parser("register", help="register a node from a NodeRegistration JSON file")
    client_opts(nr)
    nr.add_argument("--file", required=True)
    nr.set_defaults(func=cmd_admin, build=_node_register)
    nc_ = anode.add_parser("creds", help="a node agent's NATS user on this machine's `pool up` "
                           "(limited to that node's subjects)")
    nc_.add_argument("name", metavar="node_id")
    nc_.add_argument("--rotate", action="store_true", help="replace the password")
    nc_.add_argument("--json", action="store_true")
    nc_.set_defaults(func=cmd_creds, kind="node")

    img = sub.add_parser("image", help="image signing keys and signatures").add_subparsers(
        dest="verb", metavar="VERB", required=True)
    ik = img.add_parser("keygen", help="a new signing key pair: PREFIX.key and PREFIX.pub")
    ik.add_argument("prefix")
    ik.add_argument("--kind", choices=["ecdsa-p256", "ed25519"], default="ecdsa-p256")
    ik.add_argument("--json", action="store_true")
    ik.set_defaults(func=cmd_image_keygen)
    isg = img.add_parser("sign", help="sign a digest-pinned image (cosign simple signing)")
    isg.add_argument("image")
    isg.add_argument("--key", required=True, help="private key PEM (`pool image keygen`)")
    isg.add_argument("--json", action="store_true")
    isg.set_defaults(func=cmd_image_sign)

    node = sub.add_parser("node", help="node maintenance").add_subparsers(dest="verb", metavar="VERB")
    node.required = True
    for verb in ("cordon", "drain", "maintenance", "uncordon"):
        np_ = node.add_parser(verb, help=f"{verb} a node")
        client_opts(np_)
        np_.add_argument("node_id")
        np_.add_argument("--reason", default="")
        np_.set_defaults(func=cmd_admin, build=lambda a: (f"node.{a.node_id}.{a.verb}",
                                                           {"reason": a.reason} if a.reason else {}))

    cred = sub.add_parser("credits", help="tenant credits").add_subparsers(dest="verb", metavar="VERB")
    cred.required = True
    cg = cred.add_parser("grant", help="add micro-credits to a tenant (idempotent by transfer id)")
    client_opts(cg)
    cg.add_argument("tenant_id")
    cg.add_argument("amount", type=int, help="micro-credits")
    cg.add_argument("--transfer-id", help="idempotency id (default: a new random one)")
    cg.set_defaults(func=cmd_admin, build=_credits_grant)

    def db_opts(sp: argparse.ArgumentParser, nats: bool = True) -> None:
        if nats:
            sp.add_argument("--nats-url", help="default: $POOL_NATS_URL or the `pool up` endpoints")
        sp.add_argument("--database-url",
                        help="default: $POOL_DATABASE_URL or the `pool up` endpoints")
        sp.add_argument("--schema", help="the views' schema (default $POOL_VIEWS_SCHEMA or "
                        "pool_views)")
        sp.add_argument("--json", action="store_true")

    for view, help_text in (("queue", "waiting requests"), ("balance", "tenant credits"),
                            ("capacity", "node capacity"), ("leases", "every lease")):
        vp = sub.add_parser(view, help=f"{help_text}, from the PostgreSQL views")
        db_opts(vp, nats=False)
        vp.add_argument("--tenant", help="only this tenant's rows")
        vp.add_argument("--filter", action="append", metavar="COLUMN=VALUE")
        vp.add_argument("--limit", type=int, default=100)
        vp.add_argument("--cursor")
        vp.set_defaults(func=cmd_view, view=view)
    prj = sub.add_parser("projections", help="the PostgreSQL views").add_subparsers(
        dest="verb", metavar="VERB", required=True)
    pst = prj.add_parser("status", help="each view's position and lag behind the log")
    db_opts(pst)
    pst.set_defaults(func=cmd_projections_status)
    prb = prj.add_parser("rebuild", help="drop a view (or all) and fold it again from event 1")
    prb.add_argument("name", nargs="?", choices=("queue", "balance", "capacity", "leases"))
    prb.add_argument("--batch-size", type=int, default=1000)
    db_opts(prb)
    prb.set_defaults(func=cmd_projections_rebuild)
    prr = prj.add_parser("run", help="run the projector until Ctrl-C")
    prr.add_argument("--batch-size", type=int, default=1000)
    db_opts(prr)
    prr.set_defaults(func=cmd_projections_run)
    aud = sub.add_parser("audit", help="check the books against the log").add_subparsers(
        dest="verb", metavar="VERB", required=True)
    ac = aud.add_parser("credits", help="replay credit events; check charges and the balance view")
    ac.add_argument("--tenant")
    ac.add_argument("--no-views", action="store_true", help="skip the balance view cross-check")
    db_opts(ac)
    ac.set_defaults(func=cmd_audit_credits)
    agp = sub.add_parser("agent", help="run this machine as a node").add_subparsers(
        dest="verb", metavar="VERB")
    agp.required = True
    ar = agp.add_parser("run", help="join a pool and run the leases placed on this node",
                        description="Probe this machine (CPU, memory, disk, GPUs via NVML), "
                        "register it, run committed leases' jobs in the chosen runtime, "
                        "heartbeat them, and report exits; re-adopts its workloads on restart.")
    ar.add_argument("--node-id", required=True, help="this node's stable id")
    ar.add_argument("--pool", default="default", help="pool to join (default: default)")
    ar.add_argument("--runtime", choices=["process", "docker"], default="process",
                    help="process: bubblewrap sandbox (default); docker: the Docker engine")
    ar.add_argument("--labels", help="k=v,… (zone, region and failure_domain are traits)")
    ar.add_argument("--trust", choices=["trusted", "marketplace"], default="trusted")
    ar.add_argument("--state-dir", help="pid files and checkpoints "
                    "(default $POOL_HOME/agents/NODE)")
    ar.add_argument("--heartbeat-interval", type=float, default=2.0, help="seconds")
    ar.add_argument("--reserve-cpu-millis", type=int, default=500)
    ar.add_argument("--reserve-memory-mib", type=int, default=1024)
    ar.add_argument("--nats-url", help="NATS URL (default: this machine's `pool up`)")
    ar.add_argument("--verbose", "-v", action="store_true")
    ar.add_argument("--json", action="store_true", help="print the capabilities as JSON")
    ar.set_defaults(func=cmd_agent_run)
    asim = agp.add_parser("simulate", help="a fleet of simulated nodes (timed sleeps) through "
                          "the same subjects a real agent uses")
    client_opts(asim)
    asim.add_argument("--nodes", type=int, default=200)
    asim.add_argument("--profile", choices=["mixed", "cpu", "gpu", "a100"], default="mixed",
                      help="mixed: 60%% CPU, 30%% L4 ×4, 10%% A100 ×8 (half in MIG mode)")
    asim.add_argument("--pool", default="default")
    asim.add_argument("--prefix", default="sim", help="node id prefix")
    asim.add_argument("--heartbeat-interval", type=float, default=3.0)
    asim.add_argument("--report-every", type=float, default=0,
                      help="print the fleet's counters every N seconds")
    asim.set_defaults(func=cmd_agent_simulate)
    apr = agp.add_parser("probe", help="print what this node would offer, and its GPUs")
    apr.add_argument("--json", action="store_true")
    apr.set_defaults(func=cmd_agent_probe)
    tel = sub.add_parser("telemetry", help="samples from node agents").add_subparsers(
        dest="verb", metavar="VERB", required=True)
    tf = tel.add_parser("follow", help="print telemetry live; with --since, replay it first")
    tf.add_argument("--nats-url", help="NATS server (default: POOL_NATS_URL or `pool up`)")
    tf.add_argument("--tenant", help="follow as this tenant's user, only its leases "
                    "(default: $POOL_TENANT; none: as the operator)")
    tf.add_argument("--pool", help="only this pool")
    tf.add_argument("--node", help="only this node")
    tf.add_argument("--lease", help="only this lease")
    tf.add_argument("--kind", choices=("queue", "startup", "execution", "utilization", "failure"))
    tf.add_argument("--since", metavar="T", help="replay from T first: a duration back from now "
                    "(30s, 10m, 2h, 1d) or an ISO 8601 time (UTC unless it has an offset)")
    tf.add_argument("--count", type=int, metavar="N", help="exit after N samples")
    tf.add_argument("--duration", type=float, metavar="SECONDS", help="exit after SECONDS")
    tf.add_argument("--json", action="store_true", help="one JSON object per sample")
    tf.set_defaults(func=cmd_telemetry_follow)
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
    args = parser.parse_args(words)
    if tail is not None:
        if not hasattr(args, "job_command"):
            parser.error("`-- COMMAND` is only taken by `pool lease commit`")
        args.job_command = tail
    func: Callable[[argparse.Namespace], int] = args.func
    from bus import observability

    observability.setup()  # POOL_OTEL_EXPORTER=none|console|otlp; none by default
    try:
        return func(args)
    except _Usage as e:
        print(f"pool: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("pool: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - the edge: every failure leaves as one clear line
        code = getattr(e, "code", type(e).__name__)
        return _fail(str(e) or type(e).__name__, str(code), as_json=getattr(args, "json", False))
    finally:
        observability.shutdown()  # export what is still queued


if __name__ == "__main__":
    sys.exit(main())
