"""The demo's stage: its cast (pools, tenants, prices, credits), the processes it starts (the
embedded servers, the control plane, the fleets, the gateway) and how it stops them."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bus.local.procs import die_with
from bus.subjects import admin_subject

if TYPE_CHECKING:
    from projections.fair_share import FairShareReport

POOL = "demo"  # the big simulated fleet: fair share under a flood, credits
HPC = "hpc"  # one 8-GPU node: preemptible batch work and an urgent job that preempts it
EDGE = "edge"  # the real sandboxed agent and a node whose agent goes silent; short timeouts
LAB = "lab"  # one 16-core node in a cohort: globex borrows acme's half, acme reclaims it
TRAIN = "train"  # two A100 nodes in one rack: a gang of two 8-GPU members, placed together
HALF_LAB = {"cpu_millis": 8000, "memory_mib": 4096}
TENANTS = {"acme": 3.0, "globex": 2.0, "initech": 1.0}
IMAGE = "registry.demo/jobs/sleeper@sha256:" + "5" * 64
# big jobs pinned to zone z1: only its GPU nodes can hold one (CPU nodes are too small), so
# the flood far exceeds what fits and fair share decides who runs
FLOOD_SHAPE = {"cpu_millis": 32000, "memory_mib": 65536, "zone": "z1"}
MAX_RUNTIME = 120
# a 32-core, 64 GiB lease for 120 s holds 32×10×120 + 64×2×120 = 53,760 micro-credits
PRICES = {"cpu_core_second": 10, "memory_gib_second": 2,
          "gpu_second": {"NVIDIA L4": 400, "NVIDIA A100 80GB": 1500, "*": 800},
          "gpu_partition_second": {"*": 250}}
# initech can hold one lease at a time and soon not even that: it runs out of credit
CREDITS = {"acme": 10**11, "globex": 10**11, "initech": 60_000}


@dataclass
class Check:
    name: str
    ok: bool = False
    detail: str = ""


@dataclass
class Tracked:
    lease_id: str
    tenant: str
    job: dict[str, Any] | None
    kind: str = "flood"
    state: str = "queued"
    final: dict[str, Any] = field(default_factory=dict)


class Stage:
    """The demo's servers, clients and processes, and the plumbing the scenes share."""

    def __init__(self, home: Path, *, nodes: int = 200, flood: int = 150, keep: bool = False,
                 say: Callable[[str], None] = print, live: bool | None = None) -> None:
        self.home = home
        self.nodes = nodes
        self.flood = flood
        self.keep = keep
        self.say = say
        self.live = live
        self.checks: dict[str, Check] = {k: Check(k) for k in (
            "fair_share", "preemption", "reclaim", "gpu_devices", "gang", "cancellation",
            "unsatisfiable", "silent_agent", "out_of_credit", "real_sandbox", "audit",
            "decisions")}
        self.tracked: dict[str, Tracked] = {}
        self.fair: FairShareReport | None = None
        self.unanswered: list[str] = []  # commands the plane did not answer in time
        self.initech_dry_at: float | None = None
        self.t0 = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.local = False

    # -- plumbing ----------------------------------------------------------------------------

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def _ok(self, r: dict[str, Any], what: str) -> dict[str, Any]:
        if not r.get("ok"):
            raise RuntimeError(f"{what}: {r.get('error')}")
        return r

    def submit(self, tenant: str, key: str, shape: dict[str, Any], job: dict[str, Any] | None,
               *, kind: str = "flood", priority: str = "standard",
               pool: str = POOL, group: dict[str, Any] | None = None) -> Tracked | None:
        """Request a lease (a gang's lead, with `group`; committing it commits the gang)."""
        from bus.errors import BusError

        try:
            r = self.clients[tenant].request_lease({
                "pool_id": pool, "shape": shape, "maximum_runtime_seconds": MAX_RUNTIME,
                "idempotency_key": key, "priority_class": priority,
                # preempted work goes back in line, its job restarted on the next placement
                "preemptible_requeue": kind == "victim",
                **({"group": group} if group else {})})
        except BusError as e:  # the same key asked again later would be the same lease
            self.unanswered.append(f"request {key} of {tenant}: {e}")
            return None
        if not r.get("ok"):
            return None
        t = Tracked(r["lease"]["lease_id"], tenant, job, kind, r["lease"]["state"])
        with self._lock:
            self.tracked[t.lease_id] = t
        return t

    def get(self, t: Tracked) -> dict[str, Any]:
        """The lease as its tenant reads it; {} when the plane did not answer in time (said in
        the report, and the check that needed it fails naming what it saw)."""
        from bus.errors import BusError

        try:
            return dict(self.clients[t.tenant].lease(t.lease_id, "get").get("lease") or {})
        except BusError as e:
            self.unanswered.append(f"get of {t.lease_id}: {e}")
            return {}

    # -- set-up ------------------------------------------------------------------------------

    def spawn(self, name: str, *argv: str, nats_url: str | None = None) -> subprocess.Popen[bytes]:
        """A `pool …` process of the demo's own (one interpreter each: its own GIL), logging
        under $home/logs. `nats_url` (with the service password) goes in its environment, never
        on its command line, which every local user can read in /proc."""
        logs = self.home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in ("POOL_NATS_URL",
                                                                  "POOL_DATABASE_URL")}
        env["POOL_HOME"] = str(self.home)
        if nats_url:
            env["POOL_NATS_URL"] = nats_url
        # its own session (Ctrl-C reaches the demo, which stops the rest in order), and a
        # SIGTERM from the kernel should the demo itself die without its teardown
        with open(logs / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "cli.main", *argv], env=env, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=die_with(os.getpid()))  # noqa: PLW1509 - the child only calls prctl
        self.procs[name] = proc
        return proc

    def setup(self) -> None:
        """The servers, the control plane and the gateway; the pools, tenants and credits; the
        fleets, once every node has registered."""
        if self.home.exists():
            shutil.rmtree(self.home)  # every demo starts from an empty log
        self._start_plane()
        self.dashboard = self._start_gateway()
        self._configure_pools()
        total = self._start_fleets()
        self._wait_for_nodes(total)
        for n in ("sim-0003", "sim-0007", "sim-0011"):
            self.admin.admin(f"node.{n}.cordon", {"reason": "demo: cordoned"})

    def _start_plane(self) -> None:
        """The embedded NATS and PostgreSQL, the control plane, and the clients once it answers."""
        from bus.admin import ensure_all_streams
        from client.api import PoolClient
        from local import embedded

        os.environ.setdefault("POOL_NATS_PORT", "0")
        self.say(f"starting the embedded NATS and PostgreSQL in {self.home} …")
        self.emb = embedded.start(self.home, with_postgres=True)
        url = self.url = self.emb.service_url or self.emb.nats_url
        ensure_all_streams(url)
        # the control plane: commands, scheduler, dispatcher, reconciler and projector
        self.spawn("control-plane", "serve", nats_url=url)
        self.admin = PoolClient(url, timeout=20)
        self.clients = {t: PoolClient(url, t, timeout=20) for t in TENANTS}
        from bus.errors import BusError

        def answers() -> bool:
            try:
                r = self.admin.call(admin_subject("pool.show"), {"pool_id": POOL}, timeout=2.0)
            except BusError:
                return False
            code: object = r.get("error", {}).get("code")
            return code == "unknown_pool"

        deadline = time.monotonic() + 30
        while not answers():
            if time.monotonic() > deadline:
                raise RuntimeError("the control plane did not start: see "
                                   f"{self.home / 'logs' / 'control-plane.log'}")
            time.sleep(0.2)

    def _configure_pools(self) -> None:
        """Each pool's settings and prices, the tenants' weights and classes in it, the lab's
        cohort, and every tenant's credits."""
        classes = {"preemptible": 0, "standard": 10, "high": 20}
        pools: dict[str, dict[str, Any]] = {
            # fair share orders the flood; no preemption here, so short jobs never thrash
            POOL: {"heartbeat_timeout_seconds": 15, "node_timeout_seconds": 20,
                   "lost_node_release_seconds": 10},
            HPC: {"preemption": {"enabled": True, "grace_seconds": 2, "min_runtime_seconds": 0},
                  "heartbeat_timeout_seconds": 8, "node_timeout_seconds": 10},
            EDGE: {"heartbeat_timeout_seconds": 3, "node_timeout_seconds": 4,
                   "lost_node_release_seconds": 3},
            LAB: {"preemption": {"enabled": True, "grace_seconds": 2, "min_runtime_seconds": 0},
                  "heartbeat_timeout_seconds": 8, "node_timeout_seconds": 10},
            TRAIN: {"heartbeat_timeout_seconds": 8, "node_timeout_seconds": 10},
        }
        for pool, cfg in pools.items():
            self._ok(self.admin.admin("pool.set", {"pool_id": pool, "priority_classes": classes,
                                                   "commit_timeout_seconds": 15, **cfg}), "pool")
            self._ok(self.admin.admin("pool.prices", {"pool_id": pool, **PRICES}), "prices")
            # the operator grants the demo's tenants every class (a tenant's default: the
            # pool's default class only)
            for tenant, weight in TENANTS.items():
                self._ok(self.admin.admin("tenant.set", {"tenant": tenant, "pool_id": pool,
                                                         "weight": weight,
                                                         "priority_classes": sorted(classes)}),
                         "tenant")
        # the lab's cohort: acme and globex each own half its node and may borrow the other half
        self._ok(self.admin.admin("cohort.set", {"pool_id": LAB, "name": "lab"}), "cohort")
        for tenant in ("acme", "globex"):
            self._ok(self.admin.admin("tenant.set", {
                "tenant": tenant, "pool_id": LAB, "weight": TENANTS[tenant], "cohort": "lab",
                "nominal": {"cpu_millis": HALF_LAB["cpu_millis"]},
                "priority_classes": sorted(classes)}), "tenant")
        for tenant in TENANTS:
            self._ok(self.admin.admin("credits.grant", {
                "tenant": tenant, "amount_microcredits": CREDITS[tenant],
                "transfer_id": f"demo-grant-{tenant}"}), "grant")

    def _start_fleets(self) -> int:
        """The simulated fleets and, where a sandbox works here, a real agent enrolled by the
        operator; the number of nodes that will register."""
        url = self.url
        total = self.nodes + 5
        self.say(f"starting {total} simulated nodes and a real sandboxed agent …")
        self.spawn("fleet", "agent", "simulate", "--nodes", str(self.nodes), "--pool", POOL,
                   "--heartbeat-interval", "4", "--report-every", "5", nats_url=url)
        self.spawn("fleet-hpc", "agent", "simulate", "--nodes", "1", "--profile", "a100",
                   "--prefix", "hpc", "--pool", HPC, "--heartbeat-interval", "1", nats_url=url)
        self.spawn("fleet-train", "agent", "simulate", "--nodes", "2", "--profile", "a100",
                   "--prefix", "gpu", "--pool", TRAIN, "--heartbeat-interval", "1", nats_url=url)
        self.spawn("fleet-lab", "agent", "simulate", "--nodes", "1", "--profile", "cpu",
                   "--prefix", "lab", "--pool", LAB, "--heartbeat-interval", "1", nats_url=url)
        self.spawn("fleet-quiet", "agent", "simulate", "--nodes", "1", "--profile", "cpu",
                   "--prefix", "quiet", "--pool", EDGE, "--heartbeat-interval", "1",
                   nats_url=url)
        from agents.runtimes.process import ProcessRuntime

        why = ProcessRuntime(self.home / "probe").available()
        self.local = why is None
        if self.local:
            # enrolled by the operator, then run as the node's own NATS user, like any real agent
            enrolled = self.admin.admin("node.enroll", {"node_id": "local-1", "pool_id": EDGE,
                                                        "trust_level": "trusted", "max_gpus": 8})
            if not enrolled.get("ok"):
                raise RuntimeError(f"enrolling local-1: {enrolled.get('error')}")
            self.spawn("agent-local-1", "agent", "run", "--node-id", "local-1", "--pool", EDGE,
                       "--labels", "zone=z3,region=local", "--heartbeat-interval", "1",
                       "--reserve-memory-mib", "512")
            total += 1
        else:
            self.checks["real_sandbox"].ok = True
            self.checks["real_sandbox"].detail = f"skipped: {why}"
        return total

    def _wait_for_nodes(self, total: int) -> None:
        """Until the capacity view counts `total` nodes."""
        from projections.summary import Summary

        summary = Summary(self.emb.database_url)
        deadline = time.monotonic() + 60
        while sum(c["nodes"] for c in summary.snapshot().get("capacity", [])) < total:
            if time.monotonic() > deadline:
                raise RuntimeError("the simulated fleet did not register: see "
                                   f"{self.home / 'logs'}")
            time.sleep(0.3)
        summary.close()

    def _start_gateway(self) -> str:
        """The HTTP API and web dashboard beside the demo, in a process of its own reading this
        home's endpoints: a line saying where, with an admin token made for this run."""
        import socket

        from bus.local.server import free_port
        from gateway.tokens import TOKENS_FILE, TokenStore

        try:  # 8080 when it is free, else any free port
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 8080))
            port = 8080
        except OSError:
            port = free_port()
        token = TokenStore(self.home / TOKENS_FILE).issue_admin(rotate=True)
        self.spawn("gateway", "gateway", "--http", f"127.0.0.1:{port}")
        line = f"dashboard: http://127.0.0.1:{port}/ (admin token {token})"
        self.say(line)
        return line

    def teardown(self) -> None:
        for c in list(getattr(self, "clients", {}).values()) + [getattr(self, "admin", None)]:
            if c is not None:
                c.close()
        # agents first, then the control plane they report to
        order = [n for n in self.procs if n != "control-plane"] + ["control-plane"]
        for group in (order[:-1], order[-1:]):
            for name in group:
                proc = self.procs.get(name)
                if proc is not None and proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)
                    proc.send_signal(signal.SIGINT)
            for name in group:
                proc = self.procs.get(name)
                if proc is None:
                    continue
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if getattr(self, "emb", None) is not None:
            self.emb.stop()

