"""`pool audit decisions` names a placement that passed over a waiting request of a higher
priority class, in a log a scheduler broken on purpose wrote; a sound scheduler's passes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cli.main import main
from client.api import PoolClient
from tests.control_plane import Plane, lease_body, node_body, setup_pool

WHOLE_NODE = 8000


def _story(plane: Plane) -> tuple[str, str]:
    """A node full of beta's lease; alpha asks at standard, then beta at high, both the
    node's whole shape; beta's first lease ends and the scheduler places one of the two."""
    cp, admin, clock = plane
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0})
    assert admin.admin("node.register", node_body("n1", cpu_millis=WHOLE_NODE))["ok"]
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
        first = b.request_lease(lease_body("b0", cpu_millis=WHOLE_NODE))["lease"]["lease_id"]
        assert cp.scheduler.cycle().placed == 1
        low = a.request_lease(lease_body("a1", cpu_millis=WHOLE_NODE))["lease"]["lease_id"]
        clock.advance(1)
        high = b.request_lease(lease_body("b1", cpu_millis=WHOLE_NODE, priority="high"))[
            "lease"]["lease_id"]
        assert cp.scheduler.cycle().placed == 0
        clock.advance(5)
        assert b.lease(first, "cancel", {"reason": "done"})["ok"]
        assert cp.scheduler.cycle().placed == 1
    return low, high


def _audit(plane: Plane, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    rc = main(["audit", "decisions", "--json", "--nats-url", plane[0].nats_url])
    return rc, json.loads(capsys.readouterr().out)


def test_a_sound_scheduler_places_the_higher_class_and_the_audit_passes(
        plane: Plane, capsys: pytest.CaptureFixture[str]) -> None:
    _story(plane)
    rc, found = _audit(plane, capsys)
    assert rc == 0 and found["ok"], found
    assert found["checks"]["priority"].startswith("1 placements made while another class")
    assert "none below zero" in found["checks"]["credits"]


def test_the_audit_names_a_placement_that_passed_over_a_higher_class(
        plane: Plane, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from workers.scheduler import state

    real = state.FairQueue

    def classless(**kw: Any) -> Any:  # a broken scheduler: every class ranks the same
        kw["priority_ranks"] = dict.fromkeys(kw["priority_ranks"], 0)
        return real(**kw)

    monkeypatch.setattr(state, "FairQueue", classless)
    low, high = _story(plane)
    rc, found = _audit(plane, capsys)
    assert rc == 1 and not found["ok"]
    (line,) = found["violations"]["priority"]
    assert line.startswith(f"pool p1: {low} (alpha, class standard, rank 10 aged) placed at")
    assert f"while {high} (beta, class high, rank 20)" in line
    assert found["violations"]["quotas"] == found["violations"]["placements"] == []


def test_a_window_judges_only_its_own_placements(
        plane: Plane, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The passed-over placement is named by a window holding it, and not by the window after
    it, which still folds the log before it and judges the next placement there."""
    import time

    from workers.scheduler import state

    real = state.FairQueue

    def classless(**kw: Any) -> Any:
        kw["priority_ranks"] = dict.fromkeys(kw["priority_ranks"], 0)
        return real(**kw)

    monkeypatch.setattr(state, "FairQueue", classless)
    before = time.time()
    low, _high = _story(plane)
    time.sleep(0.05)
    middle = time.time()
    time.sleep(0.05)
    with PoolClient(plane[0].nats_url, "alpha") as a:
        assert a.lease(low, "cancel", {"reason": "done"})["ok"]
    assert plane[0].scheduler.cycle().placed == 1  # the high one, at last
    url = plane[0].nats_url

    def audit(*window: str) -> tuple[int, dict[str, Any]]:
        rc = main(["audit", "decisions", "--json", "--nats-url", url, *window])
        return rc, json.loads(capsys.readouterr().out)

    rc, found = audit("--from", str(before), "--to", str(middle))
    assert rc == 1 and len(found["violations"]["priority"]) == 1, found
    assert found["window"]["first_seq"] is not None
    rc, found = audit("--from", str(middle))
    assert rc == 0 and found["ok"], found
    assert found["checks"]["placements"].startswith("1 placements"), found
    assert found["window"]["first_seq"] > 1
    assert main(["audit", "decisions", "--nats-url", url, "--from", "1h ago"]) == 1
    assert capsys.readouterr().out.startswith("window ")
