"""The node agent end to end: a real nats-server, the real control plane (real clock), the
`process` runtime's bubblewrap sandbox, and the agent's durable work queue."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.agent import Agent
from agents.probe import NodeProbe, Reserve
from agents.runtimes.process import ProcessRuntime
from bus.agentbus import AgentLink
from bus.local.server import NatsServer
from client.api import PoolClient
from tests.control_plane import lease_body, setup_pool
from workers.plane import ControlPlane

if ProcessRuntime(Path("/tmp")).available() is not None:
    pytest.skip(f"process runtime unavailable: {ProcessRuntime(Path('/tmp')).available()}",
                allow_module_level=True)

PROBE = NodeProbe(cpu_millis=4500, cpu_arch="amd64", memory_mib=9216, local_disk_gib=50)


def wait_for(what: Callable[[], Any], timeout: float = 15.0, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


class AgentThread:
    """An in-process agent on its own thread, stoppable without stopping its workloads."""

    def __init__(self, url: str, node_id: str, state: Path, **kw: Any) -> None:
        with PoolClient(url) as admin:  # the operator enrolls the node before its agent runs
            assert admin.admin("node.enroll", {"node_id": node_id, "pool_id": "p1",
                                               "trust_level": kw.get("trust_level", "trusted")}
                               )["ok"]
        self.link = AgentLink(url, node_id).connect()
        self.agent = Agent(self.link, ProcessRuntime(state), node_id=node_id, pool_id="p1",
                           probe=PROBE, state_dir=state, reserve=Reserve(500, 1024, 0),
                           heartbeat_interval=0.5, **kw)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.agent.run, args=(self.stop_event,),
                                       daemon=True)

    def start(self) -> AgentThread:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(15)
        self.link.close()


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[tuple[str, PoolClient, PoolClient]]:
    cp = ControlPlane(fresh_nats.url, leader_ttl_seconds=1.0).start()
    admin = PoolClient(fresh_nats.url)
    alpha = PoolClient(fresh_nats.url, "alpha")
    setup_pool(admin, tenants={"alpha": 1.0}, heartbeat_timeout_seconds=2,
               node_timeout_seconds=3, lost_node_release_seconds=30,
               preemption={"enabled": False, "grace_seconds": 2})
    yield fresh_nats.url, admin, alpha
    alpha.close()
    admin.close()
    cp.stop()


def request_running(alpha: PoolClient, key: str, command: list[str], **shape: Any) -> str:
    body = lease_body(key, runtime="sandboxed", memory_mib=256, **shape)
    r = alpha.request_lease(body)
    assert r["ok"], r
    lid = r["lease"]["lease_id"]
    wait_for(lambda: alpha.lease(lid, "get")["lease"]["state"] == "reserved")
    c = alpha.lease(lid, "commit", {"job": {"image": "local/job@sha256:" + "a" * 64,
                                            "command": command}})
    assert c["ok"], c
    return str(lid)


def state_of(alpha: PoolClient, lid: str) -> str:
    return str(alpha.lease(lid, "get")["lease"]["state"])


def test_a_committed_job_runs_in_the_sandbox_and_its_exit_releases_the_lease(
        plane: tuple[str, PoolClient, PoolClient], tmp_path: Path) -> None:
    url, admin, alpha = plane
    agent = AgentThread(url, "n1", tmp_path / "n1").start()
    try:
        wait_for(lambda: admin.admin("pool.show", {"pool_id": "p1"})["ok"])
        lid = request_running(alpha, "exit-3", ["sh", "-c", "id -u > /tmp/u; exit 3"])
        wait_for(lambda: state_of(alpha, lid) == "released")
        lease = alpha.lease(lid, "get")["lease"]
        assert lease["exit_code"] == 3 and lease["end_reason"] == "failed"
        assert agent.agent.stats.started == 1
        assert len(agent.agent.stats.startup_seconds) == 1
    finally:
        agent.stop()


def test_a_cancel_stops_the_workload_with_its_grace_and_frees_the_node(
        plane: tuple[str, PoolClient, PoolClient], tmp_path: Path) -> None:
    url, _admin, alpha = plane
    agent = AgentThread(url, "n1", tmp_path / "n1").start()
    try:
        # the job traps SIGTERM and exits 7: the stop must let it
        lid = request_running(alpha, "long", ["sh", "-c",
                                              "trap 'exit 7' TERM; while :; do sleep 0.1; done"])
        wait_for(lambda: agent.agent.running.get(lid) is not None)
        assert alpha.lease(lid, "cancel", {"reason": "user"})["ok"]
        wait_for(lambda: state_of(alpha, lid) == "cancelled")
        # the node's capacity is back: a lease as big as the node fits again
        lid2 = request_running(alpha, "big", ["true"], cpu_millis=4000)
        wait_for(lambda: state_of(alpha, lid2) == "released")
    finally:
        agent.stop()


def test_a_restarted_agent_readopts_its_workload_and_never_starts_it_twice(
        plane: tuple[str, PoolClient, PoolClient], tmp_path: Path) -> None:
    url, _admin, alpha = plane
    state = tmp_path / "n1"
    first = AgentThread(url, "n1", state).start()
    lid = request_running(alpha, "survivor", ["sh", "-c", "sleep 2; exit 5"])
    wait_for(lambda: first.agent.running.get(lid) is not None)
    first.stop()  # the agent goes; its workload does not
    second = AgentThread(url, "n1", state)
    try:
        assert state_of(alpha, lid) == "running"
        second.start()
        wait_for(lambda: second.agent.running.get(lid) is not None)
        assert second.agent.stats.started == 0  # adopted, not started
        wait_for(lambda: state_of(alpha, lid) == "released", timeout=20)
        assert alpha.lease(lid, "get")["lease"]["exit_code"] == 5
        started = json.loads((state / "started.json").read_text())
        assert len([k for k in started if k.startswith(lid)]) == 1
    finally:
        second.stop()


def test_a_redelivered_start_command_is_acked_without_a_second_start(
        plane: tuple[str, PoolClient, PoolClient], tmp_path: Path) -> None:
    url, _admin, alpha = plane
    agent = AgentThread(url, "n1", tmp_path / "n1").start()
    try:
        lid = request_running(alpha, "once", ["sh", "-c", "sleep 1"])
        wait_for(lambda: agent.agent.stats.started == 1)
        from bus.agentbus import ControlLink
        from schemas import v1
        from schemas.codec import encode

        body = encode(v1.LeaseAssignment(
            lease_id=lid, epoch=1, shape=v1.ResourceShape(cpu_millis=1000, memory_mib=256,
                                                          runtime="sandboxed"),
            job=v1.JobSpec(command=["sh", "-c", "sleep 1"]), deadline_at=time.time() + 60,
            tenant="alpha", pool_id="p1", job_number=1))
        ControlLink(url).send("n1", "start", body, msg_id="a-fresh-id-after-the-window")
        wait_for(lambda: agent.agent.stats.duplicates_ignored == 1)
        assert agent.agent.stats.started == 1
        wait_for(lambda: state_of(alpha, lid) == "released")
    finally:
        agent.stop()


def test_a_node_whose_agent_is_silent_is_lost_and_its_lease_reconciled(
        plane: tuple[str, PoolClient, PoolClient], tmp_path: Path) -> None:
    url, _admin, alpha = plane
    state = tmp_path / "n1"
    agent = AgentThread(url, "n1", state).start()
    lid = request_running(alpha, "orphan", ["sh", "-c", "sleep 60"])
    wait_for(lambda: agent.agent.running.get(lid) is not None)
    agent.stop()  # silent from now on, its workload still running
    # heartbeats stop: the durable timers expire the lease (capacity kept) and lose the node
    wait_for(lambda: state_of(alpha, lid) == "reconciling", timeout=20)
    back = AgentThread(url, "n1", state).start()
    try:
        # the node returns: it re-registers, is told the lease is not live, stops the workload
        # and confirms; only then is the lease released and the capacity freed
        wait_for(lambda: state_of(alpha, lid) == "released", timeout=20)
        assert back.agent.stats.started == 0
        wait_for(lambda: not back.agent.running)
    finally:
        back.stop()


def test_a_preempted_lease_requeued_on_the_same_node_runs_again_and_stays_alive(
        fresh_nats: NatsServer, tmp_path: Path) -> None:
    """Preemption notice → SIGTERM → preempted → requeued → placed again (epoch 2) on the
    same node, its job restarted on its own (no second commit): the agent starts the job
    again and its heartbeats keep the new placement alive
    (the demo once saw the second placement expire with heartbeat_lost)."""
    cp = ControlPlane(fresh_nats.url, leader_ttl_seconds=1.0).start()
    admin, alpha = PoolClient(fresh_nats.url), PoolClient(fresh_nats.url, "alpha")
    setup_pool(admin, tenants={"alpha": 1.0}, heartbeat_timeout_seconds=2,
               node_timeout_seconds=3, lost_node_release_seconds=30,
               preemption={"enabled": True, "grace_seconds": 1, "min_runtime_seconds": 0})
    agent = AgentThread(fresh_nats.url, "n1", tmp_path / "n1").start()
    try:
        victim = alpha.request_lease(lease_body("victim", runtime="sandboxed", memory_mib=256,
                                                cpu_millis=4000, priority="preemptible",
                                                max_runtime=600) | {"preemptible_requeue": True})
        assert victim["ok"], victim
        vid = victim["lease"]["lease_id"]
        wait_for(lambda: state_of(alpha, vid) == "reserved")
        assert alpha.lease(vid, "commit", {"job": {"image": "local/job@sha256:" + "a" * 64,
                                                   "command": ["sleep", "30"]}})["ok"]
        wait_for(lambda: agent.agent.running.get(vid) is not None)
        urgent = request_running(alpha, "urgent", ["sleep", "1"], cpu_millis=4000,
                                 priority="high")
        wait_for(lambda: state_of(alpha, urgent) == "released", timeout=20)
        # requeued, placed again (a new epoch), and its job restarted without a commit
        wait_for(lambda: alpha.lease(vid, "get")["lease"].get("epoch") == 2
                 and state_of(alpha, vid) == "running", timeout=20)
        wait_for(lambda: (agent.agent.running.get(vid) is not None
                          and agent.agent.running[vid].handle.epoch == 2))
        time.sleep(4)  # two heartbeat timeouts
        lease = alpha.lease(vid, "get")["lease"]
        assert lease["state"] == "running", lease
        assert lease["epoch"] == 2 and lease["last_heartbeat_at"] is not None, lease
    finally:
        agent.stop()
        alpha.close()
        admin.close()
        cp.stop()
