"""The control plane's eventsourcing Application: each command loads, decides and saves."""

from __future__ import annotations

from workers.application.nodes import NodeCommands


class PoolApp(NodeCommands):
    """Every write the control plane makes goes through one of these methods."""
