"""The policy simulator: the live scheduler's planner on a virtual clock, fed by a
synthetic or logged workload, measured by `sim.metrics`.
"""

from __future__ import annotations

from sim.engine import (
    DRF,
    DRF_BACKFILL,
    DRF_DECAY,
    DRF_DECAY_BACKFILL,
    FIFO,
    Policy,
    SimResult,
    Simulator,
    VirtualClock,
)
from sim.metrics import Report, report
from sim.workload import (
    SimNode,
    SimRequest,
    SyntheticSpec,
    Tenant,
    Workload,
    from_leases,
    synthetic,
)

__all__ = [
    "DRF", "DRF_BACKFILL", "DRF_DECAY", "DRF_DECAY_BACKFILL", "FIFO", "Policy", "Report",
    "SimNode", "SimRequest", "SimResult", "Simulator", "SyntheticSpec", "Tenant",
    "VirtualClock", "Workload", "from_leases", "report", "synthetic",
]
