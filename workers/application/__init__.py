"""The control plane's eventsourcing Application: each command loads, decides and saves.
One atomic save per decision, however many aggregates; `now` is read here, at the edge.
"""

from workers.application.app import PoolApp
from workers.application.core import (
    APPLICATION_NAME,
    POLICY_CACHE_SECONDS,
    WEIGHT_SCALE,
    PendingSave,
    new_transfer_id,
    retried,
)

__all__ = [
    "APPLICATION_NAME",
    "POLICY_CACHE_SECONDS",
    "WEIGHT_SCALE",
    "PendingSave",
    "PoolApp",
    "new_transfer_id",
    "retried",
]
