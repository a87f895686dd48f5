"""`pool lease …`: a tenant requests, commits and manages its leases."""

from __future__ import annotations

import argparse
import time
from typing import Any

from cli import changes, files, secret, session, volumes, workflow
from cli.connect import (
    client_opts,
    context_of,
    default_pool,
    pool_client,
    sdk_client,
    tenant_connection,
    tenant_of,
)
from cli.output import (
    EXIT_OK,
    Subparsers,
    UsageError,
    print_envelope,
    print_item,
    table,
    verb_at_hand,
)
from cli.workflow import MAX_LEASES_PER_REQUEST

# the limits and words the flags offer, as domain.gang, domain.policy.gang and schemas.v1 spell
# them (kept equal by tests/unit/test_cli_start.py): parsing a flag imports neither
MAX_GANG_MEMBERS = 256
STRATEGIES: tuple[str, ...] = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
TOPOLOGY_KEYS: tuple[str, ...] = ("rack", "block", "nvlink_domain", "zone", "failure_domain")


def _request_body(args: argparse.Namespace) -> dict[str, Any]:
    import uuid

    if getattr(args, "file", None):
        from cli.jobfile import load

        loaded: dict[str, Any] = load(args.file, key=args.key)[0]
        group = _group(args)  # --members … beside a file: the file's request as a gang
        if group is not None:
            loaded["group"] = group
        return {**loaded, **_naming(args, loaded.get("labels") or {}), **workflow.body(args)}
    if args.pool is None:
        args.pool = default_pool(args) or getattr(args, "pool_fallback", None)
    for flag in ("pool", "cpu_millis", "memory_mib", "max_runtime"):
        if getattr(args, flag) is None:
            raise UsageError(f"--{flag.replace('_', '-')} is required (or -f job.yaml)")
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
        "preemptible_requeue": args.requeue_on_preemption,
    }
    if args.image:
        body["image"] = args.image
    if getattr(args, "reservation", None):
        body["reservation_id"] = args.reservation
    if args.image_signature:
        body["image_signature"] = args.image_signature
    if args.image_size is not None:
        body["image_size_bytes"] = args.image_size
    group = _group(args)
    if group is not None:
        body["group"] = group
    body.update(_naming(args, {}))
    body.update(workflow.body(args))
    for flag, value in (("--cpu-millis", args.cpu_millis), ("--memory-mib", args.memory_mib),
                        ("--max-runtime", args.max_runtime)):
        if value < (1 if flag == "--max-runtime" else 0):
            raise UsageError(f"{flag} must be ≥ {1 if flag == '--max-runtime' else 0}")
    return body


