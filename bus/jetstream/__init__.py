"""The eventsourcing persistence module on JetStream (`PERSISTENCE_MODULE=bus.jetstream`).

Owns the recorders (one subject per aggregate, atomic batches per save, tracking in the same batch).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import json
import marshal
import os
import re
import signal
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import nats.aio.client
import nats.errors
from eventsourcing.persistence import (
    AggregateRecorder,
    ApplicationRecorder,
    InfrastructureFactory,
    IntegrityError,
    ListenNotifySubscription,
    Notification,
    ProcessRecorder,
    StoredEvent,
    Subscription,
    Tracking,
    TrackingRecorder,
    Transcoder,
)
from eventsourcing.utils import Environment, resolve_topic, strtobool
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription
from nats.js.errors import NotFoundError
from nats.protocol.parser import AWAITING_CONTROL_LINE, Parser

from bus.errors import BatchTooLarge, BusError, BusUnavailable, PublishRejected
from bus.runtime import BusRuntime, get_runtime, translate
from bus.streams import ensure_event_stream
from bus.subjects import (
    EVENTS_PREFIX,
    EVENTS_STREAM,
    event_subject,
    is_token,
    token,
    tracking_subject,
)
from bus.transcoder import MsgspecTranscoder

# the server's atomic-batch limit (ADR-50 default max batch size); larger saves are refused, never split
MAX_BATCH = 1000

HDR_ORIGINATOR_ID = "Pool-Originator-Id"
HDR_ID_KIND = "Pool-Originator-Id-Kind"
HDR_VERSION = "Pool-Originator-Version"
HDR_TOPIC = "Pool-Topic"
HDR_TRACKING_ID = "Pool-Tracking-Id"
HDR_UPSTREAM = "Pool-Upstream"
HDR_EXPECTED_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
HDR_BATCH_ID = "Nats-Batch-Id"
HDR_BATCH_SEQ = "Nats-Batch-Sequence"
HDR_BATCH_COMMIT = "Nats-Batch-Commit"

# JetStream's "wrong last sequence" answers: 10071 for a plain publish, 10164 inside a batch
_WRONG_LAST_SEQUENCE = frozenset({10071, 10164})

DEFAULT_URL = "nats://127.0.0.1:4222"
REQUEST_TIMEOUT = 10.0
_DIRECT_BATCH = 1000


@dataclass
class _SubjectState:
    """What this process last saw at the end of one subject."""

    last_version: int | None
    last_seq: int


def originator_token(originator_id: UUID | str) -> str:
    """The subject token for an id; ids that are not already tokens are hashed so they stay distinct."""
    s = str(originator_id)
    if is_token(s):
        return s
    return "h-" + hashlib.sha256(s.encode("utf8")).hexdigest()[:40]


def _stored_event_from(headers: dict[str, str], data: bytes) -> StoredEvent:
    oid: UUID | str = headers[HDR_ORIGINATOR_ID]
    if headers.get(HDR_ID_KIND) == "uuid":
        oid = UUID(oid)  # type: ignore[arg-type]
    return StoredEvent(
        originator_id=oid,
        originator_version=int(headers[HDR_VERSION]),
        topic=headers[HDR_TOPIC],
        state=bytes(data or b""),
    )


_VALUE_NEWLINES = str.maketrans({"\r": " ", "\n": " "})


def _header_value(v: str) -> str:
    """`v` as nats-py would send it as a header value: trimmed, CR/LF turned into spaces."""
    if "\r" in v or "\n" in v or v != v.strip():
        return v.strip().translate(_VALUE_NEWLINES)
    return v


def _header_dict(lines: str) -> dict[str, str]:
    """Header lines as `_publish` renders them ("Key: value\\r\\n"…) back as a dict, for the
    one message that goes through nats-py's request. Keys never hold ": "; values may."""
    out: dict[str, str] = {}
    for line in lines.split("\r\n"):
        if line:
            k, _, v = line.partition(": ")
            out[k] = v
    return out


def _send_frames(nc: Any, frames: bytes, count: int) -> None:
    """Queue pre-framed PUB/HPUB bytes on nats-py's outbound buffer, as its publish would (the
    next flush writes them, in order, before anything queued later)."""
    if nc.is_closed:
        raise nats.errors.ConnectionClosedError
    if nc.is_draining_pubs:
        raise nats.errors.ConnectionDrainingError
    pending = nc._pending_data_size  # nats-py has no public raw-write call
    if not nc.is_connected and pending + len(frames) > nc._max_pending_size:
        raise nats.errors.OutboundBufferLimitError
    nc._pending.append(frames)
    nc._pending_data_size = pending + len(frames)
    nc.stats["out_msgs"] += count
    nc.stats["out_bytes"] += len(frames)


