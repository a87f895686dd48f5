"""A small Python client for the command subjects; the CLI is built on it.
Each call returns the reply envelope as a dict; it raises only bus.errors, for transport failures.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Self

from opentelemetry.trace import SpanKind

from bus import observability
from bus.errors import BusTimeout, BusUnavailable
from bus.local.auth import inbox_prefix
from bus.objects import FileStore
from bus.replies import admin_inbox
from bus.service import Client
from bus.subjects import OPS_PREFIX, admin_subject, command_subject

if TYPE_CHECKING:
    from bus.leasewatch import LeaseWatch


def scheduler_unavailable(pool_id: str, why: str) -> dict[str, Any]:
    """The refusal when no scheduler process answers an operator's question about a pool."""
    return {"ok": False, "error": {
        "code": "scheduler_unavailable", "reasons": {},
        "message": f"no scheduler answered for pool {pool_id!r} ({why}); is the control "
                   "plane running a scheduler?"}}


class PoolClient:
    """Speaks for one tenant (`pool.cmd.<tenant>.…`) and, with service credentials, for admin.

    Credentials go in `connect_options` (`user=`, `password=`) or in the URL
    (`nats://user:password@host:port`); a tenant's inbox prefix is set for it.
    """

    def __init__(self, nats_url: str, tenant: str = "", *, timeout: float = 10.0,
                 **connect_options: Any) -> None:
        self.tenant = tenant
        self.timeout = timeout
        # replies come back under the tenant's own prefix, the only inbox its user may read and
        # the only one the service answers a tenant's command on; an operator's under its own
        prefix = inbox_prefix(tenant) if tenant else admin_inbox("operator")
        connect_options.setdefault("inbox_prefix", prefix.encode())
        self._client = Client(nats_url, **connect_options)

    def raw(self, subject: str, body: bytes, *, timeout: float | None = None) -> dict[str, Any]:
        # the request's span: its context goes out in the `traceparent` header
        with observability.tracer().start_as_current_span(
            "request", kind=SpanKind.CLIENT,
            attributes={"messaging.system": "nats", "messaging.destination.name": subject},
        ):
            reply = self._client.request(subject, body, timeout=timeout or self.timeout)
        out: dict[str, Any] = json.loads(reply)
        return out

    async def raw_async(self, subject: str, body: bytes, *,
                        timeout: float | None = None) -> dict[str, Any]:
        """`raw` awaited from another event loop (the HTTP gateway's)."""
        with observability.tracer().start_as_current_span(
            "request", kind=SpanKind.CLIENT,
            attributes={"messaging.system": "nats", "messaging.destination.name": subject},
        ):
            reply = await self._client.request_async(subject, body,
                                                     timeout=timeout or self.timeout)
        out: dict[str, Any] = json.loads(reply)
        return out

    def call(self, subject: str, body: dict[str, Any] | None = None, *,
             timeout: float | None = None) -> dict[str, Any]:
        return self.raw(subject, json.dumps(body or {}).encode(), timeout=timeout)

    # -- tenant ------------------------------------------------------------------------------

    def request_lease(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.call(command_subject(self.tenant, "lease", "request"), body)

    def lease(self, lease_id: str, verb: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.call(command_subject(self.tenant, "lease", lease_id, verb), body)

    def secret(self, verb: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """Set, list or delete one of this tenant's secrets (schemas/secret.py)."""
        return self.call(command_subject(self.tenant, "secret", verb), body)

    def queue_positions(self) -> dict[str, Any]:
        """This tenant's waiting leases in queue order, with estimated starts."""
        return self.call(command_subject(self.tenant, "queue"), {})

    def watch_lease(self, lease_id: str, *, output: bool = False,
                    after: int = 0) -> LeaseWatch:
        """One of this tenant's leases as it happens, on this connection: its feed records
        after `after` and, with `output`, its job's live output (bus/leasewatch.py). Use it
        as a context manager, or `start()` and `close()` it."""
        from bus.leasewatch import LeaseWatch

        return LeaseWatch(self._client, self.tenant, lease_id, output=output, after=after)

    def files(self) -> FileStore:
        """This connection's view of the tenants' file buckets (work directories, artifacts);
        what it may read and write is what its NATS user may."""
        return self._client.files()

    def replay_telemetry(self, body: dict[str, Any]) -> dict[str, Any]:
        """A page of this tenant's telemetry samples (a lease's job output among them)."""
        return self.call(command_subject(self.tenant, "telemetry", "replay"), body)

    # -- admin -------------------------------------------------------------------------------

    def admin(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.call(admin_subject(path), body)

    def pool_shares(self, pool_id: str) -> dict[str, Any]:
        """The pool's fair shares as its leading scheduler holds them (`pool.ops`, admin
        users only); `scheduler_unavailable` when no scheduler process answers in time."""
        try:
            return self.call(f"{OPS_PREFIX}.pool.shares", {"pool_id": pool_id})
        except (BusTimeout, BusUnavailable) as e:
            return scheduler_unavailable(pool_id, str(e))

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
