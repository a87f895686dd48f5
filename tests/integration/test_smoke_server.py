from __future__ import annotations

import asyncio

import nats

from bus.local.server import NatsServer


def test_the_embedded_server_runs_jetstream_2_15(nats_server: NatsServer) -> None:
    async def go() -> str:
        nc = await nats.connect(nats_server.url)
        try:
            js = nc.jetstream()
            info = await js.account_info()
            assert info is not None
            return str(nc._server_info["version"])
        finally:
            await nc.close()

    version = asyncio.run(go())
    assert version.startswith("2.15")
