"""The WebSocket bridge of interactive sessions (exec, attach, port-forward): one socket is one
session, opened as the token's tenant's own NATS user on the same subject pair as from NATS.
The protocol: docs/api-http.md#interactive-sessions."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import msgspec
from litestar import WebSocket
from litestar.exceptions import WebSocketDisconnect
from litestar.handlers import WebsocketRouteHandler

from bus import sessions as wire
from bus.errors import BusError
from bus.subjects import is_token
from gateway.problems import TITLES, TYPE_BASE, Problem, status_of
from gateway.shared import Gateway, Refused, checked_token
from gateway.sse import Held, check_room
from gateway.tokens import Principal
from gateway.upstream import NotEnrolled
from schemas.codec import SchemaError, decode
from schemas.session import SessionOpen

log = logging.getLogger(__name__)

PATH = "/v1/compute-leases/{lease_id:str}/session"
OPEN_SECONDS = 10.0  # from the upgrade to the client's opening message
MAX_OPEN_BYTES = 64 * 1024  # the opening message: a SessionOpen body
# what a client may send on: the tenant's frames (its pings and acknowledgements are the
# gateway's own business with the node)
FROM_CLIENT = frozenset({wire.STDIN, wire.EOF, wire.RESIZE, wire.SIGNAL, wire.CLOSE,
                         wire.CONN_OPEN, wire.CONN_DATA, wire.CONN_CLOSE})
LAST = frozenset({wire.EXIT, wire.ERROR})  # the node's last frame of a session


def handler(gw: Gateway) -> WebsocketRouteHandler:
    async def lease_session(socket: WebSocket[Any, Any, Any]) -> None:
        await bridge(gw, socket)

    return WebsocketRouteHandler(path=PATH)(lease_session)


def _who(gw: Gateway, socket: WebSocket[Any, Any, Any]) -> Principal:
    """The bearer token's tenant; never a cookie (a session writes to the job, and a page of
    another site can open a WebSocket with the browser's cookies but not with a header)."""
    scheme, _, token = socket.headers.get("authorization", "").partition(" ")
    who = (checked_token(gw, socket, token.strip())
           if scheme.lower() == "bearer" and token.strip() else None)
    if who is None:
        raise Refused("unauthenticated", "a valid bearer token is required in the "
                      "Authorization header")
    if who.is_admin:
        raise Refused("forbidden", "the admin token acts for no tenant; use the lease's "
                      "tenant's token")
    return who


async def _opening(socket: WebSocket[Any, Any, Any]) -> dict[str, Any]:
    """The client's first message: a SessionOpen body less its id, as JSON text."""
    try:
        message = await asyncio.wait_for(socket.receive(), OPEN_SECONDS)
    except TimeoutError:
        raise Refused("bad_request", f"no opening message within {OPEN_SECONDS:g} s") from None
    raw = message.get("text") or message.get("bytes") or b""
    if message.get("type") != "websocket.receive" or not isinstance(raw, str | bytes) \
            or not raw:
        raise WebSocketDisconnect(detail="gone before opening")
    if len(raw) > MAX_OPEN_BYTES:
        raise Refused("payload_too_large", f"the opening message is over {MAX_OPEN_BYTES} bytes")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise Refused("malformed_json", "the opening message is not valid JSON") from None
    if not isinstance(body, dict):
        raise Refused("invalid_field", "Expected `object` - at `$`", {"path": "$"})
    if "session_id" in body:  # the gateway's to choose, as the CLI's on NATS
        raise Refused("invalid_field", "session_id is chosen by the gateway",
                      {"path": "$.session_id"})
    return body


def _checked(body: dict[str, Any], session_id: str) -> dict[str, Any]:
    try:
        cmd = decode(SessionOpen, msgspec.json.encode({**body, "session_id": session_id}))
    except SchemaError as e:
        raise Refused(e.code, e.message, {"path": e.path} if e.path else None) from None
    out: dict[str, Any] = msgspec.to_builtins(cmd)
    out.pop("session_id", None)
    return out


