"""Usage errors of the `pool` command: two lines, the first says what is wrong and suggests the
nearest word the command knows, the second where the help is; exit code 2."""

from __future__ import annotations

from pathlib import Path

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
