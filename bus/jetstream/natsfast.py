"""The one adapter that reaches into nats-py's internals: raw frame writes and a fast parser.
Its public-API fallbacks and POOL_NATS_PUBLIC_ONLY: docs/adr/004-nats-internals-adapter.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import version
from typing import Any

import nats.aio.client
import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.protocol.parser import AWAITING_CONTROL_LINE, Parser

from bus.headers import (
    HDR_BATCH_COMMIT,
    HDR_BATCH_ID,
    HDR_BATCH_SEQ,
    HDR_DESCRIPTION,
    HDR_STATUS,
)
from bus.jetstream.wire import header_dict

# the nats-py minor releases whose internals this module was written and tested against
TESTED_MINORS = ("2.16",)

RawHandler = Callable[[bytes, "bytes | None"], None]
MsgHandler = Callable[[bytes, bytes, bytes, "bytes | None"], None]
FrameCutter = Callable[[bytes, int], int]


def internals_changed() -> str | None:
    """The first nats-py internal this module relies on that is missing or changed, or None."""
    minor = ".".join(version("nats-py").split(".")[:2])
    if minor not in TESTED_MINORS:
        return f"nats-py {minor} is not a tested release ({', '.join(TESTED_MINORS)})"
    client = nats.aio.client.Client()
    for name in ("_process_msg", "_pending", "_pending_data_size", "_max_pending_size", "_ps",
                 "stats", "_resp_map", "_resp_sub_prefix", "_nuid", "_flush_queue",
                 "_init_request_sub", "_flush_pending"):
        if not hasattr(client, name):
            return f"nats.aio.client.Client.{name}"
    if type(client._ps) is not Parser:
        return "nats.aio.client.Client._ps (not a nats.protocol.parser.Parser)"
    for name in ("buf", "state", "nc"):
        if not hasattr(client._ps, name):
            return f"nats.protocol.parser.Parser.{name}"
    if not hasattr(Subscription, "_id") and "_id" not in getattr(Subscription, "__slots__", ()):
        probe = Subscription.__init__.__code__.co_names
        if "_id" not in probe:
            return "nats.aio.subscription.Subscription._id"
    return None


def _fast_enabled() -> bool:
    if os.environ.get("POOL_NATS_PUBLIC_ONLY", "") not in ("", "0"):
        return False
    return internals_changed() is None


FAST = _fast_enabled()


def _render_headers(msg: Msg) -> bytes | None:
    """A received message's headers as the raw block the fast lane hands over."""
    headers = msg.headers
    if not headers:
        return None
    status = headers.get(HDR_STATUS)
    first = "NATS/1.0"
    if status:
        first = f"NATS/1.0 {status} {headers.get('Description', '')}".rstrip()
    lines = [first] + [f"{k}: {v}" for k, v in headers.items()
                       if k not in (HDR_STATUS, HDR_DESCRIPTION)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def subscribe_raw(nc: Any, subject: str, handler: RawHandler) -> Subscription:
    """Subscribe `handler(data, raw headers)` to `subject`, past nats-py's per-message path."""
    if FAST:
        sub: Subscription = await nc.subscribe(subject, cb=_never_called)
        _RawRouter.of(nc).handlers[sub._id] = handler
        return sub

    async def cb(msg: Msg) -> None:
        handler(msg.data, _render_headers(msg))

    got: Subscription = await nc.subscribe(subject, cb=cb)
    return got


async def subscribe_raw_msgs(nc: Any, subject: str, handler: MsgHandler) -> Subscription:
    """Subscribe `handler(subject, reply, data, raw headers)` to `subject`."""
    if FAST:
        sub: Subscription = await nc.subscribe(subject, cb=_never_called)
        _RawRouter.of(nc).msg_handlers[sub._id] = handler
        return sub

    async def cb(msg: Msg) -> None:
        handler(msg.subject.encode(), (msg.reply or "").encode(), msg.data,
                _render_headers(msg))

    got: Subscription = await nc.subscribe(subject, cb=cb)
    return got


async def unsubscribe_raw(nc: Any, sub: Subscription) -> None:
    """Undo `subscribe_raw` / `subscribe_raw_msgs`."""
    router: _RawRouter | None = getattr(nc, "_pool_raw_router", None)
    if router is not None:
        router.handlers.pop(sub._id, None)
        router.msg_handlers.pop(sub._id, None)
        router.frame_handlers.pop(sub._id, None)
    await sub.unsubscribe()


def set_frame_cutter(nc: Any, sub_id: int, cutter: FrameCutter | None) -> None:
    """Let `cutter` take whole runs of a raw subscription's frames (fast lane only)."""
    if not FAST:
        return
    router = _RawRouter.of(nc)
    if cutter is None:
        router.frame_handlers.pop(sub_id, None)
    else:
        router.frame_handlers[sub_id] = cutter


def widen_reads(nc: Any, size: int) -> None:
    """Let nats-py read up to `size` bytes from the socket at a time (fast lane only)."""
    if not FAST:
        return
    nats.aio.client.DEFAULT_BUFFER_SIZE = max(nats.aio.client.DEFAULT_BUFFER_SIZE, size)
    stream_reader = getattr(getattr(nc, "_transport", None), "_io_reader", None)
    if isinstance(getattr(stream_reader, "_limit", None), int):
        stream_reader._limit = max(stream_reader._limit, size)  # type: ignore[union-attr]


async def publish_prerendered(nc: Any, messages: list[tuple[str, bytes, str]]) -> None:
    """Publish (subject, payload, header lines "K: v\\r\\n"…) in order, without waiting.

    Fast lane: ONE write of pre-framed HPUBs (nats-py's per-message publish costs about as
    much as the server's whole batch); public path: one `publish` per message."""
    if not FAST:
        for subject, payload, lines in messages:
            await nc.publish(subject, payload, headers=header_dict(lines))
        return
    chunks: list[bytes] = []
    for subject, payload, lines in messages:
        _frame(chunks, subject, "", lines, payload)
    _send_frames(nc, b"".join(chunks), len(messages))


def _frame(chunks: list[bytes], subject: str, reply: str, lines: str, payload: bytes) -> None:
    """Append one HPUB frame (with `reply` as its reply subject, if any) to `chunks`."""
    hdr = f"NATS/1.0\r\n{lines}\r\n".encode()
    to = f"{subject} {reply} " if reply else f"{subject} "
    chunks.append(f"HPUB {to}{len(hdr)} {len(hdr) + len(payload)}\r\n".encode())
    chunks.append(hdr)
    chunks.append(payload)
    chunks.append(b"\r\n")


async def request_each(nc: Any, messages: list[tuple[str, bytes, str]], *,
                       timeout: float = 10.0) -> list[Msg | BaseException]:
    """Send (subject, payload, header lines) as requests, each with a reply of its own, and
    wait for every answer: per message its reply, or its error (a timeout, no responders).

    Fast lane: the frames in ONE write, the replies on nats-py's shared response subscription
    (no task or `wait_for` per message); public path: one `request` per message, together."""
    if not FAST:
        return list(await asyncio.gather(
            *(nc.request(subject, payload, headers=header_dict(lines), timeout=timeout)
              for subject, payload, lines in messages), return_exceptions=True))
    if not nc._resp_sub_prefix:
        await nc._init_request_sub()
    prefix = nc._resp_sub_prefix.decode()
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[Msg]] = []
    tokens: list[str] = []
    chunks: list[bytes] = []
    resp_map = nc._resp_map
    for subject, payload, lines in messages:
        token = nc._nuid.next().decode()
        future: asyncio.Future[Msg] = loop.create_future()
        resp_map[token] = future
        tokens.append(token)
        futures.append(future)
        _frame(chunks, subject, prefix + token, lines, payload)
    try:
        _send_frames(nc, b"".join(chunks), len(messages))
        if nc._flush_queue is not None and nc._flush_queue.empty():
            await nc._flush_pending()  # as nats-py's publish kicks its flusher
        await asyncio.wait(futures, timeout=timeout)
    finally:
        for token in tokens:
            resp_map.pop(token, None)
    out: list[Msg | BaseException] = []
    for future in futures:
        if not future.done():
            future.cancel()
            out.append(nats.errors.TimeoutError())
            continue
        msg = future.result()
        status = msg.headers.get(HDR_STATUS) if msg.headers else None
        out.append(nats.errors.NoRespondersError() if status == "503" else msg)
    return out


