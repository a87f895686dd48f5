"""Reconciliation end to end, as an operator runs it: `pool up` (users required), `pool agent
run` as the node's own NATS user, the CLI as the tenant. SIGSTOP the agent past its lease's
heartbeat timeout: the durable timer expires the lease into `reconciling` with its capacity
held; SIGCONT it: its stale heartbeat is refused, it stops the workload and confirms, and only
then is the lease released and the capacity freed. The workload never runs twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.runtimes.process import ProcessRuntime

if ProcessRuntime(Path("/tmp")).available() is not None:
    pytest.skip("process runtime unavailable (bubblewrap)", allow_module_level=True)


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
    env.update(POOL_HOME=str(home), POOL_NATS_PORT="0")
    return env


def _pool(home: Path, *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "cli.main", *args, "--json"],
                         capture_output=True, text=True, env=_env(home), timeout=60,
                         check=False)
    reply: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout else {}
    reply["_rc"], reply["_stderr"] = out.returncode, out.stderr
    return reply


def _wait(what: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture()
def pool_home(tmp_path: Path) -> Iterator[Path]:
    home = tmp_path / "pool"
    up = subprocess.Popen([sys.executable, "-m", "cli.main", "up", "--no-postgres", "--json"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=_env(home))
    assert up.stdout is not None
    assert up.stdout.readline(), "pool up printed nothing"
    try:
        yield home
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(30)


def test_a_stopped_agent_is_reconciled_and_its_workload_never_runs_twice(
        pool_home: Path) -> None:
    home = pool_home
    assert _pool(home, "admin", "pool", "create", "p1", "--priority-classes", "standard=10",
                 "--heartbeat-timeout", "2", "--node-timeout", "60")["ok"]
    assert _pool(home, "admin", "tenant", "set", "acme", "--pool", "p1")["ok"]
    assert _pool(home, "credits", "grant", "acme", "1000000000000")["ok"]
    # the operator enrolls the node (its user, pool and trust) before its agent runs
    assert _pool(home, "admin", "node", "creds", "n1", "--pool", "p1", "--trust", "trusted")["ok"]
    state = home / "agents" / "n1"
    agent = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "agent", "run", "--node-id", "n1", "--pool", "p1",
         "--heartbeat-interval", "0.5", "--reserve-memory-mib", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(home))
    try:
        assert agent.stdout is not None
        assert "agent n1 in pool p1" in agent.stdout.readline()
        lease = _pool(home, "lease", "request", "--tenant", "acme", "--pool", "p1",
                      "--cpu-millis", "500", "--memory-mib", "128", "--runtime", "sandboxed",
                      "--max-runtime", "600", "--key", "k1")
        assert lease["ok"], lease
        lid = lease["lease"]["lease_id"]

        def state_is(want: str) -> bool:
            return _pool(home, "lease", "get", lid, "--tenant", "acme")["lease"]["state"] == want

        _wait(lambda: state_is("reserved"))
        c = _pool(home, "lease", "commit", lid, "--tenant", "acme", "--image",
                  "local/job@sha256:" + "b" * 64, "--cmd", "sleep", "120")
        assert c["ok"], c
        _wait(lambda: (state / "started.json").exists()
              and any(k.startswith(lid) for k in json.loads((state / "started.json").read_text())))

        agent.send_signal(signal.SIGSTOP)
        _wait(lambda: state_is("reconciling"), timeout=30)
        # capacity is still held while the workload may run: a lease as big as the node waits
        got = _pool(home, "lease", "get", lid, "--tenant", "acme")["lease"]
        assert got["node_id"] == "n1"
        stale = _pool(home, "lease", "heartbeat", lid, "--tenant", "acme", "--epoch", "1")
        assert not stale["ok"] and stale["error"]["code"] == "lease_expired"

        agent.send_signal(signal.SIGCONT)
        _wait(lambda: state_is("released"), timeout=30)
        started = json.loads((state / "started.json").read_text())
        assert len([k for k in started if k.startswith(lid)]) == 1  # never started twice
        # no sandboxed `sleep 120` of this lease is left on the machine
        assert not list((state / "process").glob(f"{lid}*.json"))
    finally:
        agent.send_signal(signal.SIGCONT)
        agent.send_signal(signal.SIGINT)
        try:
            agent.wait(20)
        except subprocess.TimeoutExpired:
            agent.kill()
