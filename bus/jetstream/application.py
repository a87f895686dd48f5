"""The application, tracking and process recorders, and the notification subscription."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from uuid import UUID

from eventsourcing.persistence import (
    ApplicationRecorder,
    ListenNotifySubscription,
    Notification,
    ProcessRecorder,
    StoredEvent,
    Subscription,
    Tracking,
    TrackingRecorder,
)
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription

from bus.errors import BusError
from bus.headers import (
    HDR_ID_KIND,
    HDR_ORIGINATOR_ID,
    HDR_SUBJECT,
    HDR_TOPIC,
    HDR_TRACKING_ID,
    HDR_VERSION,
)
from bus.jetstream.logreader import LogReader
from bus.jetstream.natsfast import subscribe_raw, unsubscribe_raw
from bus.jetstream.recorder import JetStreamAggregateRecorder, JetStreamRecorder
from bus.jetstream.strays import strays
from bus.jetstream.wire import (
    DIRECT_BATCH,
    RECORD_PAGE,
    UUIDS,
    LogRecord,
    SubjectState,
    is_stored_event,
    record_of,
    uuid_of,
)
from bus.runtime import translated


class JetStreamApplicationRecorder(JetStreamAggregateRecorder, ApplicationRecorder):
    """The application recorder, and the plane's `bus.recorders.LogRecorder`: its reads ahead
    (`prefetch`, `read_records`), watches, saves in flight or awaited on the bus's loop."""

    reads_ahead = True  # `prefetch` pages come from a pull consumer (may be short)
    awaits_on_loop = True  # the *_async calls run on the runtime's loop

    def insert_events(
        self, stored_events: Sequence[StoredEvent], **kwargs: Any
    ) -> Sequence[int] | None:
        return self._insert_sync(stored_events)

    async def _select_notifications(
        self,
        start: int,
        limit: int,
        stop: int | None,
        topics: Sequence[str],
    ) -> list[Notification]:
        out: list[Notification] = []
        if limit <= 0:
            return out
        wanted = set(topics)
        prefix = self._subject_prefix
        new, setattr_ = object.__new__, object.__setattr__
        seq = start
        while len(out) < limit:
            # without a topic filter every message of ours counts, so ask for what is missing
            batch = min(DIRECT_BATCH, limit - len(out)) if not wanted else DIRECT_BATCH
            # the whole stream in order, filtered here: the server's next-by-subject with a
            # wildcard costs it more per message than an unfiltered scan (docs/performance-log.md)
            msgs, at_end = await self._direct_batch(">", seq, batch)
            for s, headers, data in msgs:
                if stop is not None and s > stop:
                    return out
                subject = headers.get(HDR_SUBJECT, "")
                if not subject.startswith(prefix):
                    continue
                if not is_stored_event(headers):
                    strays().report(s, subject)  # skipped: never a reason to stop a fold
                    continue
                topic = headers[HDR_TOPIC]
                if wanted and topic not in wanted:
                    continue
                text = headers[HDR_ORIGINATOR_ID]
                oid: UUID | str = uuid_of(text) if headers.get(HDR_ID_KIND) == "uuid" else text
                version = int(headers[HDR_VERSION])
                # a follower that reads the log learns each subject's end as it goes, so its
                # next write carries the right expectation instead of a guaranteed conflict
                self._remember(subject, SubjectState(version, s))
                # the Notification a frozen dataclass's __init__ makes, built in one step, with
                # one UUID per aggregate rather than one parse per event
                n = new(Notification)
                setattr_(n, "__dict__", {
                    "originator_id": oid, "originator_version": version, "topic": topic,
                    "state": data if type(data) is bytes else bytes(data or b""), "id": s})
                out.append(n)
                if len(out) == limit:
                    return out
            if at_end or not msgs:
                return out
            seq = msgs[-1][0] + 1
        return out

    def select_notifications(
        self,
        start: int | None,
        limit: int,
        stop: int | None = None,
        topics: Sequence[str] = (),
        *,
        inclusive_of_start: bool = True,
    ) -> Sequence[Notification]:
        if start is None:
            start, inclusive_of_start = 1, True
        if not inclusive_of_start:
            start += 1
        start = max(start, 1)
        if stop is not None and stop < start:
            return []
        return self.runtime.run(
            self._select_notifications(start, limit, stop, topics), self.timeout + 5
        )

    async def _read_records(
        self, start: int, limit: int, stop: int | None
    ) -> tuple[list[LogRecord], int]:
        """The next page of a sequential read, as log records, and where the next page starts:
        from the bulk reader's consumer when it can, else (or when the consumer has nothing
        now) with direct gets, which are exact."""
        reader: LogReader | None = self.__dict__.get("_log_reader")
        if reader is None:
            # the whole stream, filtered here: a wildcard filter costs the server far more per
            # message than delivering everything (docs/performance-log.md)
            reader = self.__dict__["_log_reader"] = LogReader(self, ">")
        out: list[LogRecord] = []
        at = start
        while len(out) < limit and (stop is None or at <= stop):
            want = limit - len(out) if stop is None else min(limit - len(out), stop - at + 1)
            got = await reader.read(at, want)
            if got is None:
                break
            records, frames, at = got
            if stop is not None and records and records[-1][0] > stop:
                records = [r for r in records if r[0] <= stop]
            out += records
            if frames < want:  # the stream held no more just now
                break
        if not out:
            direct = await self._select_notifications(start, limit, stop, ())
            return [record_of(n) for n in direct], (direct[-1].id + 1 if direct else start)
        return out, at

    async def _read_ahead(self, start: int, limit: int, stop: int | None) -> list[Notification]:
        """The next page of a sequential read (`_read_records`), as notifications."""
        return self._notifications_from((await self._read_records(start, limit, stop))[0])

    @staticmethod
    def _notifications_from(records: list[LogRecord]) -> list[Notification]:
        new, setattr_ = object.__new__, object.__setattr__
        uuids = UUIDS
        out: list[Notification] = []
        append = out.append
        for seq, text, is_uuid, version, topic, data in records:
            oid: UUID | str = text
            if is_uuid:
                got = uuids.get(text)
                if got is None:
                    if len(uuids) >= 20_000:  # small: every entry is one more object for the GC
                        uuids.clear()
                    got = uuids[text] = UUID(text)
                oid = got
            # a frozen dataclass's __init__ sets each field through object.__setattr__; this
            # builds the same object in one step (the mapper builds domain events this way)
            n = new(Notification)
            setattr_(n, "__dict__", {
                "originator_id": oid, "originator_version": version,
                "topic": topic, "state": data, "id": seq})
            append(n)
        return out

    def prefetch(
        self, start: int, limit: int, stop: int | None = None
    ) -> concurrent.futures.Future[list[Notification]]:
        """Start reading what `select_notifications(start, limit, stop)` returns, without waiting:
        a reader overlaps its next read with its work on the current batch (`.result()`).

        For reads that walk the log, so a page may hold fewer events than exist at that moment
        (never none while some exist): the rest come in the next page."""
        start = max(start, 1)
        if stop is not None and stop < start:
            done: concurrent.futures.Future[list[Notification]] = concurrent.futures.Future()
            done.set_result([])
            return done
        return self.runtime.submit(translated(self._read_ahead, start, limit, stop))

    def read_records(
        self, start: int, stop: int | None = None, *, page_size: int = RECORD_PAGE,
    ) -> Iterator[list[LogRecord]]:
        """Pages of this recorder's events from `start` up to `stop` (or to the end of the log
        as the pages reach it), as bare log records (`LogRecord`): what `select_notifications`
        gives, without a Notification object or a UUID per event, for readers that walk the
        whole log and look at most events only briefly (the credit audit). While the caller
        works on one page the next is already being read."""
        start = max(start, 1)

        def fetch(at: int) -> concurrent.futures.Future[tuple[list[LogRecord], int]]:
            if stop is not None and stop < at:
                done: concurrent.futures.Future[tuple[list[LogRecord], int]] = (
                    concurrent.futures.Future())
                done.set_result(([], at))
                return done
            return self.runtime.submit(translated(self._read_records, at, page_size, stop))

        ahead = fetch(start)
        try:
            while True:
                page, at = ahead.result()
                if not page:
                    return
                if stop is not None and page[-1][0] >= stop:
                    yield page
                    return
                # from where the page's read stopped: past any other subjects' messages after
                # its last record, so the reader's consumer goes on where it is
                ahead = fetch(at)
                yield page
        finally:
            # a caller that stops early: the page in flight is not waited for (its consumer
            # carries on from where it stopped, or is dropped when idle)
            ahead.cancel()

    def watch(
        self, callback: Callable[[], None], *, again_after: float = 0.02
    ) -> Callable[[], None]:
        """Call `callback` (on the bus thread; keep it short) when messages are appended under
        this recorder's subjects, and once more `again_after` seconds later, since the core copy
        of a message can overtake its storing (an atomic batch is seen before its commit).
        Returns a function that stops watching. A reader that waits on this instead of polling
        picks new events up within milliseconds."""
        loop = self.runtime.loop
        pending = False

        def again() -> None:
            nonlocal pending
            pending = False
            callback()

        def on_raw(_data: bytes, _headers: bytes | None) -> None:
            nonlocal pending
            callback()
            if not pending:
                pending = True
                loop.call_later(again_after, again)

        async def open_sub() -> NatsSubscription:
            nc = await self.runtime.connection()
            return await subscribe_raw(nc, self.events_filter, on_raw)

        sub = self.runtime.run(open_sub(), self.timeout)

        async def close_sub() -> None:
            nc = await self.runtime.connection()
            await unsubscribe_raw(nc, sub)

        def unwatch() -> None:
            try:
                self.runtime.submit(close_sub())
            except BusError:  # pragma: no cover - runtime already closed
                pass

        return unwatch

    async def _max_notification_id(self) -> int | None:
        last = await self._last_msg(self.events_filter)
        return None if last is None else last[2]

    def max_notification_id(self) -> int | None:
        return self.runtime.run(self._max_notification_id(), self.timeout + 5)

    def subscribe(
        self, gt: int | None = None, topics: Sequence[str] = ()
    ) -> Subscription[ApplicationRecorder]:
        return JetStreamSubscription(recorder=self, gt=gt, topics=topics)


