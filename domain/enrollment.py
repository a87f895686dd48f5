"""A node's enrollment by the operator: its pool, trust level and the most it may claim.
Why the trust level is the enrollment's, never the agent's: docs/security.md.
"""

from __future__ import annotations

import dataclasses
import uuid
from uuid import UUID

from eventsourcing.domain import Aggregate, event

from domain.devices import physical_gpus
from domain.errors import InvalidAmount, NodeClaimRefused
from domain.resources import NodeCapabilities, NodeId, PoolId

_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:computepool:enrollment")
TRUST_LEVELS = ("trusted", "marketplace")


class Enrollment(Aggregate):
    """What the operator allows one node to be; `admit` turns an agent's claim into capabilities."""

    @staticmethod
    def create_id(node_id: str) -> UUID:
        return uuid.uuid5(_NAMESPACE, str(node_id))

    @classmethod
    def enroll(cls, *, node_id: NodeId, pool_id: PoolId, trust_level: str, max_gpus: int,
               max_cpu_millis: int | None, max_memory_mib: int | None, gpu_model: str | None,
               now: float) -> Enrollment:
        _check(trust_level, max_gpus, max_cpu_millis, max_memory_mib)
        return cls(node_id=str(node_id), pool_id=str(pool_id), trust_level=trust_level,
                   max_gpus=max_gpus, max_cpu_millis=max_cpu_millis,
                   max_memory_mib=max_memory_mib, gpu_model=gpu_model, at=float(now))

    @event("NodeEnrolled")
    def __init__(self, node_id: str, pool_id: str, trust_level: str, max_gpus: int,
                 max_cpu_millis: int | None, max_memory_mib: int | None,
                 gpu_model: str | None, at: float) -> None:
        self.node_id = NodeId(node_id)
        self._set(pool_id, trust_level, max_gpus, max_cpu_millis, max_memory_mib, gpu_model)

    def change(self, *, pool_id: PoolId, trust_level: str, max_gpus: int,
               max_cpu_millis: int | None, max_memory_mib: int | None, gpu_model: str | None,
               now: float) -> bool:
        """Enroll again with new terms; False (nothing recorded) when they are the same."""
        _check(trust_level, max_gpus, max_cpu_millis, max_memory_mib)
        terms = (pool_id, trust_level, max_gpus, max_cpu_millis, max_memory_mib, gpu_model)
        if terms == (self.pool_id, self.trust_level, self.max_gpus, self.max_cpu_millis,
                     self.max_memory_mib, self.gpu_model):
            return False
        self._changed(pool_id=str(pool_id), trust_level=trust_level, max_gpus=max_gpus,
                      max_cpu_millis=max_cpu_millis, max_memory_mib=max_memory_mib,
                      gpu_model=gpu_model, at=float(now))
        return True

    @event("EnrollmentChanged")
    def _changed(self, pool_id: str, trust_level: str, max_gpus: int,
                 max_cpu_millis: int | None, max_memory_mib: int | None,
                 gpu_model: str | None, at: float) -> None:
        self._set(pool_id, trust_level, max_gpus, max_cpu_millis, max_memory_mib, gpu_model)

    def _set(self, pool_id: str, trust_level: str, max_gpus: int, max_cpu_millis: int | None,
             max_memory_mib: int | None, gpu_model: str | None) -> None:
        self.pool_id = PoolId(pool_id)
        self.trust_level = trust_level
        self.max_gpus = max_gpus
        self.max_cpu_millis = max_cpu_millis
        self.max_memory_mib = max_memory_mib
        self.gpu_model = gpu_model

    def admit(self, pool_id: str, claim: NodeCapabilities) -> NodeCapabilities:
        """The capabilities to record for an agent's claim: refused (NodeClaimRefused, one reason
        per dimension outside the enrollment) or returned with the enrollment's trust level."""
        reasons: list[str] = []
        if pool_id != self.pool_id:
            reasons.append("pool")
        have = claim.allocatable
        if self.max_cpu_millis is not None and have.cpu_millis > self.max_cpu_millis:
            reasons.append("cpu_millis")
        if self.max_memory_mib is not None and have.memory_mib > self.max_memory_mib:
            reasons.append("memory_mib")
        # whole GPUs (partitions of them are counted per profile, not checked here)
        gpus = have.gpu_count
        # a MIG instance or time-slice replica is part of a GPU, not one more
        if gpus > self.max_gpus or physical_gpus(claim.devices) > self.max_gpus:
            reasons.append("gpu_count")
        if self.gpu_model is not None and gpus and claim.gpu_model != self.gpu_model:
            reasons.append("gpu_model")
        if reasons:
            raise NodeClaimRefused(
                f"node {self.node_id!r} claims more than its enrollment allows "
                f"({', '.join(reasons)})", reasons=reasons)
        return dataclasses.replace(claim, trust_level=self.trust_level)


def _check(trust_level: str, max_gpus: int, max_cpu_millis: int | None,
           max_memory_mib: int | None) -> None:
    if trust_level not in TRUST_LEVELS:
        raise InvalidAmount(f"trust level must be one of {', '.join(TRUST_LEVELS)}")
    for name, value in (("max_gpus", max_gpus), ("max_cpu_millis", max_cpu_millis),
                        ("max_memory_mib", max_memory_mib)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise InvalidAmount(f"{name} must be a non-negative integer")
