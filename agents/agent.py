"""The node agent: registers what the node has, runs the leases placed on it, and reports.
Its loop, heartbeats and re-adoption: docs/architecture.md#the-node-agent.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from agents import gpubind, secrets
from agents.assignment import refusals, workload_spec
from agents.checkpoints import DEFAULT_RETENTION_SECONDS, CheckpointSweeper
from agents.ledger import Ledger
from agents.link import Link
from agents.notice import NoticeRefused, latest_mtime, write_notice
from agents.output import OutputShipper, Stream
from agents.probe import NodeProbe, Reserve
from agents.runtimes.contract import Runtime, WorkloadError, WorkloadHandle
from agents.sessions import Sessions
from agents.workdir import JobFiles
from bus.agentbus import AgentCommand
from bus.errors import BusError
from bus.subjects import telemetry_subject
from domain.lease import TERMINAL_STATES
from schemas import v1
from schemas.codec import SchemaError, decode_command, encode
from schemas.session import SessionOrder

log = logging.getLogger(__name__)

FOLLOW_SECONDS = 1.0  # a follower looks whether its job is still this agent's this often


def next_beat(due: float, now: float, interval: float) -> float:
    """When the beat after one due at `due` and sent at `now` is due: at a fixed rate, so a
    beat held up (a busy host, a stalled plane) keeps its phase and agents held up together do
    not beat together from then on; never more than `interval` away. A first beat, or one late
    by a whole interval, starts a phase of its own, drawn at random."""
    after = due + interval
    if after <= now:
        after = now + interval * random.uniform(0.5, 1.0)
    return min(after, now + interval)

@dataclass
class Running:
    """A workload this agent is responsible for, and what it knows about its lease."""

    handle: WorkloadHandle
    pool_id: str
    tenant: str
    checkpoint_dir: Path | None = None
    last_checkpoint_at: float | None = None
    stopping: bool = False
    # the most bytes of the job's output kept and shipped; True once all of it was shipped
    max_output_bytes: int = 64 << 20
    output_shipped: bool = False
    exit_code: int | None = None  # once it exited and all its output was shipped
    # the job's files: its directory (/work) and what to store from it at its end
    has_workdir: bool = False
    artifacts: tuple[str, ...] = ()
    artifact_ttl_seconds: int = 7 * 86_400
    max_artifact_bytes: int = 1 << 30
    artifacts_stored: dict[str, Any] | None = None


@dataclass
class AgentStats:
    started: int = 0
    duplicates_ignored: int = 0
    exits_reported: int = 0
    stops: int = 0
    refused: int = 0
    heartbeats: int = 0
    notices_refused: int = 0  # a notice whose place in the job's folder held a trap
    checkpoints_removed: int = 0  # folders of leases ended for good or past their retention
    startup_seconds: list[float] = field(default_factory=list)


_DEFAULT_RESERVE = Reserve()  # frozen: one shared default is safe


class Agent:
    """One node's agent. `run(stop)` until the event is set; `step()` for tests."""

    def __init__(self, link: Link, runtime: Runtime, *, node_id: str, pool_id: str,
                 probe: NodeProbe, state_dir: Path, labels: dict[str, str] | None = None,
                 reserve: Reserve = _DEFAULT_RESERVE, trust_level: str = "trusted",
                 heartbeat_interval: float = 2.0, utilization_every: int = 5,
                 clock: Callable[[], float] = time.time, time_slice_replicas: int = 0,
                 output: OutputShipper | None = None,
                 checkpoint_retention_seconds: float = DEFAULT_RETENTION_SECONDS) -> None:
        self.link = link
        # the jobs' output, shipped by a thread of its own (never the heartbeat's, never
        # under the agent's lock), capped per job and paced for all of them together
        self.output = output or OutputShipper()
        self.time_slice_replicas = time_slice_replicas
        self.runtime = runtime
        self.node_id = node_id
        self.pool_id = pool_id
        self.probe = probe
        self.labels = labels or {}
        self.reserve = reserve
        self.trust_level = trust_level
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.heartbeat_interval = heartbeat_interval
        self.utilization_every = utilization_every
        self.clock = clock
        self.running: dict[str, Running] = {}  # by lease id
        self.stats = AgentStats()
        self.ledger = Ledger(self.state_dir)  # what it started, kept across its restarts
        self._seq = 0
        self._next_beat = 0.0
        self._stopping: list[threading.Thread] = []
        self._lock = threading.RLock()
        self._devices: dict[str, dict[str, Any]] | None = None
        self.files = JobFiles(self.state_dir / "files", link.files())
        self.sessions = Sessions(self)  # exec and port-forward into the running jobs

        def removed(n: int) -> None:
            self.stats.checkpoints_removed += n

        self.checkpoints = CheckpointSweeper(
            self.state_dir / "checkpoints", retention_seconds=checkpoint_retention_seconds,
            lock=self._lock, running=lambda: self.running.keys(), clock=clock,
            on_removed=removed)

    # -- identity and capabilities ------------------------------------------------------------

    def capabilities(self) -> dict[str, Any]:
        # only the egress the runtime really enforces
        return self.probe.capabilities(reserve=self.reserve,
                                       runtimes=self.runtime.isolation_classes(),
                                       labels=self.labels, trust_level=self.trust_level,
                                       network_egress=self.runtime.network_egress(),
                                       binds_gpus=self.runtime.binds_gpus(),
                                       time_slice_replicas=self.time_slice_replicas)

    def _own_devices(self) -> dict[str, dict[str, Any]]:
        """This node's devices by id, as it registers them."""
        if self._devices is None:
            self._devices = {d["id"]: d for d in self.capabilities().get("devices", ())}
        return self._devices

    def register(self) -> dict[str, Any]:
        caps = msgspec.convert(self.capabilities(), v1.NodeCapabilitiesSpec)
        body = v1.NodeRegistration(node_id=self.node_id, pool_id=self.pool_id, capabilities=caps)
        return self._call("register", encode(body))

    def _call(self, suffix: str, body: bytes, headers: dict[str, str] | None = None
              ) -> dict[str, Any]:
        reply = json.loads(self.link.request(suffix, body, headers=headers))
        return reply  # type: ignore[no-any-return]

    # -- restart safety -------------------------------------------------------------------------

    def adopt(self) -> int:
        """Take back the workloads a previous run of this agent started."""
        n = 0
        for handle in self.runtime.adopt():
            meta = self.ledger.read_meta(handle.lease_id)
            self.running[handle.lease_id] = Running(
                handle=handle, pool_id=meta.get("pool_id", self.pool_id),
                tenant=meta.get("tenant", "unknown"),
                checkpoint_dir=Path(meta["checkpoint_dir"]) if meta.get("checkpoint_dir")
                else None, has_workdir=bool(meta.get("workdir")),
                artifacts=tuple(meta.get("artifacts") or ()),
                artifact_ttl_seconds=int(meta.get("artifact_ttl_seconds") or 7 * 86_400),
                max_artifact_bytes=int(meta.get("max_artifact_bytes", 1 << 30)),
                max_output_bytes=int(meta.get("max_output_bytes", 64 << 20)))
            self.ledger.started.add(handle.key)
            self._follow(handle.lease_id, self.running[handle.lease_id])
            n += 1
        return n

    # -- the loop -----------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        self.adopt()
        self._register_until_ok(stop)
        while not stop.is_set():
            try:
                self.step(wait=min(0.5, max(0.05, self._next_beat - self.clock())))
            except BusError as e:
                log.warning("bus unavailable, retrying: %s", e)
                stop.wait(0.5)
        for t in self._stopping:
            t.join(10)
        self.checkpoints.join(10)
        self.output.close()
        self.deregister()

    def deregister(self) -> None:
        """Tell the control plane this agent stops: an idle node takes no more placements at
        once. With workloads still running nothing changes (they are re-adopted on restart)."""
        if self.running:
            return
        try:
            r = self._call("offline", encode(v1.NodeDrain(reason="agent_stopped")))
        except BusError as e:
            log.info("could not deregister (the node timeout will tell): %s", e)
            return
        if r.get("ok"):
            log.info("deregistered: node %s is %s", self.node_id,
                     (r.get("result") or {}).get("state"))

    def _register_until_ok(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                r = self.register()
                if r.get("ok"):
                    return
                log.error("registration refused: %s", r.get("error"))
            except BusError as e:
                log.warning("cannot register yet: %s", e)
            stop.wait(1.0)

    def step(self, wait: float = 0.2) -> None:
        for cmd in self.link.fetch(timeout=wait):
            self.handle(cmd)
        self.watch()
        if self.clock() >= self._next_beat:
            self.heartbeat()
        self.checkpoints.tick()

    def handle(self, cmd: AgentCommand) -> None:
        with self._lock:  # the jobs' followers report from their own threads
            self._handle(cmd)

    def _handle(self, cmd: AgentCommand) -> None:
        received = time.monotonic()
        try:
            if cmd.verb == "start":
                body = decode_command("agent.assign", cmd.body)
                assert isinstance(body, v1.LeaseAssignment)
                self.start(body, received, cmd.headers)
            elif cmd.verb == "session":
                order = decode_command("agent.session", cmd.body)
                assert isinstance(order, SessionOrder)
                self.sessions.open(order)
            elif cmd.verb in ("stop", "preempt"):
                rev = decode_command("agent.revoke", cmd.body)
                assert isinstance(rev, v1.LeaseRevocation)
                self.stop(rev, preempt=cmd.verb == "preempt")
            else:
                log.warning("unknown agent command %r dropped", cmd.verb)
        except SchemaError as e:
            log.error("malformed %s command dropped: %s", cmd.verb, e)
        except BusError:
            cmd.nak(1.0)  # could not report: take it again shortly
            return
        cmd.ack()

    # -- start --------------------------------------------------------------------------------

    def start(self, a: v1.LeaseAssignment, received: float,
              headers: dict[str, str] | None = None) -> None:
        try:
            bound = gpubind.bind(self._own_devices(), a.devices, self.probe.gpus)
        except WorkloadError as e:
            self.stats.refused += 1
            self._report_end(a.lease_id, a.epoch, failure=f"refused:{e.code}")
            self._telemetry(a.pool_id, a.tenant, a.lease_id, "failure",
                            {"reason": e.code, "phase": "admission", "message": str(e)[:500]})
            return
        spec = workload_spec(a, bound, node_id=self.node_id,
                             checkpoint_dir=self.checkpoints.folder(a.lease_id), files=self.files)
        if spec.key in self.ledger.started:
            self.stats.duplicates_ignored += 1  # a redelivery: never start the same job twice
            return
        refused = refusals(a, isolation_classes=self.runtime.isolation_classes(),
                           trust_level=self.trust_level)
        if refused:
            self.stats.refused += 1
            self._report_end(a.lease_id, a.epoch, failure="refused:" + ",".join(refused))
            self._telemetry(a.pool_id, a.tenant, a.lease_id, "failure",
                            {"reason": ",".join(refused), "phase": "admission"})
            return
        current = self.running.get(a.lease_id)
        if current is not None and not current.stopping:
            # an older job or placement of this lease still runs here: it must go first; what
            # it wrote so far is still shipped, then its output is followed no more
            self._stop_now(current, grace=5.0)
            self.output.finish(current.handle.key)
        mounted = {m.name for m in a.volumes}
        missing = sorted(set(a.job.volumes) - mounted)
        if missing:  # withdrawn by the pool's operator since the commit
            self.stats.refused += 1
            self._report_end(a.lease_id, a.epoch, failure=f"volume_unknown: {missing[0]}")
            self._telemetry(a.pool_id, a.tenant, a.lease_id, "failure",
                            {"reason": "volume_unknown", "phase": "volumes",
                             "message": f"the pool no longer offers {', '.join(missing)}"})
            return
        if a.volumes:
            spec = dataclasses.replace(spec, volumes=tuple(
                (m.host_path, m.target, m.read_only) for m in a.volumes))
        try:  # held in memory for the start only: the runtime hands them to the sandbox
            held = secrets.fetch(self._call, a)
        except WorkloadError as e:
            self.stats.refused += 1
            self._report_end(a.lease_id, a.epoch, failure=f"{e.code}: {e}")
            self._telemetry(a.pool_id, a.tenant, a.lease_id, "failure",
                            {"reason": e.code, "phase": "secrets", "message": str(e)[:500]})
            return
        if held:
            spec = dataclasses.replace(spec, **held)
        if spec.workdir is not None:
            try:
                ref = a.job.workdir
                self.files.prepare(spec.key, a.tenant, ref.digest if ref else None,
                                   ref.size_bytes if ref else 0)
            except WorkloadError as e:
                self.stats.refused += 1
                self._report_end(a.lease_id, a.epoch, failure=f"{e.code}: {e}")
                self._telemetry(a.pool_id, a.tenant, a.lease_id, "failure",
                                {"reason": e.code, "phase": "workdir", "message": str(e)[:500]})
                return
        self.ledger.record_started(spec.key)
        self.ledger.write_meta(a.lease_id, {"pool_id": a.pool_id, "tenant": a.tenant,
                                           "checkpoint_dir": spec.checkpoint_dir,
                                           "workdir": spec.workdir, "artifacts": a.job.artifacts,
                                           "artifact_ttl_seconds": a.artifact_ttl_seconds,
                                           "max_artifact_bytes": a.max_artifact_bytes,
                                           "max_output_bytes": a.max_output_bytes})
        try:
            handle = self.runtime.start(spec)
        except WorkloadError as e:
            self.files.remove(spec.key)
            self._report_end(a.lease_id, a.epoch, failure=f"{e.code}: {e}")
            self._telemetry(a.pool_id, a.tenant, a.lease_id, "failure",
                            {"reason": e.code, "phase": "start", "message": str(e)[:500]})
            return
        startup = time.monotonic() - received
        self.stats.started += 1
        self.stats.startup_seconds.append(startup)
        self.running[a.lease_id] = Running(handle=handle, pool_id=a.pool_id, tenant=a.tenant,
                                           checkpoint_dir=Path(spec.checkpoint_dir or "."),
                                           has_workdir=spec.workdir is not None,
                                           artifacts=tuple(a.job.artifacts),
                                           artifact_ttl_seconds=a.artifact_ttl_seconds,
                                           max_artifact_bytes=a.max_artifact_bytes,
                                           max_output_bytes=a.max_output_bytes)
        self._follow(a.lease_id, self.running[a.lease_id])
        self._report_started(a, spec.key, startup, headers)

    def _report_started(self, a: v1.LeaseAssignment, key: str, startup: float,
                        headers: dict[str, str] | None) -> None:
        """Tell the tenant and the plane the job runs; stop it if the plane fenced it."""
        log.info("job %s of lease %s (tenant %s) started in %.3f s", a.job_number, a.lease_id,
                 a.tenant, startup)
        self._telemetry(a.pool_id, a.tenant, a.lease_id, "startup",
                        {"startup_seconds": round(startup, 6), "runtime": self.runtime.name,
                         "job": a.job_number, "epoch": a.epoch}, headers)
        try:
            r = self._call(f"lease.{a.lease_id}.started",
                           encode(v1.JobStarted(epoch=a.epoch, job_number=a.job_number,
                                                startup_seconds=round(startup, 6))), headers)
        except BusError:
            return  # the heartbeat will keep the lease alive; the start itself stands
        if not r.get("ok"):
            log.warning("start of %s reported, refused: %s", key, r.get("error"))
        fenced = ("lease_expired", "stale_epoch", "illegal_transition", "lease_not_found")
        if not r.get("ok"):
            # fenced: the lease moved on while its order waited (expected, and handled below);
            # anything else is worth an operator's eye
            code = r.get("error", {}).get("code")
            (log.info if code in fenced else log.warning)(
                "start of %s reported, refused: %s", key, r.get("error"))
        if not r.get("ok") and r.get("error", {}).get("code") in fenced:
            # the lease ended or moved while its command waited: fenced, the work must not run
            self._stop_now(self.running[a.lease_id], grace=0.0)

    # -- stop ---------------------------------------------------------------------------------

    def stop(self, rev: v1.LeaseRevocation, *, preempt: bool) -> None:
        run = self.running.get(rev.lease_id)
        if run is None or run.handle.epoch > rev.epoch:
            # nothing of this placement runs here: say so, so its capacity can be returned
            self._report_end(rev.lease_id, rev.epoch, exit_code=None)
            return
        if run.stopping:
            return
        if preempt and run.checkpoint_dir is not None:
            # the notice: checkpoint now; SIGTERM follows, SIGKILL after the grace period
            self._notice(rev.lease_id, run, "PREEMPT", str(self.clock()))
        self._stop_now(run, grace=float(rev.grace_seconds))

    def _notice(self, lease_id: str, run: Running, name: str, text: str) -> None:
        """Leave a notice in the job's checkpoint folder. The job owns that folder: a FIFO, a
        link or a directory in the notice's place is refused (logged, counted, and told to
        the tenant as a `failure` sample), never waited on or followed."""
        assert run.checkpoint_dir is not None
        try:
            write_notice(run.checkpoint_dir, name, text)
        except NoticeRefused as e:
            self.stats.notices_refused += 1
            log.warning("notice %s for lease %s refused: %s", name, lease_id, e)
            self._telemetry(run.pool_id, run.tenant, lease_id, "failure",
                            {"reason": e.code, "phase": "notice", "message": str(e)[:500]})
        except OSError as e:
            log.warning("notice %s for lease %s not written: %s", name, lease_id, e)

    def _stop_now(self, run: Running, grace: float) -> None:
        run.stopping = True
        self.stats.stops += 1

        def go() -> None:
            try:
                self.runtime.stop(run.handle, grace)
            except Exception:  # the watch loop reports the exit either way
                log.exception("stopping %s failed", run.handle.key)

        t = threading.Thread(target=go, name=f"stop-{run.handle.lease_id[:8]}", daemon=True)
        t.start()
        self._stopping.append(t)

    # -- watching -----------------------------------------------------------------------------

    def _follow(self, lid: str, run: Running) -> None:
        """A thread that learns of the job's exit and output as they happen (where the runtime
        can tell: `can_wait`) and reports them at once; the loop's round is the fallback."""
        self._ship(lid, run)
        if not self.runtime.can_wait:
            return
        wait = self.runtime.wait

        def follow() -> None:
            while True:
                try:
                    what = wait(run.handle, FOLLOW_SECONDS)
                except Exception:  # the loop's round still reports it
                    log.exception("following job %s failed", run.handle.key)
                    return
                if what == "output":
                    self.output.poke()
                    continue
                with self._lock:
                    if self.running.get(lid) is not run:
                        return  # reported, or replaced by a newer job of the lease
                    try:
                        if what == "exited":
                            self._look(lid, run)
                            return  # reported, or left to the loop's round to retry
                    except Exception as e:  # noqa: BLE001 - a closed link, at the agent's end
                        log.info("job %s: left to the loop's round: %r", run.handle.key, e)
                        return

        threading.Thread(target=follow, name=f"follow-{lid[:8]}", daemon=True).start()

    def watch(self) -> None:
        """Report every workload that has exited; keep checkpoint times current."""
        with self._lock:
            for lid, run in list(self.running.items()):
                self._look(lid, run)

    def _look(self, lid: str, run: Running) -> None:
        """Ship the job's new output; report its end if it has exited."""
        if run.checkpoint_dir is not None:
            run.last_checkpoint_at = latest_mtime(run.checkpoint_dir, run.last_checkpoint_at)
        code = self.runtime.poll(run.handle)
        if code is None:
            self.output.poke()
            return
        # every output sample goes out before the end is reported (a follower of the lease's
        # feed reads them in that order): the shipper reports it once the output is shipped
        if not run.output_shipped and self.output.finish(run.handle.key):
            return
        run.output_shipped, run.exit_code = True, code  # an attach's last frame (sessions)
        log.info("job %s of lease %s exited with %d%s", run.handle.job_number, lid, code,
                 " (stopped)" if run.stopping else "")
        if run.artifacts_stored is None:
            # before the end is reported, so a tenant who sees it ended finds them stored;
            # a failed or preempted job's too (partial results matter)
            run.artifacts_stored = self.files.store_artifacts(
                run.handle.key, run.tenant, lid, run.artifacts,
                ttl_seconds=run.artifact_ttl_seconds,
                max_bytes=run.max_artifact_bytes).attrs() if run.artifacts else {}
        kind = "execution" if code == 0 or run.stopping else "failure"
        self._telemetry(run.pool_id, run.tenant, lid, kind,
                        {"exit_code": code, "stopped": run.stopping,
                         "runtime_seconds": round(self.clock() - run.handle.started_at, 3),
                         **run.artifacts_stored})
        if self._report_end(lid, run.handle.epoch, exit_code=code):
            self.output.forget(run.handle.key)
            # its stored output (all shipped) and files, once no attach still reads them
            self.sessions.after_attaches(lid, lambda: self._let_go(run))
            del self.running[lid]

    def _let_go(self, run: Running) -> None:
        with self._lock:
            self.runtime.forget(run.handle)
            if run.has_workdir:
                self.files.remove(run.handle.key)

    def _ship(self, lid: str, run: Running) -> None:
        """Hand the job's output to the shipper: `output` telemetry its tenant may read
        (`pool lease logs`), at most `max_output_bytes` of it; once its job has exited and all
        of it is shipped, the end is reported from the shipper's thread."""
        if not self.runtime.can_read_output:
            run.output_shipped = True
            return
        read = self.runtime.read_output

        def send(text: str) -> None:
            self._telemetry(run.pool_id, run.tenant, lid, "output",
                            {"text": text, "job": run.handle.job_number})

        def shipped() -> None:
            run.output_shipped = True
            with self._lock:
                if self.running.get(lid) is run:
                    self._look(lid, run)  # a failed report: the loop's round retries

        self.output.follow(run.handle.key, Stream(
            read=lambda offset, limit: read(run.handle, offset, limit), send=send,
            cap_bytes=run.max_output_bytes, on_done=shipped))

    def _report_end(self, lease_id: str, epoch: int, *, exit_code: int | None = None,
                    failure: str | None = None) -> bool:
        """Tell the control plane the job is gone; True once the report needs no retry."""
        if failure is not None:
            body = encode(v1.JobFailed(epoch=epoch, reason=failure[:500]))
            verb = "failed"
        elif exit_code is None:
            body, verb = encode(v1.LeaseStopped(epoch=epoch)), "stopped"
        else:
            body, verb = encode(v1.JobExited(epoch=epoch, exit_code=exit_code)), "exited"
        try:
            r = self._call(f"lease.{lease_id}.{verb}", body)
        except BusError:
            return False
        self.stats.exits_reported += 1
        if (r.get("lease") or {}).get("state") in TERMINAL_STATES:
            self.checkpoints.ended(lease_id)  # it runs nowhere again: its folder may go
        if not r.get("ok"):
            code = r.get("error", {}).get("code")
            if code in ("write_conflict", "internal_error", "bus_unavailable"):
                return False
            log.info("report %s for %s refused: %s", verb, lease_id, r.get("error"))
        return True

    # -- heartbeats and telemetry ------------------------------------------------------------

    def heartbeat(self) -> dict[str, Any]:
        with self._lock:  # the jobs' followers report from their own threads
            return self._heartbeat()

    def _heartbeat(self) -> dict[str, Any]:
        self._seq += 1
        self._next_beat = next_beat(self._next_beat, self.clock(), self.heartbeat_interval)
        # every workload still present is listed, stopping ones too: an unlisted lease under
        # reconciliation is taken as gone, so listing one that still runs keeps it held
        beats = [v1.LeaseBeat(lease_id=lid, epoch=r.handle.epoch,
                              last_checkpoint_at=r.last_checkpoint_at)
                 for lid, r in self.running.items()]
        body = v1.NodeHeartbeat(node_id=self.node_id, seq=self._seq, leases=beats)
        r = self._call("heartbeat", encode(body))
        self.stats.heartbeats += 1
        if not r.get("ok"):
            if r.get("error", {}).get("code") == "unknown_node":
                self.register()
            return r
        result = r.get("result") or {}
        if result.get("register"):
            self.register()  # we were declared lost: come back with what we have
            return r
        for lid, verdict in (result.get("leases") or {}).items():
            run = self.running.get(lid)
            if run is not None and not verdict.get("live", True) and not run.stopping:
                self._stop_now(run, grace=2.0)
        if self._seq % self.utilization_every == 0:
            for lid, run in list(self.running.items()):
                u = self.runtime.usage(run.handle)
                self._telemetry(run.pool_id, run.tenant, lid, "utilization",
                                utilization=v1.Utilization(cpu_millis_used=u.cpu_millis_used,
                                                           memory_mib_used=u.memory_mib_used))
        return r

    def _telemetry(self, pool: str, tenant: str, lease: str, kind: str,
                   attrs: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
                   utilization: v1.Utilization | None = None) -> None:
        event = v1.TelemetryEvent(kind=kind, at=self.clock(), seq=self._seq,  # type: ignore[arg-type]
                                  utilization=utilization, attrs=attrs or {})
        self.link.publish(telemetry_subject(pool, self.node_id, tenant, lease, kind),
                          encode(event), headers)
