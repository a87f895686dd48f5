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
from projections.workflow_checks import WorkflowReport, check_workflows

__all__ = ["PAGE", "GangReport", "PlacementReport", "QuotaReport", "WorkflowReport",
           "check_gangs", "check_placements", "check_quotas", "check_workflows", "count_events",
           "event_name", "notifications", "state_of"]
