"""The client's end of `pool lease exec` and `pool lease port-forward`: a session over the
tenant's own NATS connection or the gateway's WebSocket, relayed to this process's stdio or to
local TCP connections."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import struct
import sys
import termios
import threading
import tty
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from bus import sessions as wire
from bus.errors import SessionRefused


class Channel(Protocol):
    """An open session, whichever way it goes: frames to the node, frames from it, and a
    close that ends the session and its connection."""

    async def send(self, kind: bytes, payload: bytes = b"", conn: int | None = None) -> None: ...

    async def recv(self, timeout: float | None = None) -> tuple[bytes, int | None, bytes]: ...

    async def close(self) -> None: ...


# opens a session from a SessionOpen body (less its id) within `timeout` seconds
Opener = Callable[[dict[str, Any], float], Awaitable[Channel]]


class _NatsChannel:
    def __init__(self, nc: Any, session: wire.TenantSession) -> None:
        self.nc, self.session = nc, session
        self.send, self.recv = session.send, session.recv

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.session.close()
        with contextlib.suppress(Exception):
            await self.nc.close()


def over_nats(url: str, tenant: str, lease_id: str, options: dict[str, Any]) -> Opener:
    """Sessions into `lease_id` over a NATS connection of their own as `tenant`'s user."""

    async def open_session(body: dict[str, Any], timeout: float) -> Channel:
        from bus.connection import connect

        opts = dict(options)
        if isinstance(opts.get("inbox_prefix"), str):
            opts["inbox_prefix"] = opts["inbox_prefix"].encode()
        nc = await connect(url, reconnect=False, **opts)
        try:
            session = wire.TenantSession(nc, tenant, lease_id)
            await session.open(body, timeout=timeout)
        except BaseException:
            await nc.close()
            raise
        return _NatsChannel(nc, session)

    return open_session


def _terminal_size(fd: int) -> tuple[int, int]:
    try:
        rows, cols, _, _ = struct.unpack("HHHH", fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8))
    except OSError:
        return 24, 80
    return rows or 24, cols or 80


async def run_exec(open_session: Opener, command: list[str], *, stdin: bool = False,
                   tty_mode: bool = False, timeout: float = wire.READY_SECONDS) -> int:
    """Run `command` in the lease's sandbox, relaying this process's stdio (with `stdin`:
    this process's stdin too; `tty_mode`: through a terminal, this one in raw mode); the
    command's exit code. Raises SessionRefused, BusTimeout, BusUnavailable."""
    body: dict[str, Any] = {"kind": "exec", "command": command, "tty": tty_mode}
    if tty_mode:
        body["rows"], body["cols"] = _terminal_size(sys.stdin.fileno())
    session = await open_session(body, timeout)
    loop = asyncio.get_running_loop()
    restore: Callable[[], None] | None = None
    try:
        if tty_mode and os.isatty(0):
            saved = termios.tcgetattr(0)
            tty.setraw(0)
            restore = lambda: termios.tcsetattr(0, termios.TCSADRAIN, saved)

            def resized() -> None:
                rows, cols = _terminal_size(0)
                loop.create_task(session.send(wire.RESIZE, f"{rows} {cols}".encode()))

            loop.add_signal_handler(signal.SIGWINCH, resized)
        else:  # Ctrl-C without a terminal: the command gets SIGINT
            loop.add_signal_handler(
                signal.SIGINT, lambda: loop.create_task(session.send(wire.SIGNAL, b"INT")))
        if stdin or tty_mode:
            _relay_stdin(loop, session)
        else:
            await session.send(wire.EOF)
        return await _output(session)
    finally:
        if restore is not None:
            restore()
        for sig in (signal.SIGWINCH, signal.SIGINT):
            loop.remove_signal_handler(sig)
        with contextlib.suppress(Exception):
            await session.close()


