"""The tenants' lease feed (stream POOL_FEED, subjects `pool.feed.<tenant>.lease.<id>`): its
writer for the control plane, its pages for the replay service and its follower for tenants."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from bus.connection import connect
from bus.errors import (
    BusError,
    BusUnavailable,
    FeedRefused,
    PermissionDenied,
    PublishRejected,
)
from bus.headers import (
    HDR_EXPECTED_LAST_SEQ,
    HDR_LOG_SEQUENCE,
    HDR_SEQUENCE,
    HDR_STATUS,
    HDR_STREAM,
    HDR_SUBJECT,
)
from bus.junk import int_value, junk_values
from bus.runtime import BusRuntime, translate
from bus.streams import ensure_kv_bucket, ensure_stream, feed_stream_config
from bus.subjects import (
    FEED_STREAM,
    command_subject,
    feed_filter,
)
from bus.telemetry import TelemetryPage, read_page_async
from schemas.feed import FeedRecord

log = logging.getLogger(__name__)

BATCH_MAX = 999  # records per atomic batch (the server takes at most 1,000)
POSITION_KEY = "feed"  # in the positions bucket: the log sequence the feed is written up to
WRONG_LAST_SEQUENCE = 10071  # JetStream's err_code for a failed Nats-Expected-Last-Sequence
REPLAY_LIMIT = 500
# how far back a writer's start looks past junk at the feed's end for its own last record
# (further junk costs only records written again: the saved position still bounds them)
JUNK_WALK_BACK = 1000


class FeedConflict(BusError):
    """The feed's last sequence was not the one expected: another writer appended to it (or
    this one's append landed although its answer was lost). Nothing of the batch was stored."""

    code = "feed_conflict"


@dataclass(frozen=True)
class FeedPosition:
    """Where a writer resumes: the feed's last stored sequence, and the log sequence the
    feed is written up to (what the last record, or the saved position, says)."""

    feed_seq: int
    log_seq: int


class FeedWriter:
    """The control plane's side of the feed: a synchronous facade on a bus runtime. (What only
    the writer needs is imported here: a tenant's reader loads no eventsourcing.)"""

    def __init__(self, url: str, *, runtime: BusRuntime | None = None,
                 replicas: int = 1) -> None:
        from bus.runtime import get_runtime

        self.rt = runtime or get_runtime(url)
        self.replicas = replicas
        self.batches = 0

    def ensure(self) -> None:
        from bus.local.auth import speaks_as_role

        if speaks_as_role(self.rt.url):
            return  # a role's user may not change streams: the operator made them

        from bus.agentbus import POSITIONS_BUCKET

        async def go() -> None:
            js = await self.rt.jetstream()
            await ensure_stream(js, feed_stream_config(self.replicas))
            await ensure_kv_bucket(js, POSITIONS_BUCKET, replicas=self.replicas)

        self.rt.run(go())

    def position(self) -> FeedPosition:
        """The stream's last sequence and the log sequence its last record was made from; when
        that record has aged out, the saved position (the later of the two is the truth)."""
        from bus.agentbus import POSITIONS_BUCKET

        async def go() -> FeedPosition:
            js = await self.rt.jetstream()
            info = await js.stream_info(FEED_STREAM)
            last = int(info.state.last_seq or 0)
            log_seq = await _last_written(js, last) if int(info.state.messages or 0) else 0
            kv = await js.key_value(POSITIONS_BUCKET)
            with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                entry = await kv.get(POSITION_KEY)
                saved = int_value(entry.value, entry.revision,
                                  f"$KV.{POSITIONS_BUCKET}.{POSITION_KEY}")
                log_seq = max(log_seq, saved or 0)  # junk there: the stream's own
            return FeedPosition(last, log_seq)

        return self.rt.run(go())

    def save_position(self, log_seq: int) -> None:
        """Record that the feed is written up to `log_seq` (read back when its last record
        has aged out of the stream)."""
        from bus.agentbus import POSITIONS_BUCKET

        async def go() -> None:
            js = await self.rt.jetstream()
            kv = await js.key_value(POSITIONS_BUCKET)
            await kv.put(POSITION_KEY, str(log_seq).encode())

        self.rt.run(go())

    def append(self, records: Sequence[tuple[str, bytes, int]], *, expect_last: int) -> int:
        """Store `records` (subject, body, log sequence; at most BATCH_MAX) as one atomic batch
        whose first message expects the stream's last sequence to be `expect_last`; returns
        the new last sequence. Raises FeedConflict when the stream had moved on: nothing of
        the batch was stored."""
        if not records:
            return expect_last
        if len(records) > BATCH_MAX:
            raise ValueError(f"at most {BATCH_MAX} records a batch, not {len(records)}")
        last = self.rt.run(self._batch(records, expect_last))
        self.batches += 1
        return last

    async def _batch(self, chunk: Sequence[tuple[str, bytes, int]], expect_last: int) -> int:
        from bus.jetstream.natsfast import publish_atomic

        nc = await self.rt.connection()
        messages = [(subject, body, {HDR_LOG_SEQUENCE: str(log_seq)})
                    for subject, body, log_seq in chunk]
        messages[0][2][HDR_EXPECTED_LAST_SEQ] = str(expect_last)
        answer = await publish_atomic(nc, messages)  # the runtime translates what fails
        error = answer.get("error")
        if error:
            if error.get("err_code") == WRONG_LAST_SEQUENCE:
                raise FeedConflict(f"the feed moved on: {error.get('description')}")
            raise PublishRejected(f"the feed refused a batch: {error.get('description')}")
        return int(answer["seq"])


