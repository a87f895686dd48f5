"""The decision layer: aggregates, value objects and errors; no I/O, no clock, no brokers.

Import from here: `from domain import Lease, Node, Account, Pool, TenantPolicy, Shape, ...`.
Names are loaded on first use, so importing one light module (domain.resources for a wire
type) does not load the aggregates, eventsourcing and numpy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from domain.account import Account
    from domain.errors import (
        AlreadyAllocated,
        DomainError,
        IllegalTransition,
        InsufficientCredits,
        InvalidAmount,
        InvalidConfiguration,
        LeaseExpired,
        NodeNotEmpty,
        NodeNotSchedulable,
        NotDue,
        OverAllocation,
        PriceNotListed,
        QuotaExceeded,
        RuntimeLimitExceeded,
        StaleEpoch,
        UnknownAllocation,
        UnknownHold,
        UnknownPriorityClass,
    )
    from domain.jobspec import JobSpec
    from domain.lease import (
        CAPACITY_HOLDING_STATES,
        EXPIRY_REASONS,
        TERMINAL_STATES,
        Job,
        JobState,
        Lease,
        LeaseState,
    )
    from domain.node import Node, NodeState
    from domain.pool import Pool, TenantPolicy
    from domain.poolconfig import PoolConfig, PreemptionSettings
    from domain.prices import PriceList
    from domain.resources import (
        ZERO,
        LeaseId,
        NodeCapabilities,
        NodeId,
        PoolId,
        Resources,
        Shape,
        TenantId,
    )

# each public name and the module it comes from (a submodule stands for itself)
_HOMES: dict[str, str] = {
    "Account": "domain.account",
    "AlreadyAllocated": "domain.errors",
    "CAPACITY_HOLDING_STATES": "domain.lease",
    "DomainError": "domain.errors",
    "EXPIRY_REASONS": "domain.lease",
    "IllegalTransition": "domain.errors",
    "InsufficientCredits": "domain.errors",
    "InvalidAmount": "domain.errors",
    "InvalidConfiguration": "domain.errors",
    "Job": "domain.lease",
    "JobSpec": "domain.jobspec",
    "JobState": "domain.lease",
    "Lease": "domain.lease",
    "LeaseExpired": "domain.errors",
    "LeaseId": "domain.resources",
    "LeaseState": "domain.lease",
    "Node": "domain.node",
    "NodeCapabilities": "domain.resources",
    "NodeId": "domain.resources",
    "NodeNotEmpty": "domain.errors",
    "NodeNotSchedulable": "domain.errors",
    "NodeState": "domain.node",
    "NotDue": "domain.errors",
    "OverAllocation": "domain.errors",
    "Pool": "domain.pool",
    "PoolConfig": "domain.poolconfig",
    "PoolId": "domain.resources",
    "PreemptionSettings": "domain.poolconfig",
    "PriceList": "domain.prices",
    "PriceNotListed": "domain.errors",
    "QuotaExceeded": "domain.errors",
    "Resources": "domain.resources",
    "RuntimeLimitExceeded": "domain.errors",
    "Shape": "domain.resources",
    "StaleEpoch": "domain.errors",
    "TERMINAL_STATES": "domain.lease",
    "TenantId": "domain.resources",
    "TenantPolicy": "domain.pool",
    "UnknownAllocation": "domain.errors",
    "UnknownHold": "domain.errors",
    "UnknownPriorityClass": "domain.errors",
    "ZERO": "domain.resources",
}

__all__ = [
    "CAPACITY_HOLDING_STATES",
    "EXPIRY_REASONS",
    "TERMINAL_STATES",
    "ZERO",
    "Account",
    "AlreadyAllocated",
    "DomainError",
    "IllegalTransition",
    "InsufficientCredits",
    "InvalidAmount",
    "InvalidConfiguration",
    "Job",
    "JobSpec",
    "JobState",
    "Lease",
    "LeaseExpired",
    "LeaseId",
    "LeaseState",
    "Node",
    "NodeCapabilities",
    "NodeId",
    "NodeNotEmpty",
    "NodeNotSchedulable",
    "NodeState",
    "NotDue",
    "OverAllocation",
    "Pool",
    "PoolConfig",
    "PoolId",
    "PreemptionSettings",
    "PriceList",
    "PriceNotListed",
    "QuotaExceeded",
    "Resources",
    "RuntimeLimitExceeded",
    "Shape",
    "StaleEpoch",
    "TenantId",
    "TenantPolicy",
    "UnknownAllocation",
    "UnknownHold",
    "UnknownPriorityClass",
]


if not TYPE_CHECKING:  # mypy reads the imports above; an unknown name stays an error

    def __getattr__(name: str) -> object:
        home = _HOMES.get(name)
        if home is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        module = importlib.import_module(home)
        value = module if home == f"{__name__}.{name}" else getattr(module, name)
        globals()[name] = value  # looked up once
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *_HOMES})
