"""`pool bench http`: the HTTP gateway's cost beside the NATS path it fronts, in one run.
What it measures and how: docs/architecture.md#the-benchmarks.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.children import end_children
from bench.e2e import CTX, POOL, SHAPE, TENANTS, run_fleet, run_load, serve_plane
from bench.latency import pct
from bench.machine import machine_line

Record = tuple[float, float, bool, tuple[str, ...], str]


def _serve_gateway(url: str, tokens_path: str, port: int, ready: Any, stop: Any) -> None:
    """In a process of its own: the gateway as `pool gateway` runs it (one uvicorn worker)."""
    from gateway.app import create_app
    from gateway.server import ServerThread
    from gateway.tokens import TokenStore
    from gateway.upstream import Settings

    app = create_app(Settings(url), TokenStore(Path(tokens_path)), dashboard=False)
    server = ServerThread(app, port=port).start()
    ready.put(server.port)
    stop.wait()
    server.stop()


async def _post(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes,
                body: bytes, key: str) -> tuple[int, bytes]:
    """One POST on a kept-alive HTTP/1.1 connection: (status, body). A bare client on purpose:
    the figures are the gateway's cost, not a client library's (httpx spends more CPU per
    request than nats-py, and client and gateway share this machine's cores)."""
    writer.write(head + f"Idempotency-Key: {key}\r\nContent-Length: {len(body)}\r\n\r\n"
                 .encode() + body)
    status_line = await reader.readuntil(b"\r\n")
    length = 0
    while True:
        line = await reader.readuntil(b"\r\n")
        if line == b"\r\n":
            break
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    return int(status_line.split()[1]), await reader.readexactly(length)


async def _http_drive(base: str, tokens: list[str], clients: int, seconds: float,
                      prefix: str) -> list[Record]:
    import json

    host, _, port = base.removeprefix("http://").partition(":")
    out: list[Record] = []
    deadline = time.monotonic() + seconds
    counter = iter(range(1 << 62))
    body = json.dumps({"pool_id": POOL, "shape": SHAPE,
                       "maximum_runtime_seconds": 3600}).encode()

    async def client(token: str) -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        head = (f"POST /v1/compute-leases HTTP/1.1\r\nHost: {host}\r\n"
                f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
                ).encode()
        try:
            while time.monotonic() < deadline:
                t0 = time.time()
                try:
                    status, data = await _post(reader, writer, head, body,
                                               f"{prefix}-{next(counter)}")
                except (OSError, asyncio.IncompleteReadError, ValueError) as e:
                    out.append((t0, time.time(), False, (), type(e).__name__))
                    return
                t1 = time.time()
                reply = json.loads(data)
                ok = status == 201
                out.append((t0, t1, ok, (str(reply.get("lease_id")),) if ok else (),
                            "" if ok else str(reply.get("code", status))))
        finally:
            writer.close()

    await asyncio.gather(*(client(tokens[i % len(tokens)]) for i in range(clients)))
    return out


def _http_client_process(base: str, tokens: list[str], clients: int, seconds: float,
                         prefix: str, out: Any) -> None:
    out.put(asyncio.run(_http_drive(base, tokens, clients, seconds, prefix)))


def _http_load(base: str, tokens: list[str], *, clients: int, processes: int, seconds: float,
               run: str) -> list[Record]:
    out = CTX.Queue()
    procs = []
    for p in range(processes):
        mine = clients // processes + (1 if p < clients % processes else 0)
        if mine:
            procs.append(CTX.Process(target=_http_client_process, daemon=True,
                                      args=(base, tokens, mine, seconds, f"{run}-p{p}", out)))
    for proc in procs:
        proc.start()
    records: list[Record] = []
    for _ in procs:
        records.extend(out.get(timeout=seconds + 120))
    for proc in procs:
        proc.join(10)
    return records


def _figures(records: list[Record], seconds: float) -> dict[str, Any]:
    ok = [r for r in records if r[2]]
    replies = [r[1] - r[0] for r in ok]
    errors: dict[str, int] = {}
    for r in records:
        if not r[2]:
            errors[r[4]] = errors.get(r[4], 0) + 1
    p50, p99 = pct(replies, 0.5), pct(replies, 0.99)
    return {"requests": len(records), "accepted": len(ok), "errors": errors,
            "accepted_per_s": len(ok) / seconds,
            "reply_p50_ms": None if p50 is None else p50 * 1000,
            "reply_p99_ms": None if p99 is None else p99 * 1000}


def run_http_bench(*, clients: int = 32, nodes: int = 200, seconds: float = 10.0,
                   processes: int | None = None, quick: bool = False,
                   progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """One run: the NATS path, then the HTTP path, same clients, plane, fleet and server."""
    from bus.admin import ensure_all_streams
    from bus.local.server import NatsServer, free_port
    from client.api import PoolClient
    from gateway.tokens import TokenStore

    if quick:
        clients, nodes, seconds = min(clients, 4), min(nodes, 10), min(seconds, 1.5)
    if clients < 1 or nodes < 1 or seconds <= 0:
        raise ValueError("clients, nodes and seconds must be positive")
    processes = processes or max(1, min(clients, 2))
    say = progress or (lambda _s: None)
    run = uuid.uuid4().hex[:6]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pool-bench-http-") as tmp:
        server = NatsServer(store_dir=Path(tmp) / "nats").start()
        stop, fleet_stop = CTX.Event(), CTX.Event()
        fleets: list[Any] = []
        ready = CTX.Queue()
        procs: list[Any] = []
        try:
            url = server.url
            ensure_all_streams(url)
            plane = CTX.Process(target=serve_plane, args=(url, ready, stop), daemon=True)
            plane.start()
            procs.append(plane)
            ready.get(timeout=120)
            with PoolClient(url, timeout=30) as admin:
                got = admin.admin("pool.set", {"pool_id": POOL, "commit_timeout_seconds": 3600,
                                               "node_timeout_seconds": 600})
                if not got.get("ok"):
                    got = admin.admin("pool.create", {"pool_id": POOL,
                                                      "commit_timeout_seconds": 3600,
                                                      "node_timeout_seconds": 600})
                if not got.get("ok"):
                    raise RuntimeError(f"the bench pool was refused: {got}")
            say(f"registering {nodes} simulated nodes…")
            fleet = CTX.Process(target=run_fleet, daemon=True,
                                 args=(url, nodes, 10.0, ready, fleet_stop))
            fleet.start()
            fleets.append(fleet)
            ready.get(timeout=600)
            store = TokenStore(Path(tmp) / "http-tokens.json")
            tokens = [store.issue_tenant(t) for t in TENANTS]
            gw = CTX.Process(target=_serve_gateway, daemon=True,
                              args=(url, str(store.path), free_port(), ready, stop))
            gw.start()
            procs.append(gw)
            base = f"http://127.0.0.1:{ready.get(timeout=120)}"
            run_load(url, clients=min(clients, 4), processes=1, seconds=0.5, rate=None,
                  run=f"{run}-warm")
            _http_load(base, tokens, clients=min(clients, 4), processes=1, seconds=0.5,
                       run=f"{run}-hwarm")
            say(f"NATS: {clients} clients for {seconds:g} s…")
            nats_path = _figures(run_load(url, clients=clients, processes=processes,
                                       seconds=seconds, rate=None, run=f"{run}-nats")[0], seconds)
            say(f"HTTP: {clients} clients for {seconds:g} s…")
            http_path = _figures(_http_load(base, tokens, clients=clients, processes=processes,
                                            seconds=seconds, run=f"{run}-http"), seconds)
        finally:
            end_children(fleet_stop, fleets)  # before the plane: no beat finds no responder
            end_children(stop, procs)
            server.stop()
    result: dict[str, Any] = {
        "clients": clients, "client_processes": processes, "nodes": nodes, "seconds": seconds,
        "nats": nats_path, "http": http_path, "machine": machine_line(), "quick": quick,
        "elapsed_s": time.monotonic() - started,
    }
    result["table"] = table(result)
    return result


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}×" if a and b else "n/a"


def table(result: dict[str, Any]) -> str:
    n, h = result["nats"], result["http"]

    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v:,.1f}"

    lines = [f"{'path':<28} {'requests/s':>11} {'p50 ms':>8} {'p99 ms':>8}  errors", "-" * 70]
    for label, f in (("NATS lease.request", n), ("HTTP POST /v1/compute-leases", h)):
        lines.append(f"{label:<28} {f['accepted_per_s']:>11,.0f} {ms(f['reply_p50_ms']):>8} "
                     f"{ms(f['reply_p99_ms']):>8}  {f['errors'] or 'none'}")
    lines.append(f"HTTP cost: p50 {_ratio(h['reply_p50_ms'], n['reply_p50_ms'])}, p99 "
                 f"{_ratio(h['reply_p99_ms'], n['reply_p99_ms'])}, throughput "
                 f"{_ratio(n['accepted_per_s'], h['accepted_per_s'])} lower (goal: under 2×)")
    lines.append(f"{result['clients']} closed-loop clients in {result['client_processes']} "
                 f"processes per path, {result['seconds']:g} s each, {result['nodes']} simulated "
                 f"nodes; one gateway process (uvicorn); {'quick' if result['quick'] else 'full'}"
                 f" sizes, {result['elapsed_s']:.0f} s in all")
    lines.append(f"machine: {result['machine']}")
    return "\n".join(lines)
