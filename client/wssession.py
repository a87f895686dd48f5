"""Interactive sessions over the gateway's WebSocket (`/v1/compute-leases/{id}/session`): the
same frames as on NATS, with only a URL and a token (docs/api-http.md#interactive-sessions)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any
from urllib.parse import quote

from bus import sessions as wire
from bus.errors import BusTimeout, BusUnavailable, SessionRefused
from client.sessions import Channel, Opener

# a frame's largest size: a chunk of data and its header
MAX_MESSAGE_BYTES = wire.CHUNK_BYTES + 64


def session_url(base: str, lease_id: str) -> str:
    """The WebSocket URL of `lease_id`'s sessions at the gateway `base` (http[s]://…)."""
    scheme, sep, rest = base.rstrip("/").partition("://")
    if not sep or scheme not in ("http", "https"):
        raise SessionRefused(f"{base!r} is not an http:// or https:// URL",
                             code="invalid_field")
    ws = "wss" if scheme == "https" else "ws"
    return f"{ws}://{rest}/v1/compute-leases/{quote(lease_id, safe='')}/session"


class WebSocketChannel:
    """One session on one WebSocket: the gateway holds the NATS side (its flow control with
    the node); this side's is TCP's."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws

    async def send(self, kind: bytes, payload: bytes = b"", conn: int | None = None) -> None:
        from websockets.exceptions import ConnectionClosed

        for i in range(0, max(1, len(payload)), wire.CHUNK_BYTES):
            try:
                await self.ws.send(wire.frame(kind, payload[i:i + wire.CHUNK_BYTES], conn))
            except ConnectionClosed as e:
                raise _ended(e) from None

    async def recv(self, timeout: float | None = None) -> tuple[bytes, int | None, bytes]:
        from websockets.exceptions import ConnectionClosed

        while True:
            try:
                data = await asyncio.wait_for(self.ws.recv(), timeout)
            except TimeoutError as e:
                raise BusTimeout("the session's node sent nothing in time") from e
            except ConnectionClosed as e:
                raise _ended(e) from None
            if isinstance(data, bytes):
                return wire.parse(data)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.send(wire.CLOSE)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(), 2)


def _ended(e: Any) -> SessionRefused:
    rcvd = getattr(e, "rcvd", None)
    reason = getattr(rcvd, "reason", "") if rcvd is not None else ""
    return SessionRefused(f"the gateway ended the session{': ' + reason if reason else ''}",
                          code="session_ended")


def over_gateway(url: str, token: str, lease_id: str) -> Opener:
    """Sessions into `lease_id` through the gateway at `url`, speaking for `token`'s tenant."""

    async def open_session(body: dict[str, Any], timeout: float) -> Channel:
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

        target = session_url(url, lease_id)
        try:
            ws = await connect(target, additional_headers={"Authorization": f"Bearer {token}"},
                               max_size=MAX_MESSAGE_BYTES, open_timeout=timeout,
                               compression=None)
        except (OSError, TimeoutError, InvalidHandshake, InvalidURI) as e:
            raise BusUnavailable(f"{url}: cannot open a WebSocket: {e or type(e).__name__}") \
                from e
        try:
            with contextlib.suppress(ConnectionClosed):  # refused at once: the answer says why
                await ws.send(json.dumps(body))
            answer = await _answer(ws, timeout)
        except BaseException:
            with contextlib.suppress(Exception):
                await ws.close()
            raise
        if not answer.get("ok"):
            err = answer.get("error") or {}
            with contextlib.suppress(Exception):
                await ws.close()
            raise SessionRefused(str(err.get("detail") or err.get("code") or "refused"),
                                 code=str(err.get("code") or "session_refused"))
        return WebSocketChannel(ws)

    return open_session


async def _answer(ws: Any, timeout: float) -> dict[str, Any]:
    """The gateway's first message: `{"ok": true, "result": …}`, or a problem under `error`."""
    from websockets.exceptions import ConnectionClosed

    try:
        first = await asyncio.wait_for(ws.recv(), timeout)
    except TimeoutError as e:
        raise BusTimeout("the gateway did not open the session in time") from e
    except ConnectionClosed as e:
        raise _ended(e) from None
    try:
        answer = json.loads(first)
    except (TypeError, ValueError):
        answer = None
    if not isinstance(answer, dict):
        raise SessionRefused("the gateway's answer is not the API's", code="session_failed")
    return answer
