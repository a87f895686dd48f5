"""Work that finishes by itself: retries, dependencies and array throttles, through the real
`pool` binary, a real control plane and a real agent running jobs in the bubblewrap sandbox."""

from __future__ import annotations

import json
import time
from typing import Any

from client.api import PoolClient
from tests.integration.test_cli_run import _lease_args, _pool, plane

__all__ = ["plane"]  # the fixture, shared with the `lease run` tests


def _ended(out: str) -> dict[str, object]:
    lease: dict[str, object] = json.loads(out.splitlines()[-1])["lease"]
    return lease


def test_a_job_failing_twice_then_succeeding_ends_succeeded_on_attempt_3(plane: str) -> None:
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


def test_a_job_failing_every_time_ends_failed_after_max_attempts(plane: str) -> None:
    out = _pool(plane, "lease", "run", *_lease_args(plane), "--retries", "2", "--json", "--",
                "sh", "-c", "exit 4")
    assert out.returncode == 4, out.stderr
    lease = _ended(out.stdout)
    assert (lease["end_reason"], lease["exit_code"], lease["attempts"]) == ("failed", 4, 2)


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
              "sh", "-c", "sleep 1").stdout.strip()
    c_req = _pool(plane, "lease", "request", *_lease_args(plane), "--after", f"{a}:notok",
                  "--json")
    assert c_req.returncode == 0, c_req.stderr
    c_id = json.loads(c_req.stdout)["lease"]["lease_id"]
    assert json.loads(c_req.stdout)["lease"]["state"] == "held"
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
