"""What a pool lets jobs reach, on the command line: the operator's `pool admin pool
create|set --volume NAME=PATH[:ro|:rw][@LEVEL,…]` and `--egress-allow CIDR`, and a job's
`pool lease run --volume NAME:TARGET`."""

from __future__ import annotations

import argparse
import ipaddress
from typing import Any

from cli.output import UsageError

TRUST_LEVELS = ("trusted", "marketplace")


def add_pool_flags(ps: argparse.ArgumentParser) -> None:
    ps.add_argument("--volume", action="append", metavar="NAME=PATH[:ro|:rw][@LEVEL,…]",
                    help="a host directory jobs may mount by NAME (read-only unless :rw; only "
                    "on nodes of the trust levels after @, default every level); repeatable, "
                    "the flags given replace the pool's volumes")
    ps.add_argument("--no-volumes", action="store_true", help="offer no volumes")
    ps.add_argument("--egress-allow", action="append", metavar="CIDR",
                    help="an IPv4 network the pool's jobs with egress may reach past the denied "
                    "ranges (private, link-local, the host's own); repeatable, the flags given "
                    "replace the pool's list")
    ps.add_argument("--no-egress-allow", action="store_true",
                    help="allow no network past the denied ranges")


def pool_egress_allow(args: argparse.Namespace) -> list[str] | None:
    """The pool's whole egress allow-list from the flags; None when neither flag was given."""
    items = getattr(args, "egress_allow", None) or []
    if getattr(args, "no_egress_allow", False):
        if items:
            raise UsageError("--no-egress-allow and --egress-allow: one or the other")
        return []
    if not items:
        return None
    out: list[str] = []
    for item in items:
        try:
            net = ipaddress.ip_network(item.strip(), strict=False)
        except ValueError:
            raise UsageError(f"--egress-allow wants an IPv4 network such as 203.0.113.0/24, "
                             f"not {item!r}") from None
        if net.version != 4:
            raise UsageError(f"--egress-allow {item}: only IPv4 networks can be allowed")
        out.append(str(net))
    return out


def pool_volumes(args: argparse.Namespace) -> dict[str, Any] | None:
    """The pool's whole set of volumes from the flags; None when neither flag was given."""
    items = getattr(args, "volume", None) or []
    if getattr(args, "no_volumes", False):
        if items:
            raise UsageError("--no-volumes and --volume: one or the other")
        return {}
    if not items:
        return None
    out: dict[str, Any] = {}
    for item in items:
        name, sep, rest = item.partition("=")
        rest, _at, levels = rest.partition("@")
        path, mode = rest, "ro"
        if rest.endswith((":ro", ":rw")):
            path, mode = rest[:-3], rest[-2:]
        if not sep or not name or not path.startswith("/"):
            raise UsageError(f"--volume wants NAME=/host/path[:ro|:rw][@LEVEL,…], not {item!r}")
        trust = [t.strip() for t in levels.split(",") if t.strip()]
        bad = [t for t in trust if t not in TRUST_LEVELS]
        if bad:
            raise UsageError(f"--volume {name}: trust level {bad[0]!r} is not one of "
                             f"{', '.join(TRUST_LEVELS)}")
        out[name] = {"host_path": path, "read_only": mode == "ro", "trust_levels": trust}
    return out


def add_run_flags(run: argparse.ArgumentParser) -> None:
    run.add_argument("--volume", action="append", metavar="NAME:TARGET",
                     help="mount the pool's volume NAME at TARGET in the sandbox (repeatable; "
                     "`pool admin pool show` lists a pool's volumes)")


def with_volumes(args: argparse.Namespace, job: dict[str, Any]) -> dict[str, Any]:
    """`job` with the flags' volumes added to a job file's (the flags win)."""
    volumes = dict(job.get("volumes") or {})
    for item in getattr(args, "volume", None) or []:
        name, sep, target = item.partition(":")
        if not sep or not name or not target.startswith("/"):
            raise UsageError(f"--volume wants NAME:/path/in/the/sandbox, not {item!r}")
        volumes[name] = target
    return {**job, "volumes": volumes} if volumes else job
