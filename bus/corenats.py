"""A synchronous core-NATS connection in the standard library alone, for a short command's one
thread (`pool lease run`): connect, subscribe, publish, request/reply; no JetStream, no TLS.

nats-py loads its JetStream API and asyncio on import (~100 ms of a 300 ms command); this speaks
the few protocol lines the run path needs. Messages wait per subscription until read.
"""

from __future__ import annotations

import json
import os
import select
import socket
import time
from collections import deque
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from bus.errors import BusError, BusTimeout, BusUnavailable, PayloadTooLarge, PermissionDenied

CRLF = b"\r\n"
CONNECT_TIMEOUT_SECONDS = 5.0
RECONNECT_SECONDS = 120.0  # a server gone longer: BusUnavailable
RECONNECT_WAIT_SECONDS = 0.5
MAX_CONTROL_LINE = 4096


class Unsupported(BusError):
    """A server or URL this connection does not speak (TLS, WebSocket, nkeys): use nats-py."""

    code = "unsupported"


@dataclass(frozen=True)
class Message:
    """One message as delivered: its subject, reply subject, headers and body."""

    subject: str
    reply: str
    headers: dict[str, str]
    data: bytes

    @property
    def status(self) -> str:
        """The status line's code of a server-made message ("503": no responders), or ""."""
        return self.headers.get("Status", "")


def _parse_headers(block: bytes) -> dict[str, str]:
    lines = block.decode("utf-8", "replace").split("\r\n")
    head = lines[0].split(" ", 2)  # NATS/1.0[ status[ description]]
    out: dict[str, str] = {}
    if len(head) > 1 and head[1]:
        out["Status"] = head[1]
        if len(head) > 2:
            out["Description"] = head[2]
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            out[name.strip()] = value.strip()
    return out