def _naming(args: argparse.Namespace, labels: dict[str, str]) -> dict[str, Any]:
    """`--name N` and `--label k=v …` as the request's fields (the flags win over a file's)."""
    out: dict[str, Any] = {}
    if getattr(args, "name", None):
        out["name"] = args.name
    given = dict(labels)
    for item in getattr(args, "label", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--label wants KEY=VALUE, not {item!r}")
        given[key] = value
    if given:
        out["labels"] = given
    return out


def _group(args: argparse.Namespace) -> dict[str, Any] | None:
    """`--members N [--same KEY | --spread KEY] [--strategy S]` as the request's group."""
    members = getattr(args, "members", None)
    flags = {k: getattr(args, k, None) for k in ("same", "spread", "strategy")}
    if members is None:
        if any(flags.values()):
            raise UsageError("--same, --spread and --strategy shape a gang: add --members N")
        return None
    if not 1 <= members <= MAX_GANG_MEMBERS:
        raise UsageError(f"--members must be between 1 and {MAX_GANG_MEMBERS}")
    if flags["same"] and flags["spread"]:
        raise UsageError("a gang is packed (--same) or spread (--spread), not both")
    return {"members": members, **{k: v for k, v in flags.items() if v}}


def cmd_lease_request(args: argparse.Namespace) -> int:
    from cli.run import report_not_reserved, wait_reserved

    body = _request_body(args)
    if args.count != 1:
        if not 1 <= args.count <= MAX_LEASES_PER_REQUEST:
            raise UsageError(f"--count must be between 1 and {MAX_LEASES_PER_REQUEST}")
        if args.wait:
            raise UsageError("--wait takes one lease: leave out --count")
        if "group" in body:
            raise UsageError("a request is a gang (--members) or a batch (--count), not both")
        body["count"] = args.count
    elif "max_running" in body:
        raise UsageError("--max-running throttles an array: add --count N")
    if args.wait and "group" in body:
        raise UsageError("--wait takes one lease: leave it out for a gang (`pool lease get`)")
    with pool_client(args, tenant_of(args)) as c:
        reply = c.request_lease(body)
        if args.wait and reply.get("ok"):
            waited = wait_reserved(c, str(reply["lease"]["lease_id"]), timeout=args.wait_seconds)
            if not waited.reserved:
                return report_not_reserved(waited, args.json)
            reply = {"ok": True, "lease": waited.lease}
    ids = (reply.get("result") or {}).get("lease_ids")
    if reply.get("ok") and ids and not args.json:
        for lease_id in ids:  # one id a line, in order: easy to pipe
            print(lease_id)
        return EXIT_OK
    return print_envelope(reply, args.json)


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
    if args.verb == "renew" and args.extend_seconds is not None:
        body["extend_seconds"] = args.extend_seconds
    if args.verb == "release" and args.exit_code is not None:
        body["exit_code"] = args.exit_code
    if args.verb in ("release", "cancel") and args.reason:
        body["reason"] = args.reason
    if args.verb in ("why", "get") and args.at:  # then, not now
        from cli.whatif import parse_when
        body["at"] = parse_when("--at", args.at, time.time())
        if args.verb == "get":  # the leases view as it was
            from cli.asof import lease_at

            return lease_at(args, tenant_of(args), body["at"])
    with sdk_client(args, tenant_of(args)) as c:  # the SDK's Client: the envelope as given
        reply = c.envelope(args.lease_id, args.verb, body)
    gang = (reply.get("lease") or {}).get("gang") if reply.get("ok") else None
    if args.json or not gang:
        return print_envelope(reply, args.json)
    reply["lease"] = {k: v for k, v in reply["lease"].items() if k != "gang"}
    print_envelope(reply, False)
    constraint = gang.get("same") or gang.get("spread")
    print(f"\ngang {gang['gang_id']}: {gang['size']} member(s), {gang['strategy']}"
          + (f" over {constraint}" if constraint else ""))
    rows = [{**m, "devices": ",".join(m.get("devices") or ()) or "-"} for m in gang["members"]]
    print(table(rows, GANG_COLUMNS))
    return EXIT_OK


GANG_COLUMNS = ("member", "lease_id", "state", "node_id", "devices")


QUEUE_COLUMNS = ("position", "lease_id", "pool", "priority_class", "estimated_start",
                 "reserved")


def cmd_lease_queue(args: argparse.Namespace) -> int:
    import datetime as dt

    with pool_client(args, tenant_of(args)) as c:
        reply = c.queue_positions()
    if args.json or not reply.get("ok"):
        return print_envelope(reply, args.json)
    rows = []
    for r in reply["result"]["leases"]:
        at = r.get("estimated_start_at")
        rows.append({**r, "estimated_start": None if at is None else
                     dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")})
    print(table(rows, QUEUE_COLUMNS))
    return EXIT_OK


def _job(args: argparse.Namespace) -> dict[str, Any]:
    """The job of `lease run`: the command after `--`, the image and the environment."""
    command = list(getattr(args, "job_command", None) or [])
    if not command:
        raise UsageError("no command: put the job's command after `--`, e.g. "
                         "pool lease run … -- python3 -c 'print(1)'")
    job: dict[str, Any] = {"command": command}
    if args.image:
        job["image"] = args.image
    if args.image_signature:
        job["image_signature"] = args.image_signature
    env: dict[str, str] = {}
    for item in args.env or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UsageError(f"--env wants NAME=VALUE, not {item!r}")
        env[name] = value
    if env:
        job["env"] = env
    return job


def cmd_lease_run(args: argparse.Namespace) -> int:
    from cli.run import run_lease

    if args.runtime is None:  # a bare command runs in the sandbox; an image, in a container
        args.runtime = "container" if args.image else "sandboxed"
    body = _request_body(args)
    if args.file:
        from cli.jobfile import load

        job = load(args.file)[1]
        if args.job_command:  # the command after `--` replaces the file's
            job["command"] = list(args.job_command)
        if not job.get("command"):
            raise UsageError(f"{args.file}: command: the job needs one (or put it after `--`)")
    else:
        job = _job(args)
    from cli.files import with_files
    from cli.secret import with_secrets
    from cli.volumes import with_volumes

    job = with_volumes(args, with_secrets(args, job))
    if getattr(args, "stdin", False):  # a pipe for `pool lease attach -i`
        job["stdin"] = True
    tenant = tenant_of(args)
    # a job file's workdir is a local folder too; the flags win over the file
    workdir, artifacts = job.pop("workdir", None), job.pop("artifacts", None)
    with _run_client(args, tenant, bool(args.workdir or workdir)) as c:
        files = with_files(c, tenant, job, args.workdir or workdir,
                           args.artifacts or artifacts, quiet=args.quiet or args.json)
        return run_lease(c, tenant, body, files.job, detach=args.detach, as_json=args.json,
                         quiet=args.quiet, on_commit_refused=files.commit_refused)


# `pool lease run` speaks core NATS alone (client.lean), a fast path, unless the one switch
# of the fast paths is off (POOL_FAST_PATHS=off, workers/fastpaths.py), a context speaks HTTP,
# a work directory goes up (the object store is JetStream's), traces are exported (nats-py
# carries their headers) or the server asks for what it does not speak (TLS, nkeys)
FAST_ENV = "POOL_FAST_PATHS"


def _run_client(args: argparse.Namespace, tenant: str, uploads: bool) -> Any:
    """The client `lease run` speaks through: the lean one where it can, else pool_client's."""
    import os

    tracing = os.environ.get("POOL_OTEL_EXPORTER", "").strip().lower() not in ("", "none")
    lean = os.environ.get(FAST_ENV, "").strip().lower() != "off"
    if lean and not uploads and not tracing \
            and context_of(args) is None:
        from bus.corenats import Unsupported
        from client.lean import LeanClient

        url, options = tenant_connection(args, tenant)
        try:
            return LeanClient(url, tenant, timeout=args.timeout, **options)
        except Unsupported:
            pass
    return pool_client(args, tenant)


def cmd_lease_logs(args: argparse.Namespace) -> int:
    from cli.run import OutputReader, follow_until_done, parse_duration, write_out

    tenant = tenant_of(args)
    with pool_client(args, tenant) as c:
        reader = OutputReader(c, tenant, args.lease_id, since=parse_duration(args.since,
                                                                             "--since"))
        if not args.follow:
            reader.read(write_out)
            return EXIT_OK
        # live from here on; what is stored is read after, and what both bring is written once
        # (from the watch's start less a minute's slack for the agent's clock)
        with c.watch_lease(args.lease_id, output=True) as watch:
            reader.keep_after = watch.live_from
            reader.read(write_out)
            follow_until_done(c, watch, args.lease_id, seen=reader.seen)
    return EXIT_OK


def cmd_lease_watch(args: argparse.Namespace) -> int:
    """Print each state change of a lease until it ends; without an id, of every lease of the
    tenant until Ctrl-C. Follows the tenant's feed: what is stored (after --after), then live
    (no polling)."""
    import asyncio
    import sys

    from cli.connect import tenant_connection
    from cli.run import FINAL_STATES

    if args.after is not None and args.after < 0:
        raise UsageError("--after must be ≥ 0")
    tenant = tenant_of(args)
    ctx = context_of(args)
    if ctx is not None:
        return _watch_over_http(args, ctx)
    lease = None
    if args.lease_id:
        with pool_client(args, tenant) as c:  # an unknown (or another's) lease: refused here
            reply = c.lease(args.lease_id, "get")
        if not reply.get("ok"):
            return print_envelope(reply, args.json)
        lease = reply["lease"]
    url, options = tenant_connection(args, tenant)

    async def watch() -> int:
        from bus.feed import follow

        printed = 0
        done_already = lease is not None and lease.get("state") in FINAL_STATES
        # a lease's whole story; every lease's only from now, unless told where to resume
        after = args.after if args.after is not None else (0 if args.lease_id else None)
        def ready() -> None:
            if not args.lease_id:
                print(f"pool: watching every lease of {tenant} (Ctrl-C to stop)",
                      file=sys.stderr, flush=True)

        items = follow(url, tenant, lease=args.lease_id or None, after=after, **options,
                       until_caught_up=done_already, on_ready=ready)
        try:
            async for item in items:
                changes.print_change(item, args.json)
                printed += 1
                if lease is not None and item.record is not None \
                        and item.record.state in FINAL_STATES:
                    return EXIT_OK
        finally:
            await items.aclose()
        if lease is not None and not printed:  # ended before the feed's oldest record
            changes.print_lease(lease, args.json)
        return EXIT_OK

    try:
        return asyncio.run(watch())
    except KeyboardInterrupt:  # how a watch of every lease ends
        return EXIT_OK


def _watch_over_http(args: argparse.Namespace, ctx: Any) -> int:
    """`lease watch ID` through the gateway's event stream of the lease (its feed, as the
    token's tenant), until the lease ends."""
    from cli.connect import http_client

    if not args.lease_id:
        raise UsageError("over HTTP, `lease watch` follows one lease: give its id")
    with http_client(ctx, args.timeout) as c:
        reply = c.lease(args.lease_id, "get")
        if not reply.get("ok"):
            return print_envelope(reply, args.json)
        printed = 0
        for record in c.lease_events(args.lease_id, after=args.after or 0):
            printed += 1
            if args.json:
                print_item(record)
            else:
                print(changes.change_line(record.get("at"), str(record.get("lease_id")),
                                   record.get("previous_state"), str(record.get("state")),
                                   record.get("node_id"), record.get("end_reason"),
                                   record.get("exit_code")), flush=True)
        if not printed:  # ended before the feed's oldest record
            changes.print_lease(reply["lease"], args.json)
    return EXIT_OK


def _shape_flags(p: argparse.ArgumentParser, *, defaults: bool) -> None:
    """The flags of a lease's shape and terms; `lease run` gives the everyday ones defaults."""

    if defaults:
        p.add_argument("--pool", help="pool id (default: $POOL_POOL, the context's pool "
                       "(`pool login --pool`), or default)")
        p.set_defaults(pool_fallback="default")
        p.add_argument("--cpu-millis", type=int, default=1000,
                       help="CPU in thousandths of a core (default 1000: one core)")
        p.add_argument("--memory-mib", type=int, default=512, help="memory in MiB (default 512)")
    else:
        p.add_argument("--pool", help="pool id (default: $POOL_POOL or the context's pool; "
                       "required otherwise, unless -f)")
        p.add_argument("--cpu-millis", type=int,
                       help="CPU in thousandths of a core (1000: one core; required unless -f)")
        p.add_argument("--memory-mib", type=int, help="memory in MiB (required unless -f)")
    p.add_argument("--gpu-count", type=int, default=0)
    p.add_argument("--gpu-memory-gib-min", type=int, default=0)
    p.add_argument("--gpu-model")
    p.add_argument("--gpu-partition", help="a MIG profile such as 1g.10gb, or time-slice")
    p.add_argument("--cpu-arch", choices=["amd64", "arm64"])
    p.add_argument("--local-disk-gib", type=int, default=0)
    p.add_argument("--runtime", choices=["container", "sandboxed", "microvm", "dedicated-host"],
                   help="isolation class" + (" (default: sandboxed for a bare command, "
                                             "container with --image)" if defaults else
                                             " (default container)"))
    p.add_argument("--egress", choices=["none", "restricted", "open"])
    p.add_argument("--region")
    p.add_argument("--zone")
    if defaults:
        p.add_argument("--max-runtime", type=int, default=3600, metavar="SECONDS",
                       help="the longest the job may run, in seconds (default 3600)")
    else:
        p.add_argument("--max-runtime", type=int, metavar="SECONDS",
                       help="the longest the lease may run, in seconds (required unless -f); a "
                       "commit grants all of it unless the pool sets a shorter renewable term")
    p.add_argument("-f", "--file", metavar="JOB.yaml",
                   help="the request (and the job) from a YAML file whose keys are those of "
                   "schemas/json/LeaseRequest.json (command, env, checkpoint_policy for the "
                   "job); the shape flags are then not used")
    p.add_argument("--name", help="what you call the lease: shown in `pool leases`, and "
                   "filtered by (`pool leases --name N`); need not be unique")
    p.add_argument("--label", "-l", action="append", metavar="KEY=VALUE",
                   help="a label of the lease (repeatable): `pool leases -l KEY=VALUE`")
    p.add_argument("--priority", default="standard", help="priority class")
    p.add_argument("--key", help="idempotency key (default: a new random one)")
    p.add_argument("--image", help="image reference, pinned by digest")
    p.add_argument("--image-signature", help="base64 signature (`pool image sign`)")
    p.add_argument("--image-size", type=int, help="image size in bytes")
    p.add_argument("--checkpointable", action="store_true",
                   help="the job resumes from its checkpoints: preemption counts only the work "
                   "since the last one")
    p.add_argument("--requeue-on-preemption", action="store_true",
                   help="when preempted, go back in the queue and restart the job on the next "
                   "placement (default: end as preempted)")
    workflow.add_flags(p)
    p.add_argument("--reservation", metavar="ID",
                   help="an advance reservation of the tenant's whose capacity it may use "
                   "while its window is open (`pool admin reservation create`)")


def register(sub: Subparsers) -> None:
    """Add `lease` and its verbs."""
    lease = sub.add_parser("lease", help="request and manage leases").add_subparsers(
        dest="sub", metavar="VERB")
    lease.required = True
    _add_run(lease)
    if verb_at_hand(sub, "lease") == "run":
        return  # `pool lease run …` parses with its own parser: the other verbs' cost ~9 ms
    files.register(lease)
    session.register(lease)
    _add_logs_and_watch(lease)
    _add_request(lease)
    _add_verbs(lease)


def _add_run(lease: Subparsers) -> None:
    """Add `lease run`."""
    run = lease.add_parser(
        "run", help="run a command on a lease: request, wait, commit, stream, exit with its code",
        description="Request a lease, wait for its reservation, commit it with the command "
        "after `--`, stream the job's output, renew as needed, and exit with the job's exit "
        "code (1 when it could not run or was ended otherwise, 130 when cancelled). Ctrl-C "
        "cancels the lease.",
        epilog="example: pool lease run --tenant acme --pool p1 --cpu-millis 500 -- "
        "python3 -c 'print(1)'")
    client_opts(run, tenant=True)
    _shape_flags(run, defaults=True)
    run.set_defaults(runtime=None)
    run.add_argument("--env", action="append", metavar="NAME=VALUE",
                     help="the job's environment (repeatable)")
    run.add_argument("--detach", "-d", action="store_true",
                     help="print the lease id once the job is committed, and return")
    run.add_argument("--quiet", "-q", action="store_true",
                     help="no progress lines on stderr")
    files.add_run_flags(run)
    secret.add_run_flags(run)
    volumes.add_run_flags(run)
    session.add_run_flags(run)
    run.set_defaults(func=cmd_lease_run, job_command=[], count=1)


def _add_logs_and_watch(lease: Subparsers) -> None:
    """Add `lease logs` and `lease watch`."""
    lg = lease.add_parser("logs", help="the job's stdout and stderr (--follow: until it ends)")
    client_opts(lg, tenant=True)
    lg.add_argument("lease_id")
    lg.add_argument("--follow", "-f", action="store_true",
                    help="keep printing as the job writes, until the lease ends")
    lg.add_argument("--since", metavar="T", help="only output from T on: a duration back from "
                    "now (30s, 10m, 2h) or an ISO 8601 time")
    lg.set_defaults(func=cmd_lease_logs)
    wt = lease.add_parser("watch", help="print each state change of a lease, until it ends "
                          "(no id: of every lease of the tenant, until Ctrl-C)",
                          description="Follows the tenant's lease feed: the changes stored "
                          "(7 days), then each as it happens. --json: one envelope a line, "
                          '{"ok": true, "result": {"seq": …, "state": …}}.')
    client_opts(wt, tenant=True)
    wt.add_argument("lease_id", nargs="?")
    wt.add_argument("--after", type=int, metavar="SEQ",
                    help="first the stored changes after feed sequence SEQ (each --json line "
                    "has its `seq`; 0: all kept); default: a lease's from its start, every "
                    "lease's from now on")
    wt.set_defaults(func=cmd_lease_watch)


def _add_request(lease: Subparsers) -> None:
    """Add `lease request` and `lease queue`."""
    rq = lease.add_parser("request", help="ask for a lease on a resource shape")
    client_opts(rq, tenant=True)
    _shape_flags(rq, defaults=False)
    rq.add_argument("--wait", action="store_true",
                    help="wait until it is reserved; if it cannot be, say why and exit 1")
    rq.add_argument("--wait-seconds", type=float, metavar="SECONDS",
                    help="with --wait: give up (exit 1, saying why it waits) after SECONDS")
    rq.add_argument("--count", type=int, default=1,
                    help=f"leases to request at once, each its own lease (1 to "
                         f"{MAX_LEASES_PER_REQUEST}; ids follow from --key and the index)")
    workflow.add_array_flags(rq)
    rq.add_argument("--members", type=int, metavar="N",
                    help=f"a gang of N leases (1 to {MAX_GANG_MEMBERS}), one node each, placed "
                    "all-or-nothing and committed, renewed, preempted and requeued together")
    rq.add_argument("--same", choices=TOPOLOGY_KEYS, metavar="KEY",
                    help="with --members: every member in one value of this node label "
                    f"({', '.join(TOPOLOGY_KEYS)})")
    rq.add_argument("--spread", choices=TOPOLOGY_KEYS, metavar="KEY",
                    help="with --members: each member in a distinct value of this label")
    rq.add_argument("--strategy", choices=STRATEGIES,
                    help="with --members: PACK or SPREAD prefer the constraint, STRICT_PACK "
                    "(--same's default) and STRICT_SPREAD (--spread's) require it")
    rq.set_defaults(func=cmd_lease_request)
    lq = lease.add_parser("queue", help="your waiting leases in queue order, with estimated "
                          "starts (from each pool's leading scheduler)")
    client_opts(lq, tenant=True)
    lq.set_defaults(func=cmd_lease_queue)


def _add_verbs(lease: Subparsers) -> None:
    """Add the lease's verbs one by one: commit, heartbeat, renew, release, cancel, get, why."""
    for verb, help_text in (("commit", ("confirm a reservation within the pool's commit window "
                             "(30 s unless the pool sets another) and start its job")),
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
        vp.add_argument("--extend-seconds", type=int, default=None, metavar="SECONDS",
                        help=argparse.SUPPRESS if verb != "renew" else
                        "extend to now + SECONDS (default: the pool's lease term), never past "
                        "the maximum runtime")
        vp.add_argument("--exit-code", type=int, help=argparse.SUPPRESS if verb != "release" else "the workload's exit code")
        vp.add_argument("--reason", help=argparse.SUPPRESS if verb not in ("release", "cancel") else "why")
        vp.add_argument("--at", metavar="TIME", help=argparse.SUPPRESS if verb not in (
            "why", "get") else f"the {'reason recorded' if verb == 'why' else 'lease as it was'}"
            " at TIME: ISO (2026-12-06T14:03), epoch seconds, or `2h ago`")