async def _never_called(_: Msg) -> None:  # pragma: no cover - raw subscriptions skip callbacks
    pass


def _parse_headers(raw: bytes | None) -> dict[str, str]:
    """A NATS header block as nats-py parses it (inline status as "Status"/"Description"),
    for the few well-formed headers a JetStream direct get carries: a split, not a scan."""
    if not raw:
        return {}
    lines = raw.decode("utf-8", "replace").split("\r\n")
    out: dict[str, str] = {}
    first = lines[0]
    if len(first) > 9 and first[8] == " ":  # "NATS/1.0 404 Message Not Found"
        status, _, desc = first[9:].strip().partition(" ")
        if status.isdigit():
            out["Status"] = status
        if desc:
            out["Description"] = desc
    for line in lines[1:]:
        if line:
            k, sep, v = line.partition(":")
            if sep:
                out[k.strip()] = v.strip()
    return out


_KEY_ID = "\r\n" + HDR_ORIGINATOR_ID + ":"
_KEY_KIND = "\r\n" + HDR_ID_KIND + ":"
_KEY_VERSION = "\r\n" + HDR_VERSION + ":"
_KEY_TOPIC = "\r\n" + HDR_TOPIC + ":"
_UUIDS: dict[str, UUID] = {}  # ids seen in log reads: one parse per aggregate, not per event


def _uuid_of(text: str) -> UUID:
    """UUID(text), one object per id while few ids are seen (every entry of the table is one
    more object for the cyclic collector to walk, so it is emptied once it grows)."""
    got = _UUIDS.get(text)
    if got is None:
        if len(_UUIDS) >= 20_000:
            _UUIDS.clear()
        got = _UUIDS[text] = UUID(text)
    return got


def _header(text: str, key: str) -> str | None:
    """The value of `key` ("\r\nName:") in a header block's text, as _parse_headers gives it."""
    i = text.find(key)
    if i < 0:
        return None
    i += len(key)
    return text[i:text.find("\r\n", i)].strip()


class _FastParser(Parser):
    """nats-py's parser with a fast lane: a run of HMSG frames for raw-routed subscriptions at
    the head of the buffer is cut with find/split and handed to their handlers directly (no
    regex tries, no coroutine per message); anything else, from the first frame that is not
    such a message, goes through nats-py's own parse, unchanged.

    While a bulk log read waits for its page, its frame cutter (`_RawRouter.frame_handlers`)
    takes a whole run of its frames in one call, from one immutable copy of the buffer."""

    async def parse(self, data: bytes = b"") -> None:
        buf = self.buf
        buf.extend(data)
        router: _RawRouter | None = getattr(self.nc, "_pool_raw_router", None)
        if self.state == AWAITING_CONTROL_LINE and router is not None:
            handlers, msg_handlers = router.handlers, router.msg_handlers
            cutters = list(router.frame_handlers.values())
            pos, size = 0, len(buf)
            # one copy of the buffer per read from the socket, so a cutter's slices are bytes
            # (one copy each) instead of bytearrays copied twice
            view: bytes | bytearray = bytes(buf) if cutters and buf.startswith(b"HMSG ") else buf
            try:
                while view.startswith(b"HMSG ", pos):
                    if cutters:
                        new = pos
                        for cut in cutters:
                            new = cut(view, pos)
                            if new != pos:
                                break
                        if new != pos:
                            pos = new
                            continue
                    eol = view.find(b"\r\n", pos)
                    if eol < 0:
                        return  # the rest of the control line is still on its way
                    parts = view[pos + 5:eol].split()
                    if len(parts) == 5:
                        subject, sid_text, reply, hlen, tlen = parts
                    elif len(parts) == 4:
                        subject, sid_text, hlen, tlen = parts
                        reply = b""
                    else:
                        break
                    sid = int(sid_text)
                    handler = handlers.get(sid)
                    msg_handler = None if handler is not None else msg_handlers.get(sid)
                    if handler is None and msg_handler is None:
                        break
                    body = eol + 2
                    split = body + int(hlen)
                    end = body + int(tlen)
                    if end + 2 > size:
                        return  # the rest of the message is still on its way
                    headers = bytes(view[body:split])
                    payload = bytes(view[split:end])
                    pos = end + 2
                    if handler is not None:
                        handler(payload, headers)
                    elif msg_handler is not None:
                        msg_handler(bytes(subject), bytes(reply), payload, headers)
            finally:
                if pos:
                    del buf[:pos]
        if buf:
            await super().parse()