async def publish_atomic(nc: Any, messages: Sequence[tuple[str, bytes, Mapping[str, str]]], *,
                         timeout: float = 10.0) -> dict[str, Any]:
    """Publish (subject, payload, headers) as ONE JetStream atomic batch (ADR-50; at most
    1,000 messages, one stream): all but the last pre-framed in one write, the last a request
    carrying the commit. Returns the server's ack, with "error" when it refused the batch:
    nothing of it was stored then."""
    if not messages:
        raise ValueError("an atomic batch needs at least one message")
    batch_id = uuid.uuid4().hex
    head = []
    for i, (subject, payload, headers) in enumerate(messages[:-1], 1):
        lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        head.append((subject, payload,
                     f"{lines}{HDR_BATCH_ID}: {batch_id}\r\n{HDR_BATCH_SEQ}: {i}\r\n"))
    await publish_prerendered(nc, head)
    subject, payload, headers = messages[-1]
    reply = await nc.request(subject, payload, timeout=timeout, headers={
        **headers, HDR_BATCH_ID: batch_id, HDR_BATCH_SEQ: str(len(messages)),
        HDR_BATCH_COMMIT: "1"})
    answer = json.loads(reply.data or b"{}")
    return answer if isinstance(answer, dict) else {"error": {"description": repr(answer)}}


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


READ_SIZE = 262_144  # bytes per read from the socket while bulk reads run
LOG_READER_IDLE_NS = 30_000_000_000  # a bulk reader's consumer goes away 30 s after its last read


