"""Work that finishes by itself, at the command service: a request's retry policy and
dependencies checked, and a held lease queued (or ended) when its timer fires."""

from __future__ import annotations

from typing import TYPE_CHECKING
from uuid import UUID

from domain.dependency import DEPENDENCY_FAILED, Dependency, verdict
from domain.lease import Lease
from domain.retry import RetryPolicy
from schemas import v1
from workers.application.core import Store
from workers.errors import UnknownDependency

if TYPE_CHECKING:
    from domain.pool import Pool


def retry_policy(pool: Pool, req: v1.LeaseRequest) -> RetryPolicy | None:
    """The request's retry policy, within the pool's max_attempts (AttemptLimitExceeded)."""
    if req.retries is None:
        return None
    pool.admit_attempts(req.retries.max_attempts)
    return RetryPolicy(max_attempts=req.retries.max_attempts, on=tuple(req.retries.on),
                       backoff_seconds=req.retries.backoff_seconds,
                       backoff_max_seconds=req.retries.backoff_max_seconds)


class WorkflowService:
    """A request's dependencies checked against the tenant's leases, and a held lease moved on
    when its timer fires."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def dependencies(self, tenant: str, req: v1.LeaseRequest) -> tuple[Dependency, ...]:
        """The leases the request waits for, each an existing lease of `tenant` (else
        UnknownDependency: another tenant's lease reads as unknown). A lease can name only leases
        made before it, so no cycle can form."""
        return tuple(dict.fromkeys(
            Dependency(str(self._own_lease(tenant, ref.lease_id, "after").id), ref.condition)
            for ref in req.after))

    def each_dependency(self, tenant: str, req: v1.LeaseRequest,
                        size: int) -> tuple[Dependency, ...] | None:
        """`after_each`: for each of the request's `size` leases, the lease of the same index in
        the array `req.after_each` names by its first lease; that array must be the tenant's and
        of the same size (else UnknownDependency). An array is saved whole, so its first and last
        leases, and none past them, say it is there."""
        ref = req.after_each
        if ref is None:
            return None
        lead = self._own_lease(tenant, ref.lease_id, "after_each")
        key = lead.idempotency_key
        ids = [str(lead.id), *(str(Lease.create_id(tenant, f"{key}#{i}")) for i in range(1, size))]
        if ("#" in key or self.store.find(Lease, UUID(ids[-1])) is None
                or self.store.find(Lease, Lease.create_id(tenant, f"{key}#{size}")) is not None):
            raise UnknownDependency(
                f"after_each: lease {ref.lease_id!r} is not the first of an array of {size} "
                f"leases of tenant {tenant!r}", reasons={"after_each": ref.lease_id})
        return tuple(Dependency(i, ref.condition) for i in ids)

    def _own_lease(self, tenant: str, lease_id: str, field: str) -> Lease:
        try:
            oid = UUID(lease_id)
        except ValueError:
            oid = None
        found = None if oid is None else self.store.find(Lease, oid)
        if not isinstance(found, Lease) or found.tenant_id != tenant:
            raise UnknownDependency(f"{field}: no lease {lease_id!r} of tenant {tenant!r}",
                                    reasons={field: lease_id})
        return found

    def resolve_held(self, lease: Lease, now: float) -> str | None:
        """A held lease's timer fired: past its retry backoff it queues; waiting for leases, it
        queues once they all ended as asked, ends `dependency_failed` once one never will, and
        waits on otherwise (None: nothing was done)."""
        if lease.held_until is not None:
            if now < lease.held_until:
                return None
            lease.queue_held(now)
            self.store.save(lease)
            return "queued"
        ends: list[tuple[Dependency, str | None]] = []
        for dep in lease.dependencies:
            other = self.store.find(Lease, UUID(dep.lease_id))
            ended = other is None or other.is_terminal
            reason = None if not ended else (DEPENDENCY_FAILED if other is None
                                             else other.end_reason or str(other.state))
            ends.append((dep, reason))
        got, which = verdict(ends)
        if got == "waiting":
            return None
        if got == "failed":
            lease.reject(now, DEPENDENCY_FAILED, [f"after:{which}"])
        else:
            lease.queue_held(now)
        self.store.save(lease)
        return DEPENDENCY_FAILED if got == "failed" else "queued"
