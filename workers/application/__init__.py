"""The control plane's eventsourcing application: one store, and a command service per
aggregate over it (leases, nodes, gangs, accounts, admin, workflows), composed by `PoolApp`.
One atomic save per decision, however many aggregates; `now` is read here, at the edge.
"""

from workers.application.accounts import AccountService
from workers.application.admin import AdminService
from workers.application.app import PoolApp
from workers.application.core import (
    APPLICATION_NAME,
    POLICY_CACHE_SECONDS,
    WEIGHT_SCALE,
    PendingSave,
    Store,
    new_transfer_id,
    retried,
)
from workers.application.gangs import GangService
from workers.application.leases import LeaseService
from workers.application.nodes import NodeService
from workers.application.workflows import WorkflowService

__all__ = [
    "APPLICATION_NAME",
    "POLICY_CACHE_SECONDS",
    "WEIGHT_SCALE",
    "AccountService",
    "AdminService",
    "GangService",
    "LeaseService",
    "NodeService",
    "PendingSave",
    "PoolApp",
    "Store",
    "WorkflowService",
    "new_transfer_id",
    "retried",
]
