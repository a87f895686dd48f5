"""The embedded PostgreSQL's password: made once (mode 0600 beside the data directory), given
to initdb for a new data directory and required (scram-sha-256) for every connection. A data
directory an earlier version left on trust auth is migrated at its start.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
from psycopg import sql

from projections.errors import DatabaseUnavailable

USER = "postgres"  # pgserver's superuser, the one role the plane speaks as
# the user pgserver 0.1 runs PostgreSQL as when started by root; a data directory made here
# for another would not start (test_embedded_postgres_auth.py says so at once)
PGSERVER_USER = "pgserver"
_NO_PASSFILE = "/nonexistent/.pgpass"  # libpq warns about /dev/null ("not a plain file")

# every connection, on the socket and on loopback TCP, needs the password
HBA = """\
# Written by computepool (projections/postgres/embedded_auth.py): every connection, local socket
# or TCP, proves the password kept in the file beside this data directory (mode 0600).
# TYPE  DATABASE     USER  ADDRESS       METHOD
local   all          all                 scram-sha-256
host    all          all   127.0.0.1/32  scram-sha-256
host    all          all   ::1/128       scram-sha-256
local   replication  all                 scram-sha-256
host    replication  all   127.0.0.1/32  scram-sha-256
host    replication  all   ::1/128       scram-sha-256
"""


def password_file_of(data_dir: Path) -> Path:
    """Where a data directory's password is kept: beside it (`pg` → `pg.password`), outside
    the folder PostgreSQL owns, so the plane's user reads it and the server's user cannot."""
    return data_dir.parent / f"{data_dir.name}.password"


def with_password(url: str, password: str) -> str:
    """`url` (pgserver's `postgresql://postgres:@/db?host=…`) carrying `password`."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{quote(parts.username or USER, safe='')}:{quote(password, safe='')}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def load_or_create_password(path: Path) -> str:
    """The password kept in `path`, made (32 random bytes, URL-safe) on the first call."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # made by another start meanwhile: read it
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
    os.chmod(path, 0o600)  # one an operator copied in with wider rights is narrowed
    password = path.read_text().strip()
    if not password:
        raise DatabaseUnavailable(f"{path} is empty: restore the embedded PostgreSQL's password")
    return password


def accepts(url: str, timeout: float = 2.0) -> bool:
    """Whether PostgreSQL at `url` lets this connection in (no ~/.pgpass consulted: a wildcard
    line there must not make a refusing server look open)."""
    try:
        with psycopg.connect(url, connect_timeout=max(1, int(timeout)), passfile=_NO_PASSFILE):
            return True
    except psycopg.Error:
        return False


def init_with_password(data_dir: Path, password_file: Path) -> None:
    """Make a new data directory as pgserver would, but on scram-sha-256 from initdb on, so
    the server never runs on trust auth; pgserver then finds PG_VERSION and only starts it.
    A directory that has one already is left alone (`secure` migrates it)."""
    if (data_dir / "PG_VERSION").exists():
        return
    password = load_or_create_password(password_file)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs: XDG_RUNTIME_DIR unset; harmless
        import pgserver
        from pgserver.utils import (
            ensure_folder_permissions,
            ensure_prefix_permissions,
            ensure_user_exists,
        )
    data_dir.mkdir(parents=True, exist_ok=True)
    owner = None
    if os.geteuid() == 0:
        # what pgserver does before its own initdb when started by root (postgres_server.py)
        owner = ensure_user_exists(PGSERVER_USER)
        assert owner is not None  # made by useradd when missing
        bindir = Path(pgserver.__file__).parent / "pginstall" / "bin"  # its POSTGRES_BIN_PATH
        ensure_prefix_permissions(data_dir)
        ensure_prefix_permissions(bindir)
        readable, searchable = stat.S_IRGRP | stat.S_IROTH, stat.S_IXGRP | stat.S_IXOTH
        ensure_folder_permissions(bindir, readable | searchable)
        ensure_folder_permissions(bindir.parent / "lib", readable)
        os.chown(data_dir, owner.pw_uid, owner.pw_gid)
    with tempfile.TemporaryDirectory(prefix="pool-pg-init-") as tmp:
        pwfile = Path(tmp) / "password"
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
        if owner is not None:  # initdb runs as that user and reads the file
            os.chown(tmp, owner.pw_uid, owner.pw_gid)
            os.chown(pwfile, owner.pw_uid, owner.pw_gid)
        try:
            pgserver.initdb(  # type: ignore[attr-defined]
                ["--auth=scram-sha-256", f"--pwfile={pwfile}", "--encoding=utf8", "-U", USER],
                pgdata=data_dir, user=PGSERVER_USER if owner is not None else None)
        except subprocess.CalledProcessError as e:
            raise DatabaseUnavailable(f"initdb of {data_dir} failed: {e}") from e


def secure(url: str, data_dir: Path, password_file: Path) -> str:
    """Require the password for every connection to the server at `url` (pgserver's
    password-less URL) whose data is `data_dir`; the URL carrying the password.

    A server that already asks for it (one `init_with_password` made) is left alone. One
    still on trust auth (made by an earlier version, or by pgserver itself) gets the password
    set, then the new pg_hba.conf, then a reload; the start fails unless, after that, a
    connection without the password is refused and one with it accepted."""
    password = load_or_create_password(password_file)
    secured = with_password(url, password)
    if not accepts(url):
        if accepts(secured):
            return secured
        raise DatabaseUnavailable(
            f"the embedded PostgreSQL in {data_dir} refuses the password in {password_file}: "
            "restore that file from a backup (the server keeps only its verifier)")
    with psycopg.connect(url, autocommit=True, passfile=_NO_PASSFILE) as conn:
        # the verifier is computed here: the clear password never reaches the server or its log
        verifier = conn.pgconn.encrypt_password(password.encode(), USER.encode(),
                                                b"scram-sha-256")
        conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(
            sql.Identifier(USER), sql.Literal(verifier.decode())))
        row = conn.execute("SHOW hba_file").fetchone()
        hba = Path(str(row[0])) if row else data_dir / "pg_hba.conf"
        _write_like(hba, HBA)
        conn.execute("SELECT pg_reload_conf()")
    deadline = time.monotonic() + 10.0
    while accepts(url, timeout=1.0):  # the postmaster rereads pg_hba.conf on its signal
        if time.monotonic() > deadline:
            raise DatabaseUnavailable(f"the embedded PostgreSQL in {data_dir} still lets a "
                                      f"connection in without a password after reloading {hba}")
        time.sleep(0.05)
    if not accepts(secured):
        raise DatabaseUnavailable(f"the embedded PostgreSQL in {data_dir} refuses its own "
                                  "password after the switch to scram-sha-256")
    return secured


def _write_like(path: Path, text: str) -> None:
    """Replace `path` atomically, keeping its owner (the server's user when we are root) and
    giving it mode 0600."""
    st = path.stat()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    if os.geteuid() == 0:
        os.chown(tmp, st.st_uid, st.st_gid)
    os.replace(tmp, path)
