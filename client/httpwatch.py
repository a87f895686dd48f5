"""One lease followed over the gateway's event streams, as bus.leasewatch.LeaseWatch follows it
over NATS: the same items (feed changes, job output) through the same get/pending/close calls.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any, Self
from urllib.parse import quote

import httpx
import msgspec

from bus.leaseitems import Change, Output
from schemas.feed import FeedRecord

# the lease states a feed record ends the watch with (domain/lease.py TERMINAL_STATES)
FINAL_STATES = frozenset({"released", "cancelled", "voided", "preempted", "rejected"})
# slack for the agent's clock: output stamped this long before `start` is still delivered
CLOCK_SLACK_SECONDS = 60.0


class StreamRefused(Exception):
    """The gateway refused a lease's stream, or ended it with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, str]]:
    """The events of a text/event-stream, each as its fields (`id`, `event`, `data`)."""
    current: dict[str, str] = {}
    for line in lines:
        if not line:
            if "data" in current:
                yield current
            current = {}
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        current[name] = current[name] + "\n" + value if name == "data" and name in current \
            else value
    if "data" in current:
        yield current


def refusal(r: httpx.Response) -> StreamRefused:
    """A stream's refusal (problem+json) as an exception with the API's code."""
    r.read()
    try:
        p = r.json()
    except ValueError:
        p = {}
    if isinstance(p, dict) and "code" in p:
        return StreamRefused(str(p["code"]), str(p.get("detail") or p["code"]))
    return StreamRefused(f"http_{r.status_code}", f"HTTP {r.status_code} from {r.url}")


class HttpLeaseWatch:
    """Follows one lease through the gateway: its feed records after `after` (GET …/events)
    and, with `output`, its job's output (GET …/logs?follow=1) stamped from `live_from` on.
    A final change is handed over only once the output stored before it is, so every output
    the job wrote comes before it, as on the single NATS connection."""

    def __init__(self, http: httpx.Client, lease_id: str, *, output: bool = False,
                 after: int = 0) -> None:
        self._http = http
        self.lease_id = lease_id
        self._output = output
        self._after = after
        self.live_from = 0.0
        self._queue: queue.SimpleQueue[Output | Change | BaseException] = queue.SimpleQueue()
        self._stop = threading.Event()
        # the output stream's place (its last event id), and whether the feed took it over
        self._lock = threading.Lock()
        self._output_seq = 0
        self._drained = False
        self._threads: list[threading.Thread] = []
        self._open: list[httpx.Response] = []

    def _path(self, tail: str) -> str:
        return f"/v1/compute-leases/{quote(self.lease_id, safe='')}/{tail}"

    def start(self) -> Self:
        self.live_from = time.time() - CLOCK_SLACK_SECONDS
        runs = [self._follow_feed]
        if self._output:
            runs.append(self._follow_output)
        for run in runs:
            t = threading.Thread(target=self._guarded, args=(run,), daemon=True,
                                 name=f"watch-{run.__name__}")
            t.start()
            self._threads.append(t)
        return self

    def _guarded(self, run: Any) -> None:
        try:
            run()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            if not self._stop.is_set():
                self._queue.put(e if isinstance(e, StreamRefused) else
                                StreamRefused("gateway_unreachable", f"{e or type(e).__name__}"))

    def _stream(self, tail: str, params: dict[str, str], after: int, *,
                keep: bool = True) -> Iterator[dict[str, str]]:
        headers = {"Accept": "text/event-stream"}
        if after:
            headers["Last-Event-ID"] = str(after)
        timeout = httpx.Timeout(10.0, read=None)  # a stream is quiet while the job is
        with self._http.stream("GET", self._path(tail), params=params, headers=headers,
                               timeout=timeout) as r:
            if not r.is_success:
                raise refusal(r)
            if keep:
                self._open.append(r)
            for event in sse_events(r.iter_lines()):
                if keep and self._stop.is_set():
                    return
                if event.get("event") == "error":
                    err = json.loads(event["data"])
                    raise StreamRefused(str(err.get("code")), str(err.get("message")))
                yield event

    def _follow_feed(self) -> None:
        for event in self._stream("events", {}, self._after):
            record = msgspec.json.decode(event["data"], type=FeedRecord)
            if record.state in FINAL_STATES and self._output:
                self._drain()
            self._queue.put(Change(int(event.get("id") or 0), record))

    def _drain(self) -> None:
        """The lease ended: take over from the output stream (which would notice only on its
        next look) and read what the agent stored after its place, before the end is handed
        over (the agent stores a job's output before it reports the job's end)."""
        with self._lock:
            self._drained = True
            after = self._output_seq
        for event in self._stream("logs", {"follow": "0"}, after, keep=False):
            self._put_output(event)

    def _put_output(self, event: dict[str, str]) -> None:
        sample = json.loads(event["data"])
        body = sample.get("event") or {}
        text = (body.get("attrs") or {}).get("text")
        at = float(body.get("at") or 0.0)
        if isinstance(text, str) and at >= self.live_from:
            self._queue.put(Output(text, at, int(body.get("seq") or 0)))

    def _follow_output(self) -> None:
        for event in self._stream("logs", {"follow": "1"}, 0):
            with self._lock:
                if self._drained:
                    return
                self._put_output(event)
                self._output_seq = int(event.get("id") or 0)

    def get(self, timeout: float | None = None) -> Output | Change | None:
        """The next record or output, waiting up to `timeout` seconds (None: nothing came)."""
        try:
            got = self._queue.get(timeout=timeout) if timeout is None or timeout > 0 \
                else self._queue.get_nowait()
        except queue.Empty:
            return None
        if isinstance(got, BaseException):
            raise got
        return got

    def pending(self) -> Iterator[Output | Change]:
        """What has come already, without waiting."""
        while True:
            got = self.get(0)
            if got is None:
                return
            yield got

    def close(self) -> None:
        """Stop both streams, so the gateway counts them no more against the token."""
        self._stop.set()
        for r in list(self._open):
            with contextlib.suppress(Exception):
                r.close()  # the reading thread's iteration ends (it is a daemon anyway)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
