"""A first connection to NATS that no server answers says so within seconds, naming the URL;
once connected, a connection goes on reconnecting without end."""

from __future__ import annotations

import asyncio
import time

import pytest

from bus.connection import connect
from bus.errors import BusUnavailable
from bus.local.server import NatsServer, free_port


def test_a_first_connection_nobody_answers_is_bus_unavailable_within_seconds() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(BusUnavailable, match=url):
        # before, nats-py retried a first connection forever: the wait_for fired instead
        asyncio.run(asyncio.wait_for(connect(url), timeout=10))
    assert time.monotonic() - t0 < 5


def test_once_connected_reconnects_never_stop(fresh_nats: NatsServer) -> None:
    async def go() -> int:
        nc = await connect(fresh_nats.url)
        try:
            return int(nc.options["max_reconnect_attempts"])
        finally:
            await nc.close()

    assert asyncio.run(go()) == -1
