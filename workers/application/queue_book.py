"""The leases this command service queued for each tenant and pool, counted again from the
log's last events when a request comes near the pool's max_queued_leases.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from uuid import UUID

# a lease whose last event is one of these still waits in its pool's queue
WAITING_EVENTS: tuple[str, ...] = (".LeaseRequested", ".LeaseQueued", ".LeaseRequeued",
                                   ".LeaseRetried")
# a tenant at its limit is counted again at most this often; in between its requests are
# judged on the last count plus what was queued since (which only counts too many)
RECOUNT_SECONDS = 1.0
# a lease booked before its save has no event yet: a recount keeps it this long (longer than
# any command is worked on), so a save in flight is never counted out; a failed one then goes
UNSAVED_SECONDS = 60.0

Key = tuple[str, str]  # (tenant, pool)
LastTopics = Callable[[Sequence[UUID]], "dict[UUID, str | None] | None"]


class QueueBook:
    """Per (tenant, pool), the ids of the leases queued through this process that may still
    wait. It never undercounts them: an id leaves only when a recount finds its last event is
    no longer a waiting one (reserved, rejected, cancelled, …)."""

    def __init__(self) -> None:
        self._ids: dict[Key, dict[UUID, float]] = {}  # id: when it was booked
        self._counted_at: dict[Key, float] = {}
        self._lock = threading.Lock()

    def queued(self, key: Key) -> int:
        with self._lock:
            return len(self._ids.get(key, ()))

    def add(self, key: Key, ids: Iterable[UUID]) -> None:
        with self._lock:
            self._ids.setdefault(key, {}).update(dict.fromkeys(ids, time.monotonic()))

    def admit(self, key: Key, ids: Sequence[UUID], check: Callable[[int], None]) -> None:
        """`check` the count (it raises to refuse) and book `ids` in one step, before they are
        saved: a request whose save fails leaves them counted until a recount finds no event."""
        with self._lock:
            held = self._ids.setdefault(key, {})
            check(len(held))
            held.update(dict.fromkeys(ids, time.monotonic()))

    def recount(self, key: Key, last_topics: LastTopics) -> int:
        """Keep only the ids whose last event still waits (`last_topics` reads them; None:
        it cannot say, and all are kept); at most once per RECOUNT_SECONDS a key."""
        with self._lock:
            ids = list(self._ids.get(key, ()))
            if not ids or time.monotonic() - self._counted_at.get(key, -RECOUNT_SECONDS) < (
                    RECOUNT_SECONDS):
                return len(ids)
        last = last_topics(ids)  # outside the lock: a read of the log (NeedsRead on the loop)
        with self._lock:
            self._counted_at[key] = time.monotonic()
            if last is not None:
                held = self._ids.get(key, {})
                now = time.monotonic()
                gone = [i for i in ids if not (last.get(i) or "").endswith(WAITING_EVENTS)
                        and (last.get(i) is not None or now - held.get(i, now) > UNSAVED_SECONDS)]
                for i in gone:
                    held.pop(i, None)
            return len(self._ids.get(key, ()))
