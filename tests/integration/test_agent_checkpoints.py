"""A node's checkpoint folders do not pile up: the agent removes a lease's once the lease ended
for good, or once untouched past the retention, never while the lease runs there, and without
following or opening what a hostile job planted in it. Real files, the `process` runtime's
bubblewrap sandbox, the agent's link stood in for by a recorder that answers as the plane."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agents.agent import Agent
from agents.checkpoints import remove_tree
from agents.probe import NodeProbe, Reserve
from agents.runtimes.process import ProcessRuntime
from schemas import v1

if ProcessRuntime(Path("/tmp")).available() is not None:
    pytest.skip(f"process runtime unavailable: {ProcessRuntime(Path('/tmp')).available()}",
                allow_module_level=True)

PROBE = NodeProbe(cpu_millis=4000, cpu_arch="amd64", memory_mib=4096, local_disk_gib=10)
DAY = 86_400.0


class PlaneStandIn:
    """Answers the agent's reports as the plane would, with the lease in `state`."""

    def __init__(self, state: str) -> None:
        self.state = state
        self.lock = threading.Lock()

    def request(self, suffix: str, body: bytes, *, headers: Any = None) -> bytes:
        with self.lock:
            return json.dumps({"ok": True, "result": {}, "lease": {"state": self.state}}).encode()

    def publish(self, subject: str, body: bytes, headers: Any = None) -> None:
        pass

    def fetch(self, timeout: float = 0.0) -> list[Any]:
        return []

    def files(self) -> None:
        return None  # no file store: no job here asks for files


def _agent(tmp_path: Path, state: str = "running") -> tuple[Agent, PlaneStandIn]:
    link = PlaneStandIn(state)
    agent = Agent(link, ProcessRuntime(tmp_path / "agent"), node_id="n1",  # type: ignore[arg-type]
                  pool_id="p1", probe=PROBE, state_dir=tmp_path / "agent",
                  reserve=Reserve(0, 0, 0))
    return agent, link


def _assignment(lease_id: str, command: list[str]) -> v1.LeaseAssignment:
    return v1.LeaseAssignment(
        lease_id=lease_id, epoch=1,
        shape=v1.ResourceShape(cpu_millis=500, memory_mib=64, runtime="sandboxed"),
        job=v1.JobSpec(command=command), deadline_at=time.time() + 60, tenant="alpha",
        pool_id="p1", job_number=1)


