"""`pool bench exec`: the exec round trip of `true` into a running job (the client library's over
NATS and over the gateway's WebSocket, and a whole `pool lease exec` process's), beside `docker
exec` where a docker daemon answers, and port-forward throughput beside a direct loopback
connection, in one run on an idle plane.

The plane is bench/run.py's: `pool up --no-postgres` in a temporary POOL_HOME with one local
agent running jobs in the bubblewrap sandbox.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.run import POOL, TENANT, bench_main, local_plane, pool_argv, quantiles, timed

RUNS = 25
QUICK_RUNS = 5
WARMUP = 2
# a lease takes at most 30 sessions a minute (domain/lease.py): each kind of exec measured has
# a job of its own, and at most this many runs
MAX_RUNS = 28
SLEEPER = ["--cpu-millis", "100", "--memory-mib", "64", "--", "sleep", "900"]
FORWARD_MIB = 32
QUICK_FORWARD_MIB = 8
ECHO_PORT = 9000
# the job: an echo server on the sandbox's own loopback (what the forward is measured against)
ECHO = (
    "import socket,threading\n"
    "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
    f"s.bind(('127.0.0.1',{ECHO_PORT}));s.listen(64)\n"
    "def h(c):\n"
    "  while True:\n"
    "    d=c.recv(65536)\n"
    "    if not d: break\n"
    "    c.sendall(d)\n"
    "  c.close()\n"
    "while True:\n"
    "  c,_=s.accept();threading.Thread(target=h,args=(c,),daemon=True).start()\n")
DOCKER_IMAGE = "python:3.12-slim"


async def _exec_true(nc: Any, lease_id: str) -> float:
    """One exec of `true` through the client library: request → ready → exit code."""
    from bus import sessions as wire

    t0 = time.perf_counter()
    session = wire.TenantSession(nc, TENANT, lease_id)
    await session.open({"kind": "exec", "command": ["true"]})
    await session.send(wire.EOF)
    while True:
        kind, _, payload = await session.recv(30)
        if kind == wire.EXIT:
            took = time.perf_counter() - t0
            if payload != b"0":
                raise RuntimeError(f"`true` exited {payload!r} in the sandbox")
            await session.close()
            return took
        if kind == wire.ERROR:
            raise wire.refusal(payload)


async def _pump(port: int, mib: int) -> float:
    """MiB/s of `mib` MiB written to 127.0.0.1:`port` and read back (an echo)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    chunk = os.urandom(64 * 1024)
    total = mib * 1024 * 1024
    t0 = time.perf_counter()

    async def send() -> None:
        for _ in range(total // len(chunk)):
            writer.write(chunk)
            await writer.drain()

    sender = asyncio.create_task(send())
    got = 0
    while got < total:
        data = await asyncio.wait_for(reader.read(1 << 20), 30)
        if not data:
            raise RuntimeError(f"the echo closed after {got} of {total} bytes")
        got += len(data)
    took = time.perf_counter() - t0
    await sender
    writer.close()
    return mib / took


def _host_echo() -> tuple[subprocess.Popen[bytes], int]:
    """The job's own echo server run on the host's loopback at a free port: the direct
    connection the forward is compared with (the same server, no sandbox, no relay)."""
    from bus.local.server import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", ECHO.replace(str(ECHO_PORT), str(port))])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the host's echo server did not start")


async def _exec_over_gateway(url: str, token: str, lease_id: str, runs: int) -> list[float]:
    """Execs of `true` through the gateway's WebSocket: upgrade → ready → exit code."""
    from bus import sessions as wire
    from client.wssession import over_gateway

    open_session = over_gateway(url, token, lease_id)
    out = []
    for i in range(WARMUP + runs):
        t0 = time.perf_counter()
        session = await open_session({"kind": "exec", "command": ["true"]}, 30)
        try:
            await session.send(wire.EOF)
            while True:
                kind, _, payload = await session.recv(30)
                if kind == wire.EXIT:
                    break
        finally:
            await session.close()
        if payload != b"0":
            raise RuntimeError(f"`true` exited {payload!r} in the sandbox")
        if i >= WARMUP:
            out.append(time.perf_counter() - t0)
    return out


async def _measure(url: str, options: dict[str, Any], leases: dict[str, str], runs: int,
                   mib: int, say: Callable[[str], None]) -> dict[str, Any]:
    from bus.connection import connect
    from client.sessions import over_nats, run_forward

    nc = await connect(url, reconnect=False, **options)
    try:
        exec_s = []
        for i in range(WARMUP + runs):
            took = await _exec_true(nc, leases["client"])
            if i >= WARMUP:
                exec_s.append(took)
        say(f"bench exec: {runs} execs of true")
    finally:
        await nc.close()
    listening: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    forward = asyncio.create_task(run_forward(
        over_nats(url, TENANT, leases["echo"], options), ECHO_PORT, local=0, host="127.0.0.1",
        on_listening=listening.set_result))
    try:
        port = await asyncio.wait_for(listening, 30)
        await _pump(port, 1)  # warm
        forwarded = await _pump(port, mib)
    finally:
        forward.cancel()
    server, direct_port = _host_echo()
    try:
        await _pump(direct_port, 1)  # warm, as the forward was
        direct = await _pump(direct_port, mib)
    finally:
        server.kill()
        server.wait()
    say(f"bench exec: {mib} MiB through the forward and direct")
    return {"exec_s": exec_s, "forward_mib_s": forwarded, "direct_mib_s": direct}


