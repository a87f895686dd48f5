"""The fault suite's view of the log checks, which live in projections.decisions (one
implementation for the suite and `pool audit decisions`)."""

from projections.decisions import (
    GangReport,
    PlacementReport,
    QuotaReport,
    check_gangs,
    check_placements,
    check_quotas,
    count_events,
)
from projections.replay import PAGE, event_name, notifications, state_of

__all__ = ["PAGE", "GangReport", "PlacementReport", "QuotaReport", "check_gangs",
           "check_placements", "check_quotas", "count_events", "event_name", "notifications",
           "state_of"]
