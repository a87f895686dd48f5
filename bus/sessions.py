"""Interactive sessions (exec, port-forward) on their subject pair: the frames, and the
tenant's end (asyncio). The node's end is the agent's (agents/sessions.py) over its AgentLink.

Every message on `pool.sess.<tenant>.<node>.<session>.in|out` is one frame: a kind byte, for
a connection's frames its 4-byte id, then the payload. Only the tenant may publish `in` and
read `out`, only the node the reverse (bus.local.auth); a node's frames are accepted only from
the node the plane named, and the session id is chosen at random by the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import struct
from typing import Any

from bus.errors import BusTimeout, BusUnavailable, SessionRefused
from bus.junk import live_answer
from bus.subjects import SESSION_PREFIX, command_subject, is_token

# both ways: the bytes of data frames the sender's peer has taken so far (flow control)
ACK = b"a"
# tenant → node
STDIN, EOF, RESIZE, SIGNAL, PING, CLOSE = b"i", b"e", b"z", b"k", b"p", b"q"
CONN_OPEN, CONN_DATA, CONN_CLOSE = b"c", b"d", b"x"
# node → tenant
READY, STDOUT, STDERR, EXIT, ERROR = b"r", b"o", b"E", b"X", b"!"
CONN_OPENED, CONN_BYTES, CONN_CLOSED = b"C", b"D", b"F"
_WITH_CONN = frozenset({CONN_OPEN, CONN_DATA, CONN_CLOSE, CONN_OPENED, CONN_BYTES, CONN_CLOSED})
CHUNK_BYTES = 256 * 1024  # of data per frame: well under the server's 1 MiB max_payload
DATA = frozenset({STDIN, CONN_DATA, STDOUT, STDERR, CONN_BYTES})
# each side sends at most WINDOW_BYTES of data its peer has not acknowledged, and acknowledges
# what it has taken every ACK_EVERY_BYTES: a slow reader slows its writer instead of growing
# the server's buffers until it drops the connection
WINDOW_BYTES = 8 << 20
ACK_EVERY_BYTES = 1 << 20
PING_SECONDS = 5.0  # the tenant's keep-alive; the node ends a session silent for IDLE_SECONDS
IDLE_SECONDS = 30.0
READY_SECONDS = 15.0  # from the request to the node's first frame


def frame(kind: bytes, payload: bytes = b"", conn: int | None = None) -> bytes:
    """One message of a session."""
    if kind in _WITH_CONN:
        return kind + struct.pack(">I", conn or 0) + payload
    return kind + payload


def parse(data: bytes) -> tuple[bytes, int | None, bytes]:
    """(kind, connection id or None, payload); a frame too short reads as kind b""."""
    if not data:
        return b"", None, b""
    kind = data[:1]
    if kind in _WITH_CONN:
        if len(data) < 5:
            return b"", None, b""
        return kind, struct.unpack(">I", data[1:5])[0], data[5:]
    return kind, None, data[1:]


def new_session_id() -> str:
    return secrets.token_hex(16)


class TenantSession:
    """The tenant's end of one session over its own NATS connection `nc` (connected as the
    tenant, with its inbox prefix): `open`, then `send` and `recv` frames, then `close`."""

    def __init__(self, nc: Any, tenant: str, lease_id: str,
                 session_id: str | None = None) -> None:
        if not is_token(tenant) or not is_token(lease_id):
            raise SessionRefused("tenant and lease id must be subject tokens",
                                 code="invalid_subject")
        self.nc = nc
        self.tenant = tenant
        self.lease_id = lease_id
        self.session_id = session_id or new_session_id()
        self.node: str | None = None
        self._in: str | None = None
        self._frames: asyncio.Queue[tuple[bytes, int | None, bytes]] = asyncio.Queue()
        self._early: list[tuple[str, bytes]] = []
        self._sub: Any = None
        self._pinger: asyncio.Task[None] | None = None
        self._sent = 0  # data bytes sent, and acknowledged by the node
        self._acked = 0
        self._credit = asyncio.Event()
        self._taken = 0  # data bytes taken from the node, and acknowledged to it
        self._taken_acked = 0

    async def open(self, body: dict[str, Any], timeout: float = READY_SECONDS) -> dict[str, Any]:
        """Ask the plane for the session (`body`: a SessionOpen less its id), wait for the
        node's ready frame; the plane's answer. SessionRefused with the plane's or node's code;
        BusTimeout when the node never answers."""
        # listening first: the node's first frame may come before the plane's answer
        self._sub = await self.nc.subscribe(
            f"{SESSION_PREFIX}.{self.tenant}.*.{self.session_id}.out", cb=self._on_msg,
            pending_bytes_limit=256 * 1024 * 1024)
        subject = command_subject(self.tenant, "lease", self.lease_id, "session")
        payload = json.dumps({**body, "session_id": self.session_id}).encode()
        try:
            reply = await self.nc.request(subject, payload, timeout=timeout)
        except TimeoutError as e:  # nats-py's timeout is one
            raise BusTimeout(f"no answer on {subject}") from e
        except Exception as e:
            if "no responders" in str(e).lower():
                raise BusUnavailable("no control plane answers commands") from e
            raise
        answer: dict[str, Any] = json.loads(reply.data)
        if not answer.get("ok"):
            err = answer.get("error") or {}
            raise SessionRefused(str(err.get("message") or "refused"),
                                 code=str(err.get("code") or "session_refused"))
        result = answer.get("result") or {}
        self.node = str(result.get("node_id") or "")
        self._in = str(result.get("to_node") or "")
        for subj, data in self._early:
            self._accept(subj, data)
        self._early.clear()
        kind, _, payload = await self.recv(timeout)
        if kind == ERROR:
            raise refusal(payload)
        if kind != READY:
            raise SessionRefused("the node did not start the session", code="session_failed")
        self._pinger = asyncio.create_task(self._ping())
        return result

    async def _on_msg(self, msg: Any) -> None:
        if live_answer(msg.headers, msg.subject):
            return  # a direct get's answer aimed here: the asker's bytes, not the node's
        if self.node is None:  # before the plane named the node: held until it does
            self._early.append((msg.subject, bytes(msg.data)))
        else:
            self._accept(msg.subject, bytes(msg.data))

    def _accept(self, subject: str, data: bytes) -> None:
        # any node may publish on its own `out` subjects: only the lease's node is heard
        if subject.split(".")[3:4] != [self.node]:
            return
        kind, conn, payload = parse(data)
        if kind == ACK:
            try:
                self._acked = max(self._acked, int(payload))
            except ValueError:
                return
            self._credit.set()
        else:
            self._frames.put_nowait((kind, conn, payload))

    async def send(self, kind: bytes, payload: bytes = b"", conn: int | None = None) -> None:
        assert self._in, "open() first"
        for i in range(0, max(1, len(payload)), CHUNK_BYTES):
            part = payload[i:i + CHUNK_BYTES]
            if kind in DATA:
                while self._sent - self._acked > WINDOW_BYTES:
                    self._credit.clear()
                    await asyncio.wait_for(self._credit.wait(), IDLE_SECONDS)
                self._sent += len(part)
            await self.nc.publish(self._in, frame(kind, part, conn))

    async def recv(self, timeout: float | None = None) -> tuple[bytes, int | None, bytes]:
        """The next frame from the node; BusTimeout after `timeout` seconds."""
        try:
            got = await asyncio.wait_for(self._frames.get(), timeout)
        except TimeoutError as e:
            raise BusTimeout("the session's node sent nothing in time") from e
        if got[0] in DATA:
            self._taken += len(got[2])
            if self._taken - self._taken_acked >= ACK_EVERY_BYTES and self._in:
                self._taken_acked = self._taken
                await self.nc.publish(self._in, frame(ACK, str(self._taken).encode()))
        return got

    async def _ping(self) -> None:
        while True:
            await asyncio.sleep(PING_SECONDS)
            await self.send(PING)

    async def close(self) -> None:
        if self._pinger is not None:
            self._pinger.cancel()
        if self._in:
            with contextlib.suppress(Exception):  # closing is best effort
                await self.send(CLOSE)
                await self.nc.flush(2)
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()


def refusal(payload: bytes) -> SessionRefused:
    try:
        err = json.loads(payload)
        return SessionRefused(str(err.get("message") or "refused"),
                              code=str(err.get("code") or "session_refused"))
    except ValueError:
        return SessionRefused("refused by the node", code="session_refused")
