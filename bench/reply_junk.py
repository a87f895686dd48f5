"""`pool bench reply-junk`: how fast one tenant's client makes the server store its answers in
the event log by naming a log subject as the reply subject: none since each tenant is in an
account of its own (ADR 027; docs/security.md, "Not covered yet", for the nodes)."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from bus.admin import ensure_all_streams
from bus.connection import connect
from bus.local.auth import AuthConfig, url_with_credentials
from bus.local.server import NatsServer
from bus.objects import ensure_tenant_buckets_sync, work_bucket
from bus.replies import tenant_inbox
from bus.subjects import EVENTS_STREAM

TENANT = "alpha"
# requests sent between two round trips to the server (the client never waits on an answer):
# a flood faster than the server stores is mostly dropped, so a paced client stores more
PACES = (1, 10, 100)


async def _events_state(url: str) -> tuple[int, int]:
    nc = await connect(url)
    try:
        info = await nc.jetstream().stream_info(EVENTS_STREAM)
        return int(info.state.messages or 0), int(info.state.bytes or 0)
    finally:
        await nc.close()


async def _flood(service: str, tenant_url: str, mode: str, pace: int,
                 seconds: float) -> dict[str, Any]:
    """As the tenant, for `seconds`: `puback` stores one byte in its own work bucket, or
    `info` asks its own bucket's stream info, each answer aimed at a new log subject; a round
    trip to the server every `pace` requests."""
    before = await _events_state(service)
    nc = await connect(tenant_url, inbox_prefix=tenant_inbox(TENANT).encode())
    bucket = work_bucket(TENANT)
    subject = (f"$O.{bucket}.C.junk" if mode == "puback"
               else f"$JS.API.STREAM.INFO.OBJ_{bucket}")
    body = b"x" if mode == "puback" else b""
    sent = 0
    t0 = time.perf_counter()
    try:
        while time.perf_counter() - t0 < seconds:
            for _ in range(pace):
                await nc.publish(subject, body, reply=f"pool.evt.junk.{mode}{sent}")
                sent += 1
            await nc.flush()
        elapsed = time.perf_counter() - t0
    finally:
        await nc.close()
    # what the server still had queued lands shortly after
    after, settled = before, time.monotonic() + 5
    while time.monotonic() < settled:
        await asyncio.sleep(0.5)
        now = await _events_state(service)
        if now == after:
            break
        after = now
    stored, stored_bytes = after[0] - before[0], after[1] - before[1]
    return {"mode": mode, "pace": pace, "seconds": round(elapsed, 2), "sent": sent, "stored": stored,
            "stored_bytes": stored_bytes, "messages_per_s": round(stored / elapsed),
            "bytes_per_s": round(stored_bytes / elapsed)}


def run_reply_junk_bench(*, seconds: float = 10.0) -> dict[str, Any]:
    """Each mode on a secured server of its own; the figures and a table."""
    rows = []
    for mode, pace in ((m, p) for m in ("puback", "info") for p in PACES):
        with tempfile.TemporaryDirectory() as d:
            auth = AuthConfig()
            auth.add_tenant(TENANT)
            server = NatsServer(store_dir=Path(d) / "nats", server_name="pool-junk",
                                extra_config=auth.render()).start()
            try:
                service = url_with_credentials(server.url, auth.service)
                ensure_all_streams(service)
                ensure_tenant_buckets_sync(service, [TENANT])
                tenant = url_with_credentials(server.url, auth.tenants[TENANT])
                rows.append(asyncio.run(_flood(service, tenant, mode, pace, seconds)))
            finally:
                server.stop()
    head = (f"{'answer':<8} {'pace':>5} {'sent':>9} {'stored':>9} {'messages/s':>11} "
            f"{'bytes/s':>12}")
    lines = [head]
    lines += [f"{r['mode']:<8} {r['pace']:>5} {r['sent']:>9,} {r['stored']:>9,} "
              f"{r['messages_per_s']:>11,} {r['bytes_per_s']:>12,}" for r in rows]
    best = max(rows, key=lambda r: r["bytes_per_s"])
    lines.append(f"one tenant client, {seconds:g} s a row, each on a secured server of its own; "
                 "pace: requests a round trip; stored: messages the answers added to "
                 f"POOL_EVENTS. Fastest fill: {best['mode']} at pace {best['pace']}, "
                 f"{best['messages_per_s']:,} messages/s, {best['bytes_per_s']:,} bytes/s")
    return {"modes": rows, "fastest": best, "table": "\n".join(lines)}