class Connection:
    """One connection to one server (the first of a comma-separated URL that answers)."""

    def __init__(self, url: str, *, user: str | None = None, password: str | None = None,
                 inbox_prefix: str = "_INBOX", name: str = "pool") -> None:
        self._buf = bytearray()
        self._late: set[str] = set()
        self._server = (url, user, password, name)
        self._sock = self._open(url, user, password, name)
        self._sids = 0
        self._pongs = 0
        self._subs: dict[int, deque[Message]] = {}
        self._subjects: dict[int, str] = {}
        self.reconnects = 0  # how many times the connection was made again (messages may be lost)
        self.errors: list[str] = []
        # one wildcard subscription for every reply, as nats-py's request does
        self._inbox = f"{inbox_prefix}.{os.urandom(11).hex()}"
        self._replies = self.subscribe(f"{self._inbox}.*")
        self._requests = 0
        self._answers: dict[str, Message] = {}

    # -- the socket ---------------------------------------------------------------------------

    def _open(self, url: str, user: str | None, password: str | None,
              name: str) -> socket.socket:
        failures = []
        for server in [u.strip() for u in url.split(",") if u.strip()]:
            parts = urlsplit(server if "://" in server else f"nats://{server}")
            if parts.scheme != "nats":
                raise Unsupported(f"{parts.scheme}:// is not spoken here")
            if parts.username and parts.password is None:
                raise Unsupported("a token in the URL")  # nats-py's: token auth
            try:
                sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 4222),
                                                timeout=CONNECT_TIMEOUT_SECONDS)
            except OSError as e:
                failures.append(f"{parts.hostname}:{parts.port}: {e}")
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
            try:
                self._handshake(parts.username and unquote(parts.username) or user,
                                parts.password and unquote(parts.password) or password, name)
            except BaseException:
                sock.close()
                raise
            return sock
        raise BusUnavailable(f"cannot reach NATS at {url}: {'; '.join(failures)}")

    def _handshake(self, user: str | None, password: str | None, name: str) -> None:
        line = self._line(time.monotonic() + CONNECT_TIMEOUT_SECONDS)
        if not line.startswith(b"INFO "):
            raise BusUnavailable(f"not a NATS server: {line[:80]!r}")
        info = json.loads(line[5:])
        if info.get("tls_required") or info.get("nonce"):
            raise Unsupported("the server asks for TLS or nkeys")
        self.max_payload = int(info.get("max_payload") or 1 << 20)
        options = {"verbose": False, "pedantic": False, "protocol": 1, "headers": True,
                   "no_responders": True, "lang": "python-core", "version": "1", "name": name}
        if user:
            options.update(user=user, **{"pass": password or ""})
        self._send(b"CONNECT " + json.dumps(options).encode() + CRLF + b"PING" + CRLF)
        deadline = time.monotonic() + CONNECT_TIMEOUT_SECONDS
        while True:
            line = self._line(deadline)
            if line == b"PONG":
                return
            if line.startswith(b"-ERR"):
                raise BusUnavailable(f"NATS refused the connection: {line[5:].decode().strip()}")

    def _send(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError:
            self._reconnect()
            self._sock.sendall(data)

    def _reconnect(self) -> None:
        """Connect again (every RECONNECT_WAIT_SECONDS, for RECONNECT_SECONDS at most) and
        subscribe again to every subject; what was published meanwhile is lost, as with
        nats-py (`reconnects` tells a reader to catch up)."""
        self._sock.close()
        self._buf.clear()
        deadline = time.monotonic() + RECONNECT_SECONDS
        while True:
            try:
                self._sock = self._open(*self._server)
                break
            except (BusUnavailable, BusTimeout):
                if time.monotonic() > deadline:
                    raise
                time.sleep(RECONNECT_WAIT_SECONDS)
        self.reconnects += 1
        self._sock.sendall(b"".join(f"SUB {subject} {sid}".encode() + CRLF
                                    for sid, subject in self._subjects.items()))

    def _fill(self, deadline: float | None) -> bool:
        """Read what the socket has, waiting until `deadline`; False when it passed."""
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([self._sock], [], [], left)
        if not ready:
            return False
        try:
            chunk = self._sock.recv(1 << 16)
        except OSError:
            chunk = b""
        if not chunk:  # the server went away: connect again, and read on
            self._reconnect()
            return True
        self._buf += chunk
        return True

    def _line(self, deadline: float | None) -> bytes:
        while (end := self._buf.find(CRLF)) < 0:
            if len(self._buf) > MAX_CONTROL_LINE:
                raise BusUnavailable("a protocol line over the limit")
            if not self._fill(deadline):
                raise BusTimeout("the NATS server did not answer in time")
        line = bytes(self._buf[:end])
        del self._buf[:end + 2]
        return line

    def _read_one(self, deadline: float | None) -> bool:
        """Handle one protocol line (and its body); False when it had not all come before
        `deadline`. Nothing is taken from the buffer before the whole of it is there, so an
        interrupted read (Ctrl-C) leaves the stream whole."""
        while (end := self._buf.find(CRLF)) < 0:
            if len(self._buf) > MAX_CONTROL_LINE:
                raise BusUnavailable("a protocol line over the limit")
            if not self._fill(deadline):
                return False
        line = bytes(self._buf[:end])
        op, _, rest = line.partition(b" ")
        if op not in (b"MSG", b"HMSG"):
            del self._buf[:end + 2]
            if op == b"PING":
                self._send(b"PONG" + CRLF)
            elif op == b"PONG":
                self._pongs += 1
            elif op == b"-ERR":
                self.errors.append(rest.decode("utf-8", "replace").strip(" '"))
            return True  # +OK, INFO: nothing to do
        # MSG <subject> <sid> [reply] <size>; HMSG … [reply] <header size> <size>
        args = rest.decode().split()
        nums = 2 if op == b"HMSG" else 1
        subject, sid, size = args[0], int(args[1]), int(args[-1])
        reply = args[2] if len(args) == 3 + nums else ""
        total = end + 2 + size + 2
        while len(self._buf) < total:
            if not self._fill(deadline):
                return False
        body = bytes(self._buf[end + 2:end + 2 + size])
        del self._buf[:total]
        headers: dict[str, str] = {}
        if op == b"HMSG":
            cut = int(args[-2])
            headers, body = _parse_headers(body[:cut]), body[cut:]
        msg = Message(subject, reply, headers, body)
        if sid == self._replies:
            token = subject.rsplit(".", 1)[-1]
            if token not in self._late:  # a reply come after its request gave up is dropped
                self._answers[token] = msg
        elif (queue := self._subs.get(sid)) is not None:
            queue.append(msg)
        return True

    # -- what callers use ---------------------------------------------------------------------

    def subscribe(self, subject: str) -> int:
        """Subscribe to `subject`; its messages wait until `next(sid)` reads them."""
        self._sids += 1
        self._subs[self._sids] = deque()
        self._subjects[self._sids] = subject
        self._send(f"SUB {subject} {self._sids}".encode() + CRLF)
        return self._sids

    def unsubscribe(self, sid: int) -> None:
        self._subjects.pop(sid, None)
        if self._subs.pop(sid, None) is not None:
            self._send(f"UNSUB {sid}".encode() + CRLF)

    def publish(self, subject: str, body: bytes, reply: str = "") -> None:
        if len(body) > self.max_payload:
            raise PayloadTooLarge(f"a {len(body)}-byte request is over the server's "
                                  "max_payload")
        head = f"PUB {subject} {reply} {len(body)}" if reply else f"PUB {subject} {len(body)}"
        self._send(head.encode() + CRLF + body + CRLF)

    def next(self, sids: tuple[int, ...], timeout: float | None, *,
             answer: str | None = None) -> tuple[int, Message] | None:
        """The next message of any of `sids` (in sid order), reading the socket up to `timeout`
        seconds (None: until one comes); None when none came, or when `answer`'s reply has."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for sid in sids:
                queue = self._subs.get(sid)
                if queue:
                    return sid, queue.popleft()
            if answer is not None and answer in self._answers:
                return None
            if not self._read_one(deadline):
                return None

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until the server has handled everything sent before (its PONG)."""
        before = self._pongs
        self._send(b"PING" + CRLF)
        deadline = time.monotonic() + timeout
        while self._pongs == before:
            if not self._read_one(deadline):
                raise BusTimeout("the NATS server did not answer a PING in time")

    def ask(self, subject: str, body: bytes) -> str:
        """Send a request and return at once; its reply is `answer(token)` once it came."""
        self._requests += 1
        token = str(self._requests)
        self.publish(subject, body, f"{self._inbox}.{token}")
        return token

    def answer(self, token: str, subject: str) -> bytes | None:
        """The reply to `ask`'s `token` if it came (None: not yet); BusUnavailable when no one
        listens on `subject`."""
        msg = self._answers.pop(token, None)
        if msg is None:
            return None
        if msg.status == "503":
            raise BusUnavailable(f"no service answers on {subject}")
        return msg.data

    def answer_waiting(self, token: str) -> bool:
        return token in self._answers

    def request(self, subject: str, body: bytes, *, timeout: float) -> bytes:
        """Publish `body` on `subject` and wait for its reply (BusTimeout, or BusUnavailable
        when no one listens); other subscriptions' messages wait meanwhile."""
        token = self.ask(subject, body)
        deadline = time.monotonic() + timeout
        while token not in self._answers:
            if not self._read_one(deadline):
                self._late.add(token)
                raise BusTimeout(f"no reply on {subject} within {timeout}s")
        data = self.answer(token, subject)
        assert data is not None
        return data

    def check_permissions(self) -> None:
        """Raise PermissionDenied when the server refused a subscription or a publish."""
        for err in self.errors:
            if "permissions violation" in err.lower():
                raise PermissionDenied(err)

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
