"""`pool agent run --checkpoint-retention` and `$POOL_CHECKPOINT_RETENTION_SECONDS`: how long
an untouched checkpoint folder of a lease not running on the node is kept."""

from __future__ import annotations

import pytest

from agents.checkpoints import DEFAULT_RETENTION_SECONDS
from cli.main import build_parser


def _retention(*flags: str) -> float:
    args = build_parser().parse_args(["agent", "run", "--node-id", "n1", *flags])
    return float(args.checkpoint_retention)


def test_the_flag_wins_over_the_environment_and_the_default_is_a_week(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POOL_CHECKPOINT_RETENTION_SECONDS", raising=False)
    assert _retention() == DEFAULT_RETENTION_SECONDS == 7 * 86_400
    monkeypatch.setenv("POOL_CHECKPOINT_RETENTION_SECONDS", "3600")
    assert _retention() == 3600.0
    assert _retention("--checkpoint-retention", "60") == 60.0


@pytest.mark.parametrize("bad", ["0", "-5", "a week", "inf", "nan"])
def test_a_bad_value_is_refused_from_the_flag_and_from_the_environment(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], bad: str) -> None:
    with pytest.raises(SystemExit):
        _retention("--checkpoint-retention", bad)
    assert "--checkpoint-retention" in capsys.readouterr().err
    monkeypatch.setenv("POOL_CHECKPOINT_RETENTION_SECONDS", bad)  # never silently the default
    with pytest.raises(SystemExit):
        _retention()
    assert "--checkpoint-retention" in capsys.readouterr().err
