"""The recorder base: one subject per aggregate, atomic-batch saves, direct-get reads."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from uuid import UUID

from eventsourcing.persistence import (
    AggregateRecorder,
    IntegrityError,
    StoredEvent,
    Tracking,
)
from nats.js.errors import NotFoundError

from bus.errors import BatchTooLarge, BusError, BusUnavailable, PublishRejected
from bus.headers import (
    HDR_BATCH_COMMIT,
    HDR_BATCH_ID,
    HDR_BATCH_SEQ,
    HDR_EVENT_SEQUENCE,
    HDR_EXPECTED_SUBJECT_SEQ,
    HDR_ID_KIND,
    HDR_NUM_PENDING,
    HDR_ORIGINATOR_ID,
    HDR_SEQUENCE,
    HDR_STATUS,
    HDR_SUBJECT,
    HDR_TOPIC,
    HDR_TRACKING_ID,
    HDR_UPSTREAM,
    HDR_VERSION,
)
from bus.jetstream.groupcommit import GroupCommitter
from bus.jetstream.natsfast import (
    publish_prerendered,
    request_each,
    subscribe_raw,
    unsubscribe_raw,
)
from bus.jetstream.strays import strays
from bus.jetstream.wire import (
    DIRECT_BATCH,
    MAX_BATCH,
    REQUEST_TIMEOUT,
    UNWRITTEN,
    WRONG_LAST_SEQUENCE,
    SubjectState,
    header_dict,
    header_value,
    is_stored_event,
    originator_token,
    parse_headers,
    stored_event_from,
)
from bus.runtime import BusRuntime, translated
from bus.subjects import (
    APPENDED_PREFIX,
    EVENTS_PREFIX,
    EVENTS_STREAM,
    event_subject,
    token,
    tracking_subject,
)

# the subjects whose end one recorder remembers (for its writes' expectations), at most
SUBJECT_CACHE_MAX = 50_000
# where to start reading an aggregate after its snapshot, remembered for at most this many
SEEK_HINTS_MAX = 10_000
# the aggregates one multi-subject direct get asks for (the server answers up to 1,024)
_MULTI_LAST = 256


class JetStreamRecorder:
    """State shared by the recorders: runtime, stream and the subject space of one recorder."""

    def __init__(
        self,
        runtime: BusRuntime,
        *,
        stream: str = EVENTS_STREAM,
        kind: str = "default",
        tracking_owner: str = "default",
        timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        self.runtime = runtime
        self.stream = stream
        # `kind` is the aggregate-type token: select_events gets only an id, so the type token must
        # be fixed per recorder (the application's name; snapshots have subjects of their own,
        # bus.jetstream.snapshots)
        self.kind = token(kind)
        self._subject_prefix = event_subject(self.kind, "x")[:-1]
        self.tracking_owner = token(tracking_owner)
        self.timeout = timeout
        # only touched on the runtime's loop thread, so it needs no lock; at most
        # SUBJECT_CACHE_MAX subjects (trim_cache)
        self._cache: dict[str, SubjectState] = {}
        # per subject this process wrote, the end its last save expected: still a true point
        # of the subject after that save landed or was refused, so the fast-forward of a copy
        # at that version reads only what came after it, not the subject from its start
        # (bounded with the cache, trim_cache)
        self._before: dict[str, SubjectState] = {}
        # a writer that follows the whole log (the scheduler) sets this: read-ahead pages then
        # record every subject's end they pass, as direct gets do, so its next write to an
        # aggregate it only read carries the right expectation without a look-up first
        self.remember_subjects_read = False
        # the stream's replica count, asked once; see `_replicated`
        self._replicas: int | None = None
        # concurrent `insert_events` calls share atomic batches (bus.jetstream.groupcommit)
        self.group_commit = True
        self._group = GroupCommitter(self)
        # the log messages this recorder has read (direct gets and batches), for tests and
        # benchmarks that check what a load costs
        self.messages_read = 0
        # a snapshot recorder: the recorder of the aggregates' events (same runtime), whose
        # subject ends it writes into each snapshot and tells where a load may start
        self.events: JetStreamRecorder | None = None
        # per event subject (version, sequence) of the event a snapshot was read at (loop
        # thread only): a load for the events after that version starts after that sequence
        self._seek: dict[str, SubjectState] = {}
        # per subject (version, sequence) of the last event a read of it returned (loop thread):
        # what a snapshot of the aggregate just loaded is at, whatever was saved since
        self._last_read: dict[str, SubjectState] = {}

    # -- subjects ----------------------------------------------------------------------------

    def subject_for(self, originator_id: UUID | str) -> str:
        if type(originator_id) is UUID:
            # a UUID's text is already a token (lowercase hex and dashes): skip the re-checks
            return f"{self._subject_prefix}{originator_id}"
        return event_subject(self.kind, originator_token(originator_id))

    @property
    def events_filter(self) -> str:
        return f"{EVENTS_PREFIX}.{self.kind}.>"

    def tracking_subject_for(self, upstream: str) -> str:
        # per downstream owner and upstream name: processors sharing a stream never collide
        return tracking_subject(f"{self.tracking_owner}--{token(upstream)}")

    def watch_appends(self, originator_id: UUID | str,
                      callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` (on the bus thread; keep it short) each time an event of that
        aggregate is stored: the stream's headers-only republish, sent after the store, so a
        reader that reloads on it sees the event. Returns once the server holds the
        interest; the function returned stops watching."""
        subject = f"{APPENDED_PREFIX}.{self.subject_for(originator_id)[len(EVENTS_PREFIX) + 1:]}"

        async def open_sub() -> Any:
            nc = await self.runtime.connection()
            sub = await subscribe_raw(nc, subject, lambda _d, _h: callback())
            await nc.flush(max(1, round(self.timeout)))
            return sub

        sub = self.runtime.run(open_sub(), self.timeout + 1)

        async def close_sub() -> None:
            nc = await self.runtime.connection()
            await unsubscribe_raw(nc, sub)

        def unwatch() -> None:
            with contextlib.suppress(BusError):  # the runtime closed first: nothing to drop
                self.runtime.submit(close_sub())

        return unwatch

    def last_topics(self, originator_ids: Sequence[UUID]) -> dict[UUID, str | None]:
        """The topic of each aggregate's last event (None: it has none), no replay, so a caller
        can pass over aggregates whose last event rules them out before loading any: one
        multi-subject direct get per `_MULTI_LAST` aggregates. Any replica may answer it, so
        on a replicated stream a topic may be a moment old: a caller only passes over on it,
        and loads (from the leader) whatever it acts on."""
        if not originator_ids:
            return {}
        return self.runtime.run(self.last_topics_async(originator_ids), self.timeout + 5)

    async def last_topics_async(self, originator_ids: Sequence[UUID]) -> dict[UUID, str | None]:
        """`last_topics` for a caller on the runtime's loop."""
        subjects = [self.subject_for(i) for i in originator_ids]
        got: dict[str, dict[str, str]] = {}
        unique = list(dict.fromkeys(subjects))
        for at in range(0, len(unique), _MULTI_LAST):
            chunk = unique[at:at + _MULTI_LAST]
            msgs, _ = await self._direct_get({"multi_last": chunk, "batch": len(chunk)})
            for _seq, headers, _data in msgs:
                got[headers.get(HDR_SUBJECT, "")] = headers
        return {i: got[s].get(HDR_TOPIC) if s in got else None
                for i, s in zip(originator_ids, subjects, strict=True)}

    # -- low-level reads (loop thread) -------------------------------------------------------

    async def _replicated(self) -> bool:
        """Whether the stream has replicas. Then a direct get may be answered by any replica,
        and a follower can lag the leader (ADR-31): a read of an aggregate must not miss a
        write another process already had acknowledged, so reads ask the leader where it
        matters (`_last_msg`, `_select_events`). Single-replica streams keep pure direct gets."""
        if self._replicas is None:
            js = await self.runtime.jetstream()
            try:
                info = await js.stream_info(self.stream)
                self._replicas = int(info.config.num_replicas or 1)
            except NotFoundError:
                return False  # not created yet: ask again next time
        return self._replicas > 1

    async def _last_msg(self, subject: str) -> tuple[dict[str, str], bytes, int] | None:
        js = await self.runtime.jetstream()
        # on a replicated stream the last message comes from the leader (STREAM.MSG.GET): a
        # lagging follower's answer to a direct get could be older, or "not found" for a subject
        # whose first event another process wrote a moment ago
        direct = not await self._replicated()
        try:
            raw = await js.get_last_msg(self.stream, subject, direct=direct)
        except NotFoundError:
            return None
        self.messages_read += 1
        headers = dict(raw.headers or {})
        assert raw.seq is not None
        return headers, bytes(raw.data or b""), int(raw.seq)

    async def _leader_tail(
        self, subject: str, after_seq: int, upto_seq: int
    ) -> list[tuple[int, dict[str, str], bytes]]:
        """The messages on `subject` after `after_seq` up to `upto_seq`, from the leader, one
        get each: only used when a follower's direct batch fell short of the leader's last."""
        js = await self.runtime.jetstream()
        out: list[tuple[int, dict[str, str], bytes]] = []
        seq = after_seq + 1
        while seq <= upto_seq:
            try:
                raw = await js.get_msg(self.stream, seq=seq, subject=subject, next=True)
            except NotFoundError:
                break
            assert raw.seq is not None
            if raw.seq > upto_seq:
                break
            self.messages_read += 1
            out.append((int(raw.seq), dict(raw.headers or {}), bytes(raw.data or b"")))
            seq = int(raw.seq) + 1
        return out

    async def _subject_state(self, subject: str) -> SubjectState:
        state = self._cache.get(subject)
        if state is not None:
            return state
        last = await self._last_msg(subject)
        if last is None:
            state = SubjectState(None, 0)
        else:
            headers, _, seq = last
            state = SubjectState(self._version_in(headers), seq)
        self._remember(subject, state)
        return state

    def _version_in(self, headers: dict[str, str]) -> int | None:
        """The version (or tracking id) a subject's last message records, for the next write's
        check; None: none this recorder counts."""
        v = headers.get(HDR_VERSION) or headers.get(HDR_TRACKING_ID)
        return int(v) if v is not None else None

    def seek_from(self, subject: str, version: int, seq: int) -> None:
        """Say that `subject`'s event at `version` is at log sequence `seq` (from a snapshot):
        the next read of its events after `version` starts there (loop thread)."""
        hints = self._seek
        hints[subject] = SubjectState(version, seq)
        if len(hints) > SEEK_HINTS_MAX:
            del hints[next(iter(hints))]

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

    def _remember(self, subject: str, state: SubjectState) -> None:
        cache = self._cache
        known = cache.get(subject)
        # a slower concurrent call must not move the cache backwards
        if known is None or state.last_seq >= known.last_seq:
            if known is not None:
                del cache[subject]  # to the end: trim_cache forgets the least recently used
            cache[subject] = state
            if known is None and len(cache) > SUBJECT_CACHE_MAX:
                self.trim_cache()

    def trim_cache(self) -> None:
        """Forget the least recently remembered quarter of the subjects: a forgotten subject
        is looked up again by its next write, as after a conflict, so the cache stays bounded
        however many aggregates the log holds."""
        for cache in (self._cache, self._before):
            keep = SUBJECT_CACHE_MAX * 3 // 4
            for subject in list(itertools.islice(cache, max(0, len(cache) - keep))):
                del cache[subject]

    def forget(self, originator_id: UUID | str) -> None:
        """Drop what this process remembers of an aggregate's subject (one it will not write
        again, e.g. an ended lease): a later write looks it up first. From any thread."""
        subject = self.subject_for(originator_id)

        def drop() -> None:
            self._cache.pop(subject, None)
            self._before.pop(subject, None)

        self.runtime.call_soon(drop)

    async def _direct_batch(
        self, filter_subject: str, start_seq: int, batch: int
    ) -> tuple[list[tuple[int, dict[str, str], bytes]], bool]:
        """Messages with seq ≥ start_seq on `filter_subject`, in order, and whether that was the end."""
        return await self._direct_get(
            {"seq": max(start_seq, 1), "next_by_subj": filter_subject, "batch": batch})

    async def _direct_get(
        self, req: dict[str, Any]
    ) -> tuple[list[tuple[int, dict[str, str], bytes]], bool]:
        """One batched direct get (`req` as the server takes it): the messages it answers, in
        order, and whether the server has none left after them."""
        nc = await self.runtime.connection()
        inbox = nc.new_inbox()
        out: list[tuple[int, dict[str, str], bytes]] = []
        done: asyncio.Future[tuple[bool, str | None]] = asyncio.get_running_loop().create_future()

        def on_raw(data: bytes, raw_headers: bytes | None) -> None:
            if done.done():
                return
            headers = parse_headers(raw_headers)
            status = headers.get(HDR_STATUS)
            if status:
                if status == "404":
                    done.set_result((True, None))
                elif status == "204":  # end of batch
                    pending = int(headers.get(HDR_NUM_PENDING, "0") or 0)
                    done.set_result((pending == 0, None))
                else:
                    done.set_result((True, status))
                return
            out.append((int(headers[HDR_SEQUENCE]), headers, data))
            self.messages_read += 1

        sub = await subscribe_raw(nc, inbox, on_raw)
        try:
            await nc.publish(
                f"$JS.API.DIRECT.GET.{self.stream}", json.dumps(req).encode(), reply=inbox
            )
            at_end, status = await asyncio.wait_for(done, self.timeout)
        finally:
            await unsubscribe_raw(nc, sub)
        if status == "503":  # no responders: stream missing or JetStream down
            raise BusUnavailable(f"stream {self.stream} not available for reads")
        if status is not None:
            raise PublishRejected(f"direct get failed: {status}")
        return out, at_end

    async def _scan(
        self, filter_subject: str, start_seq: int, stop_seq: int | None = None
    ) -> Any:
        """Async generator over (seq, headers, data) from start_seq to the end (or stop_seq)."""
        seq = start_seq
        while True:
            msgs, at_end = await self._direct_batch(filter_subject, seq, DIRECT_BATCH)
            for m in msgs:
                if stop_seq is not None and m[0] > stop_seq:
                    return
                yield m
            if at_end or not msgs:
                return
            seq = msgs[-1][0] + 1

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
        if missing:
            await asyncio.gather(*(self._subject_state(s) for s in missing))

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
            last = await self._last_msg(subject)
            if last is None:
                self._remember(subject, SubjectState(None, 0))
                return []
            headers, data, seq = last
            if not is_stored_event(headers):
                # a stray is the subject's last message: read the subject to its last event
                strays().report(seq, subject)
                return (await self._select_events(originator_id, gt, lte, False, None))[-1:]
            e = stored_event_from(headers, data)
            self._remember(subject, SubjectState(e.originator_version, seq))
            at = headers.get(HDR_EVENT_SEQUENCE)
            if self.events is not None and at is not None and at.isdigit():
                self.events.seek_from(self.events.subject_for(e.originator_id),
                                      e.originator_version, int(at))
            if gt is not None and e.originator_version <= gt:
                return []
            return [e]
        events: list[StoredEvent] = []
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


