"""`pool demo` end to end at a small size: embedded NATS and PostgreSQL, the control plane and
fleets as their own processes, a real sandboxed agent; every scenario must come out right."""

from __future__ import annotations

from pathlib import Path

import pytest

from local.demo import Demo


@pytest.mark.slow
@pytest.mark.parametrize("sandbox", [True, False], ids=["sandbox", "no-sandbox"])
def test_the_demo_tells_its_whole_story(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sandbox: bool
) -> None:
    if not sandbox:
        # a machine without bubblewrap: the sandboxed jobs are skipped, and every other
        # scenario (the cancellation too, on a simulated node) must still come out right
        from agents.runtimes.process import ProcessRuntime

        monkeypatch.setattr(ProcessRuntime, "available",
                            lambda self: "bwrap hidden by the test")
    lines: list[str] = []
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
        assert checks["real_sandbox"].detail.startswith("skipped: bwrap hidden")
