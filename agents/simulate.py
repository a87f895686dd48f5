"""A simulated fleet: many real node agents in one process whose workloads are timed sleeps.
What it shares and its profiles: docs/architecture.md#the-node-agent.
"""

from __future__ import annotations

import json
import logging
import random
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents.agent import Agent
from agents.probe import Gpu, GpuProbe, NodeProbe, Reserve
from agents.runtimes.contract import (
    Runtime,
    Unsupported,
    Usage,
    WorkloadHandle,
    WorkloadSpec,
)
from agents.runtimes.enter import SandboxEntry
from bus.agentbus import FleetLink, NodeLink
from bus.errors import BusError
from bus.local.server import MAX_SUBSCRIPTIONS_PER_CONNECTION

log = logging.getLogger(__name__)

_SLEEP = re.compile(r"\bsleep\s+(\d+(?:\.\d+)?)")


class SimLink(NodeLink):
    """A simulated node's link: it has no file store, so its jobs that ask for files are
    refused (agents/workdir.py)."""

    def files(self) -> None:
        """None: no store."""


class SleepRuntime:
    """A stand-in runtime for simulated nodes: a job 'runs' for the seconds of its `sleep N`
    (or POOL_SIM_SECONDS), exits with POOL_SIM_EXIT (default 0), and stops at once."""

    name = "simulated"
    can_wait = False  # polled by the agent's round
    can_read_output = False  # a sleep writes nothing
    can_enter = False
    stdin = None

    def __init__(self, classes: tuple[str, ...] = ("container", "sandboxed"),
                 clock: Callable[[], float] = time.time) -> None:
        self.classes = classes
        self.clock = clock
        self._ends: dict[str, tuple[float, int]] = {}

    def isolation_classes(self) -> tuple[str, ...]:
        return self.classes

    def binds_gpus(self) -> bool:
        return True  # simulated devices: the bound ids are recorded, nothing else to bind

    def network_egress(self) -> str:
        return "none"

    def start(self, spec: WorkloadSpec) -> WorkloadHandle:
        env = dict(spec.env)
        seconds = float(env.get("POOL_SIM_SECONDS", "0") or 0)
        if not seconds:
            m = _SLEEP.search(" ".join(spec.command))
            seconds = float(m.group(1)) if m else 1.0
        now = self.clock()
        self._ends[spec.key] = (now + seconds, int(env.get("POOL_SIM_EXIT", "0") or 0))
        return WorkloadHandle(lease_id=spec.lease_id, epoch=spec.epoch,
                              job_number=spec.job_number, runtime=self.name, ref=spec.key,
                              started_at=now)

    def poll(self, handle: WorkloadHandle) -> int | None:
        end, code = self._ends.get(handle.key, (0.0, 0))
        return code if self.clock() >= end else None

    def stop(self, handle: WorkloadHandle, grace_seconds: float) -> int | None:
        if self.poll(handle) is None:
            self._ends[handle.key] = (self.clock(), 143)
        return self.poll(handle)

    def adopt(self) -> list[WorkloadHandle]:
        return []

    def forget(self, handle: WorkloadHandle) -> None:
        self._ends.pop(handle.key, None)

    def usage(self, handle: WorkloadHandle) -> Usage:
        return Usage(cpu_millis_used=random.randint(100, 900), memory_mib_used=256)

    def wait(self, handle: WorkloadHandle, timeout: float) -> str | None:
        raise Unsupported("a simulated job is polled (can_wait)")

    def read_output(self, handle: WorkloadHandle, offset: int, limit: int) -> tuple[bytes, int]:
        raise Unsupported("a simulated job writes nothing (can_read_output)")

    def enter(self, handle: WorkloadHandle) -> SandboxEntry:
        raise Unsupported("a simulated job has no sandbox (can_enter)")


@dataclass(frozen=True)
class SimNode:
    node_id: str
    probe: NodeProbe
    zone: str
    classes: tuple[str, ...] = ("container", "sandboxed")
    trust: str = "trusted"
    labels: dict[str, str] = field(default_factory=dict)


def _gpus(model: str, n: int, memory_gib: int, mig: tuple[str, ...] = ()) -> GpuProbe:
    gpus = []
    for i in range(n):
        profiles = tuple((p, f"MIG-sim-{i}-{j}") for j, p in enumerate(mig)) if mig else ()
        gpus.append(Gpu(index=i, uuid=f"GPU-sim-{i}", model=model, memory_mib=memory_gib * 1024,
                        mig_enabled=bool(mig), mig_profiles=profiles, minor=i,
                        nvlink_domain="nvlink-0" if n > 1 and not mig else None))
    return GpuProbe(gpus=tuple(gpus), driver="simulated")


