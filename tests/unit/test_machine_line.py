"""The benchmarks' machine line: the disk's fsync time is measured where the stores live."""

from __future__ import annotations

from pathlib import Path

from bench.machine import fsync_ms, machine_line


def test_the_fsync_time_is_measured_in_the_directory_given(tmp_path: Path) -> None:
    took = fsync_ms(str(tmp_path))
    assert took is not None and took > 0
    assert list(tmp_path.iterdir()) == []  # the probe's file is gone


def test_a_directory_where_no_file_can_be_written_gives_no_figure(tmp_path: Path) -> None:
    assert fsync_ms(str(tmp_path / "absent")) is None


def test_the_machine_line_names_the_fsync_time_beside_the_disk(tmp_path: Path) -> None:
    line = machine_line(str(tmp_path))
    assert "cores" in line and " disk (fsync " in line
    assert line.split("(fsync ", 1)[1].split(" ms)", 1)[0].replace(".", "", 1).isdigit()
    assert " disk (fsync ? ms)" in machine_line(str(tmp_path / "absent"))