class _RawRouter:
    """Hands the raw messages of chosen subscriptions straight to a plain callback.

    Bulk log reads get thousands of messages per request; nats-py's per-message path (header
    parsing, a Msg object, a queue and a callback task each) costs several times what the read
    itself does. Subscriptions registered here bypass it; all others go through unchanged."""

    def __init__(self, nc: Any) -> None:
        self.handlers: dict[int, Any] = {}  # sid → handler(data, headers)
        self.msg_handlers: dict[int, Any] = {}  # sid → handler(subject, reply, data, headers)
        # sid → cutter(buffer, pos) → the position after the frames it took (pos: none)
        self.frame_handlers: dict[int, Any] = {}
        original = nc._process_msg  # the parser's one entry point for messages
        handlers = self.handlers
        msg_handlers = self.msg_handlers

        async def process_msg(
            sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
        ) -> None:
            handler = handlers.get(sid)
            if handler is not None:
                handler(data, headers)
                return
            handler = msg_handlers.get(sid)
            if handler is not None:
                handler(subject, reply, data, headers)
                return
            await original(sid, subject, reply, data, headers)

        nc._process_msg = process_msg

    @classmethod
    def of(cls, nc: Any) -> _RawRouter:
        router: _RawRouter | None = getattr(nc, "_pool_raw_router", None)
        if router is None:
            router = cls(nc)
            nc._pool_raw_router = router
            # same state, faster class: a partly parsed buffer carries over
            if type(nc._ps) is Parser:
                nc._ps.__class__ = _FastParser
        return router


_READ_SIZE = 262_144  # bytes per read from the socket while bulk reads run
_LOG_READER_IDLE_NS = 30_000_000_000  # a bulk reader's consumer goes away 30 s after its last read


# A log record of a bulk read: (stream sequence, originator id as text, whether that id is a
# UUID, originator version, topic, stored state). A UUID id comes as its canonical text (what
# str(UUID) gives), so a reader can key by it without building UUID objects.
LogRecord = tuple[int, str, bool, int, str, bytes]

RECORD_PAGE = 2000  # records per page of read_records
_RECORD_IDS_LIMIT = 100_000  # subject token → id text, per reader; cleared when it grows past this
_UUID_TEXT = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


_UNWRITTEN = _SubjectState(None, 0)  # a subject with no message, as a save expects it


def _record_of(n: Notification) -> LogRecord:
    oid = n.originator_id
    is_uuid = isinstance(oid, UUID)
    return (n.id, str(oid), is_uuid, n.originator_version, n.topic, n.state)


def _event_fields(raw: bytes) -> tuple[str, bool, int, str]:
    """(originator id text, uuid?, version, topic) of a stored event's header block, as
    the direct gets read it (a UUID id as its canonical text)."""
    text = raw.decode("utf-8", "replace")
    oid_text, version, topic = _header(text, _KEY_ID), _header(text, _KEY_VERSION), _header(
        text, _KEY_TOPIC)
    if oid_text is None or version is None or topic is None:
        raise KeyError(f"not a stored event's headers: {text[:200]!r}")
    is_uuid = _header(text, _KEY_KIND) == "uuid"
    if is_uuid:
        oid_text = str(UUID(oid_text))
    return oid_text, is_uuid, int(version), topic


