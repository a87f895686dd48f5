"""The agent learns of a job's output and exit as they happen (a pidfd and inotify, through the
`process` runtime's `wait`), and reports them at once, without its loop's round: a real
bubblewrap sandbox, the agent's link stood in for by a recorder."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agents.agent import Agent
from agents.probe import NodeProbe, Reserve
from agents.runtimes.contract import WorkloadSpec
from agents.runtimes.process import ProcessRuntime
from schemas import v1

if ProcessRuntime(Path("/tmp")).available() is not None:
    pytest.skip(f"process runtime unavailable: {ProcessRuntime(Path('/tmp')).available()}",
                allow_module_level=True)

PROBE = NodeProbe(cpu_millis=4000, cpu_arch="amd64", memory_mib=4096, local_disk_gib=10)


class RecordingLink:
    """What the agent sends, with when: requests (reports) and publishes (telemetry)."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, str, str, bytes]] = []
        self.lock = threading.Lock()

    def request(self, suffix: str, body: bytes, *, headers: Any = None) -> bytes:
        with self.lock:
            self.sent.append((time.time(), "request", suffix, body))
        return json.dumps({"ok": True, "result": {}}).encode()

    def publish(self, subject: str, body: bytes, headers: Any = None) -> None:
        with self.lock:
            self.sent.append((time.time(), "publish", subject, body))

    def fetch(self, timeout: float = 0.0) -> list[Any]:
        return []

    def files(self) -> None:
        return None  # no file store: no job here asks for files

    def first(self, kind: str, ending: str) -> tuple[float, bytes] | None:
        with self.lock:
            return next(((at, body) for at, k, what, body in self.sent
                         if k == kind and what.endswith(ending)), None)


def _assignment(command: list[str]) -> v1.LeaseAssignment:
    return v1.LeaseAssignment(
        lease_id="00000000-0000-4000-8000-000000000042", epoch=1,
        shape=v1.ResourceShape(cpu_millis=500, memory_mib=64, runtime="sandboxed"),
        job=v1.JobSpec(command=command), deadline_at=time.time() + 60, tenant="alpha",
        pool_id="p1", job_number=1)


def _wait_for(what: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_runtime_says_when_its_workload_writes_and_when_it_exits(tmp_path: Path) -> None:
    rt = ProcessRuntime(tmp_path)
    handle = rt.start(WorkloadSpec(lease_id="l1", epoch=1, job_number=1,
                                   command=("sh", "-c", "echo hi; sleep 0.5")))
    try:
        t0 = time.monotonic()
        assert rt.wait(handle, 5.0) == "output"
        assert time.monotonic() - t0 < 0.4  # the write, not the exit
        what = rt.wait(handle, 5.0)
        while what == "output":
            what = rt.wait(handle, 5.0)
        assert what == "exited"
        assert rt.poll(handle) == 0
    finally:
        rt.stop(handle, 0)
        rt.forget(handle)
    assert rt.wait(handle, 0.1) == "exited"  # forgotten: nothing left to wait on


def test_a_job_s_exit_is_reported_at_once_without_the_loop_s_round(tmp_path: Path) -> None:
    link = RecordingLink()
    agent = Agent(link, ProcessRuntime(tmp_path), node_id="n1",  # type: ignore[arg-type]
                  pool_id="p1", probe=PROBE, state_dir=tmp_path, reserve=Reserve(0, 0, 0))
    # the job prints when it ends; the agent's loop never runs (no step, no watch)
    agent.start(_assignment(["python3", "-c", "import time; print(repr(time.time()))"]),
                time.monotonic())
    exited = _wait_for(lambda: link.first("request", ".exited"))
    output = link.first("publish", ".output")
    assert output is not None and output[0] <= exited[0]
    printed = float(json.loads(output[1])["attrs"]["text"])
    assert exited[0] - printed < 0.3, "reported on a round, not when the job exited"
    assert json.loads(exited[1])["exit_code"] == 0
    _wait_for(lambda: not agent.running)  # forgotten once the report was answered