def fleet(n: int, profile: str = "mixed", *, prefix: str = "sim") -> list[SimNode]:
    """`n` simulated nodes over three zones. mixed: 60% CPU (16 cores, 64 GiB), 30% L4 (4 GPUs,
    24 GiB), 10% A100 80 GB of which half in MIG mode (1× 3g.40gb + 2× 1g.10gb per GPU).
    cpu, gpu (L4) and a100 (8× A100 80 GB) give nodes of one kind only."""
    out = []
    for i in range(n):
        zone = f"z{i % 3 + 1}"
        kind = {"cpu": "cpu", "gpu": "l4", "a100": "a100"}.get(profile)
        if kind is None:
            r = i % 10
            kind = "cpu" if r < 6 else "l4" if r < 9 else ("a100-mig" if i % 20 == 9 else "a100")
        if kind == "cpu":
            probe = NodeProbe(16000, "amd64", 65536, 500)
        elif kind == "l4":
            probe = NodeProbe(32000, "amd64", 131072, 1000, _gpus("NVIDIA L4", 4, 24))
        elif kind == "a100":
            probe = NodeProbe(64000, "amd64", 262144, 2000, _gpus("NVIDIA A100 80GB", 8, 80))
        else:
            probe = NodeProbe(64000, "amd64", 262144, 2000,
                              _gpus("NVIDIA A100 80GB", 2, 80, ("3g.40gb", "1g.10gb", "1g.10gb")))
        out.append(SimNode(node_id=f"{prefix}-{i:04d}", probe=probe, zone=zone,
                           labels={"zone": zone, "failure_domain": f"{zone}-rack{i % 8}",
                                   "rack": f"rack-{i // 16}", "kind": kind}))
    return out


# one connection's share of nodes: each node holds a pull subscription on it, and each request
# in flight (FLEET_THREADS at once, plus the round's) an inbox of its own; half the server's
# per-connection cap leaves room for those and for a fleet sized to its limit by mistake
FLEET_THREADS = 8
NODES_PER_CONNECTION = MAX_SUBSCRIPTIONS_PER_CONNECTION // 2


