"""The log read a page at a time for the replay checks, and the two fields of a notification
they read without building the domain event.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

PAGE = 5000


def notifications(app: Any, start: int = 1, *, page: int = PAGE) -> Iterator[Any]:
    """Every notification of `app`'s log from `start`, fetched a page at a time."""
    while True:
        batch = app.recorder.select_notifications(start, page)
        if not batch:
            return
        yield from batch
        start = batch[-1].id + 1


def event_name(topic: str) -> str:
    """`domain.lease:Lease.LeaseReserved` → `LeaseReserved`."""
    return topic.rsplit(".", 1)[-1]


def state_of(notification: Any) -> dict[str, Any]:
    """The event's recorded fields, without building the domain object (fast for big logs)."""
    out: dict[str, Any] = json.loads(notification.state)
    return out
