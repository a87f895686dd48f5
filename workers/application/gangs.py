"""The gang service: a verb on one member (commit, heartbeat, renew, cancel) applies to every
member in one save, and a member lost or drained takes its gang along."""

from __future__ import annotations

from dataclasses import replace
from uuid import UUID

from domain.errors import DomainError
from domain.gang import GANG_MEMBER_LOST, GangMembership, job_env, with_members
from domain.jobspec import JobSpec
from domain.lease import Lease, LeaseState
from workers.application.core import Store


class GangService:
    """Loads a gang's members for the lease verbs and the node reports; decides for a lost or
    drained member's peers."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def with_gang(self, lease: Lease, *states: LeaseState) -> list[Lease]:
        """`lease`, and when it is a gang member every other member (loaded) in one of
        `states` (any, when none is named), in member order; the verb asked of `lease` decides
        for it alone whether its state allows it."""
        gang = lease.gang
        if gang is None:
            return [lease]
        out: list[Lease] = []
        for uid in gang.member_ids(lease.tenant_id):
            if uid == lease.id:
                out.append(lease)
            elif (member := self.store.find(Lease, uid)) is not None and (
                    not states or member.state in states):
                out.append(member)
        return out

    def members(self, lease: Lease) -> list[Lease]:
        """Every member of `lease`'s gang (just `lease` when it is none)."""
        return self.with_gang(lease)

    def _others_of(self, leases: list[Lease]) -> list[Lease]:
        """The members of the gangs of `leases` that are not among them, loaded."""
        known = {str(lease.id): lease for lease in leases}
        out: list[Lease] = []
        for lid in with_members(known, lambda uid: known.get(str(uid))):
            if lid not in known and (member := self.store.find(Lease, UUID(lid))) is not None:
                out.append(member)
        return out

    def peers_noticed(self, leases: list[Lease], now: float, grace_seconds: int, *,
                            reason: str = GANG_MEMBER_LOST, requeue: bool | None = None
                            ) -> list[Lease]:
        """The running members, on other nodes, of the gangs of `leases` (lost with their
        node, or drained) get one preemption notice with one grace: back in line together
        when the gang asked to be requeued (or `requeue` says so, as a drain does), else
        ended. A member lost with its node follows once its node is settled."""
        out: list[Lease] = []
        for member in self._others_of(leases):
            if member.state is not LeaseState.RUNNING:
                continue
            try:
                member.notice_preemption(
                    now, grace_seconds=grace_seconds, reason=reason,
                    requeue=member.requeue_when_preempted if requeue is None else requeue)
            except DomainError:
                continue
            out.append(member)
        return out


def member_job(member: Lease, spec: JobSpec | None, nodes: list[str]) -> JobSpec | None:
    """A gang member's job: the commit's job with the member's rank, the gang's size and id
    and every member's node in its environment."""
    gang: GangMembership | None = member.gang
    if spec is None or gang is None:
        return spec
    env = dict(spec.env)
    env.update(job_env(gang, nodes))
    return replace(spec, env=tuple(env.items()))
