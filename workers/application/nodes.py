"""The node service: registration, enrollment, state, heartbeats, the jobs a node reports, and
the node's liveness timer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from uuid import UUID

from eventsourcing.domain import Aggregate

from domain.enrollment import Enrollment
from domain.errors import DomainError, NodeClaimRefused
from domain.gang import GANG_MEMBER_LOST
from domain.lease import WORKLOAD_STATES, Lease, LeaseState
from domain.node import Node, NodeState
from domain.resources import NodeCapabilities, NodeId, PoolId
from schemas import v1
from workers.application.accounts import AccountService
from workers.application.core import Store, retried
from workers.application.gangs import GangService
from workers.errors import UnknownLease, UnknownNode

# a heartbeat listing more leases than this is answered on a thread: reading and copying
# that many on the bus's loop would hold up every other reply
BEAT_READS_ON_LOOP = 64


class NodeService:
    """Node registration, enrollment, state, heartbeats and the jobs they report."""

    def __init__(self, store: Store, clock: Callable[[], float], *, gangs: GangService,
                 accounts: AccountService) -> None:
        self.store = store
        self.clock = clock
        self.gangs = gangs
        self.accounts = accounts

    @retried
    def register_node(self, reg: v1.NodeRegistration, *,
                      capabilities: NodeCapabilities | None = None) -> Node:
        now = self.clock()
        self.store.pool(reg.pool_id)
        caps = capabilities or reg.capabilities.to_domain()
        node = self.store.find(Node, Node.create_id(reg.node_id))
        if node is None:
            node = Node.register(
                node_id=NodeId(reg.node_id), pool_id=PoolId(reg.pool_id),
                capabilities=caps, now=now,
            )
        elif node.capabilities != caps or node.state is NodeState.LOST:
            node.reregister(caps, now)  # a lost node comes back ready
        self.store.save(node)
        return node

    @retried
    def node_offline(self, node_id: str, reason: str = "agent_stopped") -> Node:
        """The node's agent stopped cleanly: with nothing allocated on it, the node is lost at
        once (no placements) instead of after the node timeout; its next registration brings
        it back. A node still holding leases is left as it is: their workloads may still run,
        and the agent re-adopts them when it starts again."""
        node = self.store.find(Node, Node.create_id(node_id))
        if node is None:
            raise UnknownNode(f"no node {node_id!r}")
        if not node.allocations and node.state is not NodeState.LOST:
            node.mark_lost(self.clock(), reason)
            self.store.save(node)
        return node

    @retried
    def node_state(self, node_id: str, verb: str, reason: str = "") -> Node:
        now = self.clock()
        node = self.store.find(Node, Node.create_id(node_id))
        if node is None:
            raise UnknownNode(f"no node {node_id!r}")
        actions: dict[str, Callable[[], None]] = {
            "cordon": lambda: node.cordon(now, reason),
            "drain": lambda: node.drain(now, reason),
            "maintenance": lambda: node.enter_maintenance(now, reason),
            "uncordon": lambda: node.uncordon(now),
            "end-maintenance": lambda: node.end_maintenance(now),
            "lost": lambda: node.mark_lost(now, reason or "declared_lost"),
        }
        actions[verb]()
        leases = self._drain_leases(node, now, reason) if verb == "drain" else []
        self.store.save(node, *leases)
        return node

    def _drain_leases(self, node: Node, now: float, reason: str) -> list[Lease]:
        """A drain winds the node down: each running lease gets a preemption notice with the
        pool's grace (its deadline) and goes back in the queue to run elsewhere; the agent
        stops it and the capacity is freed on its confirmation. A lease that may not be
        preempted is left to finish."""
        grace = self.store.pool(node.pool_id).config.preemption.grace_seconds
        out: list[Lease] = []
        for lid in node.allocations:
            lease = self.store.find(Lease, UUID(lid))
            if lease is None or lease.state is not LeaseState.RUNNING:
                continue
            try:
                lease.notice_preemption(now, grace_seconds=grace, requeue=True,
                                        reason=f"drain:{reason}" if reason else "drain")
            except DomainError:
                continue
            out.append(lease)
        # a gang member's peers on other nodes go with it, with the same grace
        return out + self.gangs.peers_noticed(out, now, grace, requeue=True,
                                              reason=f"drain:{reason}" if reason else "drain")

    def _node_lease(self, node_id: str, lease_id: str) -> Lease:
        # an agent speaks only for leases placed on its own node
        return self.store.lease_if(lease_id, lambda lease: lease.node_id == node_id,
                              f"on node {node_id!r}")

    def lease_on_node(self, node_id: str, lease_id: str) -> Lease:
        """The lease as the agent on `node_id` may read it: lease_not_found unless it is
        placed there."""
        return self._node_lease(node_id, lease_id)

    @retried
    def confirm_stopped(self, node_id: str, lease_id: str, body: v1.LeaseStopped) -> Lease:
        """The agent on `node_id` confirms the lease's workload is gone.

        preempting → preempted (or queued again), stopping → cancelled, expired|reconciling →
        released. Only now is the capacity returned: the node is freed and the hold settled in
        the same save, so the log never shows a freed node for a workload still running."""
        now = self.clock()
        lease = self._node_lease(node_id, lease_id)
        lease.confirm_stopped(now, epoch=body.epoch)
        others = [] if lease.holds_capacity else self.accounts.settle(lease, now, node_id)
        self.store.save(lease, *others)
        return lease

    def register_own_node(self, node_id: str, reg: v1.NodeRegistration) -> Node:
        """An agent (re)registers; it may speak only for the node its subject names, within
        its enrollment, and with the enrollment's trust level, never its own."""
        if reg.node_id != node_id:
            raise UnknownNode(f"agent of node {node_id!r} cannot register {reg.node_id!r}")
        enrollment = self.store.find(Enrollment, Enrollment.create_id(node_id))
        if enrollment is None:
            raise NodeClaimRefused(f"node {node_id!r} is not enrolled: the operator enrolls it "
                                   "(`pool admin node creds NODE --pool POOL …`)",
                                   reasons=("not_enrolled",))
        caps = enrollment.admit(reg.pool_id, reg.capabilities.to_domain())
        return self.register_node(reg, capabilities=caps)

    @retried
    def enroll_node(self, cmd: v1.NodeEnrollment) -> Enrollment:
        """The operator's terms for a node, recorded before its agent may register."""
        now = self.clock()
        self.store.pool(cmd.pool_id)
        terms: dict[str, Any] = {
            "pool_id": PoolId(cmd.pool_id), "trust_level": cmd.trust_level,
            "max_gpus": cmd.max_gpus, "max_cpu_millis": cmd.max_cpu_millis,
            "max_memory_mib": cmd.max_memory_mib, "gpu_model": cmd.gpu_model, "now": now}
        got = self.store.find(Enrollment, Enrollment.create_id(cmd.node_id))
        if got is None:
            got = Enrollment.enroll(node_id=NodeId(cmd.node_id), **terms)
        elif not got.change(**terms):
            return got
        self.store.save(got)
        return got

    def node_heartbeat(self, node_id: str, hb: v1.NodeHeartbeat) -> dict[str, Any]:
        """The node and every lease it runs are alive. The leases' heartbeats are ONE atomic
        save; the node's own heartbeat is a second one, so the scheduler allocating on a busy
        node (a write to the node) never makes the leases' heartbeats fail. Returns, per lease,
        whether it is still live here, so the agent stops what must not run."""
        node = self.store.find(Node, Node.create_id(node_id))
        if node is None or hb.node_id != node_id:
            raise UnknownNode(f"no node {node_id!r}; register first")
        if node.state is NodeState.LOST:
            return {"node_state": str(node.state), "register": True, "leases": {}}

        def beat_leases() -> dict[str, dict[str, Any]]:
            now = self.clock()
            changed: list[Aggregate] = []
            out = {b.lease_id: self._beat(node_id, b, now, changed) for b in hb.leases}
            if changed:
                self.store.save(*changed)
            return out

        # the node as just read: each step's first try uses it, and a try that a concurrent
        # write refused reads it again (a read of a cached node is a round trip to the log)
        known: list[Node] = [node]

        def beat_node() -> Node:
            fresh = known.pop() if known else self.store.find(Node, Node.create_id(node_id))
            assert fresh is not None
            pool = self.store.pool_settings(fresh.pool_id)
            timeout = pool.config.node_timeout_seconds
            if fresh.state is not NodeState.LOST and fresh.heartbeat_is_news(self.clock(),
                                                                            timeout):
                fresh.heartbeat(self.clock())
                self.store.save(fresh)
            return fresh

        leases = self.store.retrying(beat_leases) if hb.leases else {}
        node = self.store.retrying(beat_node)
        if node.state is NodeState.LOST:
            return {"node_state": str(node.state), "register": True, "leases": leases}
        if any(lid not in leases for lid in node.allocations):
            # only then can a lease under reconciliation be one the agent no longer runs
            known.append(node)
            leases.update(self.store.retrying(lambda: self._reconcile_unlisted(
                node_id, set(leases), known.pop() if known else None)))
        return {"node_state": str(node.state), "leases": leases}

    async def node_heartbeat_async(self, node_id: str,
                                   hb: v1.NodeHeartbeat) -> dict[str, Any] | None:
        """`node_heartbeat` on the bus's loop, its node and leases read by awaiting the log;
        None when it needs what only a thread can do (a node or lease not cached, a policy not
        cached, a refused save): the caller then runs `node_heartbeat` on a thread. Running it
        again after some of its saves landed is safe: a heartbeat already recorded is no news."""
        if len(hb.leases) > BEAT_READS_ON_LOOP:
            return None
        ids = [Node.create_id(node_id)]
        for beat in hb.leases:
            try:
                ids.append(UUID(beat.lease_id))
            except ValueError:
                return None
        return await self.store.on_loop(lambda: self.node_heartbeat(node_id, hb), reads=ids,
                                  runs=4, saves=3)

    def _reconcile_unlisted(self, node_id: str, listed: set[str],
                            node: Node | None = None) -> dict[str, dict[str, Any]]:
        """A lease being reconciled that the agent no longer runs is confirmed stopped: the
        heartbeat lists every workload the agent has, adopted and stopping ones included.
        `node`: the node as the heartbeat just read or saved it (else it is read)."""
        now = self.clock()
        if node is None:
            node = self.store.find(Node, Node.create_id(node_id))
        if node is None:
            return {}
        cache: dict[UUID, Aggregate] = {node.id: node}
        changed: list[Aggregate] = []
        out: dict[str, dict[str, Any]] = {}
        unlisted = [UUID(lid) for lid in node.allocations if lid not in listed]
        last = self.store.last_topics(unlisted) if unlisted else None
        if last is not None:
            # a lease whose last event is its reservation awaits its commit, no agent runs
            # it: passed over without loading it (a node may hold many such)
            unlisted = [u for u in unlisted if not (last[u] or "").endswith(".LeaseReserved")]
        for uid in unlisted:
            lid = str(uid)
            lease = self.store.find(Lease, uid)
            if lease is not None and lease.state in (LeaseState.EXPIRED, LeaseState.RECONCILING):
                lease.confirm_stopped(now)
                changed += [lease, *self.accounts.settle(lease, now, node_id, cache)]
                out[lid] = {"live": False, "state": str(lease.state), "code": "reconciled"}
        if changed:
            self.store.save(*list({a.id: a for a in changed}.values()))
        return out

    def _beat(self, node_id: str, beat: v1.LeaseBeat, now: float,
              changed: list[Aggregate]) -> dict[str, Any]:
        try:
            lease = self._node_lease(node_id, beat.lease_id)
        except UnknownLease:
            return {"live": False, "code": "lease_not_found"}
        if lease.epoch != beat.epoch or lease.state not in WORKLOAD_STATES:
            # an older placement, or a lease that ended or expired: fenced, the work must stop
            return {"live": False, "state": str(lease.state), "epoch": lease.epoch,
                    "code": "stale_epoch" if lease.epoch != beat.epoch else "lease_not_live"}
        if not lease.heartbeat_is_news(now, beat.last_checkpoint_at):
            return {"live": True, "state": str(lease.state), "deadline": lease.deadline}
        try:
            lease.heartbeat(now, epoch=beat.epoch, checkpoint_at=beat.last_checkpoint_at)
        except DomainError as e:
            return {"live": False, "state": str(lease.state), "code": e.code}
        changed.append(lease)
        return {"live": True, "state": str(lease.state), "deadline": lease.deadline}

    @retried
    def job_started(self, node_id: str, lease_id: str, body: v1.JobStarted) -> Lease:
        lease = self._node_lease(node_id, lease_id)
        lease.job_started(self.clock(), epoch=body.epoch)
        self.store.save(lease)
        return lease

    @retried
    def job_ended(self, node_id: str, lease_id: str, *, epoch: int,
                  exit_code: int | None = None, failure: str | None = None) -> Lease:
        """The job's process is gone. A running lease is released with its exit code; a lease
        on its way out (stopping, preempting, expired, reconciling) is confirmed stopped. Node
        freed and hold settled in the same save."""
        now = self.clock()
        lease = self._node_lease(node_id, lease_id)
        if (lease.job is not None and lease.job.is_active
                and lease.state in WORKLOAD_STATES):
            if failure is not None:
                lease.job_failed(now, epoch=epoch, reason=failure)
            else:
                assert exit_code is not None
                lease.job_exited(now, epoch=epoch, exit_code=exit_code)
        if lease.state is LeaseState.RUNNING:
            lease.release(now, exit_code, epoch=epoch)
        else:
            lease.confirm_stopped(now, epoch=epoch)
        others = [] if lease.holds_capacity else self.accounts.settle(lease, now, node_id)
        self.store.save(lease, *others)
        return lease

    def node_next_due(self, node_id: str) -> float | None:
        """When the node's liveness timer should next fire: its heartbeat going stale, or,
        once lost, the release of its leases."""
        node = self.store.find(Node, Node.create_id(node_id))
        if node is None:
            return None
        cfg = self.store.pool(node.pool_id).config
        if node.state is NodeState.LOST:
            due = None if not node.allocations or node.lost_at is None else (
                node.lost_at + cfg.lost_node_release_seconds)
        else:
            due = node.last_heartbeat_at + cfg.node_timeout_seconds
        # a deadline already past was just handled: nothing to fire again until a new event
        return due if due is not None and due > self.clock() else None

    @retried
    def node_due(self, node_id: str) -> list[str]:
        """A node's liveness timer fired: a node silent past the pool's node timeout is lost and
        its leases expire into reconciliation; once lost past `lost_node_release_seconds`, its
        reconciling leases are released without the agent's word. Returns what changed."""
        now = self.clock()
        node = self.store.find(Node, Node.create_id(node_id))
        if node is None:
            return []
        cfg = self.store.pool(node.pool_id).config
        done: list[str] = []
        changed: list[Aggregate] = []
        if node.state is not NodeState.LOST:
            if not node.heartbeat_stale(now, cfg.node_timeout_seconds):
                return []
            node.mark_lost(now, "heartbeat_lost")
            changed.append(node)
            done.append("node_lost")
            for lid in list(node.allocations):
                lease = self.store.find(Lease, UUID(lid))
                if lease is not None and lease.state in WORKLOAD_STATES:
                    lease.expire(now, "node_lost")
                    lease.begin_reconciliation(now)
                    changed.append(lease)
                    done.append(f"reconciling:{lid}")
                elif lease is not None and lease.state is LeaseState.EXPIRED:
                    lease.begin_reconciliation(now)
                    changed.append(lease)
            lost = [a for a in changed if isinstance(a, Lease)]
            for member in self.gangs.peers_noticed(lost, now, cfg.preemption.grace_seconds):
                changed.append(member)
                done.append(f"{GANG_MEMBER_LOST}:{member.id}")
        elif now - (node.lost_at or now) >= cfg.lost_node_release_seconds:
            cache: dict[UUID, Aggregate] = {node.id: node}
            for lid in list(node.allocations):
                lease = self.store.find(Lease, UUID(lid))
                if lease is None or lease.state not in (LeaseState.RECONCILING,
                                                        LeaseState.EXPIRED):
                    continue
                lease.confirm_stopped(now)
                changed += [lease, *self.accounts.settle(lease, now, node_id, cache)]
                done.append(f"released:{lid}")
        if changed:
            self.store.save(*list({a.id: a for a in changed}.values()))
        return done
