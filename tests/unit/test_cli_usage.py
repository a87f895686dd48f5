"""Usage errors of the `pool` command: two lines, the first says what is wrong and suggests the
nearest word the command knows, the second where the help is; exit code 2."""

from __future__ import annotations

from pathlib import Path
from typing import Self

import pytest

from cli.main import main


def _usage(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    assert rc == 2 and out.out == ""
    lines = out.err.splitlines()
    assert len(lines) == 2, out.err
    return lines


def test_a_misspelt_flag_is_answered_with_the_flag_it_resembles(
    capsys: pytest.CaptureFixture[str],
) -> None:
    first, second = _usage(capsys, "lease", "request", "--pool", "p", "--cpu-milis", "500",
                           "--memory-mib", "512", "--max-runtime", "60")
    assert first.startswith("pool lease request: ")
    assert "did you mean --cpu-millis for --cpu-milis?" in first
    assert second == "see `pool lease request --help`"


def test_a_misspelt_command_is_answered_with_the_command_it_resembles(
    capsys: pytest.CaptureFixture[str],
) -> None:
    first, _ = _usage(capsys, "leas")
    assert "invalid choice: 'leas'" in first and "did you mean 'lease'?" in first


def test_a_missing_flag_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lease", "request", "--pool", "p"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--cpu-millis is required" in err


def test_a_job_file_s_mistake_names_its_place_in_the_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("pool_id: p1\nshape:\n  cpu_millis: -5\n  memory_mib: 512\n"
                   "maximum_runtime_seconds: 60\ncommand: [python3, -c, 'print(1)']\n")
    assert main(["lease", "request", "-f", str(job), "--tenant", "t"]) == 2
    err = capsys.readouterr().err
    assert f"{job}: shape.cpu_millis: Expected `int` >= 0" in err and err.count("\n") == 1
    job.write_text("pool_id: p1\nshape: {cpu_millis: 5, memory_mib: 5, gpus: 1}\n"
                   "maximum_runtime_seconds: 60\n")
    assert main(["lease", "request", "-f", str(job), "--tenant", "t"]) == 2
    assert "shape.gpus: unknown key" in capsys.readouterr().err
    job.write_text("pool_id: [unclosed\n")
    assert main(["lease", "request", "-f", str(job), "--tenant", "t"]) == 2
    assert "not YAML" in capsys.readouterr().err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lease", "--help"]) == 0
    assert "request" in capsys.readouterr().out


class _FakeTenantClient:
    """Answers the leases query with a changing page, then is interrupted (Ctrl-C)."""

    def __init__(self) -> None:
        self.pages = [
            [{"lease_id": "a", "state": "running", "node_id": "n1", "requested_at": 1.0}],
            [{"lease_id": "a", "state": "running", "node_id": "n1", "requested_at": 1.0}],
            [{"lease_id": "a", "state": "released", "node_id": "n1", "end_reason": "succeeded",
              "exit_code": 0, "requested_at": 1.0},
             {"lease_id": "b", "state": "queued", "requested_at": 2.0}],
        ]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def call(self, subject: str, body: dict[str, object]) -> dict[str, object]:
        assert subject == "pool.cmd.acme.query.leases"
        if not self.pages:
            raise KeyboardInterrupt
        return {"ok": True, "result": {"rows": self.pages.pop(0)}}


def test_watch_without_an_id_prints_each_of_the_tenant_s_leases_as_it_changes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import cli.lease

    monkeypatch.setattr(cli.lease, "pool_client", lambda args, tenant: _FakeTenantClient())
    monkeypatch.setattr("time.sleep", lambda s: None)
    assert main(["lease", "watch", "--tenant", "acme"]) == 130
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1:3] for line in lines] == [["a", "running"], ["a", "released"],
                                                     ["b", "queued"]]
    assert "succeeded" in lines[1] and "exit code 0" in lines[1]
