"""The embedded PostgreSQL (pgserver) and the check for an existing one.

Used by `pool up` and the test fixtures when no database URL is given or reachable.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from projections.errors import DatabaseUnavailable


def reachable_database_url(url: str, timeout: float = 2.0) -> str | None:
    """`url` when a PostgreSQL answers there, else None."""
    try:
        with psycopg.connect(url, connect_timeout=max(1, int(timeout))) as conn:
            conn.execute("select 1")
        return url
    except psycopg.Error:
        return None


@dataclass
class EmbeddedPostgres:
    """A pgserver-managed PostgreSQL whose data lives under one directory."""

    data_dir: Path
    handle: Any
    url: str  # with the password (projections/postgres/embedded_auth.py)

    def stop(self) -> None:
        with contextlib.suppress(Exception):  # best effort at shutdown
            self.handle.cleanup()


def start_embedded_postgres(data_dir: Path) -> EmbeddedPostgres:
    """Start (or find) the server whose data is `data_dir`; every connection to it needs the
    password kept beside it (`<data_dir>.password`, mode 0600), made at the first start."""
    from projections.postgres.embedded_auth import init_with_password, password_file_of, secure

    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        init_with_password(data_dir, password_file_of(data_dir))
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset (CI, root shells); harmless here
            warnings.simplefilter("ignore")
            import pgserver

            handle = pgserver.get_server(  # type: ignore[attr-defined]
                str(data_dir), cleanup_mode="stop")
    except Exception as e:  # pgserver raises plain exceptions
        raise DatabaseUnavailable(f"embedded PostgreSQL failed to start: {e}") from e
    try:
        url = secure(str(handle.get_uri()), data_dir, password_file_of(data_dir))
    except BaseException:
        with contextlib.suppress(Exception):
            handle.cleanup()
        raise
    return EmbeddedPostgres(data_dir=data_dir, handle=handle, url=url)
