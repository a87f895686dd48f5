"""Work that finishes by itself: retries, dependencies and array throttles, through the real
`pool` binary, a real control plane and a real agent running jobs in the bubblewrap sandbox."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from bus.local.server import NatsServer
from client.api import PoolClient
from tests.control_plane import lease_body, setup_pool
from tests.integration.test_agent import AgentThread, wait_for
from tests.integration.test_cli_run import _lease_args, _pool, plane
from workers.plane import ControlPlane

__all__ = ["plane"]  # the fixture, shared with the `lease run` tests


def _ended(out: str) -> dict[str, object]:
    lease: dict[str, object] = json.loads(out.splitlines()[-1])["lease"]
    return lease


def test_a_job_failing_twice_then_succeeding_ends_succeeded_on_attempt_3(plane: str) -> None:
    with PoolClient(plane) as admin:  # priced, so each attempt holds and spends credits
        assert admin.admin("pool.prices", {"pool_id": "p1", "cpu_core_second": 1000})["ok"]
    out = _pool(plane, "lease", "run", *_lease_args(plane), "--retries", "3",
                "--retry-on", "failed", "--json", "--",
                "sh", "-c", 'echo "attempt $POOL_ATTEMPT"; [ "$POOL_ATTEMPT" -ge 3 ]')
    assert out.returncode == 0, out.stderr
    assert "attempt 1\n" in out.stdout and "attempt 3\n" in out.stdout
    lease = _ended(out.stdout)
    assert (lease["state"], lease["end_reason"], lease["attempts"]) == (
        "released", "succeeded", 3)
    ends = lease["attempt_ends"]
    assert isinstance(ends, list)
    assert [(e["attempt"], e["end_reason"], e["exit_code"]) for e in ends] == [
        (1, "failed", 1), (2, "failed", 1)]
    # the feed tells each retry: how the attempt before it ended
    watched = _pool(plane, "lease", "watch", str(lease["lease_id"]), "--nats-url", plane,
                    "--tenant", "alpha")
    assert "attempt 1 failed, attempt 2 next" in watched.stdout, watched.stdout
    assert "attempt 2 failed, attempt 3 next" in watched.stdout, watched.stdout
    # each attempt held and settled on its own: the credit audit balances
    audit = _pool(plane, "audit", "credits", "--no-views", "--nats-url", plane, "--json")
    assert audit.returncode == 0, audit.stdout + audit.stderr
    alpha = json.loads(audit.stdout)["tenants"]["alpha"]
    assert alpha["held"] == 0 and alpha["spent"] > 0, alpha


def test_a_job_failing_every_time_ends_failed_after_max_attempts(plane: str) -> None:
    out = _pool(plane, "lease", "run", *_lease_args(plane), "--retries", "2", "--json", "--",
                "sh", "-c", "exit 4")
    assert out.returncode == 4, out.stderr
    lease = _ended(out.stdout)
    assert (lease["end_reason"], lease["exit_code"], lease["attempts"]) == ("failed", 4, 2)


def test_a_retry_on_the_same_node_finds_what_the_attempt_before_it_checkpointed(
        plane: str) -> None:
    # one node: the retry comes back to it, and to the lease's checkpoint folder there
    job = ('f="$POOL_CHECKPOINT_DIR/step"; if [ -f "$f" ]; then echo "resumed: $(cat "$f")"; '
           'else echo "written by attempt $POOL_ATTEMPT" > "$f"; exit 1; fi')
    out = _pool(plane, "lease", "run", *_lease_args(plane), "--retries", "2", "--json", "--",
                "sh", "-c", job)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "resumed: written by attempt 1\n" in out.stdout, out.stdout
    assert _ended(out.stdout)["attempts"] == 2

def test_retries_past_the_pool_s_max_attempts_are_refused(plane: str) -> None:
    out = _pool(plane, "lease", "request", *_lease_args(plane), "--retries", "11", "--json")
    assert out.returncode != 0
    assert json.loads(out.stdout)["error"]["code"] == "max_attempts_exceeded"


def _wait_for(c: PoolClient, lease_id: str, states: set[str],
              seconds: float = 15) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    while True:
        lease: dict[str, Any] = c.lease(lease_id, "get")["lease"]
        if lease["state"] in states or time.monotonic() > deadline:
            return lease
        time.sleep(0.1)


def test_b_runs_after_a_succeeds_and_c_waiting_for_a_failure_ends_dependency_failed(
        plane: str) -> None:
    a = _pool(plane, "lease", "run", *_lease_args(plane), "--detach", "--",
              "sh", "-c", "sleep 2").stdout.strip()
    c_req = _pool(plane, "lease", "request", *_lease_args(plane), "--after", f"{a}:notok",
                  "--json")
    assert c_req.returncode == 0, c_req.stderr
    c_id = json.loads(c_req.stdout)["lease"]["lease_id"]
    assert json.loads(c_req.stdout)["lease"]["state"] == "held"
    with PoolClient(plane, "alpha") as c:
        why = c.lease(c_id, "why")["result"]
        assert why["state"] == "held", why
        assert why["reasons"] == {"tenant": ["waiting_for_dependency"], "waiting_for": [a]}
    b = _pool(plane, "lease", "run", *_lease_args(plane), "--after", f"{a}:ok", "--json",
              "--", "echo", "b")
    assert b.returncode == 0, b.stderr
    assert b.stdout.startswith("b\n")
    with PoolClient(plane, "alpha") as c:
        assert c.lease(a, "get")["lease"]["end_reason"] == "succeeded"
        third = _wait_for(c, c_id, {"rejected"})
        assert (third["state"], third["end_reason"]) == ("rejected", "dependency_failed")
    # B was reserved only after A had ended as it asked: checked from the log
    audit = _pool(plane, "audit", "decisions", "--nats-url", plane, "--json")
    report = json.loads(audit.stdout)
    assert audit.returncode == 0 and report["ok"], audit.stdout
    assert report["checks"]["workflows"].endswith("1 dependent placements")


def test_a_dependency_on_an_unknown_lease_is_refused(plane: str) -> None:
    out = _pool(plane, "lease", "request", *_lease_args(plane), "--after",
                "00000000-0000-4000-8000-000000000000", "--json")
    assert out.returncode != 0
    assert json.loads(out.stdout)["error"]["code"] == "unknown_dependency"


def test_an_array_never_has_more_than_max_running_leases_holding_capacity(plane: str) -> None:
    out = _pool(plane, "lease", "request", *_lease_args(plane), "--count", "5",
                "--max-running", "2", "--json")
    assert out.returncode == 0, out.stderr
    ids = json.loads(out.stdout)["result"]["lease_ids"]
    released: set[str] = set()
    with PoolClient(plane, "alpha") as c:
        while len(released) < len(ids):
            deadline = time.monotonic() + 15
            while True:
                states = {i: c.lease(i, "get")["lease"]["state"] for i in ids
                          if i not in released}
                reserved = [i for i, s in states.items() if s == "reserved"]
                if len(reserved) == min(2, len(states)) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert len(reserved) == min(2, len(states)), states
            waiting = [i for i, s in states.items() if s == "queued"]
            if waiting:
                why = c.lease(waiting[0], "why")
                assert "array_throttled" in json.dumps(why)
            for i in reserved:
                assert c.lease(i, "release")["ok"]
                released.add(i)
    audit = _pool(plane, "audit", "decisions", "--nats-url", plane, "--json")
    report = json.loads(audit.stdout)
    assert audit.returncode == 0 and report["ok"], audit.stdout
    assert report["checks"]["workflows"].startswith("1 throttled arrays")


def test_a_job_whose_node_is_lost_twice_succeeds_on_attempt_3_on_a_third_node(
        fresh_nats: NatsServer, tmp_path: Path) -> None:
    url = fresh_nats.url
    cp = ControlPlane(url, leader_ttl_seconds=1.0).start()
    admin, alpha = PoolClient(url), PoolClient(url, "alpha")
    setup_pool(admin, tenants={"alpha": 1.0}, heartbeat_timeout_seconds=30,
               node_timeout_seconds=2, lost_node_release_seconds=1,
               preemption={"enabled": False, "grace_seconds": 1})
    agents = [AgentThread(url, "n1", tmp_path / "n1").start()]
    try:
        body = lease_body("lost", runtime="sandboxed", memory_mib=256, max_runtime=120) | {
            "retries": {"max_attempts": 3, "on": ["failed", "node_lost"]}}
        # the first two attempts outlive their nodes; the third ends at once
        r = alpha.request_lease(body)
        assert r["ok"], r
        lid = str(r["lease"]["lease_id"])
        wait_for(lambda: alpha.lease(lid, "get")["lease"]["state"] == "reserved")
        assert alpha.lease(lid, "commit", {"job": {
            "command": ["sh", "-c", '[ "$POOL_ATTEMPT" -ge 3 ] || sleep 6']}})["ok"]
        for attempt, node in ((1, "n1"), (2, "n2")):
            wait_for(lambda: agents[-1].agent.running.get(lid) is not None, timeout=30)
            got = alpha.lease(lid, "get")["lease"]
            assert (got["attempts"], got["node_id"]) == (attempt, node), got
            agents.append(AgentThread(url, f"n{attempt + 1}", tmp_path / f"n{attempt + 1}")
                          .start())
            agents[-2].stop()  # silent from now on: its node is lost, and the attempt with it
        lease = wait_for(lambda: (got := alpha.lease(lid, "get")["lease"])["state"] == "released"
                         and got, timeout=30)
        assert (lease["end_reason"], lease["attempts"], lease["node_id"]) == (
            "succeeded", 3, "n3")
        assert [(e["attempt"], e["end_reason"], e["node_id"]) for e in lease["attempt_ends"]] == [
            (1, "node_lost", "n1"), (2, "node_lost", "n2")]
    finally:
        for agent in agents:
            if agent.thread.is_alive():
                agent.stop()
        alpha.close()
        admin.close()
        cp.stop()

def test_an_array_of_50_with_max_running_5_never_holds_more_than_5(plane: str) -> None:
    """Fifty short jobs through the real agent, eight of which would fit the node at once:
    the log, replayed by the fault suite's check, never shows more than five holding
    capacity, and shows five at some point."""
    from chaos.invariants import check_workflows
    from workers.application import PoolApp
    from workers.bootstrap import app_env

    body = lease_body("array-50", cpu_millis=500, memory_mib=256, max_runtime=120,
                      runtime="sandboxed") | {"count": 50, "max_running": 5}
    with PoolClient(plane, "alpha") as c:
        r = c.request_lease(body)
        assert r["ok"], r
        ids: list[str] = r["result"]["lease_ids"]
        committed: set[str] = set()
        ended: dict[str, str] = {}
        deadline = time.monotonic() + 120
        while len(ended) < len(ids) and time.monotonic() < deadline:
            for lid in ids:
                if lid in ended:
                    continue
                lease = c.lease(lid, "get")["lease"]
                if lease["state"] == "reserved" and lid not in committed:
                    assert c.lease(lid, "commit", {"job": {"command": ["true"]}})["ok"]
                    committed.add(lid)
                elif lease["state"] in ("released", "cancelled", "rejected", "voided"):
                    ended[lid] = str(lease["end_reason"])
            time.sleep(0.05)
    assert sorted(set(ended.values())) == ["succeeded"] and len(ended) == len(ids), ended
    app = PoolApp(env=app_env(plane))
    try:
        report = check_workflows(app)
    finally:
        app.close()
    assert report.arrays == 1 and report.over_throttle == [], report
    assert list(report.peak.values()) == [5], report.peak
