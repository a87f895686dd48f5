"""The `pool` CLI against a live control plane: tables for people, envelopes with --json."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bus.local.server import NatsServer
from cli.main import main
from tests.control_plane import node_body
from workers.plane import ControlPlane


@pytest.fixture()
def served(fresh_nats: NatsServer) -> Iterator[str]:
    cp = ControlPlane(fresh_nats.url).start()  # real clock, scheduler thread running
    yield fresh_nats.url
    cp.stop()


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_an_operator_sets_up_a_pool_and_a_tenant_leases_from_it(
    served: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    u = ["--nats-url", served]
    assert _run(capsys, "admin", "pool", "create", "gpu-global", *u,
                "--priority-classes", "standard=10,high=20")[0] == 0
    rc, out, _ = _run(capsys, "admin", "pool", "show", "gpu-global", *u, "--json")
    shown = json.loads(out)["result"]
    assert rc == 0 and shown["config"]["commit_timeout_seconds"] == 30
    assert shown["config"]["priority_classes"] == {"standard": 10, "high": 20}
    assert _run(capsys, "admin", "tenant", "set", "acme", "--pool", "gpu-global", "--weight", "2", *u)[0] == 0
    assert _run(capsys, "credits", "grant", "acme", "1000000000", *u)[0] == 0
    f = tmp_path / "node.json"
    f.write_text(json.dumps(node_body("g1", "gpu-global", cpu_millis=16000, memory_mib=65536,
                                      gpu_count=2, gpu_model="l4", gpu_memory_gib=24)))
    assert _run(capsys, "admin", "node", "register", "--file", str(f), *u)[0] == 0

    rc, out, _ = _run(capsys, "lease", "request", "--tenant", "acme", "--pool", "gpu-global",
                      "--cpu-millis", "8000", "--memory-mib", "32768", "--gpu-count", "1",
                      "--gpu-memory-gib-min", "24", "--max-runtime", "3600", "--key", "k1",
                      "--json", *u)
    lease = json.loads(out)["lease"]
    assert rc == 0 and lease["state"] in ("queued", "reserved")
    for _ in range(100):
        rc, out, _ = _run(capsys, "lease", "get", lease["lease_id"], "--tenant", "acme", "--json", *u)
        if json.loads(out)["lease"]["state"] == "reserved":
            break
        time.sleep(0.05)
    assert json.loads(out)["lease"]["node_id"] == "g1"
    rc, out, _ = _run(capsys, "lease", "commit", lease["lease_id"], "--tenant", "acme", *u)
    assert rc == 0 and "running" in out
    rc, out, _ = _run(capsys, "lease", "release", lease["lease_id"], "--tenant", "acme", *u)
    assert rc == 0 and "released" in out


def test_a_refusal_is_one_line_on_stderr_with_exit_code_1(
    served: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = _run(capsys, "lease", "request", "--tenant", "acme", "--pool", "nowhere",
                        "--cpu-millis", "1000", "--memory-mib", "512", "--max-runtime", "60",
                        "--nats-url", served)
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and "[unknown_pool]" in err


def test_no_tenant_is_a_usage_error(served: str, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POOL_TENANT", raising=False)
    rc, _, err = _run(capsys, "lease", "get", "x", "--nats-url", served)
    assert rc == 2 and "--tenant" in err


def _pool_config(capsys: pytest.CaptureFixture[str], pool: str, u: list[str]) -> dict[str, Any]:
    rc, out, err = _run(capsys, "admin", "pool", "show", pool, "--json", *u)
    assert rc == 0, err
    config: dict[str, Any] = json.loads(out)["result"]["config"]
    return config


def test_pool_set_changes_only_the_settings_it_names(
    served: str, capsys: pytest.CaptureFixture[str]
) -> None:
    u = ["--nats-url", served]
    assert _run(capsys, "admin", "pool", "create", "gpu-global", *u, "--priority-classes",
                "high=20,standard=10", "--preemption", "--grace", "45")[0] == 0
    assert _run(capsys, "admin", "pool", "set", "gpu-global", "--commit-timeout", "120", *u)[0] == 0
    cfg = _pool_config(capsys, "gpu-global", u)
    assert cfg["commit_timeout_seconds"] == 120
    assert cfg["priority_classes"] == {"high": 20, "standard": 10}
    assert cfg["preemption"] == {"enabled": True, "min_runtime_seconds": 0, "grace_seconds": 45}
    assert _run(capsys, "admin", "pool", "set", "gpu-global", "--no-preemption", *u)[0] == 0
    cfg = _pool_config(capsys, "gpu-global", u)
    assert cfg["preemption"] == {"enabled": False, "min_runtime_seconds": 0, "grace_seconds": 45}
    assert cfg["commit_timeout_seconds"] == 120 and cfg["priority_classes"]["high"] == 20


def test_creating_a_pool_that_exists_is_refused_and_changes_nothing(
    served: str, capsys: pytest.CaptureFixture[str]
) -> None:
    u = ["--nats-url", served]
    assert _run(capsys, "admin", "pool", "create", "p1", "--commit-timeout", "60", *u)[0] == 0
    rc, out, err = _run(capsys, "admin", "pool", "create", "p1", *u)
    assert rc == 1 and out == "" and "[pool_exists]" in err and err.count("\n") == 1, err
    assert _pool_config(capsys, "p1", u)["commit_timeout_seconds"] == 60


def test_releasing_a_reservation_gives_its_capacity_back(
    served: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    u = ["--nats-url", served]
    assert _run(capsys, "admin", "pool", "create", "p1", *u)[0] == 0
    f = tmp_path / "node.json"
    f.write_text(json.dumps(node_body("n1", "p1", cpu_millis=4000, memory_mib=4096)))
    assert _run(capsys, "admin", "node", "register", "--file", str(f), *u)[0] == 0
    whole_node = ["--tenant", "acme", "--pool", "p1", "--cpu-millis", "4000", "--memory-mib",
                  "4096", "--max-runtime", "600", "--json", *u]

    def reserved(key: str) -> str:
        rc, out, err = _run(capsys, "lease", "request", "--key", key, *whole_node)
        assert rc == 0, err
        lid = str(json.loads(out)["lease"]["lease_id"])
        for _ in range(200):
            rc, out, _ = _run(capsys, "lease", "get", lid, "--tenant", "acme", "--json", *u)
            if json.loads(out)["lease"]["state"] == "reserved":
                return lid
            time.sleep(0.05)
        raise AssertionError(f"{key} was never reserved")

    first = reserved("first")
    rc, out, err = _run(capsys, "lease", "release", first, "--tenant", "acme", "--json", *u)
    assert rc == 0, err
    lease = json.loads(out)["lease"]
    assert lease["state"] == "released" and lease["end_reason"] == "reservation_released"
    reserved("second")  # the whole node again: the first reservation's capacity came back


@pytest.mark.parametrize(("term", "granted"), [((), 600), (("--lease-term", "120"), 120)])
def test_a_commit_grants_the_whole_maximum_runtime_unless_the_pool_sets_a_term(
    served: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], term: tuple[str, ...],
    granted: int,
) -> None:
    u = ["--nats-url", served]
    assert _run(capsys, "admin", "pool", "create", "p1", *term, *u)[0] == 0
    f = tmp_path / "node.json"
    f.write_text(json.dumps(node_body("n1", "p1", cpu_millis=4000, memory_mib=4096)))
    assert _run(capsys, "admin", "node", "register", "--file", str(f), *u)[0] == 0
    rc, out, err = _run(capsys, "lease", "request", "--tenant", "acme", "--pool", "p1",
                        "--cpu-millis", "1000", "--memory-mib", "512", "--max-runtime", "600",
                        "--json", *u)
    assert rc == 0, err
    lid = json.loads(out)["lease"]["lease_id"]
    for _ in range(200):
        rc, out, _ = _run(capsys, "lease", "get", lid, "--tenant", "acme", "--json", *u)
        if json.loads(out)["lease"]["state"] == "reserved":
            break
        time.sleep(0.05)
    rc, out, err = _run(capsys, "lease", "commit", lid, "--tenant", "acme", "--json", *u)
    assert rc == 0, err
    lease = json.loads(out)["lease"]
    assert lease["deadline"] - lease["started_at"] == pytest.approx(granted)


def test_granting_credits_to_an_unknown_tenant_is_refused(
    served: str, capsys: pytest.CaptureFixture[str]
) -> None:
    u = ["--nats-url", served]
    rc, out, err = _run(capsys, "credits", "grant", "ghost", "1000", *u)
    assert rc == 1 and out == "" and "[unknown_tenant]" in err, err
    assert _run(capsys, "admin", "pool", "create", "p1", *u)[0] == 0
    assert _run(capsys, "admin", "tenant", "set", "ghost", "--pool", "p1", *u)[0] == 0
    rc, out, err = _run(capsys, "credits", "grant", "ghost", "1000", "--json", *u)
    assert rc == 0 and json.loads(out)["result"]["available_microcredits"] == 1000, err


def test_an_operator_publishes_a_price_list_from_the_cli(
    served: str, capsys: pytest.CaptureFixture[str]
) -> None:
    u = ["--nats-url", served]
    assert _run(capsys, "admin", "pool", "create", "p1", *u)[0] == 0
    rc, out, err = _run(capsys, "admin", "pool", "prices", "p1", "--cpu-core-second", "10",
                        "--memory-gib-second", "2", "--gpu-second", "a100=400",
                        "--gpu-second", "*=100", "--json", *u)
    assert rc == 0, err
    prices = json.loads(out)["result"]["price_list"]
    assert prices["cpu_core_second"] == 10 and prices["memory_gib_second"] == 2
    assert prices["gpu_second"] == {"*": 100, "a100": 400}
    rc, _, err = _run(capsys, "admin", "pool", "prices", "p1", "--gpu-second", "a100", *u)
    assert rc == 2 and "--gpu-second" in err


def test_a_refused_field_is_named_by_its_flag_with_its_unit(
    served: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["lease", "request", "--tenant", "acme", "--cpu-millis", "500", "--memory-mib", "512",
            "--nats-url", served]
    rc, _, err = _run(capsys, *base, "--pool", "P Q", "--max-runtime", "60")
    assert rc == 1 and "[invalid_field]: --pool must be lowercase letters" in err, err
    rc, _, err = _run(capsys, *base, "--pool", "p1", "--max-runtime", "999999999")
    assert rc == 1 and "--max-runtime must be a whole number ≤ 2592000 (seconds)" in err, err
    assert "$." not in err and "regex" not in err
