"""What the plane asks of the log's recorder, as one contract (`LogRecorder`): eventsourcing's
reads and writes, and the ones beyond them that bus.jetstream's recorder gives (read-ahead,
bulk records, watching, saves in flight or awaited on the bus's loop, subject-end hints).

`log_recorder` gives every reader and writer of the log its recorder as that contract, once,
where it is built: the JetStream recorder as it is, any other (eventsourcing's in-memory POPO
recorder, a test's stand-in) wrapped in `PlainLogRecorder`, the plain path: exact pages read on
request, no watching (the projector polls, policies are read every time), saves waited for, no
commands on the loop. Callers call each member directly; none asks a recorder what it has."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable
from uuid import UUID

from eventsourcing.persistence import Notification, StoredEvent

from bus.jetstream.application import JetStreamApplicationRecorder
from bus.jetstream.snapshots import JetStreamSnapshotRecorder
from bus.jetstream.wire import RECORD_PAGE, REQUEST_TIMEOUT, LogRecord, record_of


@runtime_checkable
class LogRecorder(Protocol):
    """The log's recorder as the plane uses it (implemented by bus.jetstream's application
    recorder, and by `PlainLogRecorder` over any other)."""

    # seconds one request to the bus may take; a caller waiting on a read adds its margin
    timeout: float
    # `prefetch` reads ahead (a pull consumer): a page may hold fewer events than are stored
    # at that moment, so a reader reads on until a page comes back empty. False: its pages
    # are exact, a short one is the log's end (the plain path's page-at-a-time reads)
    reads_ahead: bool
    # `insert_async`, `select_async` and `last_topics_async` run on the bus's own loop, so a
    # command may be answered there (workers.application.core.Store.on_loop); False: never
    awaits_on_loop: bool
    # set by a writer that follows the whole log (the scheduler): pages read ahead remember
    # every subject's end they pass, so a write to an aggregate only read needs no look-up
    remember_subjects_read: bool

    # -- eventsourcing's ApplicationRecorder calls the plane makes ---------------------------

    def select_notifications(
        self, start: int | None, limit: int, stop: int | None = None,
        topics: Sequence[str] = (), *, inclusive_of_start: bool = True,
    ) -> Sequence[Notification]: ...

    def max_notification_id(self) -> int | None: ...

    def insert_events(
        self, stored_events: Sequence[StoredEvent], **kwargs: Any
    ) -> Sequence[int] | None: ...

    # -- reads beyond them -------------------------------------------------------------------

    def prefetch(
        self, start: int, limit: int, stop: int | None = None
    ) -> concurrent.futures.Future[list[Notification]]:
        """`select_notifications(start, limit, stop)` under way (see `reads_ahead`)."""
        ...

    def read_records(
        self, start: int, stop: int | None = None, *, page_size: int = RECORD_PAGE,
    ) -> Iterator[list[LogRecord]]:
        """Pages of the log from `start` to `stop` (None: its end) as bare records."""
        ...

    def watch(
        self, callback: Callable[[], None], *, again_after: float = 0.02
    ) -> Callable[[], None]:
        """Call `callback` when events are appended (perhaps never: the caller polls too);
        returns what stops watching."""
        ...

    def watch_appends(self, originator_id: UUID | str,
                      callback: Callable[[], None]) -> Callable[[], None] | None:
        """Call `callback` each time an event of that aggregate is stored; returns what stops
        watching, or None when this recorder cannot watch (nothing may then be cached)."""
        ...

    def last_topics(self, originator_ids: Sequence[UUID]) -> dict[UUID, str | None] | None:
        """The topic of each aggregate's last event, no replay; None: it cannot say."""
        ...

    async def last_topics_async(
        self, originator_ids: Sequence[UUID]
    ) -> dict[UUID, str | None] | None: ...

    async def select_async(
        self, originator_id: UUID, gt: int | None = None
    ) -> list[StoredEvent]: ...

    # -- writes beyond them ------------------------------------------------------------------

    def insert_events_nowait(
        self, stored_events: Sequence[StoredEvent]
    ) -> concurrent.futures.Future[list[int]]:
        """`insert_events` whose save is under way (or done) when this returns."""
        ...

    async def insert_async(self, stored_events: Sequence[StoredEvent]) -> list[int]: ...

    # -- what it remembers of subjects' ends -------------------------------------------------

    def forget(self, originator_id: UUID | str) -> None: ...

    def remember_ends(self, ends: dict[UUID, tuple[int, int]]) -> None: ...


