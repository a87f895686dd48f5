"""A tenant's webhook endpoints: where its lease-feed records are POSTed, for which events, and
the sealed secret each is signed with. One aggregate per tenant; delivery is workers/webhooks.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit
from uuid import UUID

from eventsourcing.domain import Aggregate, event

from domain.errors import InvalidWebhook, UnknownWebhook, WebhookLimit

_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:computepool:webhooks")

# what an endpoint may ask for: a lease's states as the feed names them, and `ended` (any of
# the final ones)
FEED_STATES: tuple[str, ...] = ("requested", "queued", "reserved", "running", "stopping",
                                "preempting", "expired", "reconciling", "released",
                                "cancelled", "voided", "preempted", "rejected")
ENDED_STATES: frozenset[str] = frozenset({"released", "cancelled", "voided", "preempted",
                                          "rejected"})
EVENTS: tuple[str, ...] = ("ended", *FEED_STATES)
MAX_URL_LENGTH = 2048


@dataclass(frozen=True)
class Endpoint:
    """One registered endpoint. `after_seq`: the feed's last sequence when it was added (it
    receives records after that); `sealed_secret`: its signing secret, encrypted by the plane."""

    endpoint_id: str
    url: str
    events: tuple[str, ...]
    sealed_secret: str
    after_seq: int
    created_at: float

    def wants(self, state: str) -> bool:
        return state in self.events or ("ended" in self.events and state in ENDED_STATES)

    def to_dict(self) -> dict[str, Any]:
        """What its tenant is shown (never the secret, sealed or not)."""
        return {"endpoint_id": self.endpoint_id, "url": self.url, "events": list(self.events),
                "after_seq": self.after_seq, "created_at": self.created_at}


def check_endpoint(url: str, events: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The events, in order and once each, when `url` is an http(s) URL the pool may POST to
    and every event is one of EVENTS; InvalidWebhook otherwise (addresses: the plane's)."""
    problems: list[str] = []
    if not isinstance(url, str) or len(url) > MAX_URL_LENGTH:
        problems.append(f"the URL must be text of at most {MAX_URL_LENGTH} characters")
    else:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            problems.append("the URL must be http:// or https:// with a host")
        if parts.username or parts.password:
            problems.append("the URL must not carry credentials")
        if any(c.isspace() or ord(c) < 32 for c in url):
            problems.append("the URL must not contain spaces or control characters")
    unknown = sorted({e for e in events if e not in EVENTS})
    if unknown:
        problems.append(f"unknown events {', '.join(unknown)}: choose from {', '.join(EVENTS)}")
    if not events:
        problems.append("name at least one event")
    if problems:
        raise InvalidWebhook("; ".join(problems), reasons=problems)
    return tuple(dict.fromkeys(events))


class WebhookEndpoints(Aggregate):
    """The endpoints of one tenant; each added or deleted one is an event."""

    @staticmethod
    def create_id(tenant_id: str) -> UUID:
        return uuid.uuid5(_NAMESPACE, str(tenant_id))

    @classmethod
    def open(cls, *, tenant_id: str, now: float) -> WebhookEndpoints:
        return cls(tenant_id=str(tenant_id), opened_at=float(now))

    @event("WebhookEndpointsOpened")
    def __init__(self, tenant_id: str, opened_at: float) -> None:
        self.tenant_id = tenant_id
        self.endpoints: dict[str, Endpoint] = {}

    def add(self, *, endpoint_id: str, url: str, events: list[str] | tuple[str, ...],
            sealed_secret: str, after_seq: int, now: float, most: int) -> Endpoint:
        """Register an endpoint; WebhookLimit when the tenant has `most` already."""
        wanted = check_endpoint(url, events)
        if len(self.endpoints) >= most:
            raise WebhookLimit(f"tenant {self.tenant_id!r} has {len(self.endpoints)} webhook "
                               f"endpoints, the most allowed; delete one first")
        self._added(endpoint_id=str(endpoint_id), url=url, events=list(wanted),
                    sealed_secret=str(sealed_secret), after_seq=int(after_seq), at=float(now))
        return self.endpoints[str(endpoint_id)]

    def delete(self, *, endpoint_id: str, now: float) -> Endpoint:
        found = self.endpoints.get(endpoint_id)
        if found is None:
            raise UnknownWebhook(f"no webhook endpoint {endpoint_id!r}")
        self._deleted(endpoint_id=endpoint_id, at=float(now))
        return found

    def get(self, endpoint_id: str) -> Endpoint:
        found = self.endpoints.get(endpoint_id)
        if found is None:
            raise UnknownWebhook(f"no webhook endpoint {endpoint_id!r}")
        return found

    @event("WebhookEndpointAdded")
    def _added(self, endpoint_id: str, url: str, events: list[str], sealed_secret: str,
               after_seq: int, at: float) -> None:
        self.endpoints[endpoint_id] = Endpoint(endpoint_id, url, tuple(events), sealed_secret,
                                               after_seq, at)

    @event("WebhookEndpointDeleted")
    def _deleted(self, endpoint_id: str, at: float) -> None:
        self.endpoints.pop(endpoint_id, None)
