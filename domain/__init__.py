"""The decision layer: aggregates, value objects and errors; no I/O, no clock, no brokers.

Import from here: `from domain import Lease, Node, Account, Pool, TenantPolicy, Shape, ...`.
"""

from __future__ import annotations

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
from domain.lease import (
    CAPACITY_HOLDING_STATES,
    EXPIRY_REASONS,
    TERMINAL_STATES,
    Job,
    JobSpec,
    JobState,
    Lease,
    LeaseState,
)
from domain.node import Node, NodeState
from domain.pool import Pool, PoolConfig, PreemptionSettings, PriceList, TenantPolicy
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
