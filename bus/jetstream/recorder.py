"""The recorder: one subject per aggregate, atomic-batch saves, direct-get reads; this module
holds its reads of an aggregate's events and the eventsourcing AggregateRecorder on top."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from uuid import UUID

from eventsourcing.persistence import AggregateRecorder, StoredEvent

from bus.headers import HDR_EVENT_SEQUENCE, HDR_VERSION
from bus.jetstream.saves import Saves
from bus.jetstream.strays import strays
from bus.jetstream.subjectcache import SEEK_HINTS_MAX
from bus.jetstream.wire import SubjectState, is_stored_event, stored_event_from
from bus.runtime import translated


class JetStreamRecorder(Saves):
    """State, reads and saves of one recorder (the layers under it: subjectcache, directget,
    saves); the eventsourcing recorders extend it."""

    # -- reads -------------------------------------------------------------------------------

    async def _select_events(
        self,
        originator_id: UUID | str,
        gt: int | None,
        lte: int | None,
        desc: bool,
        limit: int | None,
    ) -> list[StoredEvent]:
        subject = self.subject_for(originator_id)
        if desc and limit == 1 and lte is None:
            # the last event (e.g. the latest snapshot) is one direct get
            return await self._select_last(originator_id, subject, gt)
        last_seen: tuple[int | None, int] | None = None
        start = 1
        known = self._cache.get(subject)
        if gt is not None and (known is None or known.last_version != gt):
            # a copy older than the subject's end we know: where our last save on it started
            # (its copy was taken before that save, and a refused save's retry is too)
            known = self._before.get(subject, known)
        if gt is not None and known is not None and known.last_version == gt and known.last_seq:
            # a fast-forward from the version we last saw: read only what came after it
            start = known.last_seq + 1
            last_seen = (gt, known.last_seq)
        hint = self._seek.pop(subject, None) if self._seek else None
        hinted = 0
        if (hint is not None and gt is not None and hint.last_version == gt
                and hint.last_seq >= start):
            # after a snapshot at version gt: its event's sequence says where the rest starts.
            # The read starts at that event itself, to check that it is there (a log copied
            # into another stream is numbered anew): if not, the subject is read from its start
            hinted = start = hint.last_seq
        # on a replicated stream, the leader says where the subject ends; the direct batches
        # (served by any replica) must reach that far, or the rest is read from the leader
        leader_last = 0
        if await self._replicated():
            last = await self._last_msg(subject)
            leader_last = last[2] if last is not None else 0
            if hinted and leader_last < start:
                return await self._select_events(originator_id, gt, lte, desc, limit)
            if leader_last < start:
                self._remember(
                    subject, SubjectState(*last_seen) if last_seen else SubjectState(None, 0)
                )
                return []
        scanned: list[tuple[int, dict[str, str], bytes]] = []
        async for m in self._scan(subject, start, leader_last or None):
            scanned.append(m)
        reached = scanned[-1][0] if scanned else start - 1
        if leader_last > reached:
            scanned += await self._leader_tail(subject, reached, leader_last)
        if hinted and (not scanned or scanned[0][0] != hinted
                       or scanned[0][1].get(HDR_VERSION) != str(gt)):
            return await self._select_events(originator_id, gt, lte, desc, limit)
        return self._kept(subject, scanned, gt, lte, desc, limit, last_seen)

    async def _select_last(
        self, originator_id: UUID | str, subject: str, gt: int | None
    ) -> list[StoredEvent]:
        """The aggregate's last event after `gt` (none: []), one direct get; a snapshot's says
        where its aggregate's later events start."""
        last = await self._last_msg(subject)
        if last is None:
            self._remember(subject, SubjectState(None, 0))
            return []
        headers, data, seq = last
        if not is_stored_event(headers):
            # a stray is the subject's last message: read the subject to its last event
            strays().report(seq, subject)
            return (await self._select_events(originator_id, gt, None, False, None))[-1:]
        e = stored_event_from(headers, data)
        self._remember(subject, SubjectState(e.originator_version, seq))
        at = headers.get(HDR_EVENT_SEQUENCE)
        if self.events is not None and at is not None and at.isdigit():
            self.events.seek_from(self.events.subject_for(e.originator_id),
                                  e.originator_version, int(at))
        if gt is not None and e.originator_version <= gt:
            return []
        return [e]

    def _kept(
        self,
        subject: str,
        scanned: list[tuple[int, dict[str, str], bytes]],
        gt: int | None,
        lte: int | None,
        desc: bool,
        limit: int | None,
        last_seen: tuple[int | None, int] | None,
    ) -> list[StoredEvent]:
        """The events of a scan to the subject's end that the read asked for; the subject's
        true end is remembered for the next write."""
        events: list[StoredEvent] = []
        last_read: SubjectState | None = None
        for seq, headers, data in scanned:
            if not is_stored_event(headers):
                # a stray on this aggregate's subject: skipped, but it is the subject's end
                # for the next write's expectation if nothing follows it
                strays().report(seq, subject)
                last_seen = (last_seen[0] if last_seen else None, seq)
                continue
            e = stored_event_from(headers, data)
            last_seen = (e.originator_version, seq)
            if gt is not None and e.originator_version <= gt:
                continue
            if lte is not None and e.originator_version > lte:
                continue
            events.append(e)
            last_read = SubjectState(e.originator_version, seq)
        if last_read is not None and not desc and limit is None:
            reads = self._last_read
            reads.pop(subject, None)
            reads[subject] = last_read
            if len(reads) > SEEK_HINTS_MAX:
                del reads[next(iter(reads))]
        # the scan read to the end of the subject, so this is its true last message
        self._remember(
            subject, SubjectState(*last_seen) if last_seen else SubjectState(None, 0)
        )
        if desc:
            events.reverse()
        if limit is not None:
            events = events[:limit]
        return events

    async def select_async(self, originator_id: UUID, gt: int | None = None) -> list[StoredEvent]:
        """`select_events(originator_id, gt=gt)` for a caller on the runtime's loop (the
        command service's fast path): the read without a thread in between."""
        return await translated(  # type: ignore[no-any-return]
            self._select_events, originator_id, gt, None, False, None)

    def _select_events_sync(
        self,
        originator_id: UUID | str,
        gt: int | None = None,
        lte: int | None = None,
        desc: bool = False,
        limit: int | None = None,
    ) -> list[StoredEvent]:
        return self.runtime.run(
            self._select_events(originator_id, gt, lte, desc, limit), self.timeout + 5
        )


class JetStreamAggregateRecorder(JetStreamRecorder, AggregateRecorder):
    def insert_events(
        self, stored_events: Sequence[StoredEvent], **kwargs: Any
    ) -> Sequence[int] | None:
        self._insert_sync(stored_events)
        return None

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

