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
    plane = None
    try:
        ensure_all_streams(emb.nats_url, replicas=args.replicas)
        if not args.no_workers:
            from workers.serve import ControlPlane

            plane = ControlPlane(emb.nats_url).start()
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
            if plane is not None:
                print("control plane: commands on pool.cmd.<tenant>.lease.…, admin on "
                      "pool.admin.…, scheduler running (try `pool lease --help`)")
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


# -- control plane and clients -------------------------------------------------------------


def _nats_url(args: argparse.Namespace) -> str:
    from workers import embedded

    url = getattr(args, "nats_url", None) or embedded.endpoints()[0]
    if not url:
        raise _Usage("no NATS server: run `pool up` first, or set POOL_NATS_URL / --nats-url")
    return str(url)


class _Usage(Exception):
    code = "usage"


def cmd_serve(args: argparse.Namespace) -> int:
    from workers.serve import ControlPlane

    url = _nats_url(args)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    cp = ControlPlane(url).start()
    print(f"serving commands and scheduling on {url}: Ctrl-C to stop", flush=True)
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
    from workers.client import PoolClient

    return PoolClient(_nats_url(args), tenant, timeout=args.timeout)


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
    with _client(args, _tenant(args)) as c:
        return _print_envelope(c.request_lease(body), args.json)


def cmd_lease_verb(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {}
    if args.verb == "commit" and (args.image or args.cmd):
        body["job"] = {k: v for k, v in (("image", args.image), ("command", args.cmd)) if v}
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
        return _print_envelope(c.admin(path, body), args.json)


def _pool_set(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"pool_id": args.pool_id, "packing": args.packing,
                            "commit_timeout_seconds": args.commit_timeout,
                            "aging_seconds_per_rank": args.aging,
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


def cmd_bench_schedule(args: argparse.Namespace) -> int:
    from workers.bench_schedule import run_schedule_bench

    result = run_schedule_bench(
        nodes=args.nodes, requests=args.requests, quick=args.quick,
        progress=None if args.json else (lambda s: print(s, file=sys.stderr, flush=True)),
    )
    print(json.dumps({k: v for k, v in result.items() if k != "table"}) if args.json
          else result["table"])
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
    up.add_argument("--no-workers", action="store_true",
                    help="servers only: no command service or scheduler")
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
    sb = bench.add_parser("schedule", help="placements/s, latency and RSS of the scheduler")
    sb.add_argument("--nodes", type=int, default=10000)
    sb.add_argument("--requests", type=int, default=100000)
    sb.add_argument("--quick", action="store_true", help="500 nodes, 3,000 requests")
    sb.add_argument("--json", action="store_true")
    sb.set_defaults(func=cmd_bench_schedule)

    def client_opts(sp: argparse.ArgumentParser, tenant: bool = False) -> None:
        sp.add_argument("--nats-url", help="NATS server (default: POOL_NATS_URL or `pool up`)")
        sp.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for a reply")
        sp.add_argument("--json", action="store_true", help="print the reply envelope as JSON")
        if tenant:
            sp.add_argument("--tenant", help="tenant to act as (default: $POOL_TENANT)")

    srv = sub.add_parser("serve", help="run the command service and the scheduler")
    srv.add_argument("--nats-url", help="NATS server (default: POOL_NATS_URL or `pool up`)")
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
            vp.add_argument("--cmd", nargs="+", help="the job's command")
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
        ps.set_defaults(func=cmd_admin, build=_pool_set)
    show = apool.add_parser("show", help="every setting in force")
    client_opts(show)
    show.add_argument("pool_id")
    show.set_defaults(func=cmd_admin, build=lambda a: ("pool.show", {"pool_id": a.pool_id}))
    aten = adm.add_parser("tenant", help="tenant settings").add_subparsers(dest="verb", metavar="VERB")
    aten.required = True
    ts = aten.add_parser("set", help="a tenant's weight and quota in a pool")
    client_opts(ts)
    ts.add_argument("tenant_id")
    ts.add_argument("--pool", required=True)
    ts.add_argument("--weight", type=float, default=1.0)
    ts.add_argument("--quota", help="dimension=amount,… e.g. cpu_millis=64000,gpu_count=4")
    ts.set_defaults(func=cmd_admin, build=_tenant_set)
    anode = adm.add_parser("node", help="nodes").add_subparsers(dest="verb", metavar="VERB")
    anode.required = True
    nr = anode.add_parser("register", help="register a node from a NodeRegistration JSON file")
    client_opts(nr)
    nr.add_argument("--file", required=True)
    nr.set_defaults(func=cmd_admin, build=_node_register)

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
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except _Usage as e:
        print(f"pool: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("pool: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # the edge: every failure leaves as one clear line
        code = getattr(e, "code", type(e).__name__)
        return _fail(str(e) or type(e).__name__, str(code), as_json=getattr(args, "json", False))


if __name__ == "__main__":
    sys.exit(main())