def _wait_for(what: Callable[[], Any], timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _age(folder: Path, seconds: float) -> None:
    """Every entry's own time (a link's too, never its target's) set `seconds` back."""
    then = time.time() - seconds
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            os.utime(Path(root) / name, (then, then), follow_symlinks=False)
    os.utime(folder, (then, then), follow_symlinks=False)


def _folder(agent: Agent, lease_id: str, files: dict[str, str]) -> Path:
    folder = agent.checkpoints.folder(lease_id)
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def test_an_old_folder_goes_and_a_fresh_one_stays(tmp_path: Path) -> None:
    agent, _ = _agent(tmp_path)
    old = _folder(agent, "lease-old", {"step-100.ckpt": "weights"})
    _age(old, 8 * DAY)
    fresh = _folder(agent, "lease-fresh", {"step-200.ckpt": "weights"})
    _age(fresh, 6 * DAY)
    (fresh / "step-300.ckpt").write_text("newer")  # one file written now keeps it
    assert agent.checkpoints.sweep() == 1
    assert not old.exists() and (fresh / "step-200.ckpt").read_text() == "weights"
    assert agent.stats.checkpoints_removed == 1
    assert os.listdir(agent.checkpoints.root) == ["lease-fresh"]  # nothing left aside


def test_a_running_lease_s_folder_stays_however_old(tmp_path: Path) -> None:
    agent, _ = _agent(tmp_path)
    lid = str(uuid.uuid4())  # a job's cgroup is named by it, machine-wide
    agent.start(_assignment(lid, ["sh", "-c", "echo 1 > /checkpoint/step && exec sleep 600"]),
                time.monotonic())
    folder = agent.checkpoints.folder(lid)
    try:
        _wait_for(lambda: (folder / "step").exists())
        _age(folder, 30 * DAY)
        assert agent.checkpoints.sweep() == 0
        assert (folder / "step").read_text() == "1\n" and agent.stats.checkpoints_removed == 0
    finally:
        agent.runtime.stop(agent.running[lid].handle, 0)


def test_a_lease_that_ended_for_good_loses_its_fresh_folder_at_the_next_tick(
        tmp_path: Path) -> None:
    agent, _ = _agent(tmp_path, state="released")
    lid = str(uuid.uuid4())  # a job's cgroup is named by it, machine-wide
    agent.start(_assignment(lid, ["sh", "-c", "echo 1 > /checkpoint/step"]), time.monotonic())
    folder = agent.checkpoints.folder(lid)
    _wait_for(lambda: not agent.running)  # its exit reported: the plane said released
    assert (folder / "step").exists()
    agent.step(wait=0.0)  # the loop's round starts the sweep on its own thread
    agent.checkpoints.join(10)
    assert not folder.exists() and agent.stats.checkpoints_removed == 1


def test_a_requeued_lease_keeps_its_folder_for_its_next_placement(tmp_path: Path) -> None:
    agent, _ = _agent(tmp_path, state="queued")  # preempted and requeued: it may come back
    lid = str(uuid.uuid4())  # a job's cgroup is named by it, machine-wide
    agent.start(_assignment(lid, ["sh", "-c", "echo 1 > /checkpoint/step"]), time.monotonic())
    _wait_for(lambda: not agent.running)
    assert agent.checkpoints.sweep() == 0
    assert (agent.checkpoints.folder(lid) / "step").read_text() == "1\n"


def test_what_a_job_planted_is_removed_as_entries_never_followed_or_opened(
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    agent, _ = _agent(tmp_path, state="released")
    host_file = tmp_path / "host-file"
    host_file.write_text("the host's own\n")
    host_dir = tmp_path / "host-dir"
    host_dir.mkdir()
    (host_dir / "kept").write_text("kept\n")
    # links to the host's file and folder (the job sees neither, but may name them), a FIFO
    # no one reads, a folder it made unwritable, and one nested 1,500 deep
    plant = (f"ln -s {host_file} /checkpoint/to-file && ln -s {host_dir} /checkpoint/to-dir"
             " && mkfifo /checkpoint/fifo && mkdir -p /checkpoint/locked/in"
             " && echo x > /checkpoint/locked/in/f && chmod 0 /checkpoint/locked/in"
             " /checkpoint/locked && cd /checkpoint && python3 -c \"import os\n"
             "for _ in range(1500): os.mkdir('d'); os.chdir('d')\nopen('deep', 'w')\"")
    lid = str(uuid.uuid4())  # a job's cgroup is named by it, machine-wide
    folder = agent.checkpoints.folder(lid)
    # should the agent leave it, the tree still goes (pytest's own clean-up recurses)
    request.addfinalizer(lambda: os.path.lexists(folder) and remove_tree(folder))
    agent.start(_assignment(lid, ["sh", "-c", plant]), time.monotonic())
    _wait_for(lambda: not agent.running)
    assert os.path.islink(folder / "to-dir") and (folder / "fifo").is_fifo()
    assert (folder / "locked").is_dir() and (folder / "d" / "d" / "d").is_dir()
    done = threading.Event()
    swept: list[int] = []
    threading.Thread(target=lambda: (swept.append(agent.checkpoints.sweep()), done.set()),
                     daemon=True).start()
    assert done.wait(30), "the sweep blocked"
    assert swept == [1] and not os.path.lexists(folder)
    assert host_file.read_text() == "the host's own\n"
    assert (host_dir / "kept").read_text() == "kept\n"


def test_a_link_in_the_folder_s_own_place_is_removed_not_its_target(tmp_path: Path) -> None:
    agent, _ = _agent(tmp_path)
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "kept").write_text("kept\n")
    agent.checkpoints.root.mkdir(parents=True)
    link = agent.checkpoints.folder("lease-link")
    link.symlink_to(target)
    _age(target, 30 * DAY)
    os.utime(link, (time.time() - 30 * DAY,) * 2, follow_symlinks=False)
    assert agent.checkpoints.sweep() == 1
    assert not os.path.lexists(link) and (target / "kept").read_text() == "kept\n"


def test_a_time_set_in_the_future_does_not_keep_a_folder(tmp_path: Path) -> None:
    agent, _ = _agent(tmp_path)
    folder = _folder(agent, "lease-future", {"ckpt": "x"})
    _age(folder, 8 * DAY)
    ahead = time.time() + 365 * DAY
    os.utime(folder / "ckpt", (ahead, ahead))
    assert agent.checkpoints.sweep() == 1 and not folder.exists()