async def _last_written(js: Any, last: int) -> int:
    """The log sequence of the writer's last record at or before feed sequence `last`, passing
    over (and reporting) up to JUNK_WALK_BACK messages without its header: server answers a
    client aimed at a feed subject as its reply subject. 0 when none is found."""
    for seq in range(last, max(0, last - JUNK_WALK_BACK), -1):
        try:
            msg = await js.get_msg(FEED_STREAM, seq=seq, direct=True)
        except nats.js.errors.NotFoundError:
            continue  # aged out or never stored
        at = (msg.headers or {}).get(HDR_LOG_SEQUENCE)
        if at and at.isdigit():
            return int(at)
        junk_values().report(seq, msg.subject)
    return 0


# -- reading ------------------------------------------------------------------------------------


async def last_sequence(nc: Client) -> int:
    """The feed's last stored sequence (0 before its first record)."""
    try:
        info = await nc.jetstream().stream_info(FEED_STREAM)
    except nats.js.errors.NotFoundError:
        return 0
    except Exception as e:
        raise translate(e) from e
    return int(info.state.last_seq or 0)


async def read_page(nc: Client, tenant: str, *, lease: str | None = None, after_seq: int = 0,
                    limit: int = REPLAY_LIMIT) -> TelemetryPage:
    """Stored records of `tenant`'s feed (one lease, or all) after feed sequence `after_seq`,
    at most `limit`, in stream order (the replay service reads on a tenant's behalf)."""
    try:
        return await read_page_async(nc, feed_filter(tenant, lease), after_seq=after_seq,
                                     limit=limit, stream=FEED_STREAM)
    except BusUnavailable:
        try:
            await nc.jetstream().stream_info(FEED_STREAM)
        except nats.js.errors.NotFoundError:
            return TelemetryPage([], True)  # no record written yet: nothing to read
        raise


@dataclass(frozen=True)
class FeedItem:
    """One record as a reader sees it: its feed sequence (what a reader resumes after), its
    subject, and the record (None when the body did not decode; then `error` says why)."""

    seq: int
    subject: str
    record: FeedRecord | None
    error: str | None = None

    @classmethod
    def of(cls, seq: int, subject: str, body: bytes) -> FeedItem:
        try:
            return cls(seq, subject, msgspec.json.decode(body, type=FeedRecord))
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return cls(seq, subject, None, str(e))


