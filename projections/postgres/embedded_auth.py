"""The embedded PostgreSQL's password: made once (mode 0600 beside the data directory), set on
the `postgres` role as a SCRAM verifier, and pg_hba.conf switched to scram-sha-256 for every
connection. A data directory an earlier version left on trust auth is migrated at its start.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
from psycopg import sql

from projections.errors import DatabaseUnavailable

USER = "postgres"  # pgserver's superuser, the one role the plane speaks as
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


def secure(url: str, data_dir: Path, password_file: Path) -> str:
    """Require the password for every connection to the server at `url` (pgserver's
    password-less URL) whose data is `data_dir`; the URL carrying the password.

    A server that already asks for it is left alone. One still on trust auth (a new data
    directory: pgserver's initdb makes it so; or one an earlier version made) gets the password
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
