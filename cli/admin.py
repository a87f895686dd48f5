"""The operator's verbs: `pool admin …`, `pool node …` and `pool credits …`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from cli import buckets, retention
from cli.connect import (
    admin_context,
    admin_nats_client,
    client_opts,
    pool_client,
)
from cli.output import (
    EXIT_OK,
    Parser,
    Subparsers,
    UsageError,
    parse_kv,
    print_envelope,
)
from cli.volumes import add_pool_flags as add_volume_flags
from cli.volumes import pool_egress_allow, pool_volumes


def cmd_admin(args: argparse.Namespace) -> int:
    path, body = args.build(args)
    with pool_client(args) as c:
        reply = c.admin(path, body)
    after = getattr(args, "after", None)
    if after is not None and reply.get("ok"):
        after(args)
    return print_envelope(reply, args.json)


def _tenant_user_after_set(args: argparse.Namespace) -> None:
    """`pool admin tenant set` against this machine's `pool up` also gives the tenant a user
    (not over a gateway: its plane need not be this machine's)."""
    from local import embedded

    if not args.nats_url and admin_context(args) is None and embedded.local_auth() is not None:
        creds = embedded.add_tenant(args.tenant_id)
        if not args.json:
            print(f"tenant user: {creds.user} (see `pool admin tenant creds {args.tenant_id}`)",
                  file=sys.stderr)


def cmd_creds(args: argparse.Namespace) -> int:
    """`pool admin tenant|node creds NAME`: the user of a tenant or node agent, created if new."""
    from bus.local.auth import inbox_prefix
    from bus.replies import node_inbox
    from local import embedded

    name = args.name
    if args.kind == "tenant":
        creds = embedded.add_tenant(name, rotate=args.rotate)
        prefix = inbox_prefix(name)
    else:
        creds = embedded.add_node(name, rotate=args.rotate)
        prefix = node_inbox(creds.user.removeprefix("node-"))
    result: dict[str, Any] = {args.kind: name, "user": creds.user, "password": creds.password,
                              "nats_url": embedded.endpoints()[0], "inbox_prefix": prefix}
    if args.kind == "node" and args.pool:
        # the node's terms, recorded as an event: its agent registers within them or not at
        # all; on the plane whose NATS the user was just made on, never through a gateway
        with admin_nats_client(args) as c:
            reply = c.admin("node.enroll", _enrollment(args))
        if not reply.get("ok"):
            return print_envelope(reply, args.json)
        result["enrollment"] = reply.get("result")
    if args.json:
        print(json.dumps({"ok": True, "result": result}))
    else:
        for k, v in result.items():
            print(f"{k:<12}  {v}")
    return EXIT_OK


def _enrollment(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"node_id": args.name, "pool_id": args.pool,
                            "trust_level": args.trust, "max_gpus": args.max_gpus}
    for key in ("max_cpu_millis", "max_memory_mib", "gpu_model"):
        if getattr(args, key) is not None:
            body[key] = getattr(args, key)
    return body


# flag, wire field (preemption.* nested), create's default, help; `pool admin pool set` sends
# only the flags given, so a setting left out keeps its value
POOL_FLAGS: tuple[tuple[str, str, Any, str], ...] = (
    ("--packing", "packing", "best-fit", "best-fit or spread"),
    ("--commit-timeout", "commit_timeout_seconds", 30,
     "seconds a reservation waits for its commit before it is given back"),
    ("--priority-classes", "priority_classes", None, "name=rank,… (higher rank first)"),
    ("--aging", "aging_seconds_per_rank", 0, "seconds of waiting per rank gained (0: none)"),
    ("--preemption", "preemption.enabled", False, "allow (--no-preemption: forbid) preemption"),
    ("--min-runtime", "preemption.min_runtime_seconds", 0,
     "seconds a victim must have run before it may be preempted"),
    ("--grace", "preemption.grace_seconds", 30, "seconds a preempted lease gets to stop"),
    ("--heartbeat-timeout", "heartbeat_timeout_seconds", 30,
     "seconds a running lease may go without a heartbeat"),
    ("--lease-term", "default_lease_seconds", None,
     ("seconds a commit or renewal grants (default: each lease's whole maximum runtime; a "
      "shorter term makes holders renew)")),
    ("--node-timeout", "node_timeout_seconds", 30,
     "seconds of agent silence before a node is lost"),
    ("--lost-node-release", "lost_node_release_seconds", 300,
     "seconds after which a lost node's leases are released"),
    ("--max-runtime", "maximum_runtime_seconds", 86_400,
     "the longest maximum runtime, in seconds, a request may ask for"),
    ("--non-preemptible-classes", "non_preemptible_classes", None,
     "class,… whose leases are never preemption victims"),
    ("--fair-share-half-life", "fair_share_half_life_seconds", 0,
     "seconds: fair share also counts past usage decayed with this half-life (0: none)"),
    ("--renew-step", "renew_step_seconds", 60,
     "seconds a renewal must move a deadline to be recorded (smaller moves change nothing)"),
    ("--max-queued", "max_queued_leases", 10_000,
     "the most leases one tenant may have queued in the pool (more are refused)"),
    ("--queue-timeout", "queue_timeout_seconds", 7 * 86_400,
     "seconds a lease may wait queued before it ends queue_timeout (a request may ask less)"),
    ("--requests-per-second", "requests_per_second", 200,
     "a tenant's lease requests a second, per command service, after --request-burst"),
    ("--request-burst", "request_burst", 1000,
     "how many lease requests a tenant may send at once before --requests-per-second applies"),
    ("--max-attempts", "max_attempts", 10,
     "the most attempts a request's retry policy may ask for (--retries)"),
    ("--max-voided", "max_voided_reservations", 20,
     "timed-out reservations a tenant may have in --voided-window before it is refused"),
    ("--voided-window", "voided_reservation_window_seconds", 3600,
     "seconds over which --max-voided counts a tenant's timed-out reservations"),
    ("--max-workdir-bytes", "max_workdir_bytes", 1 << 30,
     "the largest packed work directory a job may bring (--workdir); bigger: refused"),
    ("--artifact-ttl", "artifact_ttl_seconds", 7 * 86_400,
     "seconds a job's stored artifacts are kept before they expire"),
    ("--max-artifact-bytes", "max_artifact_bytes", 1 << 30,
     "the most bytes of artifacts one job stores; files past it are left out"),
    ("--max-output-bytes", "max_output_bytes", 64 << 20,
     "the most bytes of a job's output its node keeps and ships; the rest is dropped"),
)


def _pool_body(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """`pool admin pool create` (every setting) or `set` (only those given) as a request."""
    body: dict[str, Any] = {"pool_id": args.pool_id}
    for flag, field, _, _ in POOL_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is None:
            continue
        if field == "priority_classes":
            value = parse_kv(value)
        elif field == "non_preemptible_classes":
            value = [c.strip() for c in value.split(",") if c.strip()]
        outer, _, inner = field.partition(".")
        if inner:
            body.setdefault(outer, {})[inner] = value
        else:
            body[field] = value
    volumes = pool_volumes(args)
    if volumes is not None:
        body["volumes"] = volumes
    allow = pool_egress_allow(args)
    if allow is not None:
        body["egress_allow"] = allow
    return f"pool.{args.verb}", body


def _prices(flag: str, items: list[str] | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            out[name] = int(value)
        except ValueError:
            raise UsageError(f"{flag} wants NAME=MICROCREDITS (a whole number), not "
                             f"{item!r}") from None
        if out[name] < 0:
            raise UsageError(f"{flag} {name}: a price must be ≥ 0 micro-credits per second")
    return out


def _pool_prices(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """`pool admin pool prices`: the whole price list from flags."""
    for flag in ("cpu_core_second", "memory_gib_second", "local_disk_gib_second"):
        if getattr(args, flag) < 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be ≥ 0 micro-credits per second")
    return "pool.prices", {
        "pool_id": args.pool_id, "cpu_core_second": args.cpu_core_second,
        "memory_gib_second": args.memory_gib_second,
        "local_disk_gib_second": args.local_disk_gib_second,
        "gpu_second": _prices("--gpu-second", args.gpu_second),
        "gpu_partition_second": _prices("--gpu-partition-second", args.gpu_partition_second),
    }


def _tenant_set(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"tenant": args.tenant_id, "pool_id": args.pool, "weight": args.weight}
    if args.quota:
        body["quota"] = parse_kv(args.quota)
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
            raise UsageError(f"cannot read key file {path}: {e.strerror}") from None
        keys.append({"key_id": key_id, "public_key_pem": pem})
    tenant_registries: dict[str, list[str]] = {}
    for spec in args.tenant_registry or ():
        tenant, sep, registry = spec.partition("=")
        if not sep:
            raise UsageError(f"--tenant-registry wants TENANT=REGISTRY, not {spec!r}")
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
        body["isolation_by_trust"] = parse_kv(args.isolation, str)
    return "pool.images", body


def register(sub: Subparsers) -> None:
    """Add `admin`."""
    adm = sub.add_parser("admin", help="configure pools, tenants and nodes").add_subparsers(
        dest="sub", metavar="WHAT")
    adm.required = True
    show = _add_pool(adm)
    aten, ts = _add_tenant(adm)
    from cli.quotas import register_admin

    register_admin(adm, show, ts)
    from cli.secret import register_admin as register_secrets

    register_secrets(adm, cmd_admin)
    from cli import reservation

    reservation.register_admin(adm)
    _add_tenant_creds(aten)
    buckets.register(aten)
    retention.register(aten)
    from cli.gateway import register_tokens

    register_tokens(adm, aten)
    _add_node(adm)


def _add_pool(adm: Subparsers) -> Parser:
    """Add `admin pool` and its verbs; the `show` parser, which quotas extend."""
    apool = adm.add_parser("pool", help="pool settings").add_subparsers(dest="verb", metavar="VERB")
    apool.required = True
    for verb, help_text in (
            ("create", "create a pool (refused if it exists); settings left out take defaults"),
            ("set", "change a pool's settings: only the flags given change")):
        ps = apool.add_parser(verb, help=help_text, description=help_text[0].upper()
                              + help_text[1:] + ".")
        client_opts(ps)
        ps.add_argument("pool_id")
        for flag, _, default, help_ in POOL_FLAGS:
            if verb == "set":
                default, help_ = None, f"{help_} (unchanged if left out)"
            elif default is not None:
                help_ = f"{help_} (default {default})"
            if flag == "--preemption":
                ps.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=help_)
            elif flag == "--packing":
                ps.add_argument(flag, choices=["best-fit", "spread"], default=default,
                                help=help_)
            elif flag in ("--priority-classes", "--non-preemptible-classes"):
                ps.add_argument(flag, default=default, help=help_)
            else:
                ps.add_argument(flag, type=int, default=default, metavar="SECONDS", help=help_)
        add_volume_flags(ps)
        ps.set_defaults(func=cmd_admin, build=_pool_body)
    _add_pool_prices(apool)
    show = apool.add_parser("show", help="every setting in force")
    client_opts(show)
    show.add_argument("pool_id")
    show.set_defaults(func=cmd_admin, build=lambda a: ("pool.show", {"pool_id": a.pool_id}))
    _add_pool_images(apool)
    return show


def _add_pool_prices(apool: Subparsers) -> None:
    """Add `admin pool prices`."""
    pp = apool.add_parser(
        "prices", help="publish the pool's price list (a new version; leases hold credits "
        "for their whole maximum runtime at these prices)",
        description="Prices are micro-credits per second of one unit; a lease holds what its "
        "maximum runtime would cost and is charged for what it ran. Every price left out is 0.",
        epilog="example: pool admin pool prices gpu-global --cpu-core-second 10 "
        "--memory-gib-second 2 --gpu-second a100=400 --gpu-second '*=100'")
    client_opts(pp)
    pp.add_argument("pool_id")
    pp.add_argument("--cpu-core-second", type=int, default=0, metavar="MICROCREDITS",
                    help="per CPU core per second")
    pp.add_argument("--memory-gib-second", type=int, default=0, metavar="MICROCREDITS",
                    help="per GiB of memory per second")
    pp.add_argument("--local-disk-gib-second", type=int, default=0, metavar="MICROCREDITS",
                    help="per GiB of local disk per second")
    pp.add_argument("--gpu-second", action="append", metavar="MODEL=MICROCREDITS",
                    help="per GPU of a model per second; * prices any model not listed "
                    "(repeatable)")
    pp.add_argument("--gpu-partition-second", action="append", metavar="PROFILE=MICROCREDITS",
                    help="per GPU partition (MIG profile, time-slice) per second (repeatable)")
    pp.set_defaults(func=cmd_admin, build=_pool_prices)


def _add_pool_images(apool: Subparsers) -> None:
    """Add `admin pool images`."""
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


def _add_tenant(adm: Subparsers) -> tuple[Subparsers, Parser]:
    """Add `admin tenant` and its `set` verb; both, which the other groups extend."""
    aten = adm.add_parser("tenant", help="tenant settings").add_subparsers(dest="verb", metavar="VERB")
    aten.required = True
    ts = aten.add_parser("set", help="a tenant's weight, quota and cohort in a pool")
    client_opts(ts)
    ts.add_argument("tenant_id")
    ts.add_argument("--pool", required=True)
    ts.add_argument("--weight", type=float, default=1.0)
    ts.add_argument("--quota", help="dimension=amount,… e.g. cpu_millis=64000,gpu_count=4")
    ts.set_defaults(func=cmd_admin, build=_tenant_set, after=_tenant_user_after_set)
    return aten, ts


def _add_tenant_creds(aten: Subparsers) -> None:
    """Add `admin tenant creds`."""
    tc = aten.add_parser("creds", help="the tenant's NATS user on this machine's `pool up` "
                         "(created and loaded into the running server if new)")
    tc.add_argument("name", metavar="tenant_id")
    tc.add_argument("--rotate", action="store_true", help="replace the password")
    tc.add_argument("--json", action="store_true")
    tc.set_defaults(func=cmd_creds, kind="tenant")


def _add_node(adm: Subparsers) -> None:
    """Add `admin node` and its verbs."""
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
    nc_.add_argument("--pool", help="enroll the node in this pool: its agent may register only "
                     "there and within the ceilings below (an agent never enrolled is refused)")
    nc_.add_argument("--trust", choices=("trusted", "marketplace"), default="marketplace",
                     help="the node's trust level, whatever its agent claims (default "
                     "marketplace)")
    nc_.add_argument("--max-gpus", type=int, default=0, help="most GPUs it may claim (default 0)")
    nc_.add_argument("--max-cpu-millis", type=int, help="most CPU it may claim (default: any)")
    nc_.add_argument("--max-memory-mib", type=int, help="most memory it may claim (default: any)")
    nc_.add_argument("--gpu-model", help="the only GPU model it may claim (default: any)")
    nc_.add_argument("--nats-url", help="control plane for the enrollment (default: `pool up`)")
    nc_.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for a reply")
    nc_.set_defaults(func=cmd_creds, kind="node")


def register_node_credits(sub: Subparsers) -> None:
    """Add `node` and `credits`."""
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
