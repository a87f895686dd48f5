"""`python -m bench.save_rounds` at a tiny size: every way measured, its flags checked."""

from __future__ import annotations

import pytest

from bench.save_rounds import WAYS, main, run_save_rounds


def test_each_way_is_measured_in_every_repeat() -> None:
    result = run_save_rounds(size=3, rounds=4, repeats=2)
    assert set(result["ways"]) == set(WAYS)
    for way in WAYS:
        got = result["ways"][way]
        assert len(got["cpu_us_per_message"]) == len(got["ms_per_round"]) == 2
        assert all(v > 0 for v in got["ms_per_round"])
    assert result["one_write_cpu_ratio"] > 0 and "cores" in result["machine"]


def test_a_size_below_one_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--size", "0"])
    assert e.value.code == 2 and "--size must be at least 1" in capsys.readouterr().err
