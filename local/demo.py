"""`pool demo`: the whole mission in one command, on the embedded default.
What it starts and the scenes it plays: docs/architecture.md#the-embedded-default.
"""

from __future__ import annotations

import os
import random
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


class Demo:
    """One run of the demo; `run()` returns the process exit code."""

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
        from bus.admin import ensure_all_streams
        from client.api import PoolClient
        from local import embedded

        if self.home.exists():
            shutil.rmtree(self.home)  # every demo starts from an empty log
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
        self.dashboard = self._start_gateway()
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
        from projections.summary import Summary

        summary = Summary(self.emb.database_url)
        deadline = time.monotonic() + 60
        while sum(c["nodes"] for c in summary.snapshot().get("capacity", [])) < total:
            if time.monotonic() > deadline:
                raise RuntimeError("the simulated fleet did not register: see "
                                   f"{self.home / 'logs'}")
            time.sleep(0.3)
        summary.close()
        for n in ("sim-0003", "sim-0007", "sim-0011"):
            self.admin.admin(f"node.{n}.cordon", {"reason": "demo: cordoned"})

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

    # -- the tenants -------------------------------------------------------------------------

    def committer(self) -> None:
        """Each tenant commits its leases once the leases view shows them reserved (a requeued
        one again); one query a round, not a request per lease."""
        from bus.errors import BusError
        from projections.summary import Summary

        summary = Summary(self.emb.database_url)
        try:
            while not self._stop.is_set():
                with self._lock:
                    pending = {t.lease_id: t for t in self.tracked.values()
                               if t.state not in ("released", "cancelled", "rejected")}
                for lid, state in summary.states(list(pending)).items():
                    t = pending[lid]
                    t.state = state
                    if state == "reserved":
                        try:
                            r = self.clients[t.tenant].lease(lid, "commit",
                                                             {"job": t.job} if t.job else {})
                        except BusError as e:
                            # a plane too busy to answer in time: say so in the report, and
                            # ask again next round (a commit is idempotent) rather than stop
                            self.unanswered.append(f"commit of {lid}: {e}")
                            continue
                        if r.get("ok"):
                            t.state = r["lease"]["state"]
                self._stop.wait(0.3)
        finally:
            summary.close()

    def watcher(self) -> None:
        """The views' summary for the live dashboard, once a second (shown, never judged: the
        checks read the log)."""
        from projections.summary import Summary

        summary = Summary(self.emb.database_url)
        try:
            while not self._stop.is_set():
                self.last_snapshot = summary.snapshot()
                self._stop.wait(1.0)
        finally:
            summary.close()

    def scenario(self) -> None:
        """The story: the special cases first, then the flood, then the twists."""
        # a request no node in the pool could ever hold: rejected at once, with reasons
        self.impossible = self.submit("globex", "impossible", {
            "cpu_millis": 1000, "memory_mib": 1024, "gpu_count": 16}, None, kind="impossible")
        # preemptible batch work that fills the HPC node (an urgent job will want it)
        victims = [self.submit("globex", f"batch-{i}", {"cpu_millis": 8000, "memory_mib": 8192,
                                                        "gpu_count": 8},
                               {"image": IMAGE, "command": ["sleep", "40"]},
                               kind="victim", priority="preemptible", pool=HPC)
                   for i in range(1)]
        self.victims = [v for v in victims if v is not None]
        # a 2-node gang of 8 A100s each in one rack: both members reserved in one save or
        # neither, committed together, each bound to its node's eight devices
        self.gang = self.submit("acme", "train-2x8", {"cpu_millis": 8000, "memory_mib": 8192,
                                                      "gpu_count": 8},
                                {"image": IMAGE, "command": ["sleep", "4"]}, kind="gang",
                                pool=TRAIN, group={"members": 2, "same": "rack"})
        # globex fills the lab node: its own half and, borrowed, acme's
        borrowers = [self.submit("globex", f"borrow-{i}", HALF_LAB,
                                 {"image": IMAGE, "command": ["sleep", "60"]},
                                 kind="borrower", pool=LAB) for i in range(2)]
        self.borrowers = [b for b in borrowers if b is not None]
        # on the edge pool: real sandboxed jobs (one to cancel), and a job on a node whose
        # agent will go silent
        local = {"cpu_millis": 200, "memory_mib": 128, "region": "local", "runtime": "sandboxed"}
        # without a sandbox here, the lease to cancel runs on a simulated node of the main pool
        # (its agent stops the simulated workload and confirms, as a real one would)
        self.to_cancel = self.submit(
            "acme", "long-job", local if self.local else {"cpu_millis": 1000, "memory_mib": 1024},
            {"image": IMAGE, "command": ["sleep", "60"]}, kind="cancel",
            pool=EDGE if self.local else POOL)
        self.quiet = self.submit("acme", "on-quiet-node", {"cpu_millis": 1000, "memory_mib": 1024},
                                 {"image": IMAGE, "command": ["sleep", "60"]}, kind="quiet",
                                 pool=EDGE)
        self.sandboxed: list[Tracked] = []
        if self.local:
            for i in range(3):
                t = self.submit("acme", f"sandboxed-{i}", local, {"image": IMAGE, "command": [
                    "sh", "-c", f"echo job {i} as $(id -u) in a sandbox; sleep 2"]},
                    kind="sandboxed", pool=EDGE)
                if t is not None:
                    self.sandboxed.append(t)

        # a flood of whole-node jobs from all three tenants: fair share decides who runs
        def flood(tenant: str, offset: int) -> None:
            rnd = random.Random(offset)
            for i in range(offset, self.flood, 3):
                self.submit(tenant, f"flood-{i}", FLOOD_SHAPE,
                            {"image": IMAGE, "command": ["sleep", str(rnd.choice((2, 3, 4)))]})

        floods = [threading.Thread(target=flood, args=(t, k), daemon=True)
                  for k, t in enumerate(TENANTS)]
        for th in floods:
            th.start()
        self._wait_running(self.victims + self.borrowers
                           + [x for x in (self.to_cancel, self.quiet) if x], 60)
        # the twists: an urgent job preempts the batch work, a cancel, an agent goes quiet
        self.high = self.submit("acme", "urgent", {"cpu_millis": 8000, "memory_mib": 8192,
                                                   "gpu_count": 8},
                                {"image": IMAGE, "command": ["sleep", "3"]}, kind="high",
                                priority="high", pool=HPC)
        # acme wants its own half of the lab back: one of globex's leases is preempted for it
        self.owner = self.submit("acme", "my-half", HALF_LAB,
                                 {"image": IMAGE, "command": ["sleep", "3"]}, kind="owner",
                                 pool=LAB)
        if self.owner is not None:
            deadline = time.monotonic() + 20  # answered at once unless the plane is loaded
            while time.monotonic() < deadline:
                why = self.clients["acme"].lease(self.owner.lease_id, "why").get("result") or {}
                if "waiting_for_reclaim" in str(why.get("reasons")):
                    self.reclaim_why = why.get("reasons")
                    break
                time.sleep(0.2)
        if self.to_cancel is not None:
            self.clients["acme"].lease(self.to_cancel.lease_id, "cancel", {"reason": "demo"})
        if self.quiet is not None:
            # the node's agent stops answering (as a hung or partitioned host would)
            self.procs["fleet-quiet"].send_signal(signal.SIGSTOP)
        for th in floods:
            th.join()

    def _wait_running(self, ts: list[Tracked], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(
                self.get(t).get("state") == "running" for t in ts):
            time.sleep(0.3)

    # -- the end -----------------------------------------------------------------------------

    def settle(self, timeout: float) -> None:
        """Wait for the story to finish; then cancel whatever still waits (out of credit)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            open_ = [t for t in self.tracked.values() if t.kind not in ("victim", "borrower")
                     and t.state not in ("released", "cancelled", "rejected", "preempted")
                     and not (t.tenant == "initech" and t.state == "queued")]
            if not open_ and self.elapsed() > 8:
                break
            self._refresh()
            time.sleep(0.5)
        self._refresh()
        self.credit_why = self._credit_why([t for t in self.tracked.values()
                                            if t.tenant == "initech" and t.state == "queued"])
        for t in self.tracked.values():
            if t.state in ("queued", "reserved", "running", "preempting"):
                self.clients[t.tenant].lease(t.lease_id, "cancel", {"reason": "demo over"})

    def _credit_why(self, waiting: list[Tracked], timeout: float = 10.0) -> dict[str, Any]:
        """`why` of initech's waiting leases: the first that names its credits. A lease queued
        since the scheduler's last cycle has no reasons yet, so ask again until one does."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while waiting:
            for t in waiting:
                why = self.clients["initech"].lease(t.lease_id, "why").get("result") or {}
                last = why or last
                if "insufficient_credits" in str(why.get("reasons", {})):
                    return why
            if time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        return last

    def _refresh(self) -> None:
        for t in list(self.tracked.values()):
            if t.state not in ("released", "cancelled", "rejected", "preempted"):
                lease = self.get(t)
                t.state = lease.get("state", t.state)
                t.final = lease

    def judge(self) -> None:
        c = self.checks
        if self.impossible is not None:
            why = self.clients["globex"].lease(self.impossible.lease_id, "why").get(
                "result") or {}
            lease = self.get(self.impossible)
            c["unsatisfiable"].ok = lease.get("state") == "rejected"
            c["unsatisfiable"].detail = (f"{lease.get('rejection_code')}: "
                                         f"{why.get('reasons', {})}")[:200]
        if self.to_cancel is not None:
            st = self.get(self.to_cancel).get("state")
            c["cancellation"].ok = st == "cancelled"
            c["cancellation"].detail = (f"running → stopping → {st} "
                                        f"({self.get(self.to_cancel).get('end_reason')})")
        if self.quiet is not None:
            lease = self.get(self.quiet)
            c["silent_agent"].ok = (lease.get("state") == "released"
                                    and lease.get("end_reason") in ("heartbeat_lost",
                                                                    "node_lost"))
            c["silent_agent"].detail = (f"expired ({lease.get('end_reason')}) → reconciling "
                                        f"→ {lease.get('state')}, capacity held until then")
        # a victim counts once it was requeued and its next placement really ran: started
        # again and not lost (its heartbeats kept the new epoch alive)
        again = [self.get(v) for v in self.victims]
        preempted = [v for v in again if (v.get("attempts") or 1) > 1
                     and v.get("epoch", 1) > 1 and v.get("started_at")
                     and v.get("end_reason") not in ("heartbeat_lost", "node_lost")]
        urgent: Tracked | None = getattr(self, "high", None)
        high = self.get(urgent) if urgent else {}
        c["preemption"].ok = bool(preempted) and high.get("end_reason") == "succeeded"
        c["preemption"].detail = (f"{len(preempted)} preemptible lease(s) noticed, given 2 s "
                                  f"grace, requeued and running again (attempt "
                                  f"{max([v.get('attempts') or 1 for v in again] or [1])}); "
                                  f"the high-priority lease {high.get('state')} "
                                  f"({high.get('end_reason')})")
        owner: Tracked | None = getattr(self, "owner", None)
        mine = self.get(owner) if owner else {}
        taken = [b for b in (self.get(t) for t in getattr(self, "borrowers", []))
                 if b.get("state") == "preempted"]
        borrowed = ((getattr(self, "reclaim_why", None) or {}).get("quota", {})
                    .get("borrowed_by", {}).get("globex", {}))
        lent = ",".join(f"{d}={v}" for d, v in borrowed.items())
        c["reclaim"].ok = (bool(taken) and mine.get("started_at") is not None
                           and mine.get("end_reason") == "succeeded")
        c["reclaim"].detail = (f"globex borrowed {lent or 'half the lab'} of acme's quota; "
                               f"acme's request preempted {len(taken)} borrower lease(s) "
                               f"(reclaiming_quota, 2 s grace) and ran: {mine.get('state')} "
                               f"({mine.get('end_reason')})")
        # the urgent lease was bound to the HPC node's eight GPUs by id (`pool lease get`)
        devices = list(high.get("devices") or ())
        c["gpu_devices"].ok = len(set(devices)) == 8
        c["gpu_devices"].detail = (f"the urgent lease held {len(set(devices))} GPU devices of "
                                   f"{high.get('node_id')}: {', '.join(devices[:2])}, …")
        gang_lead: Tracked | None = getattr(self, "gang", None)
        members = ((self.get(gang_lead).get("gang") or {}).get("members") or []
                   if gang_lead else [])
        self.gang_members = members
        bound = [m for m in members if len(set(m.get("devices") or ())) == 8]
        c["gang"].ok = (len(members) == 2 and len(bound) == 2
                        and len({m.get("node_id") for m in members}) == 2
                        and self.get(gang_lead or Tracked("", "acme", None)).get(
                            "end_reason") == "succeeded")
        c["gang"].detail = ("a 2-node gang (same rack) reserved in one save, committed "
                            "together: " + "; ".join(
                                f"member {m.get('member')} {m.get('state')} on "
                                f"{m.get('node_id')} with {len(m.get('devices') or ())} GPUs"
                                for m in members))
        why = getattr(self, "credit_why", {}) or {}
        reasons = why.get("reasons", {})
        c["out_of_credit"].ok = "insufficient_credits" in str(reasons)
        c["out_of_credit"].detail = f"initech waits: {reasons}"[:200]
        if self.sandboxed:
            done = [self.get(t) for t in self.sandboxed]
            c["real_sandbox"].ok = all(d.get("state") == "released" and d.get("exit_code") == 0
                                       for d in done)
            c["real_sandbox"].detail = (f"{len(done)} jobs ran under bubblewrap as uid 65534 on "
                                        f"local-1, exit codes {[d.get('exit_code') for d in done]}")

    def judge_fair_share(self, app: Any) -> None:
        """Fair share, judged from the log: every placement in the flood's pool made while
        acme and globex both waited must go to the one further below its weighted dominant
        share. Counted in placements (the flood's size sets how many), not sampled in time."""
        from projections.fair_share import check_fair_share, records_from_log

        fair = self.fair = check_fair_share(records_from_log(app, POOL), TENANTS,
                                            tenants=("acme", "globex"))
        need = self.min_contended()
        c = self.checks["fair_share"]
        c.ok = fair.ok(minimum=need)
        c.detail = fair.describe() + (f"; {len(fair.violations)} not: {fair.violations[0]}"
                                      if fair.violations else "")
        if fair.contended < need:
            c.detail += f"; too few to judge (want {need})"

    def judge_decisions(self, app: Any) -> None:
        """`pool audit decisions` over the whole log: every pool's placements sound."""
        from projections.decisions import audit_decisions

        found = audit_decisions(app)
        c = self.checks["decisions"]
        c.ok = found.ok
        bad = [f"{k}: {v[0]}" for k, v in found.violations.items() if v]
        c.detail = ("; ".join(f"{k} {s}" for k, s in found.checks.items()) if not bad
                    else f"{len(bad)} check(s) failed, first {bad[0]}")[:240]

    def min_contended(self) -> int:
        """Contended placements the fair-share check needs: a tenth of the flood (the rest
        fill the zone or drain after one tenant's requests are all placed)."""
        return max(5, self.flood // 10)

    def audit(self) -> None:
        from control.application import PoolApp
        from control.bootstrap import app_env
        from projections.audit import audit_credits
        from projections.summary import Summary

        app = PoolApp(env=app_env(self.url))
        summary = Summary(self.emb.database_url)
        try:
            last = app.recorder.max_notification_id() or 0
            deadline = time.monotonic() + 20  # let the views catch up before cross-checking
            while time.monotonic() < deadline and summary.position() < last:
                time.sleep(0.3)
            report = audit_credits(app, database_url=self.emb.database_url)
            self.judge_fair_share(app)
            self.judge_decisions(app)
        finally:
            summary.close()
            app.close()
        self.audit_lines = report.lines()
        self.checks["audit"].ok = report.ok
        self.checks["audit"].detail = self.audit_lines[-1] if self.audit_lines else ""

    # -- run ---------------------------------------------------------------------------------

    def run(self) -> int:
        self.t0 = time.monotonic()
        if threading.current_thread() is threading.main_thread():
            # `kill`/`timeout` stop the demo as Ctrl-C does: through the teardown below, so no
            # server, agent or fleet is left running
            signal.signal(signal.SIGTERM, _interrupt)
        self.setup()
        threads = [threading.Thread(target=f, daemon=True) for f in (self.committer,
                                                                     self.watcher)]
        for th in threads:
            th.start()
        try:
            story = threading.Thread(target=self.scenario, daemon=True)
            story.start()
            from local.dashboard import Dashboard

            with Dashboard(self, live=self.live):
                story.join()
                # the story ends by itself in ~30 s here; a loaded machine gets the time it needs
                self.settle(timeout=max(30.0, 150 - self.elapsed()))
            self.judge()
            self._stop.set()
            for th in threads:
                th.join(5)
            self.audit()
            self.report()
            if self.keep:
                self.say("still running (--keep): Ctrl-C to stop")
                try:
                    while True:
                        time.sleep(1)
                except KeyboardInterrupt:
                    pass
        finally:
            self._stop.set()
            self.teardown()
        return 0 if all(c.ok for c in self.checks.values()) else 1

    def report(self) -> None:
        say = self.say
        say("")
        say("credit audit (replayed from the JetStream log, cross-checked with the views):")
        for line in self.audit_lines[-3:]:
            say(f"  {line}")
        say("")
        say("fair share under contention (32-core jobs flooding zone z1), from the log:")
        fair = self.fair
        say(f"  {'tenant':<8} {'weight':>6} {'placements':>10} {'mean weighted share':>20}")
        for t, w in TENANTS.items():
            if fair is not None and t in fair.tenants:
                say(f"  {t:<8} {w:>6.0f} {fair.by_tenant.get(t, 0):>10} "
                    f"{fair.mean_share(t):>20.3f}")
        say("  (each placement made while both waited; initech is capped by its credits: it "
            "ran out, see below)")
        if self.unanswered:
            say(f"  the plane left {len(self.unanswered)} command(s) unanswered in time, first: "
                f"{self.unanswered[0]} (see {self.home / 'logs'})")
        say("")
        say("what happened:")
        for c in self.checks.values():
            say(f"  {'✓' if c.ok else '✗'} {c.name:<14} {c.detail}")
        say("")
        imp = self.impossible.lease_id if self.impossible else "ID"
        say("where to look next:")
        say(f"  {self.dashboard}")
        say(f"  pool demo --keep, then in another terminal (POOL_HOME={self.home}):")
        say(f"    pool lease why {imp} --tenant globex     # why it was rejected")
        if self.gang is not None:
            say(f"    pool lease get {self.gang.lease_id} --tenant acme   # the gang: every "
                "member, its node and devices")
            for m in getattr(self, "gang_members", []):
                devices = list(m.get("devices") or ())
                say(f"      member {m.get('member')}  {m.get('node_id')}  "
                    f"{', '.join(devices[:2])}, … ({len(devices)} devices)")
        say("    pool telemetry follow --since 5m           # startup, utilization, exits")
        say("    pool queue; pool capacity; pool balance; pool audit credits")

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


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt
