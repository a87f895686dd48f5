"""The account service: credits granted to a tenant, and the hold of a lease that no longer
needs its capacity settled (its node freed in the same save)."""

from __future__ import annotations

from collections.abc import Callable
from uuid import UUID

from eventsourcing.domain import Aggregate

from domain.account import Account
from domain.lease import Lease
from domain.node import Node
from domain.resources import LeaseId
from domain.transfer import CreditTransfer
from workers.application.core import A, Store, retried
from workers.errors import UnknownTenant


class AccountService:
    """Grants credits, and settles what a lease used against its tenant's hold."""

    def __init__(self, store: Store, clock: Callable[[], float]) -> None:
        self.store = store
        self.clock = clock

    @retried
    def grant(self, tenant: str, amount: int, transfer_id: str, reason: str = "", *,
              known_only: bool = False) -> Account:
        """Add credits; with `known_only` (the admin subject), only to a tenant set in a pool
        (whose account tenant.set opened), so a misspelt name is refused, not credited."""
        now = self.clock()
        store = self.store
        if known_only and store.find(Account, Account.create_id(tenant)) is None:
            raise UnknownTenant(f"no tenant {tenant!r} in any pool: set it first "
                                f"(pool admin tenant set {tenant} --pool POOL)")
        # the transfer id is claimed across accounts: another tenant or amount is a conflict
        claim = store.find(CreditTransfer, CreditTransfer.create_id(transfer_id))
        if claim is not None:
            claim.check(tenant, amount)
        acc = store.account(tenant, now)
        if acc.grant(transfer_id, amount, now, reason) and claim is None:
            store.save(acc, CreditTransfer.claim(transfer_id=transfer_id, tenant_id=tenant,
                                                 amount=amount, now=now))
        else:
            store.save(acc)
        return acc

    def settle(self, lease: Lease, now: float, node_id: str | None = None,
               cache: dict[UUID, Aggregate] | None = None) -> list[Aggregate]:
        """Free the node and settle the hold for a lease that no longer needs its capacity;
        the changed aggregates, for the caller's one save.

        `node_id` names the node it held when the lease no longer does (a preempted lease
        that was requeued has already forgotten its placement). With `cache`, aggregates
        loaded once are reused, so settling several leases touches one node / account object."""
        out: list[Aggregate] = []
        cache = {} if cache is None else cache

        def find(cls: type[A], uid: UUID) -> A | None:
            if uid not in cache:
                found = self.store.find(cls, uid)
                if found is None:
                    return None
                cache[uid] = found
            got = cache[uid]
            return got if isinstance(got, cls) else None

        where = lease.node_id if node_id is None else node_id
        if where is not None:
            node = find(Node, Node.create_id(where))
            if node is not None and node.free(LeaseId(str(lease.id)), now):
                out.append(node)
        acc = find(Account, Account.create_id(lease.tenant_id))
        lid = LeaseId(str(lease.id))
        if acc is not None and acc.has_hold(lid):
            pool = self.store.pool_settings(lease.pool_id)
            node_model = None
            if where is not None:
                node = next((a for a in out if isinstance(a, Node)), None) or self.store.find(
                    Node, Node.create_id(where)
                )
                node_model = node.capabilities.gpu_model if node is not None else None
            seconds = lease.runtime_seconds(now)
            charge = pool.charge_for(lease.shape, seconds, gpu_model=node_model) if seconds else 0
            acc.settle(f"settle-{lease.id}-{lease.epoch}", lid, charge, now)
            out.append(acc)
        return out
