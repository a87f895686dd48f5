"""A node speaks only for the leases it holds: telemetry a node publishes for another node's
lease (any tenant's, any lease id: its permission names only its own node token) is left out
of the tenant's replay and of its live lease watch. Real nats-server with users, real plane."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from bus.admin import ensure_all_streams
from bus.leasewatch import Output
from bus.local.auth import AuthConfig, inbox_prefix, url_with_credentials
from bus.local.server import NatsServer
from bus.telemetry import TelemetryPublisher, TelemetrySample
from bus.telemetry_follow import follow
from client.api import PoolClient
from schemas import v1
from tests.placed import place_on
from workers.plane import ControlPlane

FORGED = "\x1b]0;owned\x07\x1b[2Jforged by n2\n"


@pytest.fixture()
def secured(tmp_path: Path) -> Iterator[tuple[NatsServer, AuthConfig, ControlPlane]]:
    auth = AuthConfig()
    auth.add_tenant("alpha")
    for node in ("n1", "n2"):
        auth.add_node(node)
    server = NatsServer(store_dir=tmp_path / "nats", server_name="pool-telbind",
                        extra_config=auth.render())
    server.start()
    ensure_all_streams(url_with_credentials(server.url, auth.service), tenants=("alpha",))
    cp = ControlPlane(url_with_credentials(server.url, auth.service), roles=["commands"],
                      data_plane=False).start()
    yield server, auth, cp
    cp.stop()
    server.stop()


def _output(server: NatsServer, auth: AuthConfig, node: str, lease: str, text: str) -> None:
    """`node` publishes, as itself (the server allows its own node token only), output for
    alpha's `lease`."""
    pub = TelemetryPublisher(url_with_credentials(server.url, auth.nodes[node]))
    try:
        pub.publish(pool="p1", node=node, tenant="alpha", lease=lease, kind="output",
                    event=v1.TelemetryEvent(kind="output", at=time.time(),
                                            attrs={"text": text, "job": 1}))
        pub.flush()
    finally:
        pub.close()


def _replay(server: NatsServer, auth: AuthConfig, body: dict[str, Any]) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        a = auth.tenants["alpha"]
        nc = await nats.connect(server.url, user=a.user, password=a.password,
                                inbox_prefix=inbox_prefix("alpha").encode())
        try:
            reply = await nc.request("pool.cmd.alpha.telemetry.replay",
                                     json.dumps(body).encode(), timeout=5)
            out: dict[str, Any] = json.loads(reply.data)
            return out
        finally:
            await nc.close()

    return asyncio.run(go())


def test_a_node_s_output_for_a_lease_it_never_held_is_left_out_of_replays(
        secured: tuple[NatsServer, AuthConfig, ControlPlane]) -> None:
    server, auth, _ = secured
    place_on(url_with_credentials(server.url, auth.service), "alpha", "l1", "n1")
    _output(server, auth, "n1", "l1", "mine\n")
    _output(server, auth, "n2", "l1", FORGED)  # a lease n2 never held
    _output(server, auth, "n2", "l9", FORGED)  # one no node held
    got = _replay(server, auth, {"since": 0, "kind": "output"})
    assert got["ok"], got
    samples = got["result"]["samples"]
    assert [s["event"]["attrs"]["text"] for s in samples] == ["mine\n"]
    assert {s["subject"].split(".")[3] for s in samples} == {"n1"}
    # the next page starts past the forged samples: a forger cannot hold a reader in place
    last = got["result"]["last_seq"]
    assert last > samples[-1]["seq"]
    after = _replay(server, auth, {"after_seq": samples[-1]["seq"], "kind": "output"})
    assert after["result"]["samples"] == [] and after["result"]["last_seq"] == last
    # once the feed names n2 as the lease's (a later placement), n2's samples are its own
    place_on(url_with_credentials(server.url, auth.service), "alpha", "l1", "n2")
    again = _replay(server, auth, {"since": 0, "lease": "l1"})
    assert [s["event"]["attrs"]["text"] for s in again["result"]["samples"]] == \
        ["mine\n", FORGED]


def test_a_lease_watch_shows_live_output_only_from_the_lease_s_node(
        secured: tuple[NatsServer, AuthConfig, ControlPlane]) -> None:
    server, auth, _ = secured
    place_on(url_with_credentials(server.url, auth.service), "alpha", "l2", "n1")
    a = auth.tenants["alpha"]
    client = PoolClient(server.url, "alpha", user=a.user, password=a.password)
    try:
        with client.watch_lease("l2", output=True) as watch:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not watch.get(0.1):
                pass  # the placement's record: the watch knows the lease's node
            _output(server, auth, "n2", "l2", FORGED)
            _output(server, auth, "n1", "l2", "mine\n")
            texts: list[str] = []
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                got = watch.get(0.2)
                if isinstance(got, Output):
                    texts.append(got.text)
        assert texts == ["mine\n"]
    finally:
        client.close()


def test_a_tenant_s_live_telemetry_shows_only_its_leases_nodes(
        secured: tuple[NatsServer, AuthConfig, ControlPlane]) -> None:
    server, auth, _ = secured
    place_on(url_with_credentials(server.url, auth.service), "alpha", "l3", "n1")
    a = auth.tenants["alpha"]
    got: list[TelemetrySample] = []

    def publish() -> None:
        _output(server, auth, "n2", "l3", FORGED)
        _output(server, auth, "n1", "l3", "mine\n")

    def ready() -> None:
        threading.Thread(target=publish, daemon=True).start()

    follow(server.url, got.append, tenant="alpha", user=a.user, password=a.password,
           inbox_prefix=inbox_prefix("alpha"), on_ready=ready, max_samples=2, duration_s=2)
    assert [(s.node, s.event.attrs["text"] if s.event else None) for s in got] == \
        [("n1", "mine\n")]
