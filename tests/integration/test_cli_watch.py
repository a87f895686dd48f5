"""`pool lease watch`, the real binary following the tenant's lease feed of a real control plane:
what is stored, then each change as it happens, one JSON object a line; Ctrl-C ends it cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from bus.admin import ensure_all_streams
from bus.local.server import NatsServer
from client.api import PoolClient
from tests.control_plane import lease_body, node_body, setup_pool
from workers.plane import ControlPlane

ROOT = Path(__file__).resolve().parents[2]
JOB = {"image": "busybox@sha256:" + "a" * 64, "command": ["true"]}


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[tuple[str, PoolClient]]:
    ensure_all_streams(fresh_nats.url)
    cp = ControlPlane(fresh_nats.url, leader_ttl_seconds=1.0).start()
    admin = PoolClient(fresh_nats.url)
    alpha = PoolClient(fresh_nats.url, "alpha")
    setup_pool(admin)
    assert admin.admin("node.register", node_body("n1"))["ok"]
    yield fresh_nats.url, alpha
    alpha.close()
    admin.close()
    cp.stop()


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}


def _watch(url: str, *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "cli.main", "lease", "watch", *argv,
                             "--nats-url", url, "--tenant", "alpha", "--json"],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _ready(proc: subprocess.Popen[str]) -> None:
    """Wait until a watch of every lease says it is following (its stored part is read)."""
    assert proc.stderr is not None
    assert "watching every lease" in proc.stderr.readline()


def _lines(stream: IO[str] | None, count: int, timeout: float = 30) -> list[dict[str, Any]]:
    assert stream is not None
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while len(out) < count and time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        envelope = json.loads(line)
        assert envelope["ok"] is True
        out.append(envelope["result"])
    return out


def _wait_state(alpha: PoolClient, lid: str, state: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while alpha.lease(lid, "get")["lease"]["state"] != state:
        assert time.monotonic() < deadline, f"{lid} never became {state}"
        time.sleep(0.05)


def _wait_feed(alpha: PoolClient, lid: str, state: str, timeout: float = 20) -> None:
    """Wait until the feed holds the lease's record of `state` (its writer follows the log)."""
    deadline = time.monotonic() + timeout
    while True:
        reply = alpha.call("pool.cmd.alpha.feed.replay", {"lease": lid})
        if state in {r["record"]["state"] for r in reply["result"]["records"]}:
            return
        assert time.monotonic() < deadline, f"the feed never said {lid} became {state}"
        time.sleep(0.05)


def test_watch_follows_a_lease_live_until_it_ends(plane: tuple[str, PoolClient]) -> None:
    url, alpha = plane
    lid = str(alpha.request_lease(lease_body("watch-1"))["lease"]["lease_id"])
    proc = _watch(url, lid)
    try:
        first = _lines(proc.stdout, 2)  # queued (with its request) and reserved
        assert [r["state"] for r in first] == ["queued", "reserved"]
        assert alpha.lease(lid, "commit", {"job": JOB})["ok"]
        assert alpha.lease(lid, "release", {"exit_code": 0})["ok"]
        rest = _lines(proc.stdout, 2)
        assert proc.wait(20) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        proc.kill()
    changes = first + rest
    assert [(r["previous_state"], r["state"]) for r in changes] == [
        (None, "queued"), ("queued", "reserved"),
        ("reserved", "running"), ("running", "released")]
    assert changes[-1]["end_reason"] == "succeeded" and changes[-1]["exit_code"] == 0
    assert changes[1]["node_id"] == "n1"
    assert [r["seq"] for r in changes] == sorted(r["seq"] for r in changes)


def test_watch_of_an_ended_lease_prints_its_stored_changes_and_exits(
        plane: tuple[str, PoolClient]) -> None:
    url, alpha = plane
    lid = str(alpha.request_lease(lease_body("watch-2"))["lease"]["lease_id"])
    _wait_state(alpha, lid, "reserved")
    assert alpha.lease(lid, "cancel", {})["ok"]
    _wait_feed(alpha, lid, "cancelled")
    out = subprocess.run([sys.executable, "-m", "cli.main", "lease", "watch", lid, "--nats-url",
                          url, "--tenant", "alpha", "--json"], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    states = [json.loads(line)["result"]["state"] for line in out.stdout.splitlines()]
    assert states == ["queued", "reserved", "cancelled"]


def test_watch_without_an_id_follows_every_lease_and_ctrl_c_ends_it_cleanly(
        plane: tuple[str, PoolClient]) -> None:
    url, alpha = plane
    proc = _watch(url)
    try:
        _ready(proc)
        a = str(alpha.request_lease(lease_body("watch-a"))["lease"]["lease_id"])
        b = str(alpha.request_lease(lease_body("watch-b"))["lease"]["lease_id"])
        got = _lines(proc.stdout, 4)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(20)
        err = proc.stderr.read() if proc.stderr else ""
    finally:
        proc.kill()
    assert {(r["lease_id"], r["state"]) for r in got} == {
        (lid, s) for lid in (a, b) for s in ("queued", "reserved")}
    assert code == 0 and "Traceback" not in err, err


def test_watch_without_an_id_starts_now_unless_told_where_to_resume(
        plane: tuple[str, PoolClient]) -> None:
    url, alpha = plane
    old = str(alpha.request_lease(lease_body("watch-old"))["lease"]["lease_id"])
    _wait_feed(alpha, old, "reserved")  # records 1 (queued) and 2 (reserved)
    now = _watch(url)
    resumed = _watch(url, "--after", "1")
    try:
        _ready(now)
        _ready(resumed)
        new = str(alpha.request_lease(lease_body("watch-new"))["lease"]["lease_id"])
        # the old lease may change again later (its commit window ends): the first lines tell
        fresh = _lines(now.stdout, 1)
        again = _lines(resumed.stdout, 2)
    finally:
        for p in (now, resumed):
            p.send_signal(signal.SIGINT)
            p.wait(20)
    assert [(r["seq"], r["lease_id"], r["state"]) for r in fresh] == [(3, new, "queued")]
    assert [(r["seq"], r["lease_id"], r["state"]) for r in again] == [
        (2, old, "reserved"), (3, new, "queued")]


def test_watch_of_another_tenant_s_lease_is_refused(plane: tuple[str, PoolClient]) -> None:
    url, alpha = plane
    lid = str(alpha.request_lease(lease_body("watch-3"))["lease"]["lease_id"])
    out = subprocess.run([sys.executable, "-m", "cli.main", "lease", "watch", lid, "--nats-url",
                          url, "--tenant", "beta", "--json"], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 1
    assert json.loads(out.stdout)["error"]["code"] == "lease_not_found"