def _docker_exec(runs: int) -> list[float] | None:
    """`docker exec C true` into a running container of DOCKER_IMAGE; None without a daemon
    (or the image)."""
    docker = shutil.which("docker")
    if docker is None:
        return None
    if subprocess.run([docker, "info"], capture_output=True, check=False,
                      timeout=30).returncode != 0:
        return None
    started = subprocess.run([docker, "run", "-d", "--rm", DOCKER_IMAGE, "sleep", "600"],
                             capture_output=True, text=True, check=False, timeout=300)
    if started.returncode != 0:
        return None
    cid = started.stdout.strip()
    try:
        out = []
        for i in range(WARMUP + runs):
            took, _ = timed([docker, "exec", cid, "true"], dict(os.environ))
            if i >= WARMUP:
                out.append(took)
        return out
    finally:
        subprocess.run([docker, "rm", "-f", cid], capture_output=True, check=False, timeout=60)


def run_exec_bench(*, runs: int = RUNS, quick: bool = False, mib: int | None = None,
                   progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Exec round trips of `true` (client library, then whole CLI processes), `docker exec`
    beside them where a daemon answers, and port-forward throughput against a direct
    loopback echo; everything in one run."""
    from bus.local.auth import inbox_prefix
    from local import embedded

    say = progress or (lambda _s: None)
    if quick:
        runs = QUICK_RUNS
    mib = mib or (QUICK_FORWARD_MIB if quick else FORWARD_MIB)
    if runs > MAX_RUNS:
        raise ValueError(f"--runs: at most {MAX_RUNS} (a lease takes 30 sessions a minute)")
    pool = pool_argv()
    with tempfile.TemporaryDirectory(prefix="pool-bench-exec-") as tmp, \
            local_plane(Path(tmp) / "home", say) as env:
        home = Path(env["POOL_HOME"])
        leases: dict[str, str] = {}
        try:
            for name, job in (("echo", ["--", "python3", "-c", ECHO]), ("client", SLEEPER),
                              ("gateway", SLEEPER), ("cli", SLEEPER)):
                _, out = timed([*pool, "lease", "run", "--tenant", TENANT, "--pool", POOL,
                                "--quiet", "--detach", *job], env)
                if out.returncode != 0 or not out.stdout.strip():
                    raise RuntimeError(f"the {name} job did not start: {out.stderr.strip()}")
                leases[name] = out.stdout.strip()
            creds = embedded.tenant_credentials(TENANT, home)
            if creds is None:
                raise RuntimeError(f"no credentials for tenant {TENANT}")
            url = embedded.endpoints(home)[0]
            options = {"user": creds.user, "password": creds.password,
                       "inbox_prefix": inbox_prefix(TENANT).encode()}
            time.sleep(0.5)  # the echo server binds its port
            measured = asyncio.run(_measure(url, options, leases, runs, mib, say))
            _, tok = timed([*pool, "admin", "tenant", "token", TENANT], env)
            if tok.returncode != 0:
                raise RuntimeError(f"no HTTP token for {TENANT}: {tok.stderr.strip()}")
            gateway_s = asyncio.run(_exec_over_gateway(f"http://{env['POOL_HTTP']}",
                                                       tok.stdout.strip(), leases["gateway"],
                                                       runs))
            say(f"bench exec: {runs} execs of true over the gateway")
            cli_s = []
            argv = [*pool, "lease", "exec", leases["cli"], "--tenant", TENANT, "--", "true"]
            for _ in range(runs):
                took, done = timed(argv, env)
                if done.returncode != 0:
                    raise RuntimeError(f"`pool lease exec -- true` exited {done.returncode}: "
                                       f"{done.stderr.strip()}")
                cli_s.append(took)
            help_s = [timed([*pool, "--help"], env)[0] for _ in range(runs)]
        finally:
            for lease_id in leases.values():
                timed([*pool, "lease", "cancel", lease_id, "--tenant", TENANT], env)
    docker = _docker_exec(runs)
    rows = {"exec true (client)": quantiles(measured["exec_s"]),
            "exec true (gateway WS)": quantiles(gateway_s),
            "pool lease exec -- true": quantiles(cli_s),
            "pool --help": quantiles(help_s)}
    if docker is not None:
        rows["docker exec C true"] = quantiles(docker)
    lines = [f"{'':<26} {'n':>4} {'p50 ms':>8} {'p99 ms':>8} {'min ms':>8} {'max ms':>8}"]
    for name, q in rows.items():
        lines.append(f"{name:<26} {q['n']:4d} {q['p50_ms']:8.1f} {q['p99_ms']:8.1f} "
                     f"{q['min_ms']:8.1f} {q['max_ms']:8.1f}")
    if docker is None:
        lines.append("docker exec: no docker daemon answers here (not measured)")
    ratio = measured["forward_mib_s"] / measured["direct_mib_s"]
    lines.append(f"port-forward {mib} MiB echo: {measured['forward_mib_s']:.1f} MiB/s; direct "
                 f"loopback {measured['direct_mib_s']:.1f} MiB/s; ratio {ratio:.2f}")
    lines.append(f"sequential, idle plane with one local agent; machine: {os.cpu_count()} cores")
    return {"runs": runs, "exec_client": rows["exec true (client)"],
            "exec_gateway": rows["exec true (gateway WS)"],
            "exec_cli": rows["pool lease exec -- true"], "help": rows["pool --help"],
            "docker_exec": rows.get("docker exec C true"),
            "forward_mib_s": round(measured["forward_mib_s"], 2),
            "direct_mib_s": round(measured["direct_mib_s"], 2),
            "forward_ratio": round(ratio, 3), "table": "\n".join(lines)}


def main(argv: list[str] | None = None) -> int:
    return bench_main("exec", __doc__, run_exec_bench, argv, runs=RUNS, quick_runs=QUICK_RUNS)


if __name__ == "__main__":
    sys.exit(main())
