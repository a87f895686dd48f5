"""The command side of webhooks: add (its secret sealed, shown once), list, delete and test a
tenant's endpoints, and read its deliveries' state; each change an event of WebhookEndpoints."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from domain.webhook import Endpoint, WebhookEndpoints, check_endpoint
from schemas.webhook import WebhookAdd, WebhookDeliveries
from workers.errors import WebhooksUnavailable
from workers.webhooks import signing
from workers.webhooks.addresses import resolve
from workers.webhooks.post import post
from workers.webhooks.settings import WebhookSettings

if TYPE_CHECKING:
    from bus.webhooks import WebhookBus
    from workers.application import PoolApp


def secret_context(tenant: str, endpoint_id: str) -> str:
    """What a sealed secret is bound to: it opens for this tenant's endpoint only."""
    return f"{tenant}.{endpoint_id}"


def message(kind: str, data: dict[str, Any], at: float, **extra: Any) -> bytes:
    """A webhook body as Standard Webhooks shapes them: type, timestamp, data."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
    return msgspec.json.encode({"type": kind, "timestamp": stamp, **extra, "data": data})


class WebhookDesk:
    """What the command responders answer webhook commands with. `feed_last`: the feed's last
    sequence now (a new endpoint receives the records after it)."""

    def __init__(self, app: PoolApp, settings: WebhookSettings, *,
                 bus: WebhookBus | None = None,
                 feed_last: Callable[[], int] | None = None) -> None:
        self.app = app
        self.settings = settings
        self.bus = bus
        self.feed_last = feed_last or (lambda: 0)

    def _book(self, tenant: str) -> WebhookEndpoints | None:
        return self.app.find(WebhookEndpoints, WebhookEndpoints.create_id(tenant))

    def endpoints(self, tenant: str) -> list[Endpoint]:
        book = self._book(tenant)
        return [] if book is None else list(book.endpoints.values())

    def add(self, tenant: str, cmd: WebhookAdd) -> dict[str, Any]:
        key = self.settings.key
        if key is None:
            raise WebhooksUnavailable("this plane has no key to seal webhook secrets: its "
                                      "operator sets POOL_WEBHOOK_KEY")
        check_endpoint(cmd.url, cmd.events)  # the URL's shape before its addresses
        resolve(cmd.url, self.settings.allow)
        endpoint_id = "wh-" + uuid.uuid4().hex[:16]
        secret = signing.new_secret()
        sealed = signing.seal(key, secret, context=secret_context(tenant, endpoint_id))
        after = self.feed_last()

        def decide() -> Endpoint:
            now = self.app.clock()
            book = self._book(tenant) or WebhookEndpoints.open(tenant_id=tenant, now=now)
            added = book.add(endpoint_id=endpoint_id, url=cmd.url, events=cmd.events,
                             sealed_secret=sealed, after_seq=after, now=now,
                             most=self.settings.max_endpoints)
            self.app.save(book)
            return added

        added: Endpoint = self.app.retrying(decide)
        return {"endpoint": added.to_dict(), "secret": secret}

    def listing(self, tenant: str) -> dict[str, Any]:
        return {"endpoints": [e.to_dict() for e in self.endpoints(tenant)]}

    def delete(self, tenant: str, endpoint_id: str) -> dict[str, Any]:
        def decide() -> Endpoint:
            book = self._book(tenant) or WebhookEndpoints.open(tenant_id=tenant,
                                                              now=self.app.clock())
            gone = book.delete(endpoint_id=endpoint_id, now=self.app.clock())
            self.app.save(book)
            return gone

        gone: Endpoint = self.app.retrying(decide)
        return {"endpoint": gone.to_dict(), "deleted": True}

    def test(self, tenant: str, endpoint_id: str) -> dict[str, Any]:
        """POST a signed `webhook.test` message to the endpoint now; its answer's status."""
        key = self.settings.key
        if key is None:
            raise WebhooksUnavailable("this plane has no key to open webhook secrets")
        book = self._book(tenant)
        endpoint = (book or WebhookEndpoints.open(tenant_id=tenant, now=0)).get(endpoint_id)
        secret = signing.unseal(key, endpoint.sealed_secret,
                                context=secret_context(tenant, endpoint_id))
        _host, _port, addresses = resolve(endpoint.url, self.settings.allow)
        now = time.time()
        msg_id = "test-" + uuid.uuid4().hex[:16]
        body = message("webhook.test", {"tenant": tenant, "endpoint_id": endpoint_id}, now)
        result: dict[str, Any] = {"endpoint_id": endpoint_id, "webhook_id": msg_id}
        try:
            status = post(endpoint.url, addresses[0], body,
                          signing.headers(secret, msg_id, int(now), body),
                          timeout=self.settings.timeout_seconds)
        except (OSError, ValueError) as e:
            return {**result, "ok": False, "status": None, "error": str(e)[:200]}
        return {**result, "ok": 200 <= status < 300, "status": status}

    def deliveries(self, tenant: str, cmd: WebhookDeliveries) -> dict[str, Any]:
        from bus.webhooks import tenant_filter

        if self.bus is None:
            raise WebhooksUnavailable("this plane does not read webhook deliveries")
        rows = self.bus.states(tenant_filter(tenant, cmd.endpoint_id), limit=cmd.limit)
        return {"deliveries": [{k: v for k, v in r.items() if k != "record"} for r in rows]}
