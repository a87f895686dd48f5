"""`pool lease exec` (pipes and -it) and `pool lease port-forward` into a job running in the
bubblewrap sandbox, and who may not: another tenant, a finished lease, another node. One
secured plane (every role, tenant and node its own NATS user) for the module."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import pty
import queue
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from agents.agent import Agent
from agents.probe import NodeProbe, Reserve
from agents.runtimes.process import ProcessRuntime
from bus.admin import ensure_all_streams
from bus.agentbus import AgentLink
from bus.caps import Caps
from bus.connguard import ConnectionGuard, user_caps
from bus.local.auth import AuthConfig, guard_url, role_urls, url_with_credentials
from bus.local.server import NatsServer
from bus.replies import node_inbox, tenant_inbox
from client.api import PoolClient
from tests.control_plane import lease_body
from tests.security.roles import VIOLATION, wait_for
from workers.plane import ControlPlane

if ProcessRuntime(Path("/tmp")).available() is not None:
    pytest.skip(f"process runtime unavailable: {ProcessRuntime(Path('/tmp')).available()}",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
PROBE = NodeProbe(cpu_millis=4500, cpu_arch="amd64", memory_mib=9216, local_disk_gib=50)


class Plane:
    def __init__(self, server: NatsServer, auth: AuthConfig, lease_id: str, ended: str) -> None:
        self.server, self.auth, self.lease_id, self.ended = server, auth, lease_id, ended
        self.leases: list[str] = []  # every lease committed, cancelled at the end
        self.guard: ConnectionGuard | None = None

    def args(self, tenant: str = "alpha") -> list[str]:
        return ["--nats-url", self.server.url, "--tenant", tenant]

    def env(self, tenant: str = "alpha") -> dict[str, str]:
        c = self.auth.tenants[tenant]
        env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
        # the tenant's own user, as a laptop with NATS credentials has it
        env.update(POOL_NATS_USER=c.user, POOL_NATS_PASSWORD=c.password)
        return env

    def tenant(self, tenant: str) -> PoolClient:
        c = self.auth.tenants[tenant]
        return PoolClient(self.server.url, tenant, user=c.user, password=c.password,
                          timeout=15, inbox_prefix=tenant_inbox(tenant).encode())


def _commit(alpha: PoolClient, key: str, command: list[str],
            leases: list[str] | None = None, **job: Any) -> str:
    lid = str(alpha.request_lease(lease_body(key, runtime="sandboxed", memory_mib=256))
              ["lease"]["lease_id"])
    if leases is not None:
        leases.append(lid)
    wait_for(lambda: alpha.lease(lid, "get")["lease"]["state"] == "reserved")
    assert alpha.lease(lid, "commit", {"job": {"command": command, **job}})["ok"]
    return lid


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    tmp = tmp_path_factory.mktemp("exec")
    auth = AuthConfig()
    for tenant in ("alpha", "beta"):
        auth.add_tenant(tenant)
    for node in ("n1", "n2"):
        auth.add_node(node)
    server = NatsServer(store_dir=tmp / "nats", server_name="pool-exec",
                        extra_config=auth.render()).start()
    ensure_all_streams(url_with_credentials(server.url, auth.service))
    cp = ControlPlane(url_with_credentials(server.url, auth.roles["commands"]),
                      leader_ttl_seconds=1.0, role_urls=role_urls(server.url, auth),
                      responder_url=url_with_credentials(server.url, auth.responder)).start()
    # the agent under the default caps of a node's user: its account's limits (auth.render())
    # and the connection guard's, as `pool up` runs them
    guard = ConnectionGuard(guard_url(server.url, auth), user_caps(
        Caps.from_env({}), Caps.nodes_from_env({})), sweep_seconds=1).start()
    link = AgentLink(url_with_credentials(server.url, auth.nodes["n1"]), "n1").connect()
    stop = threading.Event()
    thread = None
    try:
        with PoolClient(url_with_credentials(server.url, auth.roles["admin"]),
                        timeout=15) as admin:
            assert admin.admin("pool.set", {"pool_id": "p1",
                                            "priority_classes": {"standard": 10}})["ok"]
            for tenant in ("alpha", "beta"):
                assert admin.admin("tenant.set", {"tenant": tenant, "pool_id": "p1",
                                                  "weight": 1.0})["ok"]
                assert admin.admin("credits.grant", {
                    "tenant": tenant, "amount_microcredits": 10**12,
                    "transfer_id": f"initial-{tenant}"})["ok"]
            assert admin.admin("node.enroll", {"node_id": "n1", "pool_id": "p1",
                                               "trust_level": "trusted"})["ok"]
        agent = Agent(link, ProcessRuntime(tmp / "n1"), node_id="n1", pool_id="p1",
                      probe=PROBE, state_dir=tmp / "n1", reserve=Reserve(500, 1024, 0),
                      heartbeat_interval=0.5)
        thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
        thread.start()
        p = Plane(server, auth, "", "")
        p.guard = guard
        with p.tenant("alpha") as alpha:
            p.ended = _commit(alpha, "ended", ["true"])
            p.lease_id = _commit(alpha, "web", ["python3", "-m", "http.server", "8000"],
                                 p.leases)
            wait_for(lambda: alpha.lease(p.ended, "get")["lease"]["state"] == "released")
            wait_for(lambda: alpha.lease(p.lease_id, "get")["lease"]["state"] == "running")
        yield p
        with p.tenant("alpha") as alpha:  # the agent leaves running jobs to its next start
            for lid in p.leases:
                alpha.lease(lid, "cancel", {})
            wait_for(lambda: not agent.running, timeout=30)
    finally:
        stop.set()
        if thread is not None:
            thread.join(15)
        link.close()
        guard.stop()
        cp.stop()
        server.stop()


def _pool(p: Plane, *argv: str, tenant: str = "alpha", timeout: float = 30,
          **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli.main", *argv], cwd=ROOT,
                          env=p.env(tenant), capture_output=True, text=True, timeout=timeout,
                          check=False, **kw)


def test_exec_prints_the_output_and_exits_with_the_command_s_code(plane: Plane) -> None:
    out = _pool(plane, "lease", "exec", plane.lease_id, *plane.args(), "--",
                "sh", "-c", "echo in; echo err >&2; id -u; exit 4")
    assert out.returncode == 4, out.stderr
    assert out.stdout == "in\n65534\n"
    assert out.stderr == "err\n"


def test_exec_runs_in_the_job_s_sandbox_and_passes_stdin_with_i(plane: Plane) -> None:
    # the job's own network namespace (its server answers on its loopback) and environment
    out = _pool(plane, "lease", "exec", "-i", plane.lease_id, *plane.args(), "--",
                "sh", "-c", "cat; echo $POOL_LEASE_ID; python3 -c \"import urllib.request;"
                "print(urllib.request.urlopen('http://127.0.0.1:8000/').status)\"",
                input="from-stdin\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"from-stdin\n{plane.lease_id}\n200\n"


def test_each_exec_is_an_event_in_the_lease_s_log(plane: Plane) -> None:
    from projections.replay import event_name, notifications, state_of
    from workers.application import PoolApp
    from workers.bootstrap import app_env

    assert _pool(plane, "lease", "exec", plane.lease_id, *plane.args(), "--",
                 "echo", "logged-bytes").returncode == 0
    _open_and_close(plane, {"kind": "forward", "port": 8000})
    _open_and_close(plane, {"kind": "attach"})
    app = PoolApp(env=app_env(url_with_credentials(plane.server.url, plane.auth.service)))
    try:
        events = [(event_name(n.topic), state_of(n)) for n in notifications(app)]
    finally:
        app.close()
    opened = [body for name, body in events if name == "SessionOpened"]
    assert opened[-3]["command"] == ["echo", "logged-bytes"]
    assert opened[-3]["kind"] == "exec" and opened[-3]["at"] > 0
    # a forward and an attach are events too: who (the lease's tenant, its subject), when, what
    assert [(o["kind"], o["port"], o["command"]) for o in opened[-2:]] == [
        ("forward", 8000, []), ("attach", None, [])]
    # the command is in the log; what it printed is not
    assert sum("logged-bytes" in json.dumps(body) for _, body in events) == 1


def _open_and_close(p: Plane, body: dict[str, Any]) -> None:
    from bus import sessions as wire

    c = p.auth.tenants["alpha"]

    async def go() -> None:
        nc = await nats.connect(p.server.url, user=c.user, password=c.password,
                                inbox_prefix=tenant_inbox("alpha").encode())
        try:
            s = wire.TenantSession(nc, "alpha", p.lease_id)
            await s.open(body)
            await s.close()
        finally:
            await nc.close()

    asyncio.run(go())


def test_exec_it_gives_a_terminal_and_ctrl_d_ends_it(plane: Plane) -> None:
    pid, fd = pty.fork()
    if pid == 0:  # the child: the CLI on a terminal of its own
        os.chdir(ROOT)
        os.execve(sys.executable, [sys.executable, "-m", "cli.main", "lease", "exec", "-it",
                                   plane.lease_id, *plane.args(), "--", "sh"], plane.env())
    import fcntl
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 101, 0, 0))
    seen = b""

    def read_until(needle: bytes, timeout: float = 10) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while needle not in seen and time.monotonic() < deadline:
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    seen += os.read(fd, 4096)
                except OSError:
                    break
        assert needle in seen, seen

    read_until(b"$ ")
    os.write(fd, b"tty; stty size\r")
    read_until(b"33 101")
    assert b"/dev/pts/" in seen
    os.write(fd, b"sleep 30\r")
    time.sleep(0.3)
    os.write(fd, b"\x03")  # Ctrl-C ends the sleep, not the session
    os.write(fd, b"echo after-$?\r")
    read_until(b"after-130")
    os.write(fd, b"\x04")  # Ctrl-D: the shell ends, and with it the session
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if select.select([fd], [], [], 0.1)[0]:
            try:
                os.read(fd, 4096)
            except OSError:
                pass
    else:
        os.kill(pid, 9)
        raise AssertionError(f"exec -it did not end on Ctrl-D: {seen!r}")
    os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_port_forward_serves_20_concurrent_requests(plane: Plane) -> None:
    local = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "lease", "port-forward",
                             plane.lease_id, f"{local}:8000", *plane.args(), "--json"],
                            cwd=ROOT, env=plane.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["ok"] and ready["result"]["local"] == f"127.0.0.1:{local}", ready

        def get(_: int) -> int:
            with urllib.request.urlopen(f"http://127.0.0.1:{local}/", timeout=10) as r:
                return int(r.status) if b"Directory listing" in r.read() else -1

        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            assert list(pool.map(get, range(20))) == [200] * 20
    finally:
        proc.send_signal(2)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""


def test_a_finished_lease_is_refused(plane: Plane) -> None:
    out = _pool(plane, "lease", "exec", plane.ended, *plane.args(), "--json", "--", "true")
    assert out.returncode == 1
    assert json.loads(out.stdout)["error"]["code"] == "illegal_transition", out.stdout


def test_another_tenant_cannot_open_or_join_a_session(plane: Plane) -> None:
    # through the CLI: beta's own subject knows no such lease
    out = _pool(plane, "lease", "exec", plane.lease_id, *plane.args("beta"), "--json", "--",
                "true", tenant="beta")
    assert out.returncode == 1 and json.loads(out.stdout)["error"]["code"] == "lease_not_found"
    out = _pool(plane, "lease", "attach", plane.lease_id, *plane.args("beta"), "--json",
                tenant="beta")
    assert out.returncode == 1 and json.loads(out.stdout)["error"]["code"] == "lease_not_found"
    out = _pool(plane, "lease", "port-forward", plane.lease_id, "0:8000", *plane.args("beta"),
                "--json", tenant="beta")
    assert out.returncode == 1 and json.loads(out.stdout)["error"]["code"] == "lease_not_found"
    # and on alpha's subjects: the server refuses each
    assert all(_tries(plane, "beta", tenant_inbox("beta"), [
        ("pub", f"pool.cmd.alpha.lease.{plane.lease_id}.session"),
        ("pub", "pool.sess.alpha.n1.0123456789abcdef0123456789abcdef.in"),
        ("sub", "pool.sess.alpha.n1.*.out"),
        ("sub", "pool.sess.alpha.>"),
    ]).values())


def test_a_node_that_does_not_hold_the_lease_cannot_join_its_sessions(plane: Plane) -> None:
    refused = _tries(plane, "n2", node_inbox("n2"), [
        ("sub", "pool.sess.alpha.n1.*.in"),
        ("sub", "pool.sess.*.n1.>"),
        ("pub", "pool.sess.alpha.n1.0123456789abcdef0123456789abcdef.out"),
    ])
    assert all(refused.values()), refused


def _tries(p: Plane, who: str, inbox: str, tries: list[tuple[str, str]]) -> dict[str, bool]:
    """Each (pub|sub, subject) tried as `who` (a tenant or a node): whether the server
    refused it (a permissions violation reported to that connection)."""
    creds = p.auth.tenants.get(who) or p.auth.nodes[who]

    async def go() -> dict[str, bool]:
        errors: list[str] = []

        async def on_error(e: Exception) -> None:
            errors.append(str(e))

        nc = await nats.connect(p.server.url, user=creds.user, password=creds.password,
                                inbox_prefix=inbox.encode(), error_cb=on_error)
        out: dict[str, bool] = {}
        try:
            for how, subject in tries:
                before = len(errors)
                if how == "pub":
                    await nc.publish(subject, b"i")
                else:
                    await nc.subscribe(subject)
                await nc.flush()
                await asyncio.sleep(0.1)
                out[f"{how} {subject}"] = any(VIOLATION.lower() in e.lower()
                                              for e in errors[before:])
        finally:
            await nc.close()
        return out

    return asyncio.run(go())


def test_an_exec_ends_with_its_lease(plane: Plane) -> None:
    with plane.tenant("alpha") as alpha:
        lid = _commit(alpha, "short", ["sleep", "60"], plane.leases)
        wait_for(lambda: alpha.lease(lid, "get")["lease"]["state"] == "running")
        proc = subprocess.Popen([sys.executable, "-m", "cli.main", "lease", "exec", lid,
                                 *plane.args(), "--", "sh", "-c", "echo up; sleep 30"],
                                cwd=ROOT, env=plane.env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "up\n"
            t0 = time.monotonic()
            assert alpha.lease(lid, "cancel", {})["ok"]
            code = proc.wait(15)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert code != 0 and time.monotonic() - t0 < 10


def test_a_slow_reader_gets_every_byte(plane: Plane) -> None:
    # twice the flow-control window, read only after a pause: nothing is dropped
    from bus import sessions as wire

    size = 2 * wire.WINDOW_BYTES
    c = plane.auth.tenants["alpha"]

    async def go() -> tuple[int, bytes]:
        nc = await nats.connect(plane.server.url, user=c.user, password=c.password,
                                inbox_prefix=tenant_inbox("alpha").encode())
        try:
            s = wire.TenantSession(nc, "alpha", plane.lease_id)
            await s.open({"kind": "exec", "command": ["head", "-c", str(size), "/dev/zero"]})
            await s.send(wire.EOF)
            await asyncio.sleep(1.0)
            got = 0
            while True:
                kind, _, payload = await s.recv(10)
                if kind == wire.STDOUT:
                    got += len(payload)
                elif kind == wire.EXIT:
                    return got, payload
        finally:
            await nc.close()

    assert asyncio.run(go()) == (size, b"0")


ECHOER = ["sh", "-c", "echo ready; while read l; do echo got-$l; done; echo eof; exit 7"]


def _attach(p: Plane, lease_id: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "cli.main", "lease", "attach", lease_id,
                             *p.args(), *extra], cwd=ROOT, env=p.env(), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def read_until(proc: subprocess.Popen[str], line: str, timeout: float = 15) -> list[str]:
    """The lines `proc` prints up to `line`; fails after `timeout` seconds."""
    assert proc.stdout is not None
    got: list[str] = []
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        while line not in got:
            got.append(proc.stdout.readline())
            assert got[-1], (got, proc.stderr.read() if proc.stderr else "")
    finally:
        timer.cancel()
    return got


def test_attach_follows_the_job_s_output_and_feeds_its_stdin(plane: Plane) -> None:
    with plane.tenant("alpha") as alpha:
        lid = _commit(alpha, "echoer", ECHOER, plane.leases, stdin=True)
        wait_for(lambda: alpha.lease(lid, "get")["lease"]["state"] == "running")
        proc = _attach(plane, lid, "-i")
        try:
            assert proc.stdin is not None
            proc.stdin.write("hello\n")
            proc.stdin.flush()
            assert read_until(proc, "got-hello\n")[-1] == "got-hello\n"
            # a second attach sees what comes once it is open, and gives the job no input
            other = _attach(plane, lid)
            lines: queue.Queue[str] = queue.Queue()
            reader = threading.Thread(
                target=lambda: [lines.put(x) for x in other.stdout or ()], daemon=True)
            reader.start()
            for i in range(60):  # until it is open: one line each half second
                proc.stdin.write(f"again{i}\n")
                proc.stdin.flush()
                with contextlib.suppress(queue.Empty):
                    first = lines.get(timeout=0.5)
                    break
            assert first.startswith("got-again"), first
            proc.stdin.close()  # the end of this stdin: the job's input ends, it exits 7
            assert read_until(proc, "eof\n")[-1] == "eof\n"
            assert proc.wait(15) == 7 and other.wait(15) == 7
            reader.join(5)
            rest = [lines.get() for _ in range(lines.qsize())]
            assert rest[-1:] == ["eof\n"], rest  # the rest of the output, then its code
        finally:
            for p in (proc, locals().get("other")):
                if p is not None and p.poll() is None:
                    p.kill()
        assert alpha.lease(lid, "get")["lease"]["exit_code"] == 7


def test_attach_i_to_a_job_without_stdin_is_refused_on_its_input(plane: Plane) -> None:
    proc = _attach(plane, plane.lease_id, "-i", "--json")
    out, _ = proc.communicate("x\n", timeout=30)
    assert proc.returncode == 1
    assert json.loads(out)["error"]["code"] == "stdin_closed", out


def test_ctrl_c_detaches_an_attach_and_the_job_runs_on(plane: Plane) -> None:
    # the web job logs each request it serves: an attach hears the next one, then detaches
    proc = _attach(plane, plane.lease_id)
    try:
        deadline = time.monotonic() + 30
        out = b""
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        while b"GET /attached" not in out and time.monotonic() < deadline:
            _pool(plane, "lease", "exec", plane.lease_id, *plane.args(), "--", "python3", "-c",
                  "import urllib.request as u\n"
                  "try: u.urlopen('http://127.0.0.1:8000/attached')\n"
                  "except Exception: pass")
            time.sleep(0.3)
            out += proc.stdout.buffer.read() or b""
        assert b"GET /attached" in out, out
        proc.send_signal(2)
        assert proc.wait(15) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    with plane.tenant("alpha") as alpha:
        assert alpha.lease(plane.lease_id, "get")["lease"]["state"] == "running"


def _stdin_session(plane: Plane, command: list[str], key: str,
                   use: Any) -> Any:
    """Run `use(session, nc)` on an attach session to a new `--stdin` job of alpha's."""
    from bus import sessions as wire

    c = plane.auth.tenants["alpha"]
    with plane.tenant("alpha") as alpha:
        lid = _commit(alpha, key, command, plane.leases, stdin=True)
        wait_for(lambda: alpha.lease(lid, "get")["lease"]["state"] == "running")

    async def go() -> Any:
        nc = await nats.connect(plane.server.url, user=c.user, password=c.password,
                                inbox_prefix=tenant_inbox("alpha").encode())
        try:
            s = wire.TenantSession(nc, "alpha", lid)
            await s.open({"kind": "attach"})
            try:
                return await use(s, nc)
            finally:
                await s.close()
        finally:
            await nc.close()

    return asyncio.run(go())


