"""`pool demo` end to end at a small size: embedded NATS and PostgreSQL, the control plane and
fleets as their own processes, a real sandboxed agent; every scenario must come out right."""

from __future__ import annotations

from pathlib import Path

import pytest

from local.demo import Demo


@pytest.mark.slow
def test_the_demo_tells_its_whole_story(tmp_path: Path) -> None:
    # one real run (the demo takes most of a minute): with bubblewrap the sandboxed jobs run
    # on local-1; without it they are skipped and the cancellation runs on a simulated node
    from agents.runtimes.process import ProcessRuntime

    sandbox = ProcessRuntime(tmp_path / "probe").available() is None
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
        assert checks["real_sandbox"].detail.startswith("skipped: ")
