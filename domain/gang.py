"""A gang lease: N member leases placed, committed, renewed, preempted and requeued together.
Each member is an ordinary Lease that carries its GangMembership; the lead is member 0.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from domain.policy.gang import GangSpec

# a gang's placement is one atomic save of lease + node + account events per member, under
# JetStream's 1000-message batch limit with room for the rest of a scheduler's batch
MAX_GANG_MEMBERS = 256
# why a gang member was noticed: a peer of it was lost (its node, or its heartbeats)
GANG_MEMBER_LOST = "gang_member_lost"

_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:computepool:lease")


def member_key(lead_key: str, member: int) -> str:
    """The idempotency key of member `member`: the lead's own key, then `<key>#<i>` (client
    keys never contain `#`, so these can never be a client's own key)."""
    return lead_key if member == 0 else f"{lead_key}#{member}"


def member_lease_id(tenant_id: str, lead_key: str, member: int) -> UUID:
    """The lease id of a member, as `Lease.create_id` derives it from the member's key."""
    return uuid.uuid5(_NAMESPACE, json.dumps([str(tenant_id), member_key(lead_key, member)]))


@dataclass(frozen=True)
class GangMembership:
    """Which gang a lease belongs to (the lead's lease id), its index, the gang's size and
    constraint, and the lead's idempotency key (from which every member's id follows)."""

    gang_id: str
    member: int
    size: int
    lead_key: str
    strategy: str = "PACK"
    same: str | None = None
    spread: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.size <= MAX_GANG_MEMBERS:
            raise ValueError(f"a gang has 1 to {MAX_GANG_MEMBERS} members, not {self.size}")
        if not 0 <= self.member < self.size:
            raise ValueError(f"member {self.member} of a gang of {self.size}")
        self.spec()  # the constraint is one the placement policy knows

    @property
    def is_lead(self) -> bool:
        return self.member == 0

    def spec(self) -> GangSpec:
        """The placement policy's view of the gang's size and constraint."""
        return GangSpec.build(self.size, same=self.same, spread=self.spread,
                              strategy=self.strategy)

    def member_ids(self, tenant_id: str) -> list[UUID]:
        """Every member's lease id, the lead first."""
        return [member_lease_id(tenant_id, self.lead_key, i) for i in range(self.size)]

    def to_dict(self) -> dict[str, Any]:
        return {"gang_id": self.gang_id, "member": self.member, "size": self.size,
                "lead_key": self.lead_key, "strategy": self.strategy, "same": self.same,
                "spread": self.spread}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GangMembership:
        return cls(gang_id=str(d["gang_id"]), member=int(d["member"]), size=int(d["size"]),
                   lead_key=str(d["lead_key"]), strategy=str(d.get("strategy") or "PACK"),
                   same=d.get("same"), spread=d.get("spread"))

    @classmethod
    def members(cls, tenant_id: str, lead_key: str, spec: GangSpec) -> list[GangMembership]:
        """The memberships of a new gang of `spec.members`, the lead first."""
        gang_id = str(member_lease_id(tenant_id, lead_key, 0))
        return [cls(gang_id=gang_id, member=i, size=spec.members, lead_key=lead_key,
                    strategy=spec.strategy, same=spec.same, spread=spec.spread)
                for i in range(spec.members)]


def job_env(membership: GangMembership, nodes: Iterable[str]) -> dict[str, str]:
    """What a member's job is told of its gang: its rank, the gang's size and id, and the
    nodes of every member in rank order (so rank 0 can be the rendezvous)."""
    return {"POOL_GANG_ID": membership.gang_id, "POOL_GANG_RANK": str(membership.member),
            "POOL_GANG_SIZE": str(membership.size), "POOL_GANG_NODES": ",".join(nodes)}


def with_members(lease_ids: Iterable[str], find: Callable[[UUID], Any]) -> list[str]:
    """`lease_ids` and, for each gang member among them, every other member of its gang
    (each once, in order): what a preemption or a drain of one member must take along."""
    out = dict.fromkeys(lease_ids)
    for lid in list(out):
        lease = find(UUID(lid))
        gang = getattr(lease, "gang", None)
        if isinstance(gang, GangMembership):
            for uid in gang.member_ids(str(lease.tenant_id)):
                out.setdefault(str(uid))
    return list(out)
