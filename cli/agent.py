"""`pool agent run|simulate|probe`: this machine (or a simulated fleet) as nodes."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from cli.connect import (
    client_opts,
    nats_url_of,
)
from cli.output import (
    EXIT_OK,
    Subparsers,
    fail,
)


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
            return fail(why, "runtime_unavailable", as_json=args.json)
    else:
        from agents.runtimes.process import ProcessRuntime

        runtime = ProcessRuntime(state)
        why = runtime.available()
        if why is not None:
            return fail(why, "runtime_unavailable", as_json=args.json)
    for line in runtime.limitations():  # said once, at the start: not advertised either
        print(f"pool agent: cannot enforce here: {line}", file=sys.stderr)
    url = getattr(args, "nats_url", None)
    if not url:
        plain = embedded.endpoints()[0]
        if not plain:
            return fail("no NATS server: run `pool up` first, or set POOL_NATS_URL / "
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
        return fail(str(e), e.code, as_json=args.json)
    agent = Agent(link, runtime, node_id=args.node_id, pool_id=args.pool, probe=probe,
                  state_dir=state, labels=labels, trust_level=args.trust,
                  reserve=Reserve(cpu_millis=args.reserve_cpu_millis,
                                  memory_mib=args.reserve_memory_mib),
                  heartbeat_interval=args.heartbeat_interval,
                  time_slice_replicas=args.time_slice,
                  checkpoint_retention_seconds=args.checkpoint_retention)
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
    from agents.simulate import fleet, fleets_stats, start_fleets

    url = nats_url_of(args)
    nodes = fleet(args.nodes, args.profile, prefix=args.prefix)
    # over as many connections as the server's subscriptions per connection need
    sims = start_fleets(url, nodes, pool_id=args.pool,
                        heartbeat_interval=args.heartbeat_interval)
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
                print(json.dumps(fleets_stats(sims)), flush=True)
    finally:
        for sim in sims:
            sim.stop()
    stats = fleets_stats(sims)
    print(json.dumps(stats) if args.json else f"fleet stopped: {stats}",
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


def _replicas(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 0 <= n <= 64:
        raise argparse.ArgumentTypeError("0 to 64 replicas per GPU")
    return n


def _retention(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError("a positive number of seconds")
    return seconds


def register(sub: Subparsers) -> None:
    """Add `agent`."""
    import os

    from agents.checkpoints import DEFAULT_RETENTION_SECONDS

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
    ar.add_argument("--time-slice", type=_replicas, default=0, metavar="N",
                    help="offer each whole GPU as N time-slice replicas (gpu_partition "
                         "time-slice) instead of whole (default 0: whole GPUs)")
    # a string default goes through `type`: a bad $POOL_CHECKPOINT_RETENTION_SECONDS is an
    # error of `pool agent run`, never silently the default
    ar.add_argument("--checkpoint-retention", type=_retention, metavar="SECONDS",
                    default=os.environ.get("POOL_CHECKPOINT_RETENTION_SECONDS",
                                           str(DEFAULT_RETENTION_SECONDS)),
                    help="remove a lease's checkpoint folder once untouched this long and its "
                    "lease not running here; at once when the lease ended for good (default "
                    f"$POOL_CHECKPOINT_RETENTION_SECONDS, else {DEFAULT_RETENTION_SECONDS:,}: "
                    "7 days)")
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