def connection_shares(nodes: list[SimNode],
                      most: int = NODES_PER_CONNECTION) -> list[list[SimNode]]:
    """`nodes` dealt into as few, as even, runs of at most `most` as there can be: one
    SimulatedFleet (one connection) each."""
    if most < 1:
        raise ValueError("a connection must hold at least one node")
    parts = max(1, -(-len(nodes) // most))
    size, extra = divmod(len(nodes), parts)
    out, at = [], 0
    for k in range(parts):
        n = size + (1 if k < extra else 0)
        out.append(nodes[at:at + n])
        at += n
    return out


# a round's longest wait for commands, and its shortest (however close the next beat)
ROUND_SECONDS, MIN_ROUND_SECONDS = 0.15, 0.005


def round_wait(next_beats: Iterable[float], now: float) -> float:
    """How long a round waits for commands: until the next node's beat is due, within
    [MIN_ROUND_SECONDS, ROUND_SECONDS]."""
    due = min(next_beats, default=now + ROUND_SECONDS)
    return min(ROUND_SECONDS, max(MIN_ROUND_SECONDS, due - now))


class SimulatedFleet:
    """Runs every simulated node's Agent from one thread over one connection: at most
    NODES_PER_CONNECTION of them (more: several fleets, `connection_shares`)."""

    def __init__(self, url: str, nodes: list[SimNode], *, pool_id: str,
                 heartbeat_interval: float = 3.0, state_dir: Path | None = None) -> None:
        if len(nodes) > NODES_PER_CONNECTION:
            # past it the server refuses a subscription and the client drops the connection
            # mid-enrollment: say so now rather than as "connection closed" later
            raise ValueError(f"{len(nodes)} simulated nodes on one connection: at most "
                             f"{NODES_PER_CONNECTION} (the server's {MAX_SUBSCRIPTIONS_PER_CONNECTION}"
                             " subscriptions per connection); deal them over several fleets")
        self.url = url
        self.nodes = nodes
        self.pool_id = pool_id
        self.heartbeat_interval = heartbeat_interval
        self._tmp = None if state_dir is not None else tempfile.TemporaryDirectory(
            prefix="pool-fleet-")
        self.state_dir = Path(state_dir or self._tmp.name)  # type: ignore[union-attr]
        self.link = FleetLink(url)
        self.agents: dict[str, Agent] = {}
        self.links: dict[str, NodeLink] = {}
        self.silent: set[str] = set()  # nodes whose agent went quiet (no heartbeats, no work)
        self.errors = 0
        self.rounds = self.commands = 0
        self.fetch_s = self.round_s = 0.0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(FLEET_THREADS, thread_name_prefix="pool-fleet-node")

    def start(self) -> SimulatedFleet:
        ids = [n.node_id for n in self.nodes]
        self.link.connect(ids)
        for n in self.nodes:
            link = SimLink(self.link, n.node_id)
            runtime: Runtime = SleepRuntime(n.classes)  # checked against the contract here
            agent = Agent(link, runtime, node_id=n.node_id,  # type: ignore[arg-type]
                          pool_id=self.pool_id, probe=n.probe,
                          state_dir=self.state_dir / n.node_id, labels=n.labels,
                          reserve=Reserve(0, 0, 0), trust_level=n.trust,
                          heartbeat_interval=self.heartbeat_interval, utilization_every=3)
            # spread the heartbeats over the interval rather than all at once
            agent._next_beat = time.time() + random.uniform(0, self.heartbeat_interval)
            self.agents[n.node_id] = agent
            self.links[n.node_id] = link
        # the fleet speaks as the operator: it enrolls each node it runs (pool, trust, GPUs) as
        # an operator enrolls a real one, and its agents then register within that
        list(self._pool.map(self._enroll, self.nodes))
        for agent in self.agents.values():
            agent.register()
        self._thread = threading.Thread(target=self._run, name="pool-fleet", daemon=True)
        self._thread.start()
        return self

    def _enroll(self, n: SimNode) -> None:
        body = {"node_id": n.node_id, "pool_id": self.pool_id, "trust_level": n.trust,
                "max_gpus": len(n.probe.gpus.gpus)}
        reply = json.loads(self.link.admin("node.enroll", json.dumps(body).encode()))
        if not reply.get("ok"):
            raise RuntimeError(f"enrolling {n.node_id}: {reply.get('error')}")

    def go_silent(self, node_id: str) -> None:
        """That node's agent stops answering: no heartbeats, no commands, no reports."""
        self.silent.add(node_id)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            live = [n for n in self.agents if n not in self.silent]
            # a round ends when the next node's beat is due, as each real agent beats on its
            # own timer (rounds of a fixed length sent all the beats due within one together)
            wait = round_wait((self.agents[n]._next_beat for n in live), time.time())
            try:
                got = self.link.fetch_many(live, timeout=wait)
            except BusError as e:
                self.errors += 1
                log.warning("fleet fetch failed: %s", e)
                self._stop.wait(0.5)
                continue
            for node_id in live:
                self.links[node_id].inbox.extend(got.get(node_id, []))
            self.commands += sum(len(v) for v in got.values())
            t1 = time.monotonic()
            # only the nodes with something to do step: a command, a workload, a beat due
            # the nodes' round trips overlap: each step's requests wait on the network
            list(self._pool.map(self._step, self._busy(live, time.time())))
            self.rounds += 1
            self.fetch_s, self.round_s = t1 - t0, time.monotonic() - t0

    def _busy(self, live: list[str], now: float) -> list[str]:
        """The nodes with something to do at `now`: a command, a workload, a beat due."""
        return [n for n in live if self.links[n].inbox or self.agents[n].running
                or self.agents[n]._next_beat <= now]

    def _step(self, node_id: str) -> None:
        try:
            self.agents[node_id].step(wait=0.0)
        except BusError as e:
            self.errors += 1
            log.warning("simulated node %s: %s", node_id, e)
        except Exception:  # one node's trouble must not stop the fleet
            self.errors += 1
            log.exception("simulated node %s failed a step", node_id)

    def running(self) -> int:
        return sum(len(a.running) for n, a in self.agents.items() if n not in self.silent)

    def stats(self) -> dict[str, Any]:
        return {"nodes": len(self.agents), "silent": sorted(self.silent),
                "started": sum(a.stats.started for a in self.agents.values()),
                "stops": sum(a.stats.stops for a in self.agents.values()),
                "exits_reported": sum(a.stats.exits_reported for a in self.agents.values()),
                "running": self.running(), "errors": self.errors, "rounds": self.rounds,
                "commands": self.commands, "last_fetch_s": round(self.fetch_s, 3),
                "last_round_s": round(self.round_s, 3)}

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(15)
        self._pool.shutdown(wait=True)
        self.link.close()
        if self._tmp is not None:
            self._tmp.cleanup()


def start_fleets(url: str, nodes: list[SimNode], *, pool_id: str,
                 heartbeat_interval: float = 3.0) -> list[SimulatedFleet]:
    """`nodes` started as SimulatedFleets of one connection each (`connection_shares`)."""
    sims: list[SimulatedFleet] = []
    try:
        for share in connection_shares(nodes):
            sims.append(SimulatedFleet(url, share, pool_id=pool_id,
                                       heartbeat_interval=heartbeat_interval).start())
    except BaseException:
        for sim in sims:
            sim.stop()
        raise
    return sims


def fleets_stats(sims: list[SimulatedFleet]) -> dict[str, Any]:
    """The fleets' stats as one fleet's: counts summed, silent nodes joined, the slowest last
    fetch and round."""
    out: dict[str, Any] = {}
    for stats in (sim.stats() for sim in sims):
        for key, value in stats.items():
            if key == "silent":
                out[key] = sorted([*out.get(key, []), *value])
            elif isinstance(value, float):
                out[key] = max(out.get(key, 0.0), value)
            else:
                out[key] = out.get(key, 0) + value
    return out
