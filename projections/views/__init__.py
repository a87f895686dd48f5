"""The PostgreSQL views of the log (queue, balance, capacity, leases), each batch and its position
written in one transaction: docs/architecture.md#the-views.
"""

from projections.views.schema import (
    APPLICATION_NAME,
    DEFAULT_BATCH,
    DEFAULT_SCHEMA,
    DIMENSIONS,
    VIEWS,
    WAITING_STATES,
    check_view,
    create_schema,
    drop_schema,
    drop_view,
    dump,
    lock_key,
    positions,
    positions_at,
    status,
)
from projections.views.writer import Folder, PoolViews, Prepared, gc_paused, read_pages, rebuild

__all__ = [
    "APPLICATION_NAME",
    "DEFAULT_BATCH",
    "DEFAULT_SCHEMA",
    "DIMENSIONS",
    "VIEWS",
    "WAITING_STATES",
    "Folder",
    "PoolViews",
    "Prepared",
    "check_view",
    "create_schema",
    "drop_schema",
    "drop_view",
    "dump",
    "gc_paused",
    "lock_key",
    "positions",
    "positions_at",
    "read_pages",
    "rebuild",
    "status",
]
