"""The node's end of interactive sessions: an exec (with or without a terminal), an attach to
the job's own output and stdin, or a port-forward into a running lease's sandbox, relayed over
the session's subject pair."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import fcntl
import json
import logging
import os
import queue
import signal
import socket
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agents.runtimes.contract import WorkloadError
from agents.stdinfeed import StdinFeed, StdinFull
from bus import sessions as wire
from bus.errors import BusError
from bus.subjects import session_subject
from schemas.session import SessionOrder

if TYPE_CHECKING:
    from agents.agent import Agent, Running
    from agents.runtimes.enter import SandboxEntry

log = logging.getLogger(__name__)

MAX_SESSIONS_PER_LEASE = 16
MAX_CONNECTIONS = 256  # of one port-forward at once
READ_BYTES = wire.CHUNK_BYTES
SEND_WINDOW = 64  # frames handed to the link and not yet on the connection
_SIGNALS = {"INT": signal.SIGINT, "TERM": signal.SIGTERM, "HUP": signal.SIGHUP,
            "QUIT": signal.SIGQUIT, "KILL": signal.SIGKILL}


class Sessions:
    """Every session this agent serves, by id."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.live: dict[str, Session] = {}
        self._seen: set[str] = set()  # an order redelivered never opens a session twice
        self._lock = threading.Lock()
        # what to do once the last attach of a lease whose job ended has read its last output
        self._after: dict[str, Callable[[], None]] = {}

    def open(self, order: SessionOrder) -> None:
        """Join the session `order` names, or tell its tenant why not (an error frame)."""
        out = session_subject(order.tenant, self.agent.node_id, order.session_id, "out")
        with self._lock:
            if order.session_id in self._seen:
                return
            self._seen.add(order.session_id)
            run = self.agent.running.get(order.lease_id)
            refusal = self._refusal(order, run)
            if refusal is None:
                assert run is not None
                session: Session = KINDS[order.kind](self, order, run, out)
                self.live[order.session_id] = session
        if refusal is not None:
            log.info("session %s for lease %s refused: %s", order.session_id, order.lease_id,
                     refusal[0])
            with contextlib.suppress(BusError):
                self.agent.link.send(out, wire.frame(wire.ERROR, json.dumps(
                    {"code": refusal[0], "message": refusal[1]}).encode()))
            return
        session.start()

    def _refusal(self, order: SessionOrder, run: Running | None) -> tuple[str, str] | None:
        if run is None or run.tenant != order.tenant or run.handle.epoch != order.epoch:
            return "lease_not_here", "the lease's job does not run on this node"
        if run.stopping:
            return "lease_stopping", "the lease's job is stopping"
        # an attach reads the job's output and writes its stdin; exec and forward enter it
        runtime = self.agent.runtime
        can = (runtime.can_read_output and runtime.stdin is not None
               if order.kind == "attach" else runtime.can_enter)
        if not can:
            return "exec_unsupported", (f"the {runtime.name} runtime cannot "
                                        f"{'attach' if order.kind == 'attach' else 'be entered'}")
        if sum(1 for s in self.live.values() if s.lease_id == order.lease_id) \
                >= MAX_SESSIONS_PER_LEASE:
            return "too_many_sessions", f"at most {MAX_SESSIONS_PER_LEASE} sessions per lease"
        return None

    def _attached(self, lease_id: str) -> bool:
        return any(isinstance(s, AttachSession) and s.lease_id == lease_id
                   for s in self.live.values())

    def after_attaches(self, lease_id: str, then: Callable[[], None]) -> None:
        """`then()` now, or once the lease's attaches have ended: its job has ended, and an
        attach may still be reading the job's last output (which `then` lets go of)."""
        with self._lock:
            if self._attached(lease_id):
                self._after[lease_id] = then
                return
        then()

    def ended(self, session: Session) -> None:
        with self._lock:
            self.live.pop(session.session_id, None)
            then = (self._after.pop(session.lease_id, None)
                    if not self._attached(session.lease_id) else None)
        if then is not None:
            then()


