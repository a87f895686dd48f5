"""Pure scheduling policy: placement (NodeTable), fairness (DRF, FairQueue), preemption, reasons.

No I/O and no clock: every function takes `now` and its inputs explicitly.
"""

from __future__ import annotations

from domain.errors import CapacityError
from domain.policy import reasons
from domain.policy.fairness import (
    FairQueue,
    PendingRequest,
    dominant_share,
    effective_rank,
    order_pending,
    quota_check,
    weighted_dominant_share,
)
from domain.policy.placement import (
    NODE_STATES,
    FilterResult,
    NodeTable,
)
from domain.policy.preemption import (
    NodeCandidate,
    PreemptionPlan,
    RunningLease,
    choose_victims,
    is_preemptible,
)
from domain.policy.reasons import WaitReasons

__all__ = [
    "NODE_STATES",
    "CapacityError",
    "FairQueue",
    "FilterResult",
    "NodeCandidate",
    "NodeTable",
    "PendingRequest",
    "PreemptionPlan",
    "RunningLease",
    "WaitReasons",
    "choose_victims",
    "dominant_share",
    "effective_rank",
    "is_preemptible",
    "order_pending",
    "quota_check",
    "reasons",
    "weighted_dominant_share",
]
