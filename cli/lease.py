"""`pool lease …`: a tenant requests, commits and manages its leases."""

from __future__ import annotations

import argparse
from typing import Any

from cli.connect import (
    client_opts,
    pool_client,
    tenant_of,
)
from cli.output import (
    EXIT_OK,
    Subparsers,
    UsageError,
    print_envelope,
    table,
)
from schemas.v1 import MAX_LEASES_PER_REQUEST


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
        "preemptible_requeue": args.requeue_on_preemption,
    }
    if args.image:
        body["image"] = args.image
    if args.image_signature:
        body["image_signature"] = args.image_signature
    if args.image_size is not None:
        body["image_size_bytes"] = args.image_size
    if args.count != 1:
        if not 1 <= args.count <= MAX_LEASES_PER_REQUEST:
            raise UsageError(f"--count must be between 1 and {MAX_LEASES_PER_REQUEST}")
        body["count"] = args.count
    with pool_client(args, tenant_of(args)) as c:
        reply = c.request_lease(body)
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
    with pool_client(args, tenant_of(args)) as c:
        return print_envelope(c.lease(args.lease_id, args.verb, body), args.json)


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


def register(sub: Subparsers) -> None:
    """Add `lease` and its verbs."""
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
    rq.add_argument("--max-runtime", type=int, required=True, metavar="SECONDS",
                    help="the longest the lease may run, in seconds; a commit grants all of it "
                    "unless the pool sets a shorter renewable term")
    rq.add_argument("--priority", default="standard", help="priority class")
    rq.add_argument("--key", help="idempotency key (default: a new random one)")
    rq.add_argument("--image", help="image reference, pinned by digest")
    rq.add_argument("--image-signature", help="base64 signature (`pool image sign`)")
    rq.add_argument("--image-size", type=int, help="image size in bytes")
    rq.add_argument("--checkpointable", action="store_true",
                    help="the job resumes from its checkpoints: preemption counts only the work "
                    "since the last one")
    rq.add_argument("--requeue-on-preemption", action="store_true",
                    help="when preempted, go back in the queue and restart the job on the next "
                    "placement (default: end as preempted)")
    rq.add_argument("--count", type=int, default=1,
                    help=f"leases to request at once, each its own lease (1 to "
                         f"{MAX_LEASES_PER_REQUEST}; ids follow from --key and the index)")
    rq.set_defaults(func=cmd_lease_request)
    lq = lease.add_parser("queue", help="your waiting leases in queue order, with estimated "
                          "starts (from the active scheduler)")
    client_opts(lq, tenant=True)
    lq.set_defaults(func=cmd_lease_queue)
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