class Session:
    """One session: frames from the tenant arrive on a queue (the link's loop thread must not
    block), a thread of its own handles them; it ends on the tenant's close, after
    IDLE_SECONDS without a frame, when the lease's job is no longer this agent's, or (exec)
    when the command has exited."""

    acks_when_written = False  # an attach acknowledges stdin once it is in the job's

    def __init__(self, owner: Sessions, order: SessionOrder, run: Running, out: str) -> None:
        self.owner = owner
        self.agent = owner.agent
        self.order = order
        self.run_ = run
        self.out = out
        self.session_id = order.session_id
        self.lease_id = order.lease_id
        self.inbox: queue.Queue[tuple[bytes, int | None, bytes]] = queue.Queue()
        self.done = threading.Event()
        self.entry: SandboxEntry | None = None
        self._unsubscribe: Any = None
        self._send_lock = threading.Lock()
        self._sent: collections.deque[concurrent.futures.Future[None]] = collections.deque()
        self._credit = threading.Condition()
        self._out_bytes = 0  # data bytes sent to the tenant, and acknowledged by it
        self._out_acked = 0
        self._in_bytes = 0  # data bytes taken from the tenant, and acknowledged to it
        self._in_acked = 0

    def start(self) -> None:
        threading.Thread(target=self._main, name=f"session-{self.session_id[:8]}",
                         daemon=True).start()

    def send(self, kind: bytes, payload: bytes = b"", conn: int | None = None) -> None:
        """Hand a frame to the link without waiting for each (a round trip to the link's loop
        per frame capped a forward's throughput); at most SEND_WINDOW are in flight."""
        if kind in wire.DATA:  # wait for the tenant to take what it was sent (flow control)
            with self._credit:
                while self._out_bytes - self._out_acked > wire.WINDOW_BYTES:
                    if self.done.is_set():
                        return
                    self._credit.wait(0.5)
                self._out_bytes += len(payload)
        with self._send_lock:  # one publisher at a time keeps the frames in order
            try:
                self._sent.append(self.agent.link.send_soon(self.out,
                                                            wire.frame(kind, payload, conn)))
                while len(self._sent) > SEND_WINDOW or (self._sent and self._sent[0].done()):
                    self._sent.popleft().result(10)
            except (BusError, concurrent.futures.TimeoutError) as e:
                log.info("session %s: cannot send: %s", self.session_id, e)
                self.done.set()

    def _on_data(self, subject: str, data: bytes) -> None:
        kind, conn, payload = wire.parse(data)
        if kind == wire.ACK:  # here, not queued: a sender waiting for it may hold the queue
            with contextlib.suppress(ValueError), self._credit:
                self._out_acked = max(self._out_acked, int(payload))
                self._credit.notify_all()
        else:
            self.inbox.put((kind, conn, payload))

    def _main(self) -> None:
        inn = session_subject(self.order.tenant, self.agent.node_id, self.session_id, "in")
        try:
            self.entry = self.enter()
            self._unsubscribe = self.agent.link.subscribe(inn, self._on_data)
            # ready before the command starts: its first output must come after it
            self.send(wire.READY)
            self.begin()
        except (WorkloadError, OSError, BusError) as e:
            code = getattr(e, "code", "exec_failed")
            self.send(wire.ERROR, json.dumps({"code": code, "message": str(e)[:500]}).encode())
            self._finish()
            return
        last = looked = time.monotonic()
        try:
            while not self.done.is_set():
                now = time.monotonic()
                if now - looked >= 0.5:  # also while frames keep coming
                    looked = now
                    if now - last > wire.IDLE_SECONDS or not self.still_here():
                        break
                try:
                    kind, conn, payload = self.inbox.get(timeout=0.5)
                except queue.Empty:
                    continue
                last = time.monotonic()
                if kind == wire.CLOSE:
                    break
                if kind != wire.PING:
                    self.handle(kind, conn, payload)
                if kind in wire.DATA and not self.acks_when_written:
                    self.took(len(payload))
        except Exception:  # a session's failure is the session's, never the agent's
            log.exception("session %s failed", self.session_id)
        finally:
            self._finish()

    def took(self, n: int) -> None:
        """`n` more data bytes of the tenant's are taken: acknowledged every ACK_EVERY_BYTES
        (by one thread of the session's: its own, or the attach's stdin writer)."""
        self._in_bytes += n
        if self._in_bytes - self._in_acked >= wire.ACK_EVERY_BYTES:
            self._in_acked = self._in_bytes
            self.send(wire.ACK, str(self._in_bytes).encode())

    def enter(self) -> SandboxEntry | None:
        """The handles into the job's sandbox that exec and forward run in."""
        return self.agent.runtime.enter(self.run_.handle)  # one that can (Sessions._refusal)

    def still_here(self) -> bool:
        """Whether the session goes on: while the lease's job is this agent's and running."""
        return self._lease_here()

    def _lease_here(self) -> bool:
        return self.agent.running.get(self.lease_id) is self.run_ and not self.run_.stopping

    def _finish(self) -> None:
        self.done.set()
        with self._credit:
            self._credit.notify_all()
        if self._unsubscribe is not None:
            self._unsubscribe()
        self.end()
        if self.entry is not None:
            self.entry.close()
        self.owner.ended(self)

    # what each kind of session does
    def begin(self) -> None:
        raise NotImplementedError

    def handle(self, kind: bytes, conn: int | None, payload: bytes) -> None:
        raise NotImplementedError

    def end(self) -> None:
        raise NotImplementedError