class JetStreamSubscription(ListenNotifySubscription[JetStreamApplicationRecorder]):
    """Pulls with select_notifications; a core subscription on the event subjects wakes it up."""

    def __init__(
        self,
        recorder: JetStreamApplicationRecorder,
        gt: int | None = None,
        topics: Sequence[str] = (),
    ) -> None:
        super().__init__(recorder=recorder, gt=gt, topics=topics)
        self._runtime = recorder.runtime
        self._sub: NatsSubscription | None = None
        self._sub_lock = threading.Lock()
        loop = self._runtime.loop

        async def on_msg(_: Msg) -> None:
            self._has_been_notified.set()
            # the core copy of a message can overtake its storing in the stream; wake again shortly
            loop.call_later(0.05, self._has_been_notified.set)

        async def open_sub() -> NatsSubscription:
            nc = await self._runtime.connection()
            return await nc.subscribe(recorder.events_filter, cb=on_msg)

        sub = self._runtime.run(open_sub(), recorder.timeout)
        with self._sub_lock:
            if self._has_been_stopped:
                self._runtime.submit(sub.unsubscribe())
            else:
                self._sub = sub
        # events recorded between the first pull and the subscription are picked up by this
        self._has_been_notified.set()

    def stop(self) -> None:
        super().stop()
        with self._sub_lock:
            sub, self._sub = getattr(self, "_sub", None), None
        if sub is not None:
            try:
                self._runtime.submit(sub.unsubscribe())
            except BusError:  # pragma: no cover - runtime already closed
                pass


class JetStreamTrackingRecorder(JetStreamRecorder, TrackingRecorder):
    def insert_tracking(self, tracking: Tracking) -> None:
        self._insert_sync([], tracking)

    async def _max_tracking_id(self, application_name: str) -> int | None:
        subject = self.tracking_subject_for(application_name)
        last = await self._last_msg(subject)
        if last is None:
            return None
        headers, _, seq = last
        tid = int(headers[HDR_TRACKING_ID])
        self._remember(subject, SubjectState(tid, seq))
        return tid

    def max_tracking_id(self, application_name: str) -> int | None:
        # always asked of the server: another process may have advanced it
        return self.runtime.run(self._max_tracking_id(application_name), self.timeout + 5)


class JetStreamProcessRecorder(
    JetStreamTrackingRecorder, JetStreamApplicationRecorder, ProcessRecorder
):
    def insert_events(
        self, stored_events: Sequence[StoredEvent], **kwargs: Any
    ) -> Sequence[int] | None:
        tracking: Tracking | None = kwargs.get("tracking")
        return self._insert_sync(stored_events, tracking)


