"""`pool bench …`: the benchmarks that print figures."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cli.output import (
    EXIT_FAILED,
    Subparsers,
    UsageError,
    print_result,
)


def _report(result: dict[str, Any], as_json: bool) -> int:
    """The figures as the envelope every command prints (--json), else the table."""
    return print_result({k: v for k, v in result.items() if k != "table"}, as_json,
                        str(result["table"]))


def cmd_bench_eventlog(args: argparse.Namespace) -> int:
    from bench.bus_rates import run_eventlog_bench

    result = run_eventlog_bench(
        nats_url=args.nats_url,
        messages=args.messages,
        saves=args.saves,
        quick=args.quick,
        progress=None if args.json else (lambda s: print(s, file=sys.stderr, flush=True)),
    )
    return _report(result, args.json)


def cmd_bench_schedule(args: argparse.Namespace) -> int:
    from bench.schedule import run_schedule_bench

    if not 0 <= args.unplaceable < 5000:
        raise UsageError("--unplaceable must be 0-4999 (a cycle examines 5,000 requests)")
    result = run_schedule_bench(
        nodes=args.nodes, requests=args.requests, quick=args.quick, rate=args.rate,
        steady_seconds=args.steady_seconds, priced=args.priced,
        half_life_seconds=args.half_life, unplaceable=args.unplaceable,
        progress=None if args.json else (lambda s: print(s, file=sys.stderr, flush=True)),
    )
    return _report(result, args.json)


def cmd_bench_agent(args: argparse.Namespace) -> int:
    from bench.agent import run_agent_bench

    result = run_agent_bench(
        starts=args.starts, quick=args.quick,
        progress=None if args.json else (lambda s: print(s, file=sys.stderr, flush=True)))
    return _report(result, args.json)


def cmd_bench_run(args: argparse.Namespace) -> int:
    from bench.run import run_run_bench

    if args.runs < 1:
        raise UsageError("--runs must be at least 1")
    result = run_run_bench(
        runs=args.runs, quick=args.quick, docker=args.docker,
        progress=None if args.json else (lambda s: print(s, file=sys.stderr, flush=True)))
    return _report(result, args.json)


def cmd_bench_workdir(args: argparse.Namespace) -> int:
    from bench.workdir import run_workdir_bench

    if args.runs < 1:
        raise UsageError("--runs must be at least 1")
    if args.mib is not None and not 1 <= args.mib <= 4096:
        raise UsageError("--mib must be 1-4096")
    result = run_workdir_bench(
        runs=args.runs, quick=args.quick, mib=args.mib,
        progress=None if args.json else (lambda s: print(s, file=sys.stderr, flush=True)))
    return _report(result, args.json)


def cmd_bench_reply_junk(args: argparse.Namespace) -> int:
    from bench.reply_junk import run_reply_junk_bench

    if not 1 <= args.seconds <= 600:
        raise UsageError("--seconds must be 1-600")
    return _report(run_reply_junk_bench(seconds=args.seconds), args.json)


def cmd_bench_exec(args: argparse.Namespace) -> int:
    from bench.exec import MAX_RUNS, run_exec_bench

    if not 1 <= args.runs <= MAX_RUNS:  # a lease takes 30 sessions a minute
        raise UsageError(f"--runs must be 1-{MAX_RUNS}")
    if args.mib is not None and not 1 <= args.mib <= 4096:
        raise UsageError("--mib must be 1-4096")
    result = run_exec_bench(
        runs=args.runs, quick=args.quick, mib=args.mib,
        progress=None if args.json else (lambda s: print(s, file=sys.stderr, flush=True)))
    return _report(result, args.json)


def cmd_bench_e2e(args: argparse.Namespace) -> int:
    from bench.e2e import run_e2e_bench

    for flag, value in (("--clients", args.clients), ("--nodes", args.nodes),
                        ("--count", args.count), ("--command-processes", args.command_processes),
                        ("--pools", args.pools),
                        ("--scheduler-processes", args.scheduler_processes)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1")
    for flag, fvalue in (("--seconds", args.seconds), ("--rate", args.rate),
                         ("--steady-seconds", args.steady_seconds)):
        if fvalue <= 0:
            raise UsageError(f"{flag} must be positive")
    if args.scheduler_processes > 1 and args.one_process:
        raise UsageError("--scheduler-processes above 1 needs the scheduler in a process of "
                         "its own: drop --one-process")
    if args.nodes < args.pools:
        raise UsageError("--nodes must be at least --pools: every pool needs a node")
    result = run_e2e_bench(
        clients=args.clients, nodes=args.nodes, seconds=args.seconds, rate=args.rate,
        steady_seconds=args.steady_seconds, count=args.count, quick=args.quick,
        command_processes=args.command_processes, one_process=args.one_process or None,
        pools=args.pools, scheduler_processes=args.scheduler_processes,
        progress=None if args.json else (lambda s: print(s, file=sys.stderr, flush=True)))
    return _report(result, args.json)


def cmd_bench_policy(args: argparse.Namespace) -> int:
    from bench.policy import NothingToReplay, run_policy_bench, workload_from_log

    # bounded, so a typo cannot ask for a workload that fills the memory
    for flag, fvalue, most in (("--days", args.days, 366.0), ("--load", args.load, 10.0),
                               ("--cycle-seconds", args.cycle_seconds, 86_400.0)):
        if fvalue is not None and not 0 < fvalue <= most:
            raise UsageError(f"{flag} must be above 0 and at most {most:g}")
    if args.pool and not args.from_log:
        raise UsageError("--pool names the pool to replay: use it with --from-log")
    workload = config = None
    if args.from_log:
        from cli.connect import close_app, log_app

        app = log_app(args)
        try:
            workload, config = workload_from_log(app, args.pool)
        except NothingToReplay as e:
            raise UsageError(f"--from-log: {e}") from None
        finally:
            close_app(app, args)
    result = run_policy_bench(
        quick=args.quick, days=args.days, seed=args.seed, offered_load=args.load,
        cycle_seconds=args.cycle_seconds, workload=workload, config=config,
        progress=None if args.json else (lambda s: print(s, file=sys.stderr, flush=True)))
    return _report(result, args.json)


def cmd_bench_http(args: argparse.Namespace) -> int:
    from bench.http import run_http_bench

    for flag, value in (("--clients", args.clients), ("--nodes", args.nodes)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1")
    if args.seconds <= 0:
        raise UsageError("--seconds must be positive")
    result = run_http_bench(
        clients=args.clients, nodes=args.nodes, seconds=args.seconds, quick=args.quick,
        progress=None if args.json else (lambda s: print(s, file=sys.stderr, flush=True)))
    return _report(result, args.json)


def cmd_bench_gang(args: argparse.Namespace) -> int:
    from bench.gang import run_gang_bench

    result = run_gang_bench(
        quick=args.quick, seed=args.seed,
        progress=None if args.json else (lambda s: print(s, file=sys.stderr, flush=True)))
    return _report(result, args.json)


def cmd_bench_all(args: argparse.Namespace) -> int:
    from bench.all import run_all
    from local import embedded
    from projections.postgres.embedded import reachable_database_url

    db = args.database_url or embedded.endpoints()[1] or None
    if db and not reachable_database_url(db):
        raise UsageError(f"no PostgreSQL answers at {db}")
    result = run_all(quick=args.quick, database_url=db,
                     progress=None if args.json else (lambda s: print(s, file=sys.stderr,
                                                                        flush=True)))
    return _report(result, args.json)


def cmd_bench_projections(args: argparse.Namespace) -> int:
    from bench.projections import run_projections_bench
    from local import embedded
    from projections.postgres.embedded import reachable_database_url

    # a reachable PostgreSQL as given (or `pool up`'s), else the bench starts an embedded one
    db = args.database_url or embedded.endpoints()[1] or None
    if db and not reachable_database_url(db):
        raise UsageError(f"no PostgreSQL answers at {db}")
    result = run_projections_bench(
        database_url=db, events=args.events, quick=args.quick,
        progress=None if args.json else (lambda s: print(s, file=sys.stderr, flush=True)),
    )
    return _report(result, args.json)


def cmd_bench_soak(args: argparse.Namespace) -> int:
    from bench.soak import run_soak

    if args.leases < 10:
        raise UsageError("--leases must be at least 10")
    result = run_soak(leases=args.leases, quick=args.quick, probe=args.probe,
                      progress=None if args.json else (lambda s: print(s, file=sys.stderr,
                                                                         flush=True)))
    code = _report(result, args.json)
    return code if result["flat"] else EXIT_FAILED


def register(sub: Subparsers) -> None:
    """Add `bench` and its benchmarks."""
    bench = sub.add_parser("bench", help="benchmarks that print figures").add_subparsers(
        dest="sub", metavar="BENCH"
    )
    bench.required = True
    for add in (_add_eventlog, _add_schedule, _add_http, _add_e2e, _add_soak, _add_policy,
                _add_gang, _add_all, _add_agent, _add_exec, _add_run, _add_projections, _add_workdir,
                _add_reply_junk):
        add(bench)


def _add_eventlog(bench: Subparsers) -> None:
    """Add `bench eventlog` and its flags."""
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


def _add_schedule(bench: Subparsers) -> None:
    """Add `bench schedule` and its flags."""
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
    sb.add_argument("--half-life", type=int, default=0, metavar="SECONDS",
                    help="the pool's fair-share half-life: decayed usage tracked and ordered "
                         "on (default 0: current usage only)")
    sb.add_argument("--unplaceable", type=int, default=0, metavar="N",
                    help="a deep queue: N requests that fit no node now (48 cores; the one "
                         "node that could hold them is cordoned) queued ahead of the backlog, "
                         "so every cycle examines them first and they wait; shows what the "
                         "node table's memory of shapes that fit nowhere saves "
                         "(POOL_FAST_PATHS=off to compare; below 5,000, a cycle's "
                         "examination budget; default 0)")
    sb.add_argument("--json", action="store_true")
    sb.set_defaults(func=cmd_bench_schedule)


def _add_http(bench: Subparsers) -> None:
    """Add `bench http` and its flags."""
    bh = bench.add_parser("http", help="the HTTP gateway beside the NATS path: requests/s and "
                          "reply p50/p99 of the same clients on each, in one run")
    bh.add_argument("--clients", type=int, default=32, help="concurrent clients (default 32)")
    bh.add_argument("--nodes", type=int, default=200, help="simulated nodes (default 200)")
    bh.add_argument("--seconds", type=float, default=10.0, help="length of each path's run")
    bh.add_argument("--quick", action="store_true", help="4 clients, 10 nodes, 1.5 s each")
    bh.add_argument("--json", action="store_true")
    bh.set_defaults(func=cmd_bench_http)


def _add_e2e(bench: Subparsers) -> None:
    """Add `bench e2e` and its flags."""
    be = bench.add_parser("e2e", help="what users see: concurrent clients requesting leases "
                          "on the public subjects against the whole control plane")
    be.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    be.add_argument("--nodes", type=int, default=1000, help="simulated nodes (default 1,000)")
    be.add_argument("--seconds", type=float, default=10.0, help="saturating phase length")
    be.add_argument("--rate", type=float, default=1000.0,
                    help="steady offered requests/s for the latency figures (default 1,000)")
    be.add_argument("--steady-seconds", type=float, default=10.0)
    be.add_argument("--count", type=int, default=1, help="leases per request (default 1)")
    be.add_argument("--command-processes", type=int, default=1,
                    help="command responders in all: the plane and N-1 `--role commands` "
                         "processes sharing its queue group (default 1, as `pool up`)")
    be.add_argument("--pools", type=int, default=1,
                    help="pools the nodes and the requests are dealt over (default 1)")
    be.add_argument("--scheduler-processes", type=int, default=1,
                    help="scheduler processes sharing the pools' leadership out (default 1)")
    be.add_argument("--one-process", action="store_true",
                    help="the plane's roles all in one process, as `pool up --one-process` "
                         "(default: as `pool up` runs them on this machine)")
    be.add_argument("--quick", action="store_true",
                    help="8 clients, 20 nodes, 2 s saturating, 100/s for 2 s")
    be.add_argument("--json", action="store_true")
    be.set_defaults(func=cmd_bench_e2e)


def _add_soak(bench: Subparsers) -> None:
    """Add `bench soak` and its flags."""
    bso = bench.add_parser("soak", help="many leases through request → reserve → commit → "
                           "release: the scheduler's RSS and a cold start-up's replay as they go")
    bso.add_argument("--leases", type=int, default=1_000_000,
                     help="leases run through their whole life (default 1,000,000)")
    bso.add_argument("--quick", action="store_true", help="2,000 leases")
    bso.add_argument("--probe", action="store_true",
                     help="trace the scheduler's allocations and say what grew from the first "
                     "tenth to each later one (slower; the RSS figures then include the tracing)")
    bso.add_argument("--json", action="store_true")
    bso.set_defaults(func=cmd_bench_soak)


def _add_policy(bench: Subparsers) -> None:
    """Add `bench policy` and its flags."""
    bpo = bench.add_parser("policy", help="a synthetic month replayed through each scheduling "
                           "policy on a virtual clock: utilisation, waits, fairness")
    bpo.add_argument("--quick", action="store_true",
                     help="a week on 6 GPU and 4 CPU nodes (default: a month on 24 and 16)")
    bpo.add_argument("--days", type=float, help="simulated days of arrivals")
    bpo.add_argument("--seed", type=int, default=1, help="the workload's seed (default 1)")
    bpo.add_argument("--load", type=float,
                     help="offered GPU demand over GPU capacity (default 0.9)")
    bpo.add_argument("--cycle-seconds", type=float, default=60.0,
                     help="simulated seconds between scheduling cycles (default 60)")
    bpo.add_argument("--from-log", action="store_true",
                     help="replay the requests and observed runtimes of a pool's leases in "
                     "the event log instead (what-if: the same load under each policy)")
    bpo.add_argument("--pool", help="with --from-log: the pool to replay (default: the one "
                     "with the most leases)")
    bpo.add_argument("--nats-url", help="with --from-log: default $POOL_NATS_URL or the "
                     "`pool up` endpoints")
    bpo.add_argument("--json", action="store_true")
    bpo.set_defaults(func=cmd_bench_policy)


def _add_gang(bench: Subparsers) -> None:
    """Add `bench gang` and its flags."""
    bg = bench.add_parser("gang", help="1-GPU leases and 2×8/4×8/16×8 gangs on 1,000 nodes × 8 "
                          "GPUs in racks of 16, on a virtual clock, with and without the "
                          "gang hold guard: placements/s, waits, utilisation, starvation")
    bg.add_argument("--quick", action="store_true", help="160 nodes, 3 simulated hours")
    bg.add_argument("--seed", type=int, default=7, help="the workload's seed (default 7)")
    bg.add_argument("--json", action="store_true")
    bg.set_defaults(func=cmd_bench_gang)


def _add_all(bench: Subparsers) -> None:
    """Add `bench all` and its flags."""
    bal = bench.add_parser("all", help="every benchmark in one run: one table of figures, "
                           "goals and ratios to the raw JetStream rate")
    bal.add_argument("--quick", action="store_true", help="the CI sizes")
    bal.add_argument("--database-url", help="PostgreSQL for the projections bench "
                     "(default: pool up's, else an embedded one)")
    bal.add_argument("--json", action="store_true")
    bal.set_defaults(func=cmd_bench_all)


def _add_agent(bench: Subparsers) -> None:
    """Add `bench agent` and its flags."""
    ba = bench.add_parser("agent", help="start overhead: start command → workload running, "
                          "process and docker runtimes, next to a plain docker run")
    ba.add_argument("--starts", type=int, default=30, help="starts per runtime")
    ba.add_argument("--quick", action="store_true", help="5 starts per runtime")
    ba.add_argument("--json", action="store_true")
    ba.set_defaults(func=cmd_bench_agent)


def _add_exec(bench: Subparsers) -> None:
    """Add `bench exec` and its flags."""
    bx = bench.add_parser("exec", help="exec round trip of `true` into a running job (client "
                          "and whole `pool lease exec`), beside `docker exec` where a daemon "
                          "answers; port-forward throughput beside a direct loopback echo")
    bx.add_argument("--runs", type=int, default=25, help="execs of each (default 25, at most 28)")
    bx.add_argument("--mib", type=int, help="MiB echoed through the forward (default 32)")
    bx.add_argument("--quick", action="store_true", help="5 execs, 8 MiB")
    bx.add_argument("--json", action="store_true")
    bx.set_defaults(func=cmd_bench_exec)


def _add_workdir(bench: Subparsers) -> None:
    """Add `bench workdir` and its flags."""
    bw = bench.add_parser("workdir", help="a work directory's upload and fetch beside a raw "
                          "object-store put and get of the same bytes; a job's start with a "
                          "cached work directory beside one without")
    bw.add_argument("--runs", type=int, default=5, help="uploads and fetches (default 5)")
    bw.add_argument("--mib", type=int, help="MiB of the work directory (default 100)")
    bw.add_argument("--quick", action="store_true", help="4 MiB, 2 runs, 5 starts")
    bw.add_argument("--json", action="store_true")
    bw.set_defaults(func=cmd_bench_workdir)


def _add_run(bench: Subparsers) -> None:
    """Add `bench run` and its flags."""
    br = bench.add_parser("run", help="`pool lease run -- true` as a user runs it, whole "
                          "processes on a plane of its own with a local agent, beside "
                          "`bwrap … true`; and job exit → its end in the log")
    br.add_argument("--runs", type=int, default=30, help="runs of each (default 30)")
    br.add_argument("--quick", action="store_true", help="5 runs of each")
    br.add_argument("--docker", action="store_true",
                    help="also `pool lease run --image … -- true` on a Docker-runtime agent, "
                    "beside `docker run --rm` of the same image (skipped, saying why, where "
                    "no engine answers)")
    br.add_argument("--json", action="store_true")
    br.set_defaults(func=cmd_bench_run)


def _add_projections(bench: Subparsers) -> None:
    """Add `bench projections` and its flags."""
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


def _add_reply_junk(bench: Subparsers) -> None:
    """Add `bench reply-junk` and its flags."""
    bj = bench.add_parser("reply-junk", help="how fast one tenant's client has the server store "
                          "its answers (PubAcks, stream info) in the event log by naming a log "
                          "subject as the reply subject")
    bj.add_argument("--seconds", type=float, default=10.0, help="seconds a mode (default 10)")
    bj.add_argument("--json", action="store_true")
    bj.set_defaults(func=cmd_bench_reply_junk)
