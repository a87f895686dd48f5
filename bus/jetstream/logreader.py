"""Bulk reads of the event log through a pull consumer, page by page."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from typing import Any

from bus.errors import PublishRejected
from bus.headers import HDR_ID_KIND, HDR_ORIGINATOR_ID, HDR_TOPIC, HDR_VERSION
from bus.jetstream.natsfast import (
    LOG_READER_IDLE_NS,
    READ_SIZE,
    set_frame_cutter,
    subscribe_raw_msgs,
    widen_reads,
)
from bus.jetstream.recorder import JetStreamRecorder
from bus.jetstream.strays import strays
from bus.jetstream.subjectcache import SUBJECT_CACHE_MAX
from bus.jetstream.wire import (
    RECORD_IDS_LIMIT,
    UUID_TEXT,
    LogRecord,
    SubjectState,
    event_fields,
)

# at most this many messages a read skips to go on with its consumer rather than make a new one
_SKIP_MAX = 256


class LogReader:
    """Sequential bulk reads of one recorder's events through a pull consumer of its own.

    A direct get costs the server about three times what delivering the same message to a
    consumer does (measured: ~13 µs against ~4 µs of server CPU per message), and on a shared
    machine that CPU is taken from the reader. So reads that walk the log page after page
    (catch-up, rebuild, the audit) ask an ephemeral pull consumer (no acks, in memory, deleted
    by the server when idle) for the next page, with `no_wait`: the server sends what is stored
    now and says when there is no more. (Tried: keeping a request in flight ahead of the reader
    made catch-up slower here, the bus thread then taking the GIL from the folding more often.)

    The page's frames are cut as they arrive into log records (`LogRecord`): the usual frame (a
    UUID-keyed event of this recorder, its own headers first, as `_insert` writes them) with one
    compiled pattern over its control line and leading headers; any other frame of the page
    (another recorder's message, another header layout) field by field, exactly.

    Only used where a read may return fewer events than exist (read-ahead); anything unusual
    (a gap in the consumer's sequence, a status, a timeout, a refused consumer) returns None
    and the caller reads with direct gets instead. Loop thread only."""

    def __init__(self, recorder: JetStreamRecorder, filter_subject: str) -> None:
        self.recorder = recorder
        self.filter_subject = filter_subject
        self.prefix = recorder._subject_prefix.encode()
        self.lock = asyncio.Lock()
        self.nc: Any = None
        self.sid: int | None = None
        self.inbox = ""
        self.consumer: str | None = None
        self.next_seq = 0  # where the consumer's next delivery starts
        # from here up to next_seq the consumer delivered no event of this recorder: a read
        # that starts anywhere in between goes on from next_seq
        self.clear_from = 0
        # frames below this stream sequence were read another way (direct gets): skipped
        self.skip_below = 0
        self.below = 0  # frames of this page below skip_below
        self.dseq = 0  # the consumer sequence of its last delivery
        self.disabled_until = 0.0
        self.want = 0
        self.done: asyncio.Future[str | None] | None = None
        # the page being read: its records, its frames (records + other subjects' messages),
        # the consumer sequences of its first and last frame
        self.records: list[LogRecord] = []
        self.frames = 0
        self.first_d = 0
        self.last_d = 0
        self.last_seq = 0  # the stream sequence of its last frame
        self.cut = 4  # dots cut from the right of an ack reply as far as the stream sequence
        self.fast: Any = None  # the compiled usual frame, once the first reply shows its form
        self.ids: dict[bytes, str] = {}  # subject token → id text
        self.topics: dict[bytes, str] = {}
        self.odd_frames = 0  # frames taken field by field, for the tests

    # -- frames (loop thread, from the parser) ---------------------------------------------

    def _on_msg(self, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        """A message of this reader's inbox that came through nats-py's own parse."""
        done = self.done
        if done is None or done.done():
            return
        if not reply:  # a status: 404 no messages, 408 / 409 the request ended
            status = headers[9:12].decode("ascii", "replace") if headers else "?"
            done.set_result(None if status in ("404", "408") else status)
            return
        try:
            self._take(subject, reply, data, headers or b"")
        except Exception as e:  # noqa: BLE001 - the read fails; the caller reads another way
            if not done.done():
                done.set_exception(e)

    def _take(self, subject: bytes, reply: bytes, data: bytes, headers: bytes) -> None:
        """One frame of the page, field by field."""
        self.odd_frames += 1
        if not self.frames and not self.records:
            self.cut = 4 if reply.count(b".") == 8 else 5
        tokens = reply.rsplit(b".", self.cut)
        seq, d = int(tokens[1]), int(tokens[2])
        self.last_seq = seq
        if self.fast is None:
            self._learn(tokens[0])
        if not self.frames:
            self.first_d = d
        elif d != self.last_d + 1:
            raise PublishRejected(f"bulk read gap: consumer sequence {d} after {self.last_d}")
        self.last_d = d
        self.frames += 1
        if seq < self.skip_below:
            self.below += 1
        elif subject.startswith(self.prefix):
            try:
                oid_text, is_uuid, version, topic = event_fields(headers)
            except (KeyError, ValueError):
                # a stray: skipped and reported; the subject's end is looked up again on its
                # next write rather than remembered from a message that is no event
                name = subject.decode("utf-8", "replace")
                strays().report(seq, name)
                self.recorder._cache.pop(name, None)
            else:
                self._learned(subject.decode(), version, seq)
                self.records.append((seq, oid_text, is_uuid, version, topic, bytes(data)))
        if self.frames >= self.want and self.done is not None and not self.done.done():
            self.done.set_result(None)

    def _learn(self, head: bytes) -> None:
        """Compile the usual frame of this consumer: `head` is its ack reply up to the delivery
        count ($JS.ACK.[<domain>.<account>.]<stream>.<consumer>.<delivered>)."""
        ack = head.rpartition(b".")[0] + b"."
        # (the subject's token is checked to be a UUID's canonical text where it is first seen;
        # after the stream and consumer sequences: the timestamp, pending count, any token)
        self.fast = re.compile(
            b"HMSG " + re.escape(self.prefix) + rb"([^ \r\n]+) "
            + str(self.sid).encode() + b" " + re.escape(ack)
            + rb"\d+\.(\d+)\.(\d+)\.[^ \r\n]+ (\d+) (\d+)\r\n"
            + b"NATS/1\\.0\r\n"
            + re.escape(f"{HDR_ORIGINATOR_ID}: ".encode()) + rb"\1\r\n"
            + re.escape(f"{HDR_ID_KIND}: uuid\r\n{HDR_VERSION}: ".encode()) + rb"(\d+)\r\n"
            + re.escape(f"{HDR_TOPIC}: ".encode()) + rb"([^\r\n]*)\r\n")

    def _learned(self, subject: str, version: int, seq: int) -> None:
        # a subject this recorder tracks learns its new end, as in _select_notifications
        # (a stale entry would make its next write conflict); one it does not track is
        # looked up by that write anyway, so it is left out here, unless the recorder asked
        # to remember every subject it reads
        cache = self.recorder._cache
        known = cache.get(subject)
        if known is None:
            if self.recorder.remember_subjects_read:
                cache[subject] = SubjectState(version, seq)
                if len(cache) > SUBJECT_CACHE_MAX:
                    self.recorder.trim_cache()
        elif seq >= known.last_seq:
            cache[subject] = SubjectState(version, seq)

    def _cut(self, view: bytes, pos: int) -> int:
        """Take this reader's frames from view[pos:]; the position after the last one taken."""
        done = self.done
        if done is None or done.done():
            return pos
        try:
            return self._cut_frames(view, pos)
        except Exception as e:  # noqa: BLE001 - the read fails; the caller reads another way
            if not done.done():
                done.set_exception(e)
            return pos

    def _cut_frames(self, view: bytes, pos: int) -> int:
        size = len(view)
        want = self.want
        while self.frames < want:
            fast = self.fast
            if fast is not None:
                # the usual frames, as many as there are in a row: a few C calls each
                match = fast.match
                ids, topics = self.ids, self.topics
                append = self.records.append
                learn = bool(self.recorder._cache) or self.recorder.remember_subjects_read
                skip_below, below = self.skip_below, self.below
                n = self.frames
                first = n == 0
                last = self.last_d
                taken = b""
                s = 0
                while n < want:
                    m = match(view, pos)
                    if m is None:
                        break
                    token, seq, d, hlen, tlen, version, topic = m.groups()
                    body = m.end(5) + 2
                    end = body + int(tlen)
                    if end + 2 > size:
                        break  # the rest of the message is still on its way
                    if first:
                        last = int(d) - 1
                        self.first_d = last + 1
                        first = False
                    text = ids.get(token)
                    if text is None:
                        if not UUID_TEXT.fullmatch(token):
                            break  # not a UUID's canonical text: field by field
                        if len(ids) >= RECORD_IDS_LIMIT:
                            ids.clear()
                        text = ids[token] = token.decode()
                    t = topics.get(topic)
                    if t is None:
                        t = topics[topic] = topic.decode().strip()
                    s = int(seq)
                    if s < skip_below:
                        below += 1
                    else:
                        if learn:
                            self._learned(self.recorder._subject_prefix + text, int(version), s)
                        append((s, text, True, int(version), t, view[body + int(hlen):end]))
                    pos = end + 2
                    n += 1
                    last += 1
                    taken = d
                self.below = below
                if n != self.frames:
                    # the consumer sequences of this run: as many as its frames, in a row
                    if int(taken) != last:
                        raise PublishRejected(
                            f"bulk read gap: consumer sequence {int(taken)}, expected {last}")
                    self.frames = n
                    self.last_d = last
                    self.last_seq = s
                    if n >= want:
                        break
            # any other frame of this reader (or the first of the page), field by field
            if not view.startswith(b"HMSG ", pos):
                break
            eol = view.find(b"\r\n", pos)
            if eol < 0:
                break
            parts = view[pos + 5:eol].split()
            if len(parts) != 5 or int(parts[1]) != self.sid:
                break  # a status, or another subscription's message: the parser's own way
            subject, _sid, reply, hlen, tlen = parts
            body = eol + 2
            split = body + int(hlen)
            end = body + int(tlen)
            if end + 2 > size:
                break
            pos = end + 2
            self._take(bytes(subject), bytes(reply), bytes(view[split:end]),
                       bytes(view[body:split]))
        if self.frames >= want and not self.done.done():  # type: ignore[union-attr]
            self.done.set_result(None)  # type: ignore[union-attr]
        return pos

    # -- the consumer (loop thread) ----------------------------------------------------------

    async def _reset(self) -> None:
        nc, consumer = self.nc, self.consumer
        self.consumer = None
        if consumer is not None and nc is not None and not nc.is_closed:
            # best effort: the server deletes an idle consumer anyway
            with contextlib.suppress(Exception):
                await nc.publish(f"$JS.API.CONSUMER.DELETE.{self.recorder.stream}.{consumer}", b"")

    async def _open(self, start: int) -> None:
        await self._reset()
        nc = await self.recorder.runtime.connection()
        # nats-py reads 32 kB from the socket at a time: one event-loop turn and one parse per
        # ~50 events of a page; up to 256 kB cuts those turns (docs/performance-log.md)
        widen_reads(nc, READ_SIZE)
        if nc is not self.nc or self.sid is None:
            self.nc = nc
            self.inbox = nc.new_inbox()
            sub = await subscribe_raw_msgs(nc, self.inbox, self._on_msg)
            self.sid = sub._id
        stream = self.recorder.stream
        config = {
            "deliver_policy": "by_start_sequence", "opt_start_seq": start,
            "ack_policy": "none", "filter_subject": self.filter_subject,
            "inactive_threshold": LOG_READER_IDLE_NS, "mem_storage": True,
            "num_replicas": 1, "max_waiting": 4,
        }
        reply = await nc.request(
            f"$JS.API.CONSUMER.CREATE.{stream}",
            json.dumps({"stream_name": stream, "config": config}).encode(),
            timeout=self.recorder.timeout,
        )
        info = json.loads(reply.data or b"{}")
        if "error" in info or not info.get("name"):
            raise PublishRejected(f"bulk reader consumer refused: {info.get('error')}")
        self.consumer = info["name"]
        self.fast = None  # its replies name the new consumer
        self.next_seq = self.clear_from = start
        self.dseq = 0

    async def read(self, start: int, limit: int) -> tuple[list[LogRecord], int, int] | None:
        """Up to `limit` messages from `start` on, in order, as the stream holds them now:
        (the records of this recorder's events among them, how many messages that was, the
        sequence after the last one); None: read some other way."""
        loop = asyncio.get_running_loop()
        if loop.time() < self.disabled_until:
            return None
        async with self.lock:
            cutting = False
            try:
                # the consumer goes on where it is when nothing of this recorder lies between
                # it and `start`, or `start` is a few messages ahead of it (the last page came
                # from direct gets): those are skipped; anything else is a new consumer
                if self.consumer is not None and self.clear_from <= start <= self.next_seq:
                    start = self.next_seq
                if self.consumer is None or not 0 <= start - self.next_seq <= _SKIP_MAX:
                    await self._open(start)
                skip = start - self.next_seq
                self.skip_below = start
                self.below = 0
                self.records = []
                self.frames = 0
                self.want = limit + skip
                self.done = loop.create_future()
                assert self.sid is not None
                set_frame_cutter(self.nc, self.sid, self._cut)
                cutting = True
                # the messages stepped over count against the pull: asked for `limit` alone,
                # the server ends it short of the page without a status, and the read waits
                await self.nc.publish(
                    f"$JS.API.CONSUMER.MSG.NEXT.{self.recorder.stream}.{self.consumer}",
                    json.dumps({"batch": self.want, "no_wait": True}).encode(), reply=self.inbox)
                status = await asyncio.wait_for(self.done, self.recorder.timeout)
                if status is not None:
                    raise PublishRejected(f"bulk read ended with status {status}")
                if self.frames:
                    if self.first_d != self.dseq + 1:
                        raise PublishRejected(
                            f"bulk read gap: consumer sequence {self.first_d} after {self.dseq}")
                    self.dseq = self.last_d
                records, frames = self.records, self.frames - self.below
                if self.frames:
                    self.next_seq = self.last_seq + 1
                    self.clear_from = records[-1][0] + 1 if records else max(
                        self.clear_from, start)
                if len(records) > limit:
                    # only where the skipped stretch had gaps in its sequences, which the
                    # log (no deletes) never has: read the other way
                    raise PublishRejected("bulk read: a skip past a gap gave more than asked")
                return records, frames, self.next_seq
            except asyncio.CancelledError:
                await self._reset()
                raise
            except Exception:  # noqa: BLE001 - any trouble: the caller reads with direct gets
                await self._reset()
                # not again for a while if the consumer itself is refused (permissions, limits)
                self.disabled_until = loop.time() + 5.0
                return None
            finally:
                if cutting and self.sid is not None:
                    set_frame_cutter(self.nc, self.sid, None)
                self.done = None
                self.records = []