def _relay_stdin(loop: asyncio.AbstractEventLoop, session: Channel) -> None:
    """This process's stdin to the session, from a thread (a file or a pipe or a terminal)."""

    def pump() -> None:
        while True:
            try:
                data = os.read(0, wire.CHUNK_BYTES)
            except OSError:
                data = b""
            kind = wire.STDIN if data else wire.EOF
            fut = asyncio.run_coroutine_threadsafe(session.send(kind, data), loop)
            try:
                fut.result(10)
            except Exception:  # noqa: BLE001 - the session has ended
                return
            if not data:
                return

    # a daemon thread: one blocked reading a terminal must not hold the process at its end
    threading.Thread(target=pump, name="exec-stdin", daemon=True).start()


async def run_attach(open_session: Opener, *, stdin: bool = False,
                     timeout: float = wire.READY_SECONDS) -> int:
    """Follow the job's own output from where its log stands (with `stdin`: this process's
    stdin goes to the job's, and its end closes the job's); the job's exit code once it
    ends. Raises SessionRefused, BusTimeout, BusUnavailable."""
    session = await open_session({"kind": "attach"}, timeout)
    try:
        if stdin:
            _relay_stdin(asyncio.get_running_loop(), session)
        return await _output(session)
    finally:
        with contextlib.suppress(Exception):
            await session.close()


async def _output(session: Channel) -> int:
    out, err = sys.stdout.buffer, sys.stderr.buffer
    while True:
        kind, _, payload = await session.recv()
        if kind == wire.STDOUT:
            out.write(payload)
            out.flush()
        elif kind == wire.STDERR:
            err.write(payload)
            err.flush()
        elif kind == wire.EXIT:
            try:
                return int(payload)
            except ValueError:
                return 1
        elif kind == wire.ERROR:
            raise wire.refusal(payload)


async def run_forward(open_session: Opener, remote: int, *, local: int, host: str,
                      on_listening: Callable[[int], None] | None = None,
                      timeout: float = wire.READY_SECONDS) -> None:
    """Forward connections to `host`:`local` (0: any free port) to port `remote` inside the
    lease's sandbox, each over the session, until cancelled; `on_listening(port)` once it
    listens. Raises SessionRefused when the plane or node refuses, or the session ends."""
    session = await open_session({"kind": "forward", "port": remote}, timeout)
    conns: dict[int, asyncio.Queue[tuple[bytes, bytes]]] = {}
    next_id = 0

    async def route() -> None:
        while True:
            kind, conn, payload = await session.recv()
            if kind == wire.ERROR:
                raise wire.refusal(payload)
            q = conns.get(conn) if conn is not None else None
            if q is not None:
                q.put_nowait((kind, payload))

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal next_id
        next_id += 1
        cid = next_id
        q: asyncio.Queue[tuple[bytes, bytes]] = asyncio.Queue()
        conns[cid] = q
        try:
            await session.send(wire.CONN_OPEN, b"", cid)
            kind, _ = await asyncio.wait_for(q.get(), timeout)
            if kind != wire.CONN_OPENED:
                return

            async def upstream() -> None:
                while True:
                    data = await reader.read(wire.CHUNK_BYTES)
                    if not data:
                        await session.send(wire.CONN_CLOSE, b"", cid)
                        return
                    await session.send(wire.CONN_DATA, data, cid)

            up = asyncio.create_task(upstream())
            try:
                while True:
                    kind, payload = await q.get()
                    if kind == wire.CONN_BYTES:
                        writer.write(payload)
                        await writer.drain()
                    elif kind == wire.CONN_CLOSED:
                        return
            finally:
                up.cancel()
        except (OSError, TimeoutError, asyncio.CancelledError):
            # cancelled: the forward is ending (3.11's streams would log a cancelled handler)
            return
        finally:
            conns.pop(cid, None)
            with contextlib.suppress(Exception):
                await session.send(wire.CONN_CLOSE, b"", cid)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    server = await asyncio.start_server(serve, host, local)
    router = asyncio.create_task(route())
    try:
        port = server.sockets[0].getsockname()[1]
        if on_listening is not None:
            on_listening(port)
        await router
        raise SessionRefused("the session ended", code="session_ended")
    finally:
        router.cancel()
        server.close()
        with contextlib.suppress(Exception):
            await session.close()