class _LogReader:
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
        if subject.startswith(self.prefix):
            oid_text, is_uuid, version, topic = _event_fields(headers)
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
                cache[subject] = _SubjectState(version, seq)
        elif seq >= known.last_seq:
            cache[subject] = _SubjectState(version, seq)

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
                        if not _UUID_TEXT.fullmatch(token):
                            break  # not a UUID's canonical text: field by field
                        if len(ids) >= _RECORD_IDS_LIMIT:
                            ids.clear()
                        text = ids[token] = token.decode()
                    t = topics.get(topic)
                    if t is None:
                        t = topics[topic] = topic.decode().strip()
                    s = int(seq)
                    if learn:
                        self._learned(self.recorder._subject_prefix + text, int(version), s)
                    append((s, text, True, int(version), t, view[body + int(hlen):end]))
                    pos = end + 2
                    n += 1
                    last += 1
                    taken = d
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
        # nats-py's read loop asks the socket's stream for 32 kB at a time (and the stream
        # stops reading the socket past 64 kB): one turn of the event loop and one parse per
        # ~50 events of a page. Up to 256 kB (what asyncio takes from the socket at once) cuts
        # those turns by up to 8 (measured: ~1 µs less per event read). Both only bound a read:
        # smaller traffic is read as before
        nats.aio.client.DEFAULT_BUFFER_SIZE = max(nats.aio.client.DEFAULT_BUFFER_SIZE, _READ_SIZE)
        stream_reader = getattr(getattr(nc, "_transport", None), "_io_reader", None)
        if isinstance(getattr(stream_reader, "_limit", None), int):
            stream_reader._limit = max(stream_reader._limit, _READ_SIZE)  # type: ignore[union-attr]
        if nc is not self.nc or self.sid is None:
            self.nc = nc
            self.inbox = nc.new_inbox()
            sub: NatsSubscription = await nc.subscribe(self.inbox, cb=_never_called)
            self.sid = sub._id
            _RawRouter.of(nc).msg_handlers[sub._id] = self._on_msg
        stream = self.recorder.stream
        config = {
            "deliver_policy": "by_start_sequence", "opt_start_seq": start,
            "ack_policy": "none", "filter_subject": self.filter_subject,
            "inactive_threshold": _LOG_READER_IDLE_NS, "mem_storage": True,
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
        self.next_seq = start
        self.dseq = 0

    async def read(self, start: int, limit: int) -> tuple[list[LogRecord], int, int] | None:
        """Up to `limit` messages from `start` on, in order, as the stream holds them now:
        (the records of this recorder's events among them, how many messages that was, the
        sequence after the last one); None: read some other way."""
        loop = asyncio.get_running_loop()
        if loop.time() < self.disabled_until:
            return None
        async with self.lock:
            router: _RawRouter | None = None
            try:
                if self.consumer is None or self.next_seq != start:
                    await self._open(start)
                self.records = []
                self.frames = 0
                self.want = limit
                self.done = loop.create_future()
                router = _RawRouter.of(self.nc)
                router.frame_handlers[self.sid] = self._cut  # type: ignore[index]
                await self.nc.publish(
                    f"$JS.API.CONSUMER.MSG.NEXT.{self.recorder.stream}.{self.consumer}",
                    json.dumps({"batch": limit, "no_wait": True}).encode(), reply=self.inbox)
                status = await asyncio.wait_for(self.done, self.recorder.timeout)
                if status is not None:
                    raise PublishRejected(f"bulk read ended with status {status}")
                if self.frames:
                    if self.first_d != self.dseq + 1:
                        raise PublishRejected(
                            f"bulk read gap: consumer sequence {self.first_d} after {self.dseq}")
                    self.dseq = self.last_d
                if self.frames:
                    self.next_seq = self.last_seq + 1
                return self.records, self.frames, self.next_seq
            except asyncio.CancelledError:
                await self._reset()
                raise
            except Exception:  # noqa: BLE001 - any trouble: the caller reads with direct gets
                await self._reset()
                # not again for a while if the consumer itself is refused (permissions, limits)
                self.disabled_until = loop.time() + 5.0
                return None
            finally:
                if router is not None:
                    router.frame_handlers.pop(self.sid, None)  # type: ignore[arg-type]
                self.done = None
                self.records = []


async def _translated(coro: Any) -> Any:
    """`coro`'s result, its nats-py errors raised as bus.errors (as BusRuntime.run does)."""
    try:
        return await coro
    except BaseException as e:
        err = translate(e)
        if err is e:
            raise
        raise err from e


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
        # be fixed per recorder (application name, or name + "_snapshots" for snapshots)
        self.kind = token(kind)
        self._subject_prefix = event_subject(self.kind, "x")[:-1]
        self.tracking_owner = token(tracking_owner)
        self.timeout = timeout
        # only touched on the runtime's loop thread, so it needs no lock
        self._cache: dict[str, _SubjectState] = {}
        # a writer that follows the whole log (the scheduler) sets this: read-ahead pages then
        # record every subject's end they pass, as direct gets do, so its next write to an
        # aggregate it only read carries the right expectation without a look-up first
        self.remember_subjects_read = False
        # the stream's replica count, asked once; see `_replicated`
        self._replicas: int | None = None

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
            out.append((int(raw.seq), dict(raw.headers or {}), bytes(raw.data or b"")))
            seq = int(raw.seq) + 1
        return out

    async def _subject_state(self, subject: str) -> _SubjectState:
        state = self._cache.get(subject)
        if state is not None:
            return state
        last = await self._last_msg(subject)
        if last is None:
            state = _SubjectState(None, 0)
        else:
            headers, _, seq = last
            v = headers.get(HDR_VERSION) or headers.get(HDR_TRACKING_ID)
            state = _SubjectState(int(v) if v is not None else None, seq)
        self._remember(subject, state)
        return state

    def _remember(self, subject: str, state: _SubjectState) -> None:
        known = self._cache.get(subject)
        # a slower concurrent call must not move the cache backwards
        if known is None or state.last_seq >= known.last_seq:
            self._cache[subject] = state

    async def _direct_batch(
        self, filter_subject: str, start_seq: int, batch: int
    ) -> tuple[list[tuple[int, dict[str, str], bytes]], bool]:
        """Messages with seq ≥ start_seq on `filter_subject`, in order, and whether that was the end."""
        nc = await self.runtime.connection()
        router = _RawRouter.of(nc)
        inbox = nc.new_inbox()
        out: list[tuple[int, dict[str, str], bytes]] = []
        done: asyncio.Future[tuple[bool, str | None]] = asyncio.get_running_loop().create_future()

        def on_raw(data: bytes, raw_headers: bytes | None) -> None:
            if done.done():
                return
            headers = _parse_headers(raw_headers)
            status = headers.get("Status")
            if status:
                if status == "404":
                    done.set_result((True, None))
                elif status == "204":  # end of batch
                    pending = int(headers.get("Nats-Num-Pending", "0") or 0)
                    done.set_result((pending == 0, None))
                else:
                    done.set_result((True, status))
                return
            out.append((int(headers["Nats-Sequence"]), headers, data))

        sub: NatsSubscription = await nc.subscribe(inbox, cb=_never_called)
        router.handlers[sub._id] = on_raw  # the sid is how nats-py routes
        try:
            req = {"seq": max(start_seq, 1), "next_by_subj": filter_subject, "batch": batch}
            await nc.publish(
                f"$JS.API.DIRECT.GET.{self.stream}", json.dumps(req).encode(), reply=inbox
            )
            at_end, status = await asyncio.wait_for(done, self.timeout)
        finally:
            router.handlers.pop(sub._id, None)
            await sub.unsubscribe()
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
            msgs, at_end = await self._direct_batch(filter_subject, seq, _DIRECT_BATCH)
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
            reply = await nc.request(subject, payload, headers=_header_dict(lines),
                                     timeout=self.timeout)
        else:
            batch_id = uuid.uuid4().hex
            # every message but the commit goes out as ONE write of pre-framed HPUBs: nats-py's
            # per-message publish (validation, header building, a flush kick) costs about as
            # much as the server's whole batch; the commit is a request, flushed behind them.
            # Header blocks are rendered once per message from text (no dict per message)
            batch_lines = f"{HDR_BATCH_ID}: {batch_id}\r\n{HDR_BATCH_SEQ}: "
            limit = nc.max_payload
            chunks: list[bytes] = []
            for i, (subject, payload, lines) in enumerate(rendered[:-1], 1):
                if len(payload) > limit:
                    raise PublishRejected(
                        f"a message of {len(payload)} bytes exceeds max_payload {limit}")
                hdr = f"NATS/1.0\r\n{lines}{batch_lines}{i}\r\n\r\n".encode()
                chunks.append(f"HPUB {subject} {len(hdr)} {len(hdr) + len(payload)}\r\n".encode())
                chunks.append(hdr)
                chunks.append(payload)
                chunks.append(b"\r\n")
            _send_frames(nc, b"".join(chunks), n - 1)
            subject, payload, lines = rendered[-1]
            headers = _header_dict(lines)
            headers[HDR_BATCH_ID] = batch_id
            headers[HDR_BATCH_SEQ] = str(n)
            headers[HDR_BATCH_COMMIT] = "1"
            reply = await nc.request(subject, payload, headers=headers, timeout=self.timeout)
        ack = json.loads(reply.data or b"{}")
        err = ack.get("error")
        if err:
            if err.get("err_code") in _WRONG_LAST_SEQUENCE:
                for s in expects:
                    self._cache.pop(s, None)
                raise IntegrityError(f"concurrent write detected: {err.get('description')}")
            raise PublishRejected(f"JetStream refused the save: {err}")
        count = int(ack.get("count", 1) or 1)
        if count != n:  # pragma: no cover - the server acks the whole batch or nothing
            raise PublishRejected(f"batch ack counted {count} messages, sent {n}")
        return int(ack["seq"]) - n + 1

    async def _insert(
        self, stored_events: Sequence[StoredEvent], tracking: Tracking | None
    ) -> list[int]:
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
                             (f"{HDR_ORIGINATOR_ID}: {_header_value(str(oid))}\r\n"
                              f"{HDR_ID_KIND}: {kind}\r\n"))
                per_originator[oid] = known
            topic = topic_lines.get(e.topic)
            if topic is None:
                topic = topic_lines[e.topic] = f"{HDR_TOPIC}: {_header_value(e.topic)}\r\n"
            subjects_of.append(known[0])
            messages.append((known[0], e.state,
                             f"{known[1]}{HDR_VERSION}: {e.originator_version}\r\n{topic}"))
        by_subject: dict[str, StoredEvent] = {}  # subject → its first event in this save
        for s, e in zip(subjects_of, stored_events, strict=True):
            by_subject.setdefault(s, e)
        trk_subject = self.tracking_subject_for(tracking.application_name) if tracking else None
        subjects = list(by_subject) + ([trk_subject] if trk_subject else [])
        cache = self._cache
        # an aggregate's first event (version 1) needs no look-up: it expects its subject to
        # hold nothing yet (last sequence 0), and the server refuses the save otherwise, as a
        # conflict. Every new lease, node or account is saved without that round trip
        missing = [s for s in subjects if s not in cache and not (
            s in by_subject and by_subject[s].originator_version == 1)]
        if missing:
            await asyncio.gather(*(self._subject_state(s) for s in missing))
        expects: dict[str, int] = {}
        for s, first_event in by_subject.items():
            state = cache.get(s)
            if state is None:
                state = (_UNWRITTEN if first_event.originator_version == 1
                         else await self._subject_state(s))
            if (state.last_version is not None
                    and first_event.originator_version <= state.last_version):
                raise IntegrityError(
                    f"version {first_event.originator_version} of {first_event.originator_id} "
                    f"is not after the recorded version {state.last_version}"
                )
            expects[s] = state.last_seq
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
                     f"{HDR_UPSTREAM}: {_header_value(tracking.application_name)}\r\n"),
                )
            )
        first = await self._publish(messages, expects)
        ids = list(range(first, first + len(stored_events)))
        last_by_subject: dict[str, tuple[int, int]] = {}
        for s, e, seq in zip(subjects_of, stored_events, ids, strict=True):
            last_by_subject[s] = (e.originator_version, seq)
        for s, (version, seq) in last_by_subject.items():
            self._remember(s, _SubjectState(version, seq))
        if tracking is not None and trk_subject is not None:
            self._remember(trk_subject, _SubjectState(tracking.notification_id, first + len(stored_events)))
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
        return self.runtime.run(self._insert(stored_events, tracking), self.timeout + 5)

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
        return self.runtime.submit(_translated(self._insert(stored_events, None)))

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
                self._remember(subject, _SubjectState(None, 0))
                return []
            headers, data, seq = last
            e = _stored_event_from(headers, data)
            self._remember(subject, _SubjectState(e.originator_version, seq))
            if gt is not None and e.originator_version <= gt:
                return []
            return [e]
        events: list[StoredEvent] = []
        last_seen: tuple[int, int] | None = None
        start = 1
        known = self._cache.get(subject)
        if gt is not None and known is not None and known.last_version == gt and known.last_seq:
            # a fast-forward from the version we last saw: read only what came after it
            start = known.last_seq + 1
            last_seen = (gt, known.last_seq)
        # on a replicated stream, the leader says where the subject ends; the direct batches
        # (served by any replica) must reach that far, or the rest is read from the leader
        leader_last = 0
        if await self._replicated():
            last = await self._last_msg(subject)
            leader_last = last[2] if last is not None else 0
            if leader_last < start:
                self._remember(
                    subject, _SubjectState(*last_seen) if last_seen else _SubjectState(None, 0)
                )
                return []
        scanned: list[tuple[int, dict[str, str], bytes]] = []
        async for m in self._scan(subject, start, leader_last or None):
            scanned.append(m)
        reached = scanned[-1][0] if scanned else start - 1
        if leader_last > reached:
            scanned += await self._leader_tail(subject, reached, leader_last)
        for seq, headers, data in scanned:
            e = _stored_event_from(headers, data)
            last_seen = (e.originator_version, seq)
            if gt is not None and e.originator_version <= gt:
                continue
            if lte is not None and e.originator_version > lte:
                continue
            events.append(e)
        # the scan read to the end of the subject, so this is its true last message
        self._remember(
            subject, _SubjectState(*last_seen) if last_seen else _SubjectState(None, 0)
        )
        if desc:
            events.reverse()
        if limit is not None:
            events = events[:limit]
        return events

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


