"""`pool demo` end to end at a small size: embedded NATS and PostgreSQL, the control plane and
fleets as their own processes, a real sandboxed agent; every scenario must come out right."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from local.demo import Demo


@pytest.mark.slow
def test_the_demo_tells_its_whole_story(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # one real run (the demo takes most of a minute): with bubblewrap the sandboxed jobs run
    # on local-1; without it they are skipped and the cancellation runs on a simulated node
    from agents.runtimes.process import ProcessRuntime

    sandbox = ProcessRuntime(tmp_path / "probe").available() is None
    lines: list[str] = []
    replayed = _replay_the_demo_s_log_at_its_audit(monkeypatch)
    demo = Demo(tmp_path / "demo", nodes=30, flood=60, live=False, say=lines.append)
    rc = demo.run()
    checks = {name: c for name, c in demo.checks.items()}
    # every outcome is a fact of the log, fair share too (placements judged, not sampled)
    failed = {n: c.detail for n, c in checks.items() if not c.ok}
    assert not failed, failed
    assert checks["audit"].ok and "audit ok" in "\n".join(lines)
    assert rc == 0
    assert any("where to look next" in line for line in lines)
    # the dashboard came up beside it, and said where
    assert any(line.startswith("dashboard: http://127.0.0.1:") for line in lines)
    assert "ready" in (tmp_path / "demo" / "logs" / "gateway.log").read_text()
    if not sandbox:
        assert checks["real_sandbox"].detail.startswith("skipped: ")
    # `pool whatif --policy drf+backfill` over the demo's log: its table, and a real column
    # that is the log's own outcome, lease by lease
    table, found, truth = replayed["table"], replayed["json"], replayed["truth"]
    assert "real" in table and "what if" in table and "not modelled" in table, table
    assert found["policy"] == "drf+backfill" and found["requests"] == len(found["leases"]) > 0
    for row in found["leases"]:
        requested, started = truth[row["lease_id"]]
        assert (row["requested_at"], row["real_start_at"]) == (requested, started), row


def _replay_the_demo_s_log_at_its_audit(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Run `pool whatif --policy drf+backfill` (table, then --json) on the demo's log while
    its audit reads it, and each lease's request and first placement from the events."""
    import contextlib
    import io
    import json

    from cli.main import main
    from projections.replay import event_name, notifications, state_of

    out: dict[str, Any] = {}
    judge = Demo.judge_decisions

    def judge_and_replay(self: Demo, app: Any) -> None:
        judge(self, app)
        for key, extra in (("table", []), ("json", ["--json"])):
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                assert main(["whatif", "--policy", "drf+backfill", "--nats-url", self.url,
                             *extra]) == 0
            out[key] = text.getvalue() if not extra else json.loads(text.getvalue())["result"]
        truth: dict[str, tuple[float, float | None]] = {}
        for n in notifications(app):
            name, lid = event_name(n.topic), str(n.originator_id)
            if name == "LeaseRequested":
                truth[lid] = (float(state_of(n)["requested_at"]), None)
            elif name == "LeaseReserved" and truth[lid][1] is None:
                truth[lid] = (truth[lid][0], float(state_of(n)["at"]))
        out["truth"] = truth

    monkeypatch.setattr(Demo, "judge_decisions", judge_and_replay)
    return out
