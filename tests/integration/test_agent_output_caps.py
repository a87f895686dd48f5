"""A job's output is capped per lease on its node and on the way to its tenant, shipped paced
and off the heartbeat's path, and its file removed once shipped: a real bubblewrap sandbox,
the agent's link stood in for by a recorder (a slow one, where the pace matters)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agents.agent import Agent
from agents.output import OutputShipper, dropped_marker
from agents.probe import NodeProbe, Reserve
from agents.runtimes.process import ProcessRuntime
from schemas import v1

if ProcessRuntime(Path("/tmp")).available() is not None:
    pytest.skip(f"process runtime unavailable: {ProcessRuntime(Path('/tmp')).available()}",
                allow_module_level=True)

PROBE = NodeProbe(cpu_millis=4000, cpu_arch="amd64", memory_mib=4096, local_disk_gib=10)
LEASE = "00000000-0000-4000-8000-000000000043"


class RecordingLink:
    """What the agent sends; each publish takes `publish_seconds` (a busy link)."""

    def __init__(self, publish_seconds: float = 0.0) -> None:
        self.sent: list[tuple[float, str, str, bytes]] = []
        self.lock = threading.Lock()
        self.publish_seconds = publish_seconds

    def request(self, suffix: str, body: bytes, *, headers: Any = None) -> bytes:
        with self.lock:
            self.sent.append((time.time(), "request", suffix, body))
        return json.dumps({"ok": True, "result": {}}).encode()

    def publish(self, subject: str, body: bytes, headers: Any = None) -> None:
        time.sleep(self.publish_seconds)
        with self.lock:
            self.sent.append((time.time(), "publish", subject, body))

    def fetch(self, timeout: float = 0.0) -> list[Any]:
        return []

    def files(self) -> None:
        return None  # no file store: no job here asks for files

    def exited(self) -> bool:
        with self.lock:
            return any(k == "request" and w.endswith(".exited") for _, k, w, _ in self.sent)

    def output(self) -> str:
        with self.lock:
            return "".join(json.loads(b)["attrs"]["text"] for _, k, w, b in self.sent
                           if k == "publish" and w.endswith(".output"))


def _assignment(command: list[str], **extra: Any) -> v1.LeaseAssignment:
    return v1.LeaseAssignment(
        lease_id=LEASE, epoch=1,
        shape=v1.ResourceShape(cpu_millis=500, memory_mib=64, runtime="sandboxed"),
        job=v1.JobSpec(command=command), deadline_at=time.time() + 60, tenant="alpha",
        pool_id="p1", job_number=1, **extra)


def _wait_for(what: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _writes(n: int, then: str = "") -> list[str]:
    return ["python3", "-c", (f"import sys, time; sys.stdout.write('x' * {n}); "
                              f"sys.stdout.flush(); {then}")]


def test_output_past_the_cap_is_neither_kept_nor_shipped_and_its_file_goes(
        tmp_path: Path) -> None:
    link = RecordingLink()
    agent = Agent(link, ProcessRuntime(tmp_path), node_id="n1",  # type: ignore[arg-type]
                  pool_id="p1", probe=PROBE, state_dir=tmp_path, reserve=Reserve(0, 0, 0))
    cap = 100_000
    # writes three times its cap, then lingers, so the node's file can be looked at
    agent.start(_assignment(_writes(3 * cap, "time.sleep(1.0)"), max_output_bytes=cap),
                time.monotonic())
    marker = dropped_marker(cap)
    _wait_for(lambda: link.output().endswith(marker))
    logs = list((tmp_path / "process").glob("*.log"))
    assert len(logs) == 1
    stored = logs[0].read_bytes()
    assert stored.startswith(b"x" * cap) and len(stored) < cap + 100, len(stored)
    assert stored.count(b"output past") == 1  # the node's own marker line
    _wait_for(link.exited)
    _wait_for(lambda: not agent.running)
    shipped = link.output()
    assert shipped == "x" * cap + marker
    assert not list((tmp_path / "process").glob("*.log")), "the shipped output stays on disk"


def test_a_backlog_at_the_job_s_end_holds_up_no_heartbeat(tmp_path: Path) -> None:
    # each sample takes 1 ms to publish, and all of them 200 KB/s: 600 KB take 3 s to ship
    link = RecordingLink(publish_seconds=0.001)
    agent = Agent(link, ProcessRuntime(tmp_path), node_id="n1",  # type: ignore[arg-type]
                  pool_id="p1", probe=PROBE, state_dir=tmp_path, reserve=Reserve(0, 0, 0),
                  output=OutputShipper(bytes_per_second=200_000, burst_bytes=64 * 1024))
    total = 600_000
    agent.start(_assignment(_writes(total)), time.monotonic())
    _wait_for(lambda: link.output())
    slowest, beats = 0.0, 0
    while not link.exited():
        t0 = time.monotonic()
        agent.heartbeat()
        slowest = max(slowest, time.monotonic() - t0)
        beats += 1
        time.sleep(0.05)
    assert beats >= 10, "the shipping was not paced"
    # behind the backlog, a heartbeat would wait seconds; a loaded machine delays one ~0.1 s
    assert slowest < 0.5, f"a heartbeat waited {slowest:.3f} s behind the output"
    assert link.output() == "x" * total  # under the cap: all of it, before the end's report
