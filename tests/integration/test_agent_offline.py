"""A node agent that stops cleanly takes its idle node out of placement at once, and its next
start brings the node back ready."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.agent import Agent
from agents.probe import NodeProbe, Reserve
from agents.simulate import SleepRuntime
from bus.agentbus import AgentLink
from bus.local.server import NatsServer
from client.api import PoolClient
from domain.node import Node, NodeState
from tests.control_plane import setup_pool
from workers.plane import ControlPlane

PROBE = NodeProbe(cpu_millis=4500, cpu_arch="amd64", memory_mib=9216, local_disk_gib=50)


def _wait(what: Callable[[], Any], timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[tuple[str, ControlPlane]]:
    cp = ControlPlane(fresh_nats.url, leader_ttl_seconds=1.0).start()
    with PoolClient(fresh_nats.url) as admin:
        setup_pool(admin, tenants={"alpha": 1.0}, node_timeout_seconds=3600)
        assert admin.admin("node.enroll", {"node_id": "n1", "pool_id": "p1",
                                           "trust_level": "trusted"})["ok"]
    yield fresh_nats.url, cp
    cp.stop()


def _run_agent(url: str, state: Path) -> tuple[threading.Event, threading.Thread, AgentLink]:
    link = AgentLink(url, "n1").connect()
    agent = Agent(link, SleepRuntime(), node_id="n1", pool_id="p1", probe=PROBE,
                  state_dir=state, reserve=Reserve(500, 1024, 0), heartbeat_interval=0.5)
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    return stop, thread, link


def test_a_stopped_idle_agent_takes_its_node_out_at_once(
    plane: tuple[str, ControlPlane], tmp_path: Path
) -> None:
    url, cp = plane

    def state() -> NodeState | None:
        node = cp.app.find(Node, Node.create_id("n1"))
        return None if node is None else node.state

    stop, thread, link = _run_agent(url, tmp_path / "n1")
    _wait(lambda: state() is NodeState.READY)
    stop.set()
    thread.join(15)
    link.close()
    # lost with the agent's reason, long before the pool's node timeout (an hour)
    assert _wait(lambda: state() is NodeState.LOST, timeout=5)
    node = cp.app.find(Node, Node.create_id("n1"))
    assert node is not None and node.state_reason == "agent_stopped"
    stop, thread, link = _run_agent(url, tmp_path / "n1")
    try:
        assert _wait(lambda: state() is NodeState.READY)
    finally:
        stop.set()
        thread.join(15)
        link.close()
