"""The embedded PostgreSQL asks every connection for its password: made at the first start,
kept 0600 beside the data, reused at every start, and set on a data directory an earlier
version left on trust auth. Real pgserver binaries and real `pool up` processes."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from projections.postgres.embedded import start_embedded_postgres
from projections.postgres.embedded_auth import HBA, accepts


@pytest.fixture()
def base() -> Iterator[Path]:
    """A folder of this test's own under /tmp that PostgreSQL's user may enter (pytest's
    tmp_path sits under a 0700 folder that every pytest run on the machine narrows again)."""
    path = Path(tempfile.mkdtemp(prefix="pool-pgauth-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _without_password(url: str) -> str:
    return re.sub(r"^(postgresql://[^:/@]+):[^@]*@", r"\1:@", url)


def _hba_methods(data_dir: Path) -> set[str]:
    lines = [ln.split() for ln in (data_dir / "pg_hba.conf").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    return {ln[-1] for ln in lines}


def test_a_new_embedded_postgres_refuses_a_connection_without_its_password(
    base: Path,
) -> None:
    pg = start_embedded_postgres(base / "pg")
    try:
        secret = base / "pg.password"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        password = secret.read_text().strip()
        assert len(password) >= 32 and f":{password}@" in pg.url
        assert accepts(pg.url)
        assert not accepts(_without_password(pg.url))
        assert not accepts(pg.url.replace(password, password[::-1]))
        assert _hba_methods(base / "pg") == {"scram-sha-256"}
    finally:
        pg.stop()
    # the next start keeps the password and the data directory's users
    pg = start_embedded_postgres(base / "pg")
    try:
        assert secret.read_text().strip() == password
        assert accepts(pg.url) and not accepts(_without_password(pg.url))
    finally:
        pg.stop()


def test_a_new_data_directory_is_never_on_trust_auth(
    base: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """initdb itself gets the password: pgserver finds the directory made and runs no initdb
    of its own (which would leave the first start on trust until the switch)."""
    caplog.set_level(logging.INFO, logger="pgserver")
    pg = start_embedded_postgres(base / "pg")
    try:
        assert not accepts(_without_password(pg.url))
        ran = [r.getMessage() for r in caplog.records if "commandline" in r.getMessage()]
        assert ran, "pgserver logged no command: the test cannot see its initdb"
        assert not any("initdb" in line and "trust" in line for line in ran), ran
        assert "PG_VERSION file found, skipping initdb" in caplog.text
    finally:
        pg.stop()


def test_a_trust_data_directory_of_an_earlier_version_is_migrated_with_its_data(
    base: Path,
) -> None:
    import psycopg

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pgserver

    # what earlier versions left: pgserver's own initdb, trust for every connection
    old = pgserver.get_server(str(base / "pg"), cleanup_mode="stop")  # type: ignore[attr-defined]
    with psycopg.connect(old.get_uri(), autocommit=True) as conn:
        conn.execute("CREATE TABLE kept (v text)")
        conn.execute("INSERT INTO kept VALUES ('from before')")
    assert "trust" in _hba_methods(base / "pg")
    old.cleanup()

    pg = start_embedded_postgres(base / "pg")
    try:
        assert not accepts(_without_password(pg.url))
        with psycopg.connect(pg.url) as conn:
            row = conn.execute("SELECT v FROM kept").fetchone()
        assert row == ("from before",)
        assert (base / "pg" / "pg_hba.conf").read_text() == HBA
    finally:
        pg.stop()


# -- through `pool up` --------------------------------------------------------------------


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
    env.update(POOL_HOME=str(home), POOL_NATS_PORT="0", POOL_HTTP="off")
    return env


def _up(home: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "up", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(home))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, proc.stderr.read() if proc.stderr else "no output"
    info = json.loads(line)
    assert "***" in info["database_url"]  # printed without its password
    return proc


def _down(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0


def _pool(home: Path, *args: str) -> Any:
    out = subprocess.run([sys.executable, "-m", "cli.main", *args, "--json"],
                         capture_output=True, text=True, env=_env(home), timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _command_lines_holding(secret: str) -> list[str]:
    """Every process's command line on this machine that shows `secret` (what `ps` shows)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        if secret in text:
            found.append(f"{cmdline.parent.name}: {text}")
    return found


def _leases(home: Path, lease_id: str, seconds: float = 30.0) -> list[Any]:
    """The views' rows for `lease_id`, once the projector has written them."""
    deadline = time.monotonic() + seconds
    while True:
        rows = _pool(home, "leases", "--tenant", "alpha")["result"]["rows"]
        hit = [r for r in rows if r.get("lease_id") == lease_id]
        if hit or time.monotonic() > deadline:
            return hit
        time.sleep(0.5)


@pytest.mark.timeout(300)
def test_pool_up_keeps_its_database_password_and_views_across_a_restart(base: Path) -> None:
    home = base / "home"
    proc = _up(home)
    try:
        password = (home / "pg.password").read_text().strip()
        url = json.loads((home / "endpoints.json").read_text())["database_url"]
        assert f":{password}@" in url and not accepts(_without_password(url))
        assert _command_lines_holding(password) == []
        assert _pool(home, "admin", "pool", "create", "p1")["ok"]
        assert _pool(home, "admin", "tenant", "set", "alpha", "--pool", "p1")["ok"]
        lease = _pool(home, "lease", "request", "--tenant", "alpha", "--pool", "p1",
                      "--cpu-millis", "100", "--memory-mib", "64", "--max-runtime", "60",
                      "--key", "k1")
        lease_id = lease["lease"]["lease_id"]
        assert _leases(home, lease_id), "the projector never wrote the lease"
    finally:
        _down(proc)

    proc = _up(home)
    try:
        assert (home / "pg.password").read_text().strip() == password
        assert _leases(home, lease_id, seconds=5.0)  # the views survived, read with the password
        assert not accepts(_without_password(url))
    finally:
        _down(proc)
