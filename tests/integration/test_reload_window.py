"""A tenant added to a running server (ADR 027) costs the plane's account's JetStream API a few
milliseconds without a responder at each reload: the management calls a process makes at its
start go through that window (the demo's fleet once failed to start in it)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import nats

from bus.agentbus import ensure_agent_queue
from bus.local.auth import AuthConfig, url_with_credentials, write_server_include
from bus.local.server import NatsServer
from bus.streams import agent_stream_config, ensure_stream


def test_agent_queues_are_made_through_reloads_that_add_tenants(tmp_path: Path) -> None:
    auth = AuthConfig()
    auth.add_tenant("alpha")
    include = tmp_path / "nats" / "auth.conf"
    include.parent.mkdir(parents=True)
    write_server_include(auth, include)
    with NatsServer(store_dir=tmp_path / "nats", server_name="pool-reloads",
                    extra_config='include "auth.conf"') as server:

        made = 0  # calls made so far, read by the grower

        def settle(more: int) -> None:
            """Wait until the caller has made `more` calls past this moment (bounded)."""
            target, deadline = made + more, time.monotonic() + 30
            while made < target and time.monotonic() < deadline:
                time.sleep(0.01)

        def grow() -> None:
            # each reload lands while calls are being made, and calls go on after it: on a
            # loaded machine the caller is slow, so the grower waits for it, not a clock
            for i in range(4):
                settle(10)
                auth.add_tenant(f"t{i}")
                server.reload(write_server_include(auth, include))
            settle(25)

        async def made_while_growing() -> int:
            nc = await nats.connect(url_with_credentials(server.url, auth.service))
            js: Any = nc.jetstream()
            await ensure_stream(js, agent_stream_config())
            nonlocal made
            grower = threading.Thread(target=grow)
            grower.start()
            try:
                while grower.is_alive():  # a 503 here would end the test with its error
                    await ensure_agent_queue(js, f"n{made % 50}")
                    made += 1
            finally:
                grower.join()
                await nc.close()
            return made

        assert asyncio.run(made_while_growing()) >= 4 * 10 + 25
