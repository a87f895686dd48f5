"""One lease followed on a core-NATS connection (bus.corenats) with no thread: its feed records
and its job's live output, read as the caller asks for them. The lean twin of bus.leasewatch.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Self

from bus.corenats import Connection, Message
from bus.errors import BusError, FeedRefused
from bus.headers import HDR_SEQUENCE, HDR_STATUS, HDR_STREAM, HDR_SUBJECT
from bus.leaseitems import Change, FeedFields, Output, OutputGate, output_sample
from bus.subjects import FEED_STREAM, command_subject, feed_filter, output_filter

REPLAY_LIMIT = 500  # records a page (bus.feed.REPLAY_LIMIT)


class LeanLeaseWatch:
    """Follows one lease as bus.leasewatch.LeaseWatch does (the same `get`, `pending`, `close`):
    the live feed and output are subscribed to and the stored records asked for in one write,
    and the records come in feed order, none twice; a live record whose subject's previous one
    was not seen (`Nats-Last-Sequence`), or a connection made again, reads the stored pages
    again from the last seen."""

    def __init__(self, conn: Connection, tenant: str, lease_id: str, *, output: bool = False,
                 after: int = 0) -> None:
        self._conn = conn
        self.tenant = tenant
        self.lease_id = lease_id
        self._output = output
        self.last = self._start = after
        self._seen: dict[str, int] = {}  # last sequence delivered, per stored subject
        self._ready: deque[Output | Change] = deque()
        self._gate = OutputGate(self._ready.append)
        self._sids: tuple[int, ...] = ()
        self._page: str | None = None  # the replay request in flight
        # live records come while a page is read: handled after it, as if they came then (one
        # that shows a gap the page did not fill asks for the next page)
        self._held: list[Message] = []
        self._page_subject = command_subject(tenant, "feed", "replay")
        self.live_from = 0.0
        self._reconnects = conn.reconnects

    def start(self) -> Self:
        self.live_from = time.time() - 60  # as LeaseWatch: the agent's clock may run behind
        # subscribed before the replay is asked for, on one connection: a record stored after
        # the page was read comes live (the server handles a connection's lines in order)
        feed = self._conn.subscribe(feed_filter(self.tenant, self.lease_id, live=True))
        out = self._conn.subscribe(output_filter(self.tenant, self.lease_id)) \
            if self._output else None
        self._sids = (feed,) if out is None else (out, feed)  # output first: it precedes the end
        self._ask_page()
        return self

    def _ask_page(self) -> None:
        if self._page is None:
            body = {"after_seq": self.last, "limit": REPLAY_LIMIT, "lease": self.lease_id}
            self._page = self._conn.ask(self._page_subject, json.dumps(body).encode())

    def _take_page(self, data: bytes) -> None:
        self._page = None
        env = json.loads(data)
        if not env.get("ok"):
            err = env.get("error") or {}
            raise FeedRefused(str(err.get("code")), str(err.get("message")))
        result = env.get("result") or {}
        records = result.get("records") or []
        for r in records:
            self._fresh(int(r["seq"]), str(r["subject"]), r.get("record"))
        if records and not result.get("at_end", True):
            self._ask_page()
            return
        held, self._held = self._held, []
        for msg in held:
            self._live(msg)

    def _fresh(self, seq: int, subject: str, record: Any) -> None:
        if seq <= self.last:
            return
        self.last = seq
        self._seen[subject] = seq
        if isinstance(record, dict):
            fields = FeedFields(record)
            self._gate.placed(fields.node_id)
            self._ready.append(Change(seq, fields))

    def _live(self, msg: Message) -> None:
        if self._page is not None:
            self._held.append(msg)
            return
        headers = msg.headers
        if headers.get(HDR_STATUS):
            return
        if headers.get(HDR_STREAM) != FEED_STREAM:
            return  # not the feed's republish: a direct get's answer aimed here (bus.feed)
        try:
            seq = int(headers[HDR_SEQUENCE])
            previous = int(headers.get("Nats-Last-Sequence", "0") or 0)
        except (KeyError, ValueError):
            return
        subject = headers.get(HDR_SUBJECT, "")
        if seq <= self.last:
            return
        if previous > self._seen.get(subject, self._start):
            self._ask_page()  # a record of this lease not seen: the pages bring it, and this
            self._held.append(msg)  # one too, or it comes again after them
            return
        try:
            record = json.loads(msg.data)
        except ValueError:
            record = None
        self._fresh(seq, subject, record)

    def get(self, timeout: float | None = None) -> Output | Change | None:
        """The next record or output, waiting up to `timeout` seconds (None: nothing came)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready:
            if self._conn.reconnects != self._reconnects:  # live records may have been missed
                self._reconnects = self._conn.reconnects
                self._page = None  # its answer, too
                self._ask_page()
            if self._page is not None:
                data = self._conn.answer(self._page, self._page_subject)
                if data is not None:
                    self._take_page(data)
                    continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            got = self._conn.next(self._sids, left, answer=self._page)
            if got is None:
                if self._page is not None and self._conn.answer_waiting(self._page):
                    continue
                self._conn.check_permissions()
                return None
            sid, msg = got
            if sid == self._sids[-1]:
                self._live(msg)
            elif HDR_STREAM not in msg.headers:  # else a direct get's answer aimed here
                sample = output_sample(msg.data)
                if sample is not None:
                    self._gate.output(msg.subject, Output(*sample))
        return self._ready.popleft()

    def pending(self) -> Iterator[Output | Change]:
        """What has come already, without waiting."""
        while True:
            got = self.get(0)
            if got is None:
                return
            yield got

    def close(self) -> None:
        for sid in self._sids:
            try:
                self._conn.unsubscribe(sid)
            except BusError:
                return  # the connection is gone: nothing to unsubscribe

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
