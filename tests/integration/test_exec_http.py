"""`pool lease exec` (pipes and -it) and `pool lease port-forward` from a laptop: an HTTP
context only, through the gateway's WebSocket bridge to a job in the bubblewrap sandbox; and
whom the gateway refuses (another tenant's token, no token, a finished or unknown lease)."""
# ruff: noqa: F811 - `laptop` is test_cli_http's fixture, imported to be used here

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import pty
import select
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_cli_http import ROOT, Laptop, laptop  # noqa: F401
from tests.integration.test_exec import ECHOER, read_until


@pytest.fixture(scope="module")
def web(laptop: Laptop) -> Iterator[str]:
    """A running job of alpha's serving HTTP on its port 8000, its lease id."""
    done = laptop.pool("login", laptop.url, "--token-stdin", "--name", "lab",
                       stdin=laptop.tokens["alpha"] + "\n")
    assert done.returncode == 0, done.stderr
    run = laptop.pool("lease", "run", "-d", "--max-runtime", "600", "--", "python3", "-m",
                      "http.server", "8000")
    assert run.returncode == 0, run.stderr
    lease_id = run.stdout.strip()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got = json.loads(laptop.pool("lease", "get", lease_id, "--json").stdout)
        if got["lease"]["state"] == "running" and _answers(laptop, lease_id):
            break
        time.sleep(0.3)
    else:
        raise AssertionError(f"lease {lease_id} never served: {got}")
    yield lease_id
    laptop.pool("lease", "cancel", lease_id)


def _answers(laptop: Laptop, lease_id: str) -> bool:
    out = laptop.pool("lease", "exec", lease_id, "--", "python3", "-c",
                      "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/')")
    return out.returncode == 0


def _env(laptop: Laptop) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("POOL_") and k != "XDG_CONFIG_HOME"}
    env.update(HOME=str(laptop.home), PYTHONPATH=str(ROOT))
    return env


def test_exec_over_the_gateway_prints_the_output_and_exits_with_its_code(
    laptop: Laptop, web: str,
) -> None:
    out = laptop.pool("lease", "exec", web, "--", "sh", "-c", "echo in; echo err >&2; exit 4")
    assert out.returncode == 4, out.stderr
    assert out.stdout == "in\n" and out.stderr == "err\n"
    piped = laptop.pool("lease", "exec", "-i", web, "--", "sh", "-c", "cat; echo $POOL_LEASE_ID",
                        stdin="from-stdin\n")
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == f"from-stdin\n{web}\n"


def test_exec_it_over_the_gateway_gives_a_terminal_and_ctrl_d_ends_it(
    laptop: Laptop, web: str,
) -> None:
    import fcntl
    import struct
    import termios

    pid, fd = pty.fork()
    if pid == 0:  # the child: the CLI on a terminal of its own, with the HTTP context only
        os.chdir(laptop.home)
        os.execve(sys.executable, [sys.executable, "-m", "cli.main", "lease", "exec", "-it",
                                   web, "--", "sh"], _env(laptop))
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 101, 0, 0))
    seen = b""

    def read_until(needle: bytes, timeout: float = 15) -> None:
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
    os.write(fd, b"\x04")  # Ctrl-D: the shell ends, and with it the session
    deadline = time.monotonic() + 15
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


def test_port_forward_over_the_gateway_serves_20_concurrent_requests(
    laptop: Laptop, web: str,
) -> None:
    local = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "lease", "port-forward", web,
                             f"{local}:8000", "--json"], cwd=laptop.home, env=_env(laptop),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["ok"] and ready["result"]["local"] == f"127.0.0.1:{local}", ready

        def get(_: int) -> int:
            with urllib.request.urlopen(f"http://127.0.0.1:{local}/", timeout=15) as r:
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


