"""The fault suite's private PostgreSQL starts for a root user whose checkout (and so
pgserver's binaries) sits under a folder only root may enter, as a clone under /root does."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import psycopg
import pytest

from projections.postgres import pgproc


@pytest.mark.skipif(os.geteuid() != 0, reason="drops root only when run as root")
def test_a_private_postgres_starts_from_binaries_under_a_closed_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    closed = tmp_path / "home"
    closed.mkdir(mode=0o700)
    # the wheel's layout, as a virtual environment in the closed folder holds it
    site = closed / "venv" / "site-packages"
    real = pgproc.postgres_bin().parent
    install = site / real.parent.name / real.name
    shutil.copytree(real, install, symlinks=True)
    libs = real.parent.parent / f"{real.parent.name}.libs"
    if libs.is_dir():
        shutil.copytree(libs, site / libs.name, symlinks=True)
    closed.chmod(0o700)
    monkeypatch.setattr(pgproc, "postgres_bin", lambda: install / "bin")
    assert not pgproc._traversable(install / "bin")
    pg = pgproc.PrivatePostgres().start()
    try:
        with psycopg.connect(pg.url, connect_timeout=5) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        ran = pgproc.reachable_bin(install / "bin")
        assert ran != install / "bin" and pgproc._traversable(ran)
    finally:
        pg.destroy()
    assert closed.stat().st_mode & 0o777 == 0o700  # nothing opened up on the user's side
