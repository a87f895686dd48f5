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
from tests.control_plane import FakeClock, node_body, setup_pool, start
from workers.plane import ControlPlane

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


async def _burst(url: str, tenants: list[str], answered: list[dict[str, Any]]) -> Any:
    """BURST replays from `tenants` in turn, sent at once; their answers kept as they come."""
    nc = await nats.connect(url)

    async def on_reply(msg: Any) -> None:
        answered.append(json.loads(msg.data))

    for tenant in tenants:
        await nc.subscribe(f"{inbox_prefix(tenant)}.burst.>", cb=on_reply)
    body = json.dumps({"since": 0, "limit": 1}).encode()
    for i in range(BURST):
        tenant = tenants[i % len(tenants)]
        await nc.publish(f"pool.cmd.{tenant}.telemetry.replay", body,
                         reply=f"{inbox_prefix(tenant)}.burst.{i}")
    await nc.flush()
    return nc


class Burst:
    """A burst of reads sent from a loop of its own thread, its answers taken as they come."""

    def __init__(self, url: str, tenants: list[str]) -> None:
        self.answered: list[dict[str, Any]] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.nc = asyncio.run_coroutine_threadsafe(
            _burst(url, tenants, self.answered), self.loop).result(15)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.nc.close(), self.loop).result(15)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


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
    # many tenants' reads (each within its own limit of reads at once)
    burst = Burst(fresh_nats.url, [f"t{i}" for i in range(BURST // 3)])
    try:
        time.sleep(0.1)  # the burst is in the service's hands
        pending = BURST - len(burst.answered)
        took = max(_beat(agent, seq) for seq in range(2, 7))
    finally:
        done.set()  # the rest of the burst answered at once: the plane stops without a wait
        burst.close()
    assert took < 0.25, f"a heartbeat waited {took:.2f} s behind {pending} tenant queries"
    assert pending > BURST // 2, "the burst was answered before the heartbeats were asked"


def test_one_tenant_s_burst_of_reads_is_refused_past_its_limit_and_others_read_at_once(
        plane: tuple[ControlPlane, PoolClient], fresh_nats: NatsServer) -> None:
    cp, _ = plane
    done = threading.Event()
    _slow_reads(cp, done)
    beta = PoolClient(fresh_nats.url, "beta")
    burst = Burst(fresh_nats.url, ["alpha"])
    try:
        time.sleep(0.2)  # the burst is in the service's hands
        t0 = time.monotonic()
        got = beta.replay_telemetry({"since": 0, "limit": 1})
        took = time.monotonic() - t0
        refused = [a for a in burst.answered if not a["ok"]]
    finally:
        done.set()
        beta.close()
        burst.close()
    assert got["ok"], got
    assert took < SLOW_SECONDS + 0.2, f"beta's read waited {took:.2f} s behind alpha's burst"
    # alpha's reads past its limit were refused at once, naming the limit
    assert len(refused) >= BURST - 8, len(refused)
    assert {a["error"]["code"] for a in refused} == {"concurrency_limit"}
    assert refused[0]["error"]["reasons"] == {"max_concurrent": 4}