class PlainLogRecorder:
    """`LogRecorder` over any recorder with eventsourcing's `select_notifications`,
    `max_notification_id` and `insert_events`: the plain path of each capability."""

    reads_ahead = False
    awaits_on_loop = False

    def __init__(self, recorder: Any, *, timeout: float = REQUEST_TIMEOUT) -> None:
        self.recorder = recorder
        self.timeout = timeout
        self.remember_subjects_read = False

    def select_notifications(
        self, start: int | None, limit: int, stop: int | None = None,
        topics: Sequence[str] = (), *, inclusive_of_start: bool = True,
    ) -> Sequence[Notification]:
        # as the caller asked it: a stand-in may take only what it was asked (start, limit)
        kwargs: dict[str, Any] = {}
        if stop is not None:
            kwargs["stop"] = stop
        if topics:
            kwargs["topics"] = topics
        if not inclusive_of_start:
            kwargs["inclusive_of_start"] = False
        page: Sequence[Notification] = self.recorder.select_notifications(start, limit, **kwargs)
        return page

    def max_notification_id(self) -> int | None:
        top: int | None = self.recorder.max_notification_id()
        return top

    def insert_events(
        self, stored_events: Sequence[StoredEvent], **kwargs: Any
    ) -> Sequence[int] | None:
        ids: Sequence[int] | None = self.recorder.insert_events(stored_events, **kwargs)
        return ids

    def prefetch(
        self, start: int, limit: int, stop: int | None = None
    ) -> concurrent.futures.Future[list[Notification]]:
        """The exact page, read now."""
        done: concurrent.futures.Future[list[Notification]] = concurrent.futures.Future()
        done.set_result(list(self.select_notifications(start, limit, stop=stop)))
        return done

    def read_records(
        self, start: int, stop: int | None = None, *, page_size: int = RECORD_PAGE,
    ) -> Iterator[list[LogRecord]]:
        """Pages of notifications read one after the other, as records."""
        at = max(start, 1)
        while stop is None or at <= stop:
            page = self.select_notifications(at, page_size, stop=stop)
            if not page:
                return
            yield [record_of(n) for n in page]
            at = page[-1].id + 1

    def watch(
        self, callback: Callable[[], None], *, again_after: float = 0.02
    ) -> Callable[[], None]:
        """Never called back: the reader's poll finds what was appended."""
        return _nothing

    def watch_appends(self, originator_id: UUID | str,
                      callback: Callable[[], None]) -> Callable[[], None] | None:
        return None

    def last_topics(self, originator_ids: Sequence[UUID]) -> dict[UUID, str | None] | None:
        return None

    async def last_topics_async(
        self, originator_ids: Sequence[UUID]
    ) -> dict[UUID, str | None] | None:
        return None

    async def select_async(
        self, originator_id: UUID, gt: int | None = None
    ) -> list[StoredEvent]:
        """The read, made here (`awaits_on_loop` is False: the plane does not ask this)."""
        return list(self.recorder.select_events(originator_id, gt=gt))

    def insert_events_nowait(
        self, stored_events: Sequence[StoredEvent]
    ) -> concurrent.futures.Future[list[int]]:
        """The save made now; the future holds its ids or its error."""
        future: concurrent.futures.Future[list[int]] = concurrent.futures.Future()
        try:
            future.set_result(list(self.insert_events(stored_events) or []))
        except Exception as e:  # noqa: BLE001 - handed to whoever asks for the result
            future.set_exception(e)
        return future

    async def insert_async(self, stored_events: Sequence[StoredEvent]) -> list[int]:
        """The save, made here (`awaits_on_loop` is False: the plane does not ask this)."""
        return list(self.insert_events(stored_events) or [])

    def forget(self, originator_id: UUID | str) -> None:
        """Nothing remembered, nothing to forget."""

    def remember_ends(self, ends: dict[UUID, tuple[int, int]]) -> None:
        """Nothing remembered: each save asks the recorder as it would."""


def _nothing() -> None:
    pass


def log_recorder(recorder: object) -> LogRecorder:
    """`recorder` as the plane's `LogRecorder`: bus.jetstream's application recorder as it is
    (mypy checks here that it is one), any other wrapped in `PlainLogRecorder`."""
    if isinstance(recorder, (JetStreamApplicationRecorder, PlainLogRecorder)):
        return recorder
    return PlainLogRecorder(recorder)


def snapshots_available(recorder: object) -> Callable[[], bool]:
    """Whether the snapshot recorder can read and save snapshots now: bus.jetstream's says
    (its stream may be missing, as in an old deployment); any other always can."""
    if isinstance(recorder, JetStreamSnapshotRecorder):
        return recorder.available
    return _always


def _always() -> bool:
    return True
