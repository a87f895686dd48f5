"""`python -m bench.import_rtt [N]`: a tenant client's requests to a plain responder on a
secured server, one at a time and all at once: what the path from the tenant's user to the
plane's account costs (since ADR 027, a service import; run it on both sides of a change)."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nats

from bus.local.auth import AuthConfig, url_with_credentials
from bus.local.server import NatsServer
from bus.replies import tenant_inbox

TENANT = "alpha"
WARM_UP = 200


async def _requests(server: NatsServer, auth: AuthConfig, n: int) -> dict[str, Any]:
    plane = await nats.connect(url_with_credentials(server.url, auth.responder))

    async def answer(msg: Any) -> None:
        await plane.publish(msg.reply, b"ok")

    await plane.subscribe("pool.cmd.>", cb=answer)
    await plane.flush()
    tenant = await nats.connect(url_with_credentials(server.url, auth.tenants[TENANT]),
                                inbox_prefix=tenant_inbox(TENANT).encode())
    subject = f"pool.cmd.{TENANT}.ping"
    try:
        for _ in range(WARM_UP):
            await tenant.request(subject, b"{}", timeout=5)
        t0 = time.perf_counter()
        for _ in range(n):
            await tenant.request(subject, b"{}", timeout=5)
        one_at_a_time = time.perf_counter() - t0
        t0 = time.perf_counter()
        await asyncio.gather(*(tenant.request(subject, b"{}", timeout=30) for _ in range(n)))
        at_once = time.perf_counter() - t0
    finally:
        await tenant.close()
        await plane.close()
    return {"requests": n, "round_trip_us": round(one_at_a_time / n * 1e6),
            "at_once_per_s": round(n / at_once)}


def run_import_rtt(n: int = 5000) -> dict[str, Any]:
    """The figures on a secured server of its own."""
    with tempfile.TemporaryDirectory() as d:
        auth = AuthConfig()
        auth.add_tenant(TENANT)
        server = NatsServer(store_dir=Path(d) / "nats", server_name="pool-rtt",
                            extra_config=auth.render()).start()
        try:
            return asyncio.run(_requests(server, auth, n))
        finally:
            server.stop()


if __name__ == "__main__":
    print(json.dumps(run_import_rtt(int(sys.argv[1]) if len(sys.argv) > 1 else 5000)))
