"""The recorders' writes: a save rendered into messages, each subject's expectation, one atomic
batch (or one publish each) and the refusals translated to IntegrityError."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import uuid
from collections.abc import Iterable, Sequence
from typing import Any
from uuid import UUID

from eventsourcing.persistence import IntegrityError, StoredEvent, Tracking

from bus.errors import BatchTooLarge, PublishRejected
from bus.headers import (
    HDR_BATCH_COMMIT,
    HDR_BATCH_ID,
    HDR_BATCH_SEQ,
    HDR_EVENT_SEQUENCE,
    HDR_EXPECTED_SUBJECT_SEQ,
    HDR_ID_KIND,
    HDR_ORIGINATOR_ID,
    HDR_SUBJECT,
    HDR_TOPIC,
    HDR_TRACKING_ID,
    HDR_UPSTREAM,
    HDR_VERSION,
)
from bus.jetstream.directget import MULTI_LAST, DirectReads
from bus.jetstream.groupcommit import GroupCommitter
from bus.jetstream.natsfast import publish_prerendered, request_each
from bus.jetstream.wire import (
    MAX_BATCH,
    UNWRITTEN,
    WRONG_LAST_SEQUENCE,
    SubjectState,
    header_dict,
    header_value,
)
from bus.runtime import translated

# more subjects than this unknown to one save are looked up together (`_look_up_many`)
_LOOK_UP_ONE_BY_ONE = 8


class Saves(DirectReads):
    """A recorder's saves, each one atomic batch with an expectation per subject."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # concurrent `insert_events` calls share atomic batches (bus.jetstream.groupcommit)
        self.group_commit = True
        self._group = GroupCommitter(self)

    def _event_sequence_line(self, e: StoredEvent) -> str:
        """A snapshot's header line naming where its aggregate's event at the snapshot's
        version lies in the log, when this process knows (its events recorder saw that event
        as the subject's last); else nothing."""
        events = self.events
        if events is None:
            return ""
        subject = events.subject_for(e.originator_id)
        for at in (events._last_read.get(subject), events._cache.get(subject)):
            if at is not None and at.last_version == e.originator_version and at.last_seq:
                return f"{HDR_EVENT_SEQUENCE}: {at.last_seq}\r\n"
        return ""


    # -- writes (loop thread) ----------------------------------------------------------------

    async def _publish(
        self, messages: list[tuple[str, bytes, str]], expects: dict[str, int]
    ) -> int:
        """Publish `messages` atomically; the sequence of the first one. Conflicts → IntegrityError.

        Each message is (subject, payload, its own header lines, rendered as `_header_lines`);
        the expectation and the batch headers are added here."""
        nc = await self.runtime.connection()
        n = len(messages)
        seen: set[str] = set()
        rendered: list[tuple[str, bytes, str]] = []
        for subject, payload, lines in messages:
            # only the first message per subject may carry the expectation (ADR-50)
            if subject not in seen:
                seen.add(subject)
                lines = f"{lines}{HDR_EXPECTED_SUBJECT_SEQ}: {expects[subject]}\r\n"
            rendered.append((subject, payload, lines))
        if n == 1:
            # fast path: a plain publish with an expectation is already atomic
            subject, payload, lines = rendered[0]
            reply = await nc.request(subject, payload, headers=header_dict(lines),
                                     timeout=self.timeout)
        else:
            batch_id = uuid.uuid4().hex
            # every message but the commit goes out unawaited; the commit is a request, flushed
            # behind them. Header blocks are rendered once per message from text
            batch_lines = f"{HDR_BATCH_ID}: {batch_id}\r\n{HDR_BATCH_SEQ}: "
            limit = nc.max_payload
            head: list[tuple[str, bytes, str]] = []
            for i, (subject, payload, lines) in enumerate(rendered[:-1], 1):
                if len(payload) > limit:
                    raise PublishRejected(
                        f"a message of {len(payload)} bytes exceeds max_payload {limit}")
                head.append((subject, payload, f"{lines}{batch_lines}{i}\r\n"))
            await publish_prerendered(nc, head)
            subject, payload, lines = rendered[-1]
            headers = header_dict(lines)
            headers[HDR_BATCH_ID] = batch_id
            headers[HDR_BATCH_SEQ] = str(n)
            headers[HDR_BATCH_COMMIT] = "1"
            reply = await nc.request(subject, payload, headers=headers, timeout=self.timeout)
        ack = json.loads(reply.data or b"{}")
        refused = self._refusal(ack, expects)
        if refused is not None:
            raise refused
        count = int(ack.get("count", 1) or 1)
        if count != n:  # pragma: no cover - the server acks the whole batch or nothing
            raise PublishRejected(f"batch ack counted {count} messages, sent {n}")
        return int(ack["seq"]) - n + 1

    async def _publish_each(
        self, messages: list[tuple[str, bytes, str]], expects: dict[str, int]
    ) -> list[int | BaseException]:
        """Publish single-message saves of distinct subjects, all sent before any answer is
        awaited, each with its own expectation: per message its sequence, or its own error
        (IntegrityError for a stale expectation); one refusal leaves the others stored."""
        nc = await self.runtime.connection()
        rendered = [(subject, payload,
                     f"{lines}{HDR_EXPECTED_SUBJECT_SEQ}: {expects[subject]}\r\n")
                    for subject, payload, lines in messages]
        replies = await request_each(nc, rendered, timeout=self.timeout)
        out: list[int | BaseException] = []
        for (subject, _payload, _lines), reply in zip(rendered, replies, strict=True):
            if isinstance(reply, BaseException):
                out.append(reply)
                continue
            ack = json.loads(reply.data or b"{}")
            refused = self._refusal(ack, (subject,))
            out.append(int(ack["seq"]) if refused is None else refused)
        return out

    def _refusal(self, ack: dict[str, Any], subjects: Iterable[str]) -> Exception | None:
        """What a save's JetStream ack refuses, None if it stored the save: a stale expectation is
        an IntegrityError (the cached ends of `subjects` dropped), anything else PublishRejected."""
        err = ack.get("error")
        if not err:
            return None
        if err.get("err_code") in WRONG_LAST_SEQUENCE:
            for subject in subjects:
                self._cache.pop(subject, None)
            return IntegrityError(f"concurrent write detected: {err.get('description')}")
        return PublishRejected(f"JetStream refused the save: {err}")

    def _render(
        self, stored_events: Sequence[StoredEvent]
    ) -> tuple[list[tuple[str, bytes, str]], list[str], dict[str, StoredEvent]]:
        """A save's messages (subject, payload, header lines), each event's subject, and per
        subject its first event in the save (the one that carries the expectation)."""
        # per originator (a node appears once per placement on it) its subject and id header
        # lines, and per topic its header line, computed once: saves of 900 events add up
        per_originator: dict[UUID | str, tuple[str, str]] = {}
        topic_lines: dict[str, str] = {}
        subjects_of: list[str] = []
        messages: list[tuple[str, bytes, str]] = []
        for e in stored_events:
            oid = e.originator_id
            known = per_originator.get(oid)
            if known is None:
                if type(oid) is UUID:
                    text = str(oid)
                    known = (f"{self._subject_prefix}{text}",
                             f"{HDR_ORIGINATOR_ID}: {text}\r\n{HDR_ID_KIND}: uuid\r\n")
                else:
                    kind = "uuid" if isinstance(oid, UUID) else "str"
                    known = (self.subject_for(oid),
                             (f"{HDR_ORIGINATOR_ID}: {header_value(str(oid))}\r\n"
                              f"{HDR_ID_KIND}: {kind}\r\n"))
                per_originator[oid] = known
            topic = topic_lines.get(e.topic)
            if topic is None:
                topic = topic_lines[e.topic] = f"{HDR_TOPIC}: {header_value(e.topic)}\r\n"
            subjects_of.append(known[0])
            lines = f"{known[1]}{HDR_VERSION}: {e.originator_version}\r\n{topic}"
            if self.events is not None:
                lines += self._event_sequence_line(e)
            messages.append((known[0], e.state, lines))
        by_subject: dict[str, StoredEvent] = {}
        for s, e in zip(subjects_of, stored_events, strict=True):
            by_subject.setdefault(s, e)
        return messages, subjects_of, by_subject

    async def _look_up(self, subjects: list[str], by_subject: dict[str, StoredEvent]) -> None:
        """Fill the subject cache for `subjects`, concurrently. An aggregate's first event
        (version 1) needs no look-up: it expects its subject to hold nothing yet (last
        sequence 0), and the server refuses the save otherwise, as a conflict. Every new
        lease, node or account is saved without that round trip."""
        cache = self._cache
        missing = [s for s in subjects if s not in cache and not (
            s in by_subject and by_subject[s].originator_version == 1)]
        if len(missing) > _LOOK_UP_ONE_BY_ONE and not await self._replicated():
            # many at once (a scheduler's batch of leases it has not written before): one
            # multi-subject direct get per MULTI_LAST subjects, not a request for each
            await asyncio.gather(*(self._look_up_many(missing[at:at + MULTI_LAST])
                                   for at in range(0, len(missing), MULTI_LAST)))
            missing = [s for s in missing if s not in cache]
        if missing:
            await asyncio.gather(*(self._subject_state(s) for s in missing))

    async def _look_up_many(self, subjects: list[str]) -> None:
        """Remember where each of `subjects` ends, from one multi-subject direct get; a
        subject that has no message is remembered as unwritten only when the server said it
        had answered them all (else the caller looks it up alone)."""
        msgs, at_end = await self._direct_get({"multi_last": subjects, "batch": len(subjects)})
        seen: set[str] = set()
        for seq, headers, _data in msgs:
            subject = headers.get(HDR_SUBJECT, "")
            seen.add(subject)
            self._remember(subject, SubjectState(self._version_in(headers), seq))
        if at_end:
            for subject in subjects:
                if subject not in seen:
                    self._remember(subject, SubjectState(None, 0))

    def _expectations(self, by_subject: dict[str, StoredEvent]) -> dict[str, int]:
        """Per subject the last sequence the save expects, from the cache (after `_look_up`);
        IntegrityError when the cache already holds the save's version or a later one."""
        expects: dict[str, int] = {}
        cache = self._cache
        before = self._before
        for s, first_event in by_subject.items():
            state = cache.get(s, UNWRITTEN)
            if (state.last_version is not None
                    and first_event.originator_version <= state.last_version):
                raise IntegrityError(
                    f"version {first_event.originator_version} of {first_event.originator_id} "
                    f"is not after the recorded version {state.last_version}"
                )
            expects[s] = state.last_seq
            if state.last_version is not None:
                before[s] = state
        return expects

    def _remember_saved(self, subjects_of: list[str], stored_events: Sequence[StoredEvent],
                        first: int) -> list[int]:
        """The notification ids of a save acknowledged from sequence `first`; the cache moves
        to each subject's last event."""
        ids = list(range(first, first + len(stored_events)))
        last_by_subject: dict[str, tuple[int, int]] = {}
        for s, e, seq in zip(subjects_of, stored_events, ids, strict=True):
            last_by_subject[s] = (e.originator_version, seq)
        for s, (version, seq) in last_by_subject.items():
            self._remember(s, SubjectState(version, seq))
        return ids

    async def _insert(
        self, stored_events: Sequence[StoredEvent], tracking: Tracking | None
    ) -> list[int]:
        messages, subjects_of, by_subject = self._render(stored_events)
        trk_subject = self.tracking_subject_for(tracking.application_name) if tracking else None
        await self._look_up(list(by_subject), by_subject)
        for s, first_event in by_subject.items():
            if s not in self._cache and first_event.originator_version != 1:
                await self._subject_state(s)  # evicted by a concurrent conflict meanwhile
        expects = self._expectations(by_subject)
        if tracking is not None and trk_subject is not None:
            state = await self._subject_state(trk_subject)
            if state.last_version is not None and tracking.notification_id <= state.last_version:
                raise IntegrityError(
                    f"Tracking notification ID {tracking.notification_id} not greater than "
                    f"current max tracking ID {state.last_version}"
                )
            expects[trk_subject] = state.last_seq
            # last, so the events' notification ids stay contiguous from the first sequence
            messages.append(
                (
                    trk_subject,
                    str(tracking.notification_id).encode(),
                    (f"{HDR_TRACKING_ID}: {tracking.notification_id}\r\n"
                     f"{HDR_UPSTREAM}: {header_value(tracking.application_name)}\r\n"),
                )
            )
        first = await self._publish(messages, expects)
        ids = self._remember_saved(subjects_of, stored_events, first)
        if tracking is not None and trk_subject is not None:
            self._remember(trk_subject,
                           SubjectState(tracking.notification_id, first + len(stored_events)))
        return ids

    def _check_insert(
        self, stored_events: Sequence[StoredEvent], tracking: Tracking | None
    ) -> int:
        """The number of messages the save will write; refuses what no batch may hold."""
        total = len(stored_events) + (1 if tracking is not None else 0)
        if total > MAX_BATCH:
            raise BatchTooLarge(
                f"a save of {total} messages exceeds the atomic batch limit of {MAX_BATCH}; "
                "it is refused rather than split (save fewer events at once)"
            )
        # versions of one originator must rise within the save (duplicates are a conflict)
        last: dict[str, int] = {}
        for e in stored_events:
            key = str(e.originator_id)
            if key in last and e.originator_version <= last[key]:
                raise IntegrityError(f"Stored events are not unique or not in order: {e}")
            last[key] = e.originator_version
        return total

    def _insert_sync(
        self, stored_events: Sequence[StoredEvent], tracking: Tracking | None = None
    ) -> list[int]:
        if not self._check_insert(stored_events, tracking):
            return []
        if self.group_commit and tracking is None:
            # a lone save goes at once; one made while another is in flight rides the next batch
            return self.runtime.run(self._group.insert(stored_events), 2 * self.timeout + 5)
        return self.runtime.run(self._insert(stored_events, tracking), self.timeout + 5)

    async def insert_async(self, stored_events: Sequence[StoredEvent]) -> list[int]:
        """`insert_events` for a caller already on the runtime's loop (the command service's
        fast path): the save rides the group commit without a thread in between."""
        if not self._check_insert(stored_events, None):
            return []
        if self.group_commit:
            return await translated(self._group.insert, stored_events)  # type: ignore[no-any-return]
        return await translated(self._insert, stored_events, None)  # type: ignore[no-any-return]

    def insert_events_nowait(
        self, stored_events: Sequence[StoredEvent]
    ) -> concurrent.futures.Future[list[int]]:
        """`insert_events` without the wait: the atomic batch is under way when this returns
        and the future gives its notification ids, or raises as `insert_events` would
        (IntegrityError on a conflict). The caller decides what overlaps the round trip; a
        save submitted before an earlier one is acknowledged would carry stale expectations
        for any subject they share, and be refused."""
        if not self._check_insert(stored_events, None):
            done: concurrent.futures.Future[list[int]] = concurrent.futures.Future()
            done.set_result([])
            return done
        return self.runtime.submit(translated(self._insert, stored_events, None))