def test_input_past_the_window_to_a_job_that_does_not_read_is_refused_stdin_full(
    plane: Plane,
) -> None:
    # a client that ignores its window (frames published straight to the session's subject)
    # while the job reads nothing: the agent holds at most its buffer, then refuses, at once
    from agents.stdinfeed import STDIN_BUFFER_BYTES
    from bus import sessions as wire
    from bus.subjects import session_subject

    async def flood(s: Any, nc: Any) -> tuple[str, float]:
        inn = session_subject("alpha", s.node, s.session_id, "in")
        chunk = b"x" * wire.CHUNK_BYTES
        for _ in range(STDIN_BUFFER_BYTES // len(chunk) + 4):
            await nc.publish(inn, wire.frame(wire.STDIN, chunk))
        t0 = time.monotonic()
        while True:
            kind, _, payload = await s.recv(20)
            if kind == wire.ERROR:
                return json.loads(payload)["code"], time.monotonic() - t0

    code, waited = _stdin_session(plane, ["sleep", "120"], "deaf", flood)
    assert code == "stdin_full" and waited < 10, (code, waited)


def test_more_input_than_the_window_reaches_a_job_that_reads_late(plane: Plane) -> None:
    # acknowledged as the job takes it: the client waits for it, nothing is refused or lost
    from bus import sessions as wire

    size = 2 * wire.WINDOW_BYTES

    async def pipe(s: Any, nc: Any) -> bytes:
        await s.send(wire.STDIN, b"y" * size)
        await s.send(wire.EOF)
        out = b""
        while True:
            kind, _, payload = await s.recv(30)
            if kind == wire.STDOUT:
                out += payload
            elif kind in (wire.EXIT, wire.ERROR):
                return out + kind + payload

    got = _stdin_session(plane, ["sh", "-c", "sleep 2; wc -c"], "late", pipe)
    assert got.split() == [str(size).encode(), b"X0"], got


def _node_connections(p: Plane, node: str) -> list[dict[str, Any]]:
    """The node's user's connections as the server lists them (CONNZ, its subscriptions)."""
    async def go() -> list[dict[str, Any]]:
        nc = await nats.connect(guard_url(p.server.url, p.auth))
        try:
            r = await nc.request("$SYS.REQ.SERVER.PING.CONNZ", json.dumps(
                {"auth": True, "subscriptions": True, "limit": 1024}).encode(), timeout=5)
        finally:
            await nc.close()
        return [c for c in json.loads(r.data)["data"]["connections"]
                if c.get("authorized_user") == f"node-{node}"]

    return asyncio.run(go())


def test_the_agent_serves_sessions_within_the_default_caps_of_a_node(plane: Plane) -> None:
    """A real agent holds one connection, two subscriptions and one a session open: five
    execs and a port-forward serving 20 requests at once stay far inside a node's default
    caps (8 connections, 2,048 subscriptions), and the guard closes nothing of it."""
    caps = Caps.nodes_from_env({})
    execs = [subprocess.Popen(
        [sys.executable, "-m", "cli.main", "lease", "exec", "-i", plane.lease_id,
         *plane.args(), "--", "sh", "-c", "cat; echo done"], cwd=ROOT, env=plane.env(),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(5)]
    local = _free_port()
    forward = subprocess.Popen([sys.executable, "-m", "cli.main", "lease", "port-forward",
                                plane.lease_id, f"{local}:8000", *plane.args(), "--json"],
                               cwd=ROOT, env=plane.env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert forward.stdout is not None
        assert json.loads(forward.stdout.readline())["ok"]
        wait_for(lambda: sum(c.get("subscriptions") or 0
                             for c in _node_connections(plane, "n1")) >= 2 + 6, timeout=30)

        def get(_: int) -> int:
            with urllib.request.urlopen(f"http://127.0.0.1:{local}/", timeout=10) as r:
                return int(r.status)

        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            assert list(pool.map(get, range(20))) == [200] * 20
        held = _node_connections(plane, "n1")
        assert len(held) == 1 <= caps.max_connections, held
        assert 2 + 6 <= held[0]["subscriptions"] <= caps.max_subscriptions, held
        outs = [e.communicate("in\n", timeout=30) for e in execs]
        assert [o[0] for o in outs] == ["in\ndone\n"] * 5, outs
    finally:
        forward.send_signal(2)
        forward.wait(10)
        for e in execs:
            if e.poll() is None:
                e.kill()
    assert plane.guard is not None and not plane.guard.kicked, plane.guard.kicked
