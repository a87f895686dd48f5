"""A node is what its enrollment says: pool, trust level and ceilings come from the operator."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from uuid import UUID

import pytest

from bus.agentbus import AgentLink
from bus.local.auth import AuthConfig, url_with_credentials
from bus.local.server import NatsServer
from client.api import PoolClient
from domain.node import Node
from tests.control_plane import node_body, setup_pool
from tests.security.conftest import service_url
from workers.application import PoolApp
from workers.plane import ControlPlane, app_env


@pytest.fixture()
def enrolled(secured: tuple[NatsServer, AuthConfig]) -> Iterator[tuple[PoolClient, AgentLink, str]]:
    """Pools p1 and p2; node gpu-7 enrolled in p1 as marketplace with at most 2 GPUs; its agent
    connected as its own user."""
    server, auth = secured
    url = service_url(server, auth)
    cp = ControlPlane(url, roles=["commands"], data_plane=False).start()
    admin = PoolClient(url)
    setup_pool(admin)
    setup_pool(admin, "p2")
    got = admin.admin("node.enroll", {"node_id": "gpu-7", "pool_id": "p1",
                                      "trust_level": "marketplace", "max_gpus": 2,
                                      "max_cpu_millis": 16000, "max_memory_mib": 65536})
    assert got["ok"], got
    link = AgentLink(url_with_credentials(server.url, auth.nodes["gpu-7"]), "gpu-7").connect()
    yield admin, link, url
    link.close()
    admin.close()
    cp.stop()


def _register(link: AgentLink, body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(link.request("register", json.dumps(body).encode()))
    return out


def _trust(url: str, node_id: str) -> str | None:
    app = PoolApp(env=app_env(url))
    try:
        node = app.find(Node, Node.create_id(node_id))
        return None if node is None else node.capabilities.trust_level
    finally:
        app.close()


def test_a_node_cannot_register_as_trusted(
    enrolled: tuple[PoolClient, AgentLink, str],
) -> None:
    _, link, url = enrolled
    reply = _register(link, node_body("gpu-7", trust_level="trusted"))
    assert reply["ok"], reply
    assert _trust(url, "gpu-7") == "marketplace"


@pytest.mark.parametrize(("claim", "reason"), [
    ({"pool": "p2"}, "pool"),
    ({"gpu_count": 8, "gpu_model": "H100", "gpu_memory_gib": 80}, "gpu_count"),
    ({"cpu_millis": 512000}, "cpu_millis"),
    ({"memory_mib": 10**6}, "memory_mib"),
])
def test_a_node_cannot_claim_a_pool_or_capacity_outside_its_enrollment(
    enrolled: tuple[PoolClient, AgentLink, str], claim: dict[str, Any], reason: str,
) -> None:
    _, link, url = enrolled
    reply = _register(link, node_body("gpu-7", **claim))
    assert not reply["ok"] and reply["error"]["code"] == "node_claim_refused", reply
    assert reason in reply["error"]["reasons"]
    assert _trust(url, "gpu-7") is None  # nothing registered


def test_a_node_that_was_never_enrolled_cannot_register(
    secured: tuple[NatsServer, AuthConfig],
) -> None:
    server, auth = secured
    url = service_url(server, auth)
    cp = ControlPlane(url, roles=["commands"], data_plane=False).start()
    try:
        with PoolClient(url) as admin:
            setup_pool(admin)
        link = AgentLink(url_with_credentials(server.url, auth.nodes["gpu-7"]), "gpu-7").connect()
        try:
            reply = _register(link, node_body("gpu-7"))
        finally:
            link.close()
        assert not reply["ok"] and reply["error"]["code"] == "node_claim_refused", reply
        assert reply["error"]["reasons"] == {"not_enrolled": 1}
        assert _trust(url, "gpu-7") is None
    finally:
        cp.stop()


def test_an_enrollment_is_an_event_in_the_log(
    enrolled: tuple[PoolClient, AgentLink, str],
) -> None:
    _, _, url = enrolled
    from domain.enrollment import Enrollment

    app = PoolApp(env=app_env(url))
    try:
        events = list(app.events.get(UUID(str(Enrollment.create_id("gpu-7")))))
    finally:
        app.close()
    assert [type(e).__name__ for e in events] == ["NodeEnrolled"]