class JetStreamApplicationRecorder(JetStreamAggregateRecorder, ApplicationRecorder):
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
            batch = min(_DIRECT_BATCH, limit - len(out)) if not wanted else _DIRECT_BATCH
            # the whole stream in order, filtered here: the server's next-by-subject with a
            # wildcard costs it ~4x more per message than an unfiltered scan
            msgs, at_end = await self._direct_batch(">", seq, batch)
            for s, headers, data in msgs:
                if stop is not None and s > stop:
                    return out
                subject = headers.get("Nats-Subject", "")
                if not subject.startswith(prefix):
                    continue
                topic = headers[HDR_TOPIC]
                if wanted and topic not in wanted:
                    continue
                text = headers[HDR_ORIGINATOR_ID]
                oid: UUID | str = _uuid_of(text) if headers.get(HDR_ID_KIND) == "uuid" else text
                version = int(headers[HDR_VERSION])
                # a follower that reads the log learns each subject's end as it goes, so its
                # next write carries the right expectation instead of a guaranteed conflict
                self._remember(subject, _SubjectState(version, s))
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
        reader: _LogReader | None = self.__dict__.get("_log_reader")
        if reader is None:
            # the whole stream, filtered here: a wildcard filter costs the server ~9x more per
            # message than delivering everything (measured: ~44 µs against ~5 µs)
            reader = self.__dict__["_log_reader"] = _LogReader(self, ">")
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
            return [_record_of(n) for n in direct], (direct[-1].id + 1 if direct else start)
        return out, at

    def _read_records_forked(
        self, start: int, stop: int | None, page_size: int
    ) -> Iterator[list[LogRecord]]:
        try:
            r, w = os.pipe()
        except OSError:
            yield from self.read_records(start, stop, page_size=page_size)
            return
        try:
            pid = os.fork()
        except OSError:
            os.close(r)
            os.close(w)
            yield from self.read_records(start, stop, page_size=page_size)
            return
        if pid == 0:  # the child: its own loop thread and connection, nothing of the parent's
            code = 1
            try:
                os.close(r)
                runtime = BusRuntime(self.runtime.url)
                reader = JetStreamApplicationRecorder(
                    runtime, stream=self.stream, kind=self.kind,
                    tracking_owner=self.tracking_owner, timeout=self.timeout)
                with os.fdopen(w, "wb", buffering=1 << 20) as out:
                    for page in reader.read_records(start, stop, page_size=page_size):
                        # marshal: the same interpreter on both ends, and half pickle's cost
                        # for tuples of ints, strings and bytes
                        data = marshal.dumps(page)
                        out.write(len(data).to_bytes(8, "little"))
                        out.write(data)
                        out.flush()
                    out.write(bytes(8))  # the end: a page of no bytes
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        self.__dict__["_reader_child"] = pid  # for the tests
        at = start
        finished = False
        try:
            with os.fdopen(r, "rb", buffering=1 << 20) as got:
                while True:
                    head = got.read(8)
                    if len(head) != 8:
                        break  # the child ended without the end mark
                    size = int.from_bytes(head, "little")
                    if not size:
                        finished = True
                        break
                    data = got.read(size)
                    if len(data) != size:
                        break
                    page = marshal.loads(data)
                    at = page[-1][0] + 1
                    yield page
        finally:
            # the child ends once its pipe is closed (a write to it fails) or it is done
            if not finished:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.waitpid(pid, 0)
        if not finished and (stop is None or at <= stop):
            yield from self.read_records(at, stop, page_size=page_size)

    async def _read_ahead(self, start: int, limit: int, stop: int | None) -> list[Notification]:
        """The next page of a sequential read (`_read_records`), as notifications."""
        return self._notifications_from((await self._read_records(start, limit, stop))[0])

    @staticmethod
    def _notifications_from(records: list[LogRecord]) -> list[Notification]:
        new, setattr_ = object.__new__, object.__setattr__
        uuids = _UUIDS
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
        return self.runtime.submit(_translated(self._read_ahead(start, limit, stop)))

    def read_records(
        self, start: int, stop: int | None = None, *, page_size: int = RECORD_PAGE,
        reader_process: bool = False,
    ) -> Iterator[list[LogRecord]]:
        """Pages of this recorder's events from `start` up to `stop` (or to the end of the log
        as the pages reach it), as bare log records (`LogRecord`): what `select_notifications`
        gives, without a Notification object or a UUID per event, for readers that walk the
        whole log and look at most events only briefly (the credit audit). While the caller
        works on one page the next is already being read.

        `reader_process`: read and cut the pages in a forked child process with a connection of
        its own, which hands them over (marshalled) through a pipe, so that work runs beside the
        caller's instead of taking turns with it under one GIL (Linux, 2+ cores; not while
        this recorder tracks subjects it writes, which reads here would keep up to date).
        Should the child fail, the rest is read here."""
        start = max(start, 1)
        if reader_process and not self._cache and hasattr(os, "fork") and (
                os.cpu_count() or 1) > 1:
            yield from self._read_records_forked(start, stop, page_size)
            return

        def fetch(at: int) -> concurrent.futures.Future[tuple[list[LogRecord], int]]:
            if stop is not None and stop < at:
                done: concurrent.futures.Future[tuple[list[LogRecord], int]] = (
                    concurrent.futures.Future())
                done.set_result(([], at))
                return done
            return self.runtime.submit(_translated(self._read_records(at, page_size, stop)))

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
            sub = await nc.subscribe(self.events_filter, cb=_never_called)
            _RawRouter.of(nc).handlers[sub._id] = on_raw
            return sub

        sub = self.runtime.run(open_sub(), self.timeout)

        async def close_sub() -> None:
            nc = await self.runtime.connection()
            _RawRouter.of(nc).handlers.pop(sub._id, None)
            await sub.unsubscribe()

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
        self._remember(subject, _SubjectState(tid, seq))
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


