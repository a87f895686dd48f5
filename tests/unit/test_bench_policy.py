"""`pool bench policy` replays one workload through every policy and reports each in full."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cli.main import main


def test_pool_bench_policy_reports_every_policy_on_the_same_workload(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "policy", "--quick", "--days", "2", "--json"]) == 0
    envelope = json.loads(capsys.readouterr().out)
    assert envelope["ok"] is True
    result = envelope["result"]
    policies = {p["policy"]: p for p in result["policies"]}
    assert set(policies) == {"fifo", "drf", "drf+decay", "drf+backfill", "drf+decay+backfill"}
    for p in policies.values():
        assert p["requests"] == result["requests"] > 0
        assert 0 < p["utilisation"]["gpu"] <= 1 and 0 < p["utilisation"]["cpu"] <= 1
        assert set(p["by_width"]) == {"1-gpu", "8-gpu", "wide-cpu"}
        assert len(p["by_tenant"]) == 12
        assert 0 < p["jain_share_over_weight"] <= 1
    assert policies["fifo"]["reservations_made"] == 0
    assert set(result["checks"]) == {"backfill_raises_utilisation",
                                     "backfill_cuts_the_longest_wide_wait"}
    assert "decayed" in result["policy_descriptions"]["drf+decay"]


@pytest.mark.parametrize("flag,value", [("--days", "0"), ("--days", "1e9"), ("--load", "nan"),
                                        ("--cycle-seconds", "-1")])
def test_pool_bench_policy_names_a_bad_flag(
        flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "policy", flag, value]) != 0
    assert flag in capsys.readouterr().err


def test_pool_bench_policy_wants_from_log_for_a_pool() -> None:
    done = subprocess.run([sys.executable, "-m", "cli.main", "bench", "policy", "--pool", "p"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0 and "--from-log" in done.stderr
