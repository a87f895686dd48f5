"""Wiring at process start: the environment that binds the application to the event log."""

from __future__ import annotations

from bus.local.auth import speaks_as_role


def app_env(nats_url: str, **extra: str) -> dict[str, str]:
    # cached aggregates are fast-forwarded by reading only the events after their version, so a
    # node or lease with a long history of heartbeats costs one short read, not a full replay
    env = {"PERSISTENCE_MODULE": "bus.jetstream", "NATS_URL": nats_url,
           "AGGREGATE_CACHE_MAXSIZE": "20000"}
    if speaks_as_role(nats_url):
        env["CREATE_TABLE"] = "no"  # a role's user may not change streams: the operator made them
    return {**env, **extra}
