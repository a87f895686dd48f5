"""The recorders' low-level reads of the log: direct gets (batched, multi-subject), the leader's
answer where replicas may lag, and the append signal of one aggregate."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Sequence
from typing import Any
from uuid import UUID

from nats.js.errors import NotFoundError

from bus.errors import BusError, BusUnavailable, PublishRejected
from bus.headers import HDR_NUM_PENDING, HDR_SEQUENCE, HDR_STATUS, HDR_SUBJECT, HDR_TOPIC
from bus.jetstream.natsfast import subscribe_raw, unsubscribe_raw
from bus.jetstream.subjectcache import SubjectCache
from bus.jetstream.wire import DIRECT_BATCH, SubjectState, parse_headers
from bus.subjects import APPENDED_PREFIX, EVENTS_PREFIX

# the aggregates one multi-subject direct get asks for (the server answers up to 1,024)
MULTI_LAST = 256


class DirectReads(SubjectCache):
    """A recorder's reads below the eventsourcing contract (loop thread unless said)."""

    # -- one aggregate's appends and last topics ---------------------------------------------

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
        multi-subject direct get per `MULTI_LAST` aggregates. Any replica may answer it, so
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
        for at in range(0, len(unique), MULTI_LAST):
            chunk = unique[at:at + MULTI_LAST]
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