async def _refuse(socket: WebSocket[Any, Any, Any], code: str, detail: str,
                  reasons: dict[str, Any] | None = None) -> None:
    """The refusal as a problem in the first message, then a close whose code is 4000 + the
    HTTP status the same refusal has elsewhere in the API."""
    status = status_of(code)
    body = Problem(type=TYPE_BASE + code, title=TITLES.get(status, "Error"), status=status,
                   detail=detail[:1000], code=code,
                   reasons={str(k): v if isinstance(v, int | str) else str(v)
                            for k, v in (reasons or {}).items()})
    with contextlib.suppress(Exception):
        await socket.send_text(json.dumps({"ok": False,
                                           "error": msgspec.to_builtins(body)}))
        await socket.close(4000 + status, code[:120])


async def bridge(gw: Gateway, socket: WebSocket[Any, Any, Any]) -> None:
    """One session: authorise, open it on NATS as the tenant, relay frames both ways, end."""
    await socket.accept()
    held: Held | None = None
    try:
        who = _who(gw, socket)
        lease_id = str(socket.path_params.get("lease_id", ""))
        if not is_token(lease_id):
            raise Refused("lease_not_found", f"no lease {lease_id[:64]!r}")
        check_room(gw, who)
        held = Held(gw, who)
        body = await _opening(socket)
        await _open_and_relay(gw, socket, who, lease_id, body)
    except Refused as e:
        await _refuse(socket, e.code, e.detail, e.reasons)
    except NotEnrolled as e:
        await _refuse(socket, e.code, str(e))
    except BusError as e:
        await _refuse(socket, e.code, str(e))
    except WebSocketDisconnect:
        return
    finally:
        if held is not None:
            held.release()


async def _open_and_relay(gw: Gateway, socket: WebSocket[Any, Any, Any], who: Principal,
                          lease_id: str, body: dict[str, Any]) -> None:
    from bus.connection import connect

    url, prefix = gw.upstream.connection_for(who)
    session_id = wire.new_session_id()
    checked = _checked(body, session_id)
    nc = await connect(url, reconnect=False, inbox_prefix=prefix.encode())
    try:
        session = wire.TenantSession(nc, who.tenant, lease_id, session_id)
        result = await session.open(checked)
        log.info("session %s of tenant %s into lease %s opened over WebSocket", session_id,
                 who.tenant, lease_id)
        await socket.send_text(json.dumps({"ok": True, "result": {
            "session_id": session_id, "lease_id": lease_id,
            "node_id": result.get("node_id"), "kind": checked["kind"]}}))
        try:
            await _relay(socket, session)
        finally:
            await session.close()
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


async def _relay(socket: WebSocket[Any, Any, Any], session: wire.TenantSession) -> None:
    """Frames both ways until the node's last frame, the client's close, or either side
    failing; each direction waits for the other side to take what it has (TCP's flow control
    towards the client, the session's window towards the node)."""

    async def to_node() -> None:
        while True:
            try:
                message = await socket.receive()
            except WebSocketDisconnect:
                return
            if message.get("type") != "websocket.receive":
                return
            data = message.get("bytes")
            if not isinstance(data, bytes) or not data:
                continue  # text after the opening message means nothing
            kind, conn, payload = wire.parse(data)
            if kind == wire.CLOSE:
                return
            if kind in FROM_CLIENT:
                await session.send(kind, payload, conn)

    async def to_client() -> None:
        while True:
            kind, conn, payload = await session.recv()
            await socket.send_bytes(wire.frame(kind, payload, conn))
            if kind in LAST:
                return

    tasks = [asyncio.ensure_future(to_node()), asyncio.ensure_future(to_client())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    with contextlib.suppress(Exception):
        await socket.close(1000)