class ExecSession(Session):
    """A command in the sandbox: pipes, or a terminal (a pty here, relayed by `script` to one
    of the sandbox's own); its output goes back as it comes, then its exit code."""

    proc: subprocess.Popen[bytes]
    master: int | None = None

    def begin(self) -> None:
        assert self.entry is not None
        entry = self.entry
        argv = entry.argv(self.order.command, tty=self.order.tty)
        env = {"PATH": "/usr/bin:/bin"}
        if self.order.tty:
            master, slave = os.openpty()
            self.master = master
            _resize(master, self.order.rows or 24, self.order.cols or 80)

            def child() -> None:
                os.setsid()
                fcntl.ioctl(0, termios.TIOCSCTTY, 0)
                entry.preexec()

            try:
                self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave,
                                             pass_fds=entry.pass_fds(), env=env,
                                             preexec_fn=child)  # noqa: PLW1509
            finally:
                os.close(slave)
            readers = [self._reader(master, wire.STDOUT)]
        else:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, pass_fds=entry.pass_fds(),
                                         env=env, start_new_session=True,
                                         preexec_fn=entry.preexec)  # noqa: PLW1509
            assert self.proc.stdout is not None and self.proc.stderr is not None
            readers = [self._reader(self.proc.stdout.fileno(), wire.STDOUT),
                       self._reader(self.proc.stderr.fileno(), wire.STDERR)]
        log.info("session %s: exec in lease %s (tty %s)", self.session_id, self.lease_id,
                 self.order.tty)

        def waiter() -> None:
            code = self.proc.wait()
            for r in readers:  # all of its output before its exit code (they may wait for credit)
                while r.is_alive() and not self.done.is_set():
                    r.join(0.5)
            self.send(wire.EXIT, str(code).encode())
            self.done.set()

        threading.Thread(target=waiter, name=f"exec-{self.session_id[:8]}", daemon=True).start()

    def _reader(self, fd: int, kind: bytes) -> threading.Thread:
        def read() -> None:
            while True:
                try:
                    data = os.read(fd, READ_BYTES)
                except OSError:  # a pty's EIO once the terminal's last user is gone
                    return
                if not data:
                    return
                self.send(kind, data)

        t = threading.Thread(target=read, name=f"exec-out-{self.session_id[:8]}", daemon=True)
        t.start()
        return t

    def handle(self, kind: bytes, conn: int | None, payload: bytes) -> None:
        if kind == wire.STDIN:
            self._write(payload)
        elif kind == wire.EOF:
            if self.master is not None:
                self._write(b"\x04")
            elif self.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
        elif kind == wire.RESIZE and self.master is not None:
            try:
                rows, cols = (int(x) for x in payload.split(b" ", 1))
            except ValueError:
                return
            _resize(self.master, max(1, min(rows, 10_000)), max(1, min(cols, 10_000)))
        elif kind == wire.SIGNAL:
            sig = _SIGNALS.get(payload.decode(errors="replace"))
            if sig is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, sig)

    def _write(self, data: bytes) -> None:
        if self.master is not None:
            _until_raw(self.master)
            with contextlib.suppress(OSError):
                os.write(self.master, data)
        elif self.proc.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdin.write(data)
                self.proc.stdin.flush()

    def end(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        if self.master is not None:
            with contextlib.suppress(OSError):
                os.close(self.master)


class ForwardSession(Session):
    """TCP connections to one port inside the sandbox's network namespace, one per
    connection the tenant opens, each relayed both ways until either side closes."""

    def begin(self) -> None:
        self.conns: dict[int, socket.socket] = {}
        self.conns_lock = threading.Lock()
        log.info("session %s: port-forward to %s in lease %s", self.session_id,
                 self.order.port, self.lease_id)

    def handle(self, kind: bytes, conn: int | None, payload: bytes) -> None:
        if conn is None:
            return
        if kind == wire.CONN_OPEN:
            with self.conns_lock:
                full = len(self.conns) >= MAX_CONNECTIONS or conn in self.conns
            if full:
                self.send(wire.CONN_CLOSED, b"too many connections", conn)
                return
            threading.Thread(target=self._connect, args=(conn,), daemon=True,
                             name=f"fwd-{self.session_id[:8]}").start()
        elif kind == wire.CONN_DATA:
            with self.conns_lock:
                s = self.conns.get(conn)
            if s is not None:
                try:
                    s.sendall(payload)
                except OSError:
                    self._drop(conn)
        elif kind == wire.CONN_CLOSE:
            with self.conns_lock:
                s = self.conns.get(conn)
            if s is not None:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_WR)

    def _connect(self, conn: int) -> None:
        assert self.entry is not None and self.order.port is not None
        try:
            s = self.entry.connect(self.order.port)
        except OSError as e:
            self.send(wire.CONN_CLOSED, str(e)[:200].encode(), conn)
            return
        with self.conns_lock:
            self.conns[conn] = s
        self.send(wire.CONN_OPENED, b"", conn)
        while not self.done.is_set():
            try:
                data = s.recv(READ_BYTES)
            except OSError:
                break
            if not data:
                break
            self.send(wire.CONN_BYTES, data, conn)
        self._drop(conn)

    def _drop(self, conn: int) -> None:
        with self.conns_lock:
            s = self.conns.pop(conn, None)
        if s is not None:
            with contextlib.suppress(OSError):
                s.close()
            self.send(wire.CONN_CLOSED, b"", conn)

    def end(self) -> None:
        with self.conns_lock:
            conns, self.conns = getattr(self, "conns", {}), {}
        for s in conns.values():
            with contextlib.suppress(OSError):
                s.close()


