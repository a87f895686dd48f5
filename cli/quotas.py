"""`pool admin cohort set`, the quota flags of `pool admin tenant set`, the limits table of
`pool admin pool show`, and `pool shares`."""

from __future__ import annotations

import argparse
import time
from typing import Any

from cli.connect import client_opts, nats_url_of, pool_client
from cli.output import EXIT_OK, UsageError, print_envelope

Subparsers = Any  # argparse's _SubParsersAction


def parse_limits(flag: str, text: str | None) -> dict[str, int] | None:
    """`dimension=amount,…` as limits; UsageError naming `flag` for anything else."""
    if text is None:
        return None
    out: dict[str, int] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        try:
            amount = int(value.strip())
        except ValueError:
            amount = -1
        if not sep or not key.strip() or amount < 0:
            raise UsageError(f"{flag} wants dimension=amount,… with whole amounts ≥ 0, "
                             f"not {part.strip()!r}")
        out[key.strip()] = amount
    return out


def tenant_set_body(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """`pool admin tenant set` as a request: weight, nominal quota, cohort and its limits."""
    if args.quota is not None and args.nominal is not None:
        raise UsageError("give --nominal or --quota (the same setting), not both")
    body: dict[str, Any] = {"tenant": args.tenant_id, "pool_id": args.pool,
                            "weight": args.weight, "preemptible": args.preemptible}
    for flag, field in (("--quota", "quota"), ("--nominal", "nominal"),
                        ("--borrow-limit", "borrow_limit"), ("--lend-limit", "lend_limit")):
        limits = parse_limits(flag, getattr(args, field))
        if limits is not None:
            body[field] = limits
    if (args.borrow_limit or args.lend_limit) and not args.cohort:
        raise UsageError("--borrow-limit and --lend-limit need --cohort")
    if args.cohort:
        body["cohort"] = args.cohort
    if args.priority_classes:
        body["priority_classes"] = [c.strip() for c in args.priority_classes.split(",")
                                    if c.strip()]
    return "tenant.set", body


def add_tenant_flags(ts: argparse.ArgumentParser) -> None:
    """The quota flags of `pool admin tenant set` (--quota is added by the caller)."""
    ts.add_argument("--nominal", metavar="DIM=N,…",
                    help="nominal quota (another name for --quota): the dimensions named are "
                    "limited, the rest unlimited")
    ts.add_argument("--cohort", help="the cohort whose unused quota the tenant may borrow "
                    "(create it with `pool admin cohort set`)")
    ts.add_argument("--borrow-limit", metavar="DIM=N,…",
                    help="the most the tenant may use past its nominal quota (dimensions left "
                    "out: no cap)")
    ts.add_argument("--lend-limit", metavar="DIM=N,…",
                    help="the most of its nominal quota others may borrow (dimensions left "
                    "out: all of it)")
    ts.add_argument("--preemptible", action=argparse.BooleanOptionalAction, default=True,
                    help="whether the tenant's leases may be preemption victims (default yes)")
    ts.add_argument("--priority-classes", metavar="CLASS,…",
                    help="the priority classes the tenant may request besides the pool's "
                    "default (default: the pool's default class only)")
    ts.set_defaults(build=tenant_set_body)


def cmd_cohort_set(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"pool_id": args.pool, "name": args.name, "reclaim": args.reclaim,
                            "nominal": parse_limits("--nominal", args.nominal) or {}}
    with pool_client(args) as c:
        return print_envelope(c.admin("cohort.set", body), args.json)


def _limits_text(limits: dict[str, int] | None, none: str) -> str:
    if limits is None:
        return none
    return ",".join(f"{d}={v}" for d, v in limits.items()) or none


def cmd_pool_show(args: argparse.Namespace) -> int:
    """`pool admin pool show`: every setting, then the limits in force as tables."""
    with pool_client(args) as c:
        reply = c.admin("pool.show", {"pool_id": args.pool_id})
    if args.json or not reply.get("ok"):
        return print_envelope(reply, args.json)
    result = dict(reply["result"])
    quotas = result.pop("quotas", None) or {}
    print_envelope({"ok": True, "result": result}, False)
    tenants = quotas.get("tenants") or {}
    cohorts = quotas.get("cohorts") or {}
    if tenants:
        rows = [["TENANT", "WEIGHT", "NOMINAL", "COHORT", "BORROW LIMIT", "LEND LIMIT",
                 "PREEMPTIBLE"]]
        for name, t in tenants.items():
            in_cohort = t.get("cohort") is not None
            rows.append([name, f"{t.get('weight', 1.0):g}",
                         _limits_text(t.get("nominal"), "unlimited"), t.get("cohort") or "-",
                         _limits_text(t.get("borrow_limit"), "no cap") if in_cohort else "-",
                         _limits_text(t.get("lend_limit"), "all") if in_cohort else "-",
                         "yes" if t.get("preemptible", True) else "no"])
        print()
        print(_grid(rows))
    if cohorts:
        rows = [["COHORT", "OWN NOMINAL", "RECLAIM", "MEMBERS"]]
        for name, c in cohorts.items():
            rows.append([name, _limits_text(c.get("nominal"), "-"), c.get("reclaim", "any"),
                         ",".join(c.get("members") or ()) or "-"])
        print()
        print(_grid(rows))
    return EXIT_OK


def shares_now(args: argparse.Namespace) -> dict[str, Any]:
    """The pool's fair shares as its leading scheduler holds them: over the gateway with an
    admin's HTTP context (`pool login URL --token ADMIN`), else over `pool.ops`; a
    `scheduler_unavailable` refusal when no scheduler process answers in time."""
    with pool_client(args) as c:
        reply: dict[str, Any] = c.pool_shares(args.pool_id)
        return reply


def cmd_shares(args: argparse.Namespace) -> int:
    """`pool shares POOL`: each tenant's weight, current share, decayed usage and rank, from
    the pool's leading scheduler (`--at`: the log folded up to then, on this machine)."""
    if args.at:
        from cli.asof import shares_at
        from cli.whatif import parse_when

        result = shares_at(nats_url_of(args), args.pool_id,
                           parse_when("--at", args.at, time.time()))
        if result is None:
            return print_envelope({"ok": False, "error": {
                "code": "unknown_pool", "message": f"no pool named {args.pool_id!r}"}},
                args.json)
    else:
        reply = shares_now(args)
        if not reply.get("ok"):
            return print_envelope(reply, args.json)
        result = reply["result"]
    if args.json:
        return print_envelope({"ok": True, "result": result}, True)
    rows = [["RANK", "TENANT", "WEIGHT", "CURRENT SHARE", "DECAYED SHARE", "KEY",
             "DECAYED USAGE (resource-seconds)"]]
    for t in result["tenants"]:
        usage = ",".join(f"{d}={v:.0f}" for d, v in sorted(t["decayed_usage"].items())
                         if v >= 0.5) or "-"
        rows.append([str(t["rank"]), t["tenant"], f"{t['weight']:g}",
                     f"{t['current_share']:.3f}", f"{t['decayed_share']:.3f}",
                     f"{t['priority']:.3f}", usage])
    half_life = result["half_life_seconds"]
    print(f"pool {result['pool_id']}: ordered by (current share + decayed share) / weight, "
          "lowest first; " + (f"usage decays with a {half_life:g} s half-life"
                              if half_life else "no half-life set: current usage only"))
    print(_grid(rows))
    if result.get("stale"):
        print("(the pool's leader did not answer in time: another scheduler's view, maybe "
              "behind)")
    return EXIT_OK


def _grid(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def register_admin(adm: Subparsers, show: argparse.ArgumentParser,
                   ts: argparse.ArgumentParser) -> None:
    """Add `admin cohort set`, the quota flags of `admin tenant set`, and the limits table of
    `admin pool show`."""
    add_tenant_flags(ts)
    show.set_defaults(func=cmd_pool_show)
    coh = adm.add_parser("cohort", help="cohorts of tenants that borrow and lend quota"
                         ).add_subparsers(dest="verb", metavar="VERB")
    coh.required = True
    cs = coh.add_parser("set", help="create or reconfigure a cohort",
                        description="Create or reconfigure a cohort. Tenants join it with "
                        "`pool admin tenant set --cohort`; members borrow each other's unused "
                        "nominal quota (and the cohort's own) up to their borrow limits.")
    client_opts(cs)
    cs.add_argument("name")
    cs.add_argument("--pool", required=True)
    cs.add_argument("--nominal", metavar="DIM=N,…",
                    help="quota the cohort itself holds, lent to any member (default none)")
    cs.add_argument("--reclaim", choices=["any", "never"], default="any",
                    help="any: an owner within its nominal quota may preempt borrowers to "
                    "take it back (default); never: it waits for them to finish")
    cs.set_defaults(func=cmd_cohort_set)


def register(sub: Subparsers) -> None:
    """Add `shares`."""
    sh = sub.add_parser("shares", help="each tenant's weight, current share, decayed usage and "
                        "rank in a pool's fair share")
    client_opts(sh)
    sh.add_argument("pool_id")
    sh.add_argument("--at", metavar="TIME", help="the shares as they were at TIME (the log "
                    "folded up to then): ISO, epoch seconds, or `2h ago`")
    sh.set_defaults(func=cmd_shares)
