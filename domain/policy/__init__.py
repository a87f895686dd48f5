"""Pure scheduling policy: placement (NodeTable), fairness (DRF, FairQueue), preemption, reasons.

No I/O and no clock: every function takes `now` and its inputs explicitly.
Names are loaded on first use: the gang policy, which wire types check against, is imported
without numpy and the placement table.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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

# each public name and the module it comes from (a submodule stands for itself)
_HOMES: dict[str, str] = {
    "CapacityError": "domain.errors",
    "FairQueue": "domain.policy.fairness",
    "FilterResult": "domain.policy.placement",
    "NODE_STATES": "domain.policy.placement",
    "NodeCandidate": "domain.policy.preemption",
    "NodeTable": "domain.policy.placement",
    "PendingRequest": "domain.policy.fairness",
    "PreemptionPlan": "domain.policy.preemption",
    "RunningLease": "domain.policy.preemption",
    "WaitReasons": "domain.policy.reasons",
    "choose_victims": "domain.policy.preemption",
    "dominant_share": "domain.policy.fairness",
    "effective_rank": "domain.policy.fairness",
    "is_preemptible": "domain.policy.preemption",
    "order_pending": "domain.policy.fairness",
    "quota_check": "domain.policy.fairness",
    "reasons": "domain.policy.reasons",
    "weighted_dominant_share": "domain.policy.fairness",
}

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