class JetStreamFactory(InfrastructureFactory[JetStreamTrackingRecorder]):
    """Builds JetStream recorders from NATS_URL / NATS_STREAM / NATS_REPLICAS in the environment."""

    NATS_URL = "NATS_URL"
    POOL_NATS_URL = "POOL_NATS_URL"
    NATS_STREAM = "NATS_STREAM"
    NATS_REPLICAS = "NATS_REPLICAS"
    NATS_TIMEOUT = "NATS_TIMEOUT"
    CREATE_TABLE = "CREATE_TABLE"

    def __init__(self, env: Environment | Any | None) -> None:
        super().__init__(env)
        self.url = self.env.get(self.NATS_URL) or self.env.get(self.POOL_NATS_URL) or DEFAULT_URL
        self.stream = self.env.get(self.NATS_STREAM) or EVENTS_STREAM
        self.replicas = int(self.env.get(self.NATS_REPLICAS) or 1)
        self.timeout = float(self.env.get(self.NATS_TIMEOUT) or REQUEST_TIMEOUT)
        self.app_name = self.env.name or "default"
        self.runtime = get_runtime(self.url)
        self._stream_ensured = False

    def _ensure_stream(self) -> None:
        if self._stream_ensured or not strtobool(self.env.get(self.CREATE_TABLE) or "yes"):
            return

        async def go() -> None:
            await ensure_event_stream(
                await self.runtime.jetstream(), replicas=self.replicas, name=self.stream
            )

        self.runtime.run(go(), self.timeout + 5)
        self._stream_ensured = True

    def _kwargs(self, kind: str) -> dict[str, Any]:
        self._ensure_stream()
        return {
            "stream": self.stream,
            "kind": kind,
            "tracking_owner": self.app_name,
            "timeout": self.timeout,
        }

    def transcoder(self) -> Transcoder:
        if self.env.get(self.TRANSCODER_TOPIC):
            return super().transcoder()
        return MsgspecTranscoder()

    def aggregate_recorder(self, purpose: str = "events") -> AggregateRecorder:
        kind = self.app_name if purpose == "events" else f"{self.app_name}_{purpose}"
        return JetStreamAggregateRecorder(self.runtime, **self._kwargs(kind))

    def application_recorder(self) -> ApplicationRecorder:
        topic = self.env.get(self.APPLICATION_RECORDER_TOPIC)
        cls: type[JetStreamApplicationRecorder] = (
            resolve_topic(topic) if topic else JetStreamApplicationRecorder
        )
        return cls(self.runtime, **self._kwargs(self.app_name))

    def tracking_recorder(
        self, tracking_recorder_class: type[JetStreamTrackingRecorder] | None = None
    ) -> JetStreamTrackingRecorder:
        if tracking_recorder_class is None:
            topic = self.env.get(self.TRACKING_RECORDER_TOPIC)
            tracking_recorder_class = resolve_topic(topic) if topic else JetStreamTrackingRecorder
        assert tracking_recorder_class is not None
        return tracking_recorder_class(self.runtime, **self._kwargs(self.app_name))

    def process_recorder(self) -> ProcessRecorder:
        topic = self.env.get(self.PROCESS_RECORDER_TOPIC)
        cls: type[JetStreamProcessRecorder] = (
            resolve_topic(topic) if topic else JetStreamProcessRecorder
        )
        return cls(self.runtime, **self._kwargs(self.app_name))

    def close(self) -> None:
        # the runtime is shared by every factory in the process; it closes at exit
        pass


Factory = JetStreamFactory
