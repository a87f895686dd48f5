"""The command service's lanes: node agents' reports, tenants' commands and tenants' reads
each have a queue group and workers of their own, so a burst of slow tenant queries does not
delay a node's heartbeat. A real plane on a real nats-server; the reads made slow by hand."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import nats
import pytest

from bus.local.auth import inbox_prefix
from bus.local.server import NatsServer
from bus.replies import node_inbox
from client.api import PoolClient
from control.plane import ControlPlane
from tests.control_plane import FakeClock, node_body, setup_pool, start

SLOW_SECONDS = 0.3
BURST = 300


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[tuple[ControlPlane, PoolClient]]:
    cp = start(fresh_nats.url, FakeClock())
    admin = PoolClient(fresh_nats.url)
    setup_pool(admin, tenants={"alpha": 1.0})
    assert admin.admin("node.register", node_body("n1"))["ok"]
    agent = PoolClient(fresh_nats.url, inbox_prefix=node_inbox("n1").encode())
    yield cp, agent
    agent.close()
    admin.close()
    cp.stop()


def _slow_reads(cp: ControlPlane, done: threading.Event) -> None:
    """Every tenant read takes SLOW_SECONDS on its worker (a query over a big view would),
    until `done`."""
    for lane in getattr(cp, "lanes", [cp.commands]):
        handler = lane.handler

        def slow(subject: str, body: bytes, headers: dict[str, str],
                 handler: Any = handler) -> bytes:
            if subject.endswith(".telemetry.replay"):
                done.wait(SLOW_SECONDS)
            return handler(subject, body, headers)  # type: ignore[no-any-return]

        lane.handler = slow


async def _burst(url: str, answered: list[float]) -> Any:
    """BURST replays from tenant alpha, sent at once; their answers counted as they come."""
    prefix = inbox_prefix("alpha")
    nc = await nats.connect(url, inbox_prefix=prefix.encode())

    async def on_reply(msg: Any) -> None:
        answered.append(time.monotonic())

    await nc.subscribe(f"{prefix}.burst.>", cb=on_reply)
    body = json.dumps({"since": 0, "limit": 1}).encode()
    for i in range(BURST):
        await nc.publish("pool.cmd.alpha.telemetry.replay", body, reply=f"{prefix}.burst.{i}")
    await nc.flush()
    return nc


def _beat(agent: PoolClient, seq: int) -> float:
    t0 = time.monotonic()
    r = agent.call("pool.node.n1.heartbeat", {"node_id": "n1", "seq": seq, "leases": []},
                   timeout=20)
    assert r["ok"], r
    return time.monotonic() - t0


def test_a_burst_of_slow_tenant_queries_does_not_delay_a_node_heartbeat(
        plane: tuple[ControlPlane, PoolClient], fresh_nats: NatsServer) -> None:
    cp, agent = plane
    _beat(agent, 1)  # warm: the node cached
    done = threading.Event()
    _slow_reads(cp, done)
    answered: list[float] = []
    loop = asyncio.new_event_loop()
    try:
        nc = loop.run_until_complete(_burst(fresh_nats.url, answered))
        time.sleep(0.1)  # the burst is in the service's hands
        took = max(_beat(agent, seq) for seq in range(2, 7))
        pending = BURST - len(answered)
        loop.run_until_complete(nc.close())
    finally:
        done.set()  # the rest of the burst answered at once: the plane stops without a wait
        loop.close()
    assert pending > BURST // 2, "the burst was answered before the heartbeats were asked"
    assert took < 0.25, f"a heartbeat waited {took:.2f} s behind {pending} tenant queries"