def _raw(laptop: Laptop, lease_id: str, token: str | None,
         body: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """The gateway's first message to a WebSocket opened with `token`, and its close code."""
    import contextlib

    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    from client.wssession import session_url

    async def go() -> tuple[dict[str, Any], int | None]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with connect(session_url(laptop.url, lease_id), additional_headers=headers,
                           open_timeout=10) as ws:
            with contextlib.suppress(ConnectionClosed):  # a refusal may come first
                await ws.send(json.dumps(body))
            first = json.loads(await asyncio.wait_for(ws.recv(), 30))
            await ws.wait_closed()
            return first, ws.close_code

    return asyncio.run(go())


def test_the_gateway_refuses_another_tenant_no_token_and_ended_or_unknown_leases(
    laptop: Laptop, web: str, tmp_path: Path,
) -> None:
    exec_true = {"kind": "exec", "command": ["true"]}
    for body in (exec_true, {"kind": "forward", "port": 8000}):
        answer, close = _raw(laptop, web, laptop.tokens["beta"], body)
        assert answer["error"]["code"] == "lease_not_found" and close == 4404, answer
    answer, close = _raw(laptop, web, None, exec_true)
    assert answer["error"]["code"] == "unauthenticated" and close == 4401, answer
    answer, close = _raw(laptop, web, laptop.tokens["alpha"], {"kind": "exec", "command": []})
    assert answer["error"]["code"] == "invalid_field" and close == 4422, answer
    answer, close = _raw(laptop, "no-such-lease", laptop.tokens["alpha"], exec_true)
    assert answer["error"]["code"] == "lease_not_found", answer
    ended = laptop.pool("lease", "run", "-d", "--", "true").stdout.strip()
    deadline = time.monotonic() + 30
    while json.loads(laptop.pool("lease", "get", ended, "--json").stdout)["lease"]["state"] \
            != "released" and time.monotonic() < deadline:
        time.sleep(0.3)
    answer, close = _raw(laptop, ended, laptop.tokens["alpha"], exec_true)
    assert answer["error"]["code"] == "illegal_transition" and close == 4409, answer
    # through the CLI, as beta from its own laptop: exec and port-forward are refused
    beta = laptop.pool("login", laptop.url, "--token-stdin", stdin=laptop.tokens["beta"] + "\n",
                       home=tmp_path)
    assert beta.returncode == 0, beta.stderr
    out = laptop.pool("lease", "exec", web, "--json", "--", "true", home=tmp_path)
    assert out.returncode == 1 and json.loads(out.stdout)["error"]["code"] == "lease_not_found"
    fwd = laptop.pool("lease", "port-forward", web, "0:8000", home=tmp_path)
    assert fwd.returncode == 1 and "[lease_not_found]" in fwd.stderr, fwd.stderr
    att = laptop.pool("lease", "attach", web, home=tmp_path)
    assert att.returncode == 1 and "[lease_not_found]" in att.stderr, att.stderr


def test_attach_over_the_gateway_feeds_stdin_and_exits_with_the_job_s_code(
    laptop: Laptop, web: str,
) -> None:
    run = laptop.pool("lease", "run", "-d", "--stdin", "--max-runtime", "120", "--", *ECHOER)
    assert run.returncode == 0, run.stderr
    lease_id = run.stdout.strip()
    deadline = time.monotonic() + 30
    while json.loads(laptop.pool("lease", "get", lease_id, "--json").stdout)["lease"]["state"] \
            != "running" and time.monotonic() < deadline:
        time.sleep(0.3)
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "lease", "attach", "-i",
                             lease_id], cwd=laptop.home, env=_env(laptop), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert proc.stdin is not None
        proc.stdin.write("hello\n")
        proc.stdin.flush()
        assert read_until(proc, "got-hello\n")[-1] == "got-hello\n"
        proc.stdin.close()
        assert read_until(proc, "eof\n")[-1] == "eof\n"
        assert proc.wait(15) == 7
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_slow_reader_over_the_gateway_gets_every_byte(laptop: Laptop, web: str) -> None:
    # twice the session's flow-control window, read only after a pause: nothing is dropped
    from bus import sessions as wire
    from client.wssession import over_gateway

    size = 2 * wire.WINDOW_BYTES

    async def go() -> tuple[int, bytes]:
        open_session = over_gateway(laptop.url, laptop.tokens["alpha"], web)
        s = await open_session({"kind": "exec", "command": ["head", "-c", str(size),
                                                             "/dev/zero"]}, 15)
        try:
            await s.send(wire.EOF)
            await asyncio.sleep(1.0)
            got = 0
            while True:
                kind, _, payload = await s.recv(15)
                if kind == wire.STDOUT:
                    got += len(payload)
                elif kind == wire.EXIT:
                    return got, payload
        finally:
            await s.close()

    assert asyncio.run(go()) == (size, b"0")


def test_the_admin_token_opens_no_session_into_any_lease(laptop: Laptop, web: str) -> None:
    # the operator acts for no tenant: a session runs as the lease's tenant, so the admin
    # token is refused before any lease is looked up, for every kind of session
    admin = laptop.token_store.issue_admin()
    for body in ({"kind": "exec", "command": ["true"]}, {"kind": "attach"},
                 {"kind": "forward", "port": 8000}):
        answer, close = _raw(laptop, web, admin, body)
        assert answer["error"]["code"] == "forbidden" and close == 4403, answer


def test_a_token_holds_at_most_16_sessions_and_gets_room_back_when_one_closes(
    laptop: Laptop, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # sessions count with the token's event streams: 16 sockets waiting for their opening
    # message hold 16 places; the 17th is refused, and one closing makes room again
    from websockets.asyncio.client import connect

    from client.wssession import session_url
    from gateway import sessions
    from gateway.sse import MAX_STREAMS_PER_TOKEN

    monkeypatch.setattr(sessions, "OPEN_SECONDS", 120.0)  # the held ones wait this test out
    headers = {"Authorization": f"Bearer {laptop.tokens['beta']}"}
    url = session_url(laptop.url, "some-lease")
    bad = json.dumps({"kind": "exec", "command": []})  # refused after the room check

    async def first(ws: Any) -> tuple[dict[str, Any], int | None]:
        got = json.loads(await asyncio.wait_for(ws.recv(), 30))
        await ws.wait_closed()
        return got, ws.close_code

    async def go() -> None:
        held = [await connect(url, additional_headers=headers, open_timeout=10)
                for _ in range(MAX_STREAMS_PER_TOKEN)]
        try:
            async with connect(url, additional_headers=headers, open_timeout=10) as ws:
                answer, close = await first(ws)
            assert answer["error"]["code"] == "too_many_requests" and close == 4429, answer
            assert answer["error"]["reasons"]["max_streams_per_token"] == 16
            await held.pop().close()
            deadline = time.monotonic() + 10
            while True:  # the gateway releases the place when it sees the close
                async with connect(url, additional_headers=headers, open_timeout=10) as ws:
                    await ws.send(bad)
                    answer, close = await first(ws)
                if answer["error"]["code"] != "too_many_requests" \
                        or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            assert answer["error"]["code"] == "invalid_field" and close == 4422, answer
        finally:
            for ws in held:
                await ws.close()

    asyncio.run(go())