class AttachSession(Session):
    """The job's own output from where `pool lease logs` stands as it attaches, and the
    tenant's input to the job's stdin (a job started with one); it ends with the job's exit
    code, or an error frame when the job is no longer this node's."""

    FOLLOW_SECONDS = 0.05  # how often the job's output is looked at when nothing came
    acks_when_written = True
    feed: StdinFeed | None = None
    GONE_GRACE_SECONDS = 2.0  # for the job's last output and code once the agent lets it go
    gone_at: float | None = None

    def still_here(self) -> bool:
        """A job that has just exited leaves the agent's running jobs at once: its last
        output and exit code still go out, for a short grace (the follower ends the session)."""
        if self._lease_here():
            return True
        self.gone_at = self.gone_at or time.monotonic()
        return time.monotonic() - self.gone_at < self.GONE_GRACE_SECONDS

    def enter(self) -> SandboxEntry | None:
        return None  # the job's output and stdin are the runtime's: nothing to enter

    def begin(self) -> None:
        self.exit_sent = False
        key = self.run_.handle.key
        self.offset = self.agent.output.offset(key) or 0
        log.info("session %s: attach to lease %s", self.session_id, self.lease_id)
        threading.Thread(target=self._follow, name=f"attach-{self.session_id[:8]}",
                         daemon=True).start()

    def _follow(self) -> None:
        runtime, handle = self.agent.runtime, self.run_.handle
        exited: int | None = None
        while runtime.can_read_output and not self.done.is_set():
            data, self.offset = runtime.read_output(handle, self.offset, READ_BYTES)
            if data:
                self.send(wire.STDOUT, data)
                continue
            if exited is not None:  # the rest of its output is out: its code goes last
                self.exit_sent = True
                self.send(wire.EXIT, str(exited).encode())
                self.done.set()
                return
            if self._lease_here():
                exited = runtime.poll(handle)
            else:  # the agent let it go (and its runtime may have forgotten it): its code
                exited = self.run_.exit_code
            if exited is None:
                time.sleep(self.FOLLOW_SECONDS)

    def handle(self, kind: bytes, conn: int | None, payload: bytes) -> None:
        """Input goes to the session's feed (agents/stdinfeed.py): this thread never waits
        for the job to read, so a close, a ping or the job's end are still seen."""
        pipes = self.agent.runtime.stdin
        if kind not in (wire.STDIN, wire.EOF) or pipes is None:
            return
        if self.feed is None:
            self.feed = StdinFeed(pipes, self.run_.handle.key, self.took, self._refused,
                                  self.done, f"stdin-{self.session_id[:8]}")
        if kind == wire.EOF:
            self.feed.end()
            return
        try:
            self.feed.put(payload)
        except StdinFull as e:
            self._refused(e)

    def _refused(self, e: Exception) -> None:
        """The job's stdin is closed (StdinClosed) or full (StdinFull): the tenant is told,
        the session ends."""
        if self.done.is_set():
            return
        self.send(wire.ERROR, json.dumps({"code": getattr(e, "code", "stdin_closed"),
                                          "message": str(e)[:500]}).encode())
        self.exit_sent = True
        self.done.set()

    def end(self) -> None:
        if not getattr(self, "exit_sent", True):
            self.send(wire.ERROR, json.dumps({
                "code": "session_ended",
                "message": "the job no longer runs here (or the session was idle)"}).encode())


KINDS: dict[str, type[Session]] = {"exec": ExecSession, "forward": ForwardSession,
                                   "attach": AttachSession}


def _resize(fd: int, rows: int, cols: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _until_raw(master: int, wait_s: float = 1.0) -> None:
    """Until `script` has put the terminal in raw mode (its first act), at most `wait_s`: a
    keystroke before then would be echoed twice."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if not termios.tcgetattr(master)[3] & termios.ICANON:
                return
        except termios.error:
            return
        time.sleep(0.005)
