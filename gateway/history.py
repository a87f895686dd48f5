"""A lease's flight recorder: every event of it in the log, decoded, in order.
Run only once the caller's right to the lease is settled: docs/api-http.md#the-dashboard.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

import msgspec

SKIP = frozenset({"originator_id", "originator_version", "timestamp"})
MAX_EVENTS = 2000


def _plain(value: Any) -> Any:
    """Event fields as JSON values (UUIDs, enums, tuples and small domain objects as text)."""
    out: Any = msgspec.json.decode(msgspec.json.encode(value, enc_hook=_hook))
    return out


def _hook(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, set | frozenset):
        return sorted(value, key=str)
    return str(value)


class History:
    """One application over the log, opened on first use (by the composition root's
    `open_log`, workers/bootstrap.py) and kept."""

    def __init__(self, service_url: str, open_log: Callable[[str], Any]) -> None:
        self.service_url = service_url
        self._open_log = open_log
        self._app: Any = None
        self._lock = threading.Lock()

    def _application(self) -> Any:
        with self._lock:
            if self._app is None:
                self._app = self._open_log(self.service_url)
            return self._app

    def log_head(self) -> int | None:
        """Blocking: the log's last sequence (the metrics' log sequence and views' lag)."""
        head: int | None = self._application().recorder.max_notification_id()
        return head

    def events(self, lease_id: str) -> list[dict[str, Any]]:
        """Blocking: the caller runs it in a thread. Empty when there is no such lease."""
        try:
            originator = uuid.UUID(lease_id)
        except ValueError:
            return []
        app = self._application()
        out: list[dict[str, Any]] = []
        for event in app.events.get(originator):
            at = getattr(event, "timestamp", None)
            out.append({
                "version": getattr(event, "originator_version", None),
                "type": type(event).__qualname__.split(".")[-1],
                "at": at.timestamp() if isinstance(at, datetime) else None,
                "fields": _plain({k: v for k, v in vars(event).items() if k not in SKIP}),
            })
            if len(out) >= MAX_EVENTS:
                break
        return out

    def close(self) -> None:
        with self._lock:
            if self._app is not None:
                self._app.close()
                self._app = None
