"""Every command's --json is the same envelope: `{"ok": …, "result": …}` or `{"ok": false,
"error": {"code", "message", "reasons"}}` — the benchmarks, the fault suite and usage errors too,
checked on the real `pool` binary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _pool(tmp_path: Path, *argv: str, timeout: float = 300) -> tuple[int, dict[str, Any], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
    env["POOL_HOME"] = str(tmp_path / "home")
    out = subprocess.run([sys.executable, "-m", "cli.main", *argv], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout, check=False)
    lines = out.stdout.splitlines()
    assert len(lines) == 1, out.stdout[-2000:] + out.stderr[-2000:]
    return out.returncode, json.loads(lines[0]), out.stderr


def _is_envelope(doc: dict[str, Any]) -> None:
    assert isinstance(doc["ok"], bool)
    assert set(doc) <= {"ok", "result", "lease", "error"}
    if not doc["ok"]:
        assert set(doc["error"]) == {"code", "message", "reasons"}


def test_a_benchmark_s_figures_come_in_the_envelope(tmp_path: Path) -> None:
    # a simulated day: the envelope is the point, not the figures (a week took six times longer)
    code, doc, _ = _pool(tmp_path, "bench", "policy", "--quick", "--days", "1", "--json")
    assert code == 0
    _is_envelope(doc)
    assert doc["ok"] and doc["result"]["policies"] and "table" not in doc["result"]


def test_the_fault_suite_s_results_come_in_the_envelope(tmp_path: Path) -> None:
    code, doc, _ = _pool(tmp_path, "chaos", "--quick", "--only", "8", "--json")
    _is_envelope(doc)
    assert code == (0 if doc["ok"] else 1)
    result = doc["result"]
    assert [r["scenario"] for r in result["results"]] == [8]
    assert result["summary"].startswith("faults: ")


def test_a_usage_error_with_json_is_an_envelope_too(tmp_path: Path) -> None:
    code, doc, err = _pool(tmp_path, "chaos", "--only", "x", "--json")
    assert code == 2
    _is_envelope(doc)
    assert doc["error"]["code"] == "usage" and "--only" in doc["error"]["message"]
    assert "--only" in err
    code, doc, _ = _pool(tmp_path, "telemetry", "follow", "--since", "yesterday", "--json")
    assert code == 2 and doc["error"]["code"] == "usage"
