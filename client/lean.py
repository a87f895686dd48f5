"""The tenant's client for `pool lease run` over core NATS alone (bus.corenats): the calls the run
path makes, answered with the same envelopes as client.api.PoolClient, without loading nats-py,
asyncio, OpenTelemetry or the schemas (a third of a short command's time)."""

from __future__ import annotations

import json
from typing import Any, Self

from bus.corenats import Connection
from bus.leanwatch import LeanLeaseWatch
from bus.subjects import command_subject


class LeanClient:
    """Speaks for one tenant on one core-NATS connection, its replies under `inbox_prefix`."""

    def __init__(self, nats_url: str, tenant: str, *, timeout: float = 10.0,
                 inbox_prefix: str, user: str | None = None,
                 password: str | None = None) -> None:
        self.tenant = tenant
        self.timeout = timeout
        self._conn = Connection(nats_url, user=user, password=password,
                                inbox_prefix=inbox_prefix)

    def call(self, subject: str, body: dict[str, Any] | None = None, *,
             timeout: float | None = None) -> dict[str, Any]:
        reply = self._conn.request(subject, json.dumps(body or {}).encode(),
                                   timeout=timeout or self.timeout)
        out: dict[str, Any] = json.loads(reply)
        return out

    def request_lease(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.call(command_subject(self.tenant, "lease", "request"), body)

    def lease(self, lease_id: str, verb: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.call(command_subject(self.tenant, "lease", lease_id, verb), body)

    def replay_telemetry(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.call(command_subject(self.tenant, "telemetry", "replay"), body)

    def watch_lease(self, lease_id: str, *, output: bool = False,
                    after: int = 0) -> LeanLeaseWatch:
        return LeanLeaseWatch(self._conn, self.tenant, lease_id, output=output, after=after)

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
