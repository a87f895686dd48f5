"""A job is hostile to its agent: what it leaves where the agent writes its preemption notice
(a FIFO, a link to a host file, a directory) neither blocks the agent nor redirects its write.
A real plane, a real agent and the `process` runtime's bubblewrap sandbox."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.agent import Agent
from agents.notice import NoticeRefused, write_notice
from agents.probe import NodeProbe, Reserve
from agents.runtimes.process import ProcessRuntime
from bus.agentbus import AgentLink
from bus.local.server import NatsServer
from client.api import PoolClient
from tests.control_plane import lease_body, setup_pool
from workers.plane import ControlPlane

PROBE = NodeProbe(cpu_millis=4500, cpu_arch="amd64", memory_mib=9216, local_disk_gib=50)
IMAGE = "local/job@sha256:" + "a" * 64
# what the job leaves in its checkpoint folder (`/checkpoint` inside the sandbox) before it
# sleeps; {host} is a file of the host the job cannot see, only name
TRAPS = {
    "fifo": "mkfifo /checkpoint/PREEMPT",  # no reader: an open for writing waits forever
    "symlink": "ln -s {host} /checkpoint/PREEMPT",
    "directory": "mkdir /checkpoint/PREEMPT",
}


def _wait_for(what: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture()
def plane(fresh_nats: NatsServer, tmp_path: Path) -> Iterator[tuple[PoolClient, Agent]]:
    if (why := ProcessRuntime(tmp_path).available()) is not None:
        pytest.skip(f"process runtime unavailable: {why}")
    cp = ControlPlane(fresh_nats.url, leader_ttl_seconds=1.0).start()
    admin, alpha = PoolClient(fresh_nats.url), PoolClient(fresh_nats.url, "alpha")
    setup_pool(admin, tenants={"alpha": 1.0}, heartbeat_timeout_seconds=2,
               node_timeout_seconds=3, lost_node_release_seconds=30,
               preemption={"enabled": True, "grace_seconds": 1, "min_runtime_seconds": 0})
    assert admin.admin("node.enroll", {"node_id": "n1", "pool_id": "p1",
                                       "trust_level": "trusted"})["ok"]
    link = AgentLink(fresh_nats.url, "n1").connect()
    state = tmp_path / "agent"
    agent = Agent(link, ProcessRuntime(state), node_id="n1", pool_id="p1", probe=PROBE,
                  state_dir=state, reserve=Reserve(500, 1024, 0), heartbeat_interval=0.5)
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    yield alpha, agent
    stop.set()
    thread.join(15)
    link.close()
    alpha.close()
    admin.close()
    cp.stop()


def _state(alpha: PoolClient, lid: str) -> str:
    return str(alpha.lease(lid, "get")["lease"]["state"])


def _running(alpha: PoolClient, key: str, command: list[str], priority: str) -> str:
    r = alpha.request_lease(lease_body(key, runtime="sandboxed", memory_mib=256,
                                       cpu_millis=4000, priority=priority))
    assert r["ok"], r
    lid = str(r["lease"]["lease_id"])
    _wait_for(lambda: _state(alpha, lid) == "reserved")
    assert alpha.lease(lid, "commit", {"job": {"image": IMAGE, "command": command}})["ok"]
    return lid


@pytest.mark.parametrize("trap", sorted(TRAPS))
def test_a_trap_in_the_checkpoint_folder_is_refused_and_the_preemption_goes_on(
        plane: tuple[PoolClient, Agent], tmp_path: Path, trap: str,
        caplog: pytest.LogCaptureFixture) -> None:
    alpha, agent = plane
    host = tmp_path / "host-file"
    host.write_text("the host's own\n")
    setup = TRAPS[trap].format(host=host)
    victim = _running(alpha, f"victim-{trap}", ["sh", "-c", f"{setup} && exec sleep 600"],
                      "preemptible")
    notice = agent.state_dir / "checkpoints" / victim / "PREEMPT"
    _wait_for(lambda: os.path.lexists(notice))
    with caplog.at_level(logging.WARNING, logger="agents.agent"):
        urgent = _running(alpha, f"urgent-{trap}", ["true"], "high")
        # the agent went on: the victim was stopped, the urgent lease ran and ended
        _wait_for(lambda: _state(alpha, victim) == "preempted")
        _wait_for(lambda: _state(alpha, urgent) == "released")
    assert host.read_text() == "the host's own\n"  # the link led the write nowhere
    assert agent.stats.notices_refused == 1
    assert any("refused" in r.getMessage() and victim in r.getMessage()
               for r in caplog.records), caplog.text
    beats = agent.stats.heartbeats
    _wait_for(lambda: agent.stats.heartbeats > beats + 1)  # and it still beats


def test_a_plain_notice_is_still_written_for_the_job(
        plane: tuple[PoolClient, Agent]) -> None:
    alpha, agent = plane
    victim = _running(alpha, "victim", ["sleep", "600"], "preemptible")
    _wait_for(lambda: victim in agent.running)
    _running(alpha, "urgent", ["true"], "high")
    _wait_for(lambda: _state(alpha, victim) == "preempted")
    notice = agent.state_dir / "checkpoints" / victim / "PREEMPT"
    _wait_for(notice.exists)  # the log says preempted before the agent hears its revoke
    assert float(notice.read_text()) > 0 and agent.stats.notices_refused == 0


def test_a_fifo_the_job_reads_and_a_hard_link_are_refused_too(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    fifo = folder / "PREEMPT"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # with a reader, the open succeeds
    try:
        with pytest.raises(NoticeRefused, match="not a regular file"):
            write_notice(folder, "PREEMPT", "1")
        assert os.read(reader, 10) == b""
    finally:
        os.close(reader)
    fifo.unlink()
    host = tmp_path / "host-file"
    host.write_text("kept")
    os.link(host, fifo)
    with pytest.raises(NoticeRefused, match="2 links"):
        write_notice(folder, "PREEMPT", "1")
    assert host.read_text() == "kept"
    linked = tmp_path / "linked"
    linked.symlink_to(folder)
    with pytest.raises(NoticeRefused, match="not a plain directory"):
        write_notice(linked, "NOTICE", "1")