class FeedFollower:
    """A tenant's reader of its own feed, on a connection made as that tenant: what is stored
    after `after` (pages from the control plane; None: from the feed's end now), then each
    record as it is stored (the live
    republish, subscribed to before the first page so nothing falls in between). A gap in the
    live messages of a lease, or a reconnect, reads the pages again from the last sequence."""

    def __init__(self, nc: Client, tenant: str, *, lease: str | None = None,
                 after: int | None = 0, refused: asyncio.Future[str] | None = None) -> None:
        self.nc = nc
        self.tenant = tenant
        self.lease = lease
        self._from_end = after is None  # only what is stored from now on
        self.last = after or 0
        self._start = after or 0
        self._live: asyncio.Queue[tuple[int, int, str, bytes]] = asyncio.Queue()
        self._seen: dict[str, int] = {}  # last sequence delivered, per stored subject
        self._catch_up = asyncio.Event()
        self._refused = refused
        self._sub: Any = None

    def reconnected(self) -> None:
        """The connection came back: live messages may have been missed while it was down."""
        self._catch_up.set()

    async def _on_live(self, msg: Msg) -> None:
        headers = msg.headers or {}
        if headers.get(HDR_STATUS):
            return
        if headers.get(HDR_STREAM) != FEED_STREAM:
            # not the feed's republish: a direct get's answer some client aimed here as its
            # reply subject, carrying the asker's own body (the server sets this header)
            at = headers.get(HDR_SEQUENCE, "")
            junk_values().report(int(at) if at.isdigit() else 0, msg.subject, stored=False)
            return
        try:
            seq = int(headers[HDR_SEQUENCE])
            previous = int(headers.get("Nats-Last-Sequence", "0") or 0)
        except (KeyError, ValueError):
            return
        await self._live.put((seq, previous, headers.get(HDR_SUBJECT, ""), msg.data))

    async def _subscribe(self) -> None:
        self._sub = await self.nc.subscribe(feed_filter(self.tenant, self.lease, live=True),
                                            cb=self._on_live)
        # a refused subscription is answered with -ERR before the PONG of this flush
        await self.nc.flush(timeout=5)
        await asyncio.sleep(0)
        self._check_refused()

    def _check_refused(self) -> None:
        if self._refused is not None and self._refused.done():
            raise PermissionDenied(self._refused.result())

    async def _page(self, *, from_end: bool = False) -> tuple[list[FeedItem], bool]:
        body: dict[str, Any] = {"after_seq": self.last, "limit": REPLAY_LIMIT}
        if self.lease:
            body["lease"] = self.lease
        if from_end:
            body = {"from_end": True}
        subject = command_subject(self.tenant, "feed", "replay")
        try:
            reply = await self.nc.request(subject, msgspec.json.encode(body), timeout=10)
        except nats.errors.NoRespondersError:
            raise BusUnavailable(f"no control plane answers {subject}") from None
        except Exception as e:
            self._check_refused()
            raise translate(e) from e
        env = msgspec.json.decode(reply.data)
        if not env.get("ok"):
            err = env.get("error") or {}
            raise FeedRefused(str(err.get("code")), str(err.get("message")))
        result = env.get("result") or {}
        if from_end:
            self.last = self._start = int(result.get("last_seq") or 0)
        items = [FeedItem.of(int(r["seq"]), str(r["subject"]),
                             msgspec.json.encode(r.get("record")))
                 for r in result.get("records", [])]
        return items, bool(result.get("at_end", True))

    def _fresh(self, item: FeedItem) -> bool:
        if item.seq <= self.last:
            return False
        self.last = item.seq
        self._seen[item.subject] = item.seq
        if item.record is None:
            # no record the writer stores: a server's answer some client aimed at the subject
            # as its reply subject (nats-server checks no permission on one). Passed over.
            junk_values().report(item.seq, item.subject)
            return False
        return True

    async def _replay(self) -> AsyncIterator[FeedItem]:
        while True:
            items, at_end = await self._page()
            for item in items:
                if self._fresh(item):
                    yield item
            if at_end or not items:
                return

    async def items(self, *, until_caught_up: bool = False,
                    on_ready: Callable[[], None] | None = None) -> AsyncIterator[FeedItem]:
        """Every record after `after`, in feed order, none twice, until the caller stops (or,
        `until_caught_up`, once what was stored is read); `on_ready` is called once the
        stored ones are read and the live ones are awaited."""
        await self._subscribe()
        try:
            if self._from_end:  # subscribed first: what is stored after this comes live
                await self._page(from_end=True)
            async for item in self._replay():
                yield item
            if on_ready is not None:
                on_ready()
            while not until_caught_up:
                if self._catch_up.is_set():
                    self._catch_up.clear()
                    async for item in self._replay():
                        yield item
                    continue
                getter = asyncio.ensure_future(self._live.get())
                waker = asyncio.ensure_future(self._catch_up.wait())
                try:
                    done, _ = await asyncio.wait({getter, waker},
                                                 return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waker.cancel()
                    if not getter.done():
                        getter.cancel()
                self._check_refused()
                if getter not in done or getter.cancelled():
                    continue
                seq, previous, subject, body = getter.result()
                if seq <= self.last:
                    continue
                known = self._seen.get(subject, self._start)
                if previous > known:  # a record of this lease we have not seen: read pages
                    self._catch_up.set()
                    self._live.put_nowait((seq, previous, subject, body))
                    continue
                item = FeedItem.of(seq, subject, body)
                if self._fresh(item):
                    yield item
        finally:
            if self._sub is not None:
                with contextlib.suppress(Exception):  # the connection may be gone
                    await self._sub.unsubscribe()


async def follow(url: str, tenant: str, *, lease: str | None = None, after: int | None = 0,
                 user: str | None = None, password: str | None = None,
                 inbox_prefix: str | None = None, until_caught_up: bool = False,
                 on_ready: Callable[[], None] | None = None,
                 ) -> AsyncGenerator[FeedItem, None]:
    """Connect as the tenant and yield its feed's records after `after` (see FeedFollower),
    until the caller stops; closes the connection then. Raises BusUnavailable,
    PermissionDenied or FeedRefused."""
    loop = asyncio.get_running_loop()
    refused: asyncio.Future[str] = loop.create_future()
    follower: FeedFollower | None = None

    async def on_error(e: Exception) -> None:
        if "permissions violation" in str(e).lower() and not refused.done():
            refused.set_result(str(e).removeprefix("nats: "))
        else:
            log.debug("feed follow: %r", e)

    async def on_reconnect() -> None:
        if follower is not None:
            follower.reconnected()

    options: dict[str, Any] = {"user": user, "password": password} if user else {}
    if inbox_prefix:
        options["inbox_prefix"] = inbox_prefix.encode()
    nc = await connect(url, error_cb=on_error, reconnected_cb=on_reconnect, **options)
    try:
        follower = FeedFollower(nc, tenant, lease=lease, after=after, refused=refused)
        async for item in follower.items(until_caught_up=until_caught_up, on_ready=on_ready):
            yield item
    finally:
        with contextlib.suppress(Exception):  # closing is best effort
            await nc.close()


__all__ = [
    "FeedConflict",
    "FeedFollower",
    "FeedItem",
    "FeedPosition",
    "FeedRefused",
    "FeedWriter",
    "feed_filter",
    "follow",
    "last_sequence",
    "read_page",
]
