"""The scheduler: folds the log into memory and places queued leases in cycles, one atomic
batch per cycle (docs/architecture.md#the-scheduler).
"""

from workers.scheduler.folding import SchedulerFold
from workers.scheduler.loop import Scheduler
from workers.scheduler.planner import Plan, Planner
from workers.scheduler.state import (
    ENDED_REMEMBERED,
    GC_THRESHOLDS,
    LONG_LIVED_FOLD,
    MAX_MESSAGES_PER_BATCH,
    NOTIFICATION_PAGE,
    CycleReport,
    PendingPreemption,
    PoolState,
    tune_gc,
)

__all__ = [
    "ENDED_REMEMBERED",
    "GC_THRESHOLDS",
    "LONG_LIVED_FOLD",
    "MAX_MESSAGES_PER_BATCH",
    "NOTIFICATION_PAGE",
    "CycleReport",
    "PendingPreemption",
    "Plan",
    "Planner",
    "PoolState",
    "Scheduler",
    "SchedulerFold",
    "tune_gc",
]
