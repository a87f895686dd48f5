"""The snapshot recorder: each aggregate's latest snapshot on pool.snap.<application>.<id> in
POOL_SNAPSHOTS, stamped with its event log's creation so it is never applied to another log."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any
from uuid import UUID

import nats.errors
from eventsourcing.persistence import AggregateRecorder, StoredEvent, Tracking
from nats.js.errors import NotFoundError

from bus.errors import SnapshotsUnavailable
from bus.headers import HDR_EVENT_SEQUENCE, HDR_LOG_CREATED
from bus.jetstream.recorder import JetStreamRecorder
from bus.jetstream.wire import (
    SubjectState,
    header_value,
    is_stored_event,
    originator_token,
    stored_event_from,
)
from bus.runtime import BusRuntime
from bus.subjects import EVENTS_STREAM, SNAPSHOTS_STREAM, snapshot_subject

log = logging.getLogger(__name__)

# how long what this recorder learned of the two streams (the snapshot stream is there, the
# log's creation) holds before it asks again: a missing stream is looked for again after this
RECHECK_S = 60.0


class JetStreamSnapshotRecorder(JetStreamRecorder, AggregateRecorder):
    """One message a subject, the latest snapshot. A snapshot whose `Pool-Log-Created` is not
    the event stream's creation (taken from an earlier log) is passed over as if absent, and
    the next one replaces it. Without the snapshot stream (an old deployment) reads find
    nothing and writes raise SnapshotsUnavailable, both without asking the server, until
    RECHECK_S has passed."""

    def __init__(self, runtime: BusRuntime, *, stream: str = SNAPSHOTS_STREAM,
                 log_stream: str = EVENTS_STREAM, **kwargs: Any) -> None:
        super().__init__(runtime, stream=stream, **kwargs)
        self._subject_prefix = snapshot_subject(self.kind, "x")[:-1]
        self.log_stream = log_stream
        # one snapshot save at a time (the snapshot thread): nothing to group
        self.group_commit = False
        # the event stream's creation, or None while it or this stream is missing, and when
        # that was learned (monotonic; None: never)
        self._log_created: str | None = None
        self._checked_at: float | None = None
        self._missing_said = False

    def subject_for(self, originator_id: UUID | str) -> str:
        if type(originator_id) is UUID:
            return f"{self._subject_prefix}{originator_id}"
        return snapshot_subject(self.kind, originator_token(originator_id))

    # -- the two streams (loop thread) -------------------------------------------------------

    async def _created(self) -> str | None:
        """The event stream's creation when this stream is there too; None when either is
        missing. Asked of the server at most once each RECHECK_S."""
        now = time.monotonic()
        if self._checked_at is not None and now - self._checked_at < RECHECK_S:
            return self._log_created
        self._checked_at = now
        js = await self.runtime.jetstream()
        created: str | None = None
        try:
            info = await js.stream_info(self.stream)
            self._replicas = int(info.config.num_replicas or 1)
            events = await js.stream_info(self.log_stream)
            created = events.created.isoformat() if events.created is not None else None
        except (TimeoutError, NotFoundError, nats.errors.Error) as e:
            if not self._missing_said:
                log.warning("snapshot stream %s not usable (%s): aggregates load from their "
                            "whole history and no snapshot is saved; `pool up` or `pool "
                            "cluster init` creates it", self.stream, e)
                self._missing_said = True
        else:
            if created is not None and self._missing_said:
                log.info("snapshot stream %s found: snapshots are used again", self.stream)
            self._missing_said = created is None
        self._log_created = created
        return created

    def available(self) -> bool:
        """Whether snapshots can be read and saved now (as `_created` last found)."""
        return self.runtime.run(self._created(), self.timeout + 5) is not None

    def _unusable(self) -> None:
        """The stream went away under a read: treat it as missing until the next check."""
        self._log_created = None
        self._checked_at = time.monotonic()

    def _ours(self, headers: dict[str, str]) -> bool:
        """A snapshot this log's aggregates may start from: the recorder's headers and the
        event stream's creation (an unstamped or foreign one is passed over)."""
        created = self._log_created
        return (created is not None and is_stored_event(headers)
                and headers.get(HDR_LOG_CREATED) == created)

    def _version_in(self, headers: dict[str, str]) -> int | None:
        # a passed-over snapshot's version must not refuse a newer log's earlier one
        return super()._version_in(headers) if self._ours(headers) else None

    # -- writes ------------------------------------------------------------------------------

    def _render(
        self, stored_events: Sequence[StoredEvent]
    ) -> tuple[list[tuple[str, bytes, str]], list[str], dict[str, StoredEvent]]:
        messages, subjects_of, by_subject = super()._render(stored_events)
        stamp = f"{HDR_LOG_CREATED}: {header_value(self._log_created or '')}\r\n"
        return [(s, d, lines + stamp) for s, d, lines in messages], subjects_of, by_subject

    async def _insert(
        self, stored_events: Sequence[StoredEvent], tracking: Tracking | None
    ) -> list[int]:
        if await self._created() is None:
            raise SnapshotsUnavailable(f"snapshot stream {self.stream} is not usable")
        return await super()._insert(stored_events, tracking)

    def insert_events(
        self, stored_events: Sequence[StoredEvent], **kwargs: Any
    ) -> Sequence[int] | None:
        self._insert_sync(stored_events)
        return None

    # -- reads -------------------------------------------------------------------------------

    async def _select_events(
        self,
        originator_id: UUID | str,
        gt: int | None,
        lte: int | None,
        desc: bool,
        limit: int | None,
    ) -> list[StoredEvent]:
        """The subject's one snapshot when it is this log's and within `gt`/`lte`; else none."""
        if await self._created() is None or limit == 0:
            return []
        subject = self.subject_for(originator_id)
        try:
            last = await self._last_msg(subject)
        except (TimeoutError, NotFoundError, nats.errors.Error) as err:
            log.warning("snapshot of %s not read (%s): loading its history", originator_id, err)
            self._unusable()
            return []
        if last is None:
            self._remember(subject, SubjectState(None, 0))
            return []
        headers, data, seq = last
        if not self._ours(headers):
            self._remember(subject, SubjectState(None, seq))
            return []
        e = stored_event_from(headers, data)
        self._remember(subject, SubjectState(e.originator_version, seq))
        at = headers.get(HDR_EVENT_SEQUENCE)
        if self.events is not None and at is not None and at.isdigit():
            self.events.seek_from(self.events.subject_for(e.originator_id),
                                  e.originator_version, int(at))
        if (gt is not None and e.originator_version <= gt) or (
                lte is not None and e.originator_version > lte):
            return []
        return [e]

    def select_events(
        self,
        originator_id: UUID | str,
        *,
        gt: int | None = None,
        lte: int | None = None,
        desc: bool = False,
        limit: int | None = None,
    ) -> Sequence[StoredEvent]:
        return self._select_events_sync(originator_id, gt, lte, desc, limit)
