"""The flags of work that finishes by itself — retries, dependencies, array throttles — and
their request fields (docs/workflows.md)."""

from __future__ import annotations

import argparse
from typing import Any

from cli.output import UsageError

# the domain's words and limits, repeated here so that parsing a flag imports no domain module
# (kept equal by tests/unit/test_cli_start.py)
MAX_LEASES_PER_REQUEST = 999
RETRY_REASONS: tuple[str, ...] = ("failed", "node_lost", "heartbeat_lost", "preempted",
                                  "deadline")
DEPENDENCY_CONDITIONS: tuple[str, ...] = ("ok", "any", "notok")


def add_flags(p: argparse.ArgumentParser) -> None:
    """`--retries`, `--retry-on`, `--retry-backoff[-max]` and `--after`."""
    p.add_argument("--retries", type=int, metavar="N",
                   help="run it again when an attempt ends badly, up to N attempts in all "
                   "(the job sees POOL_ATTEMPT=1, 2, …)")
    p.add_argument("--retry-on", action="append", metavar="REASON,…",
                   help=f"with --retries: the end reasons retried on ({', '.join(RETRY_REASONS)}; "
                   "default failed)")
    p.add_argument("--retry-backoff", type=int, metavar="SECONDS",
                   help="with --retries: the first retry waits SECONDS, each next one twice as "
                   "long (default 0)")
    p.add_argument("--retry-backoff-max", type=int, metavar="SECONDS",
                   help="with --retries: the longest wait between attempts (default 3600)")
    p.add_argument("--after", action="append", metavar="ID[:ok|:any|:notok]",
                   help="wait (held) until lease ID succeeded (ok, the default), ended "
                   "otherwise (notok) or ended at all (any); repeatable; a dependency that can "
                   "no longer be met ends it dependency_failed")


def add_array_flags(rq: argparse.ArgumentParser) -> None:
    """`--after-each` and `--max-running`, for a request of `--count N` leases."""
    rq.add_argument("--after-each", metavar="ID[:ok|:any|:notok]",
                    help="with --count N: lease i waits for lease i of the array of N whose "
                    "first lease is ID (as --after does)")
    rq.add_argument("--max-running", type=int, metavar="K",
                    help="with --count: at most K of these leases reserved or running at once")


def body(args: argparse.Namespace) -> dict[str, Any]:
    """`--retries N --retry-on … --retry-backoff S`, `--after ID[:ok|:any|:notok]` and
    `--max-running K` as the request's fields (the flags win over a file's)."""
    out: dict[str, Any] = {}
    retries = getattr(args, "retries", None)
    on = [r for item in getattr(args, "retry_on", None) or [] for r in item.split(",") if r]
    if retries is None and (on or getattr(args, "retry_backoff", None) is not None):
        raise UsageError("--retry-on and --retry-backoff shape a retry policy: add --retries N")
    if retries is not None:
        if not 1 <= retries <= 100:
            raise UsageError("--retries must be between 1 and 100 (attempts in all)")
        for reason in on:
            if reason not in RETRY_REASONS:
                raise UsageError(f"--retry-on {reason!r}: one of {', '.join(RETRY_REASONS)}")
        policy: dict[str, Any] = {"max_attempts": retries, "on": on or ["failed"]}
        for flag, name in (("retry_backoff", "backoff_seconds"),
                           ("retry_backoff_max", "backoff_max_seconds")):
            value = getattr(args, flag, None)
            if value is not None:
                if not 0 <= value <= 86_400:
                    raise UsageError(f"--{flag.replace('_', '-')} must be 0 to 86400 seconds")
                policy[name] = value
        out["retries"] = policy
    after = [dependency("--after", item) for item in getattr(args, "after", None) or []]
    if after:
        out["after"] = after
    if getattr(args, "after_each", None):
        out["after_each"] = dependency("--after-each", args.after_each)
    max_running = getattr(args, "max_running", None)
    if max_running is not None:
        if not 1 <= max_running <= MAX_LEASES_PER_REQUEST:
            raise UsageError(f"--max-running must be between 1 and {MAX_LEASES_PER_REQUEST}")
        out["max_running"] = max_running
    return out


def dependency(flag: str, item: str) -> dict[str, str]:
    lease_id, _, condition = item.partition(":")
    condition = condition or "ok"
    if not lease_id or condition not in DEPENDENCY_CONDITIONS:
        raise UsageError(f"{flag} wants ID[:ok|:any|:notok], not {item!r}")
    return {"lease_id": lease_id, "condition": condition}


