"""The embedded default: one machine's NATS (from the wheel) and PostgreSQL (pgserver) under $POOL_HOME.

`pool up` and `pool demo` start through here; existing servers named by POOL_NATS_URL /
POOL_DATABASE_URL are used instead when set. Endpoints are written to $POOL_HOME/endpoints.json.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from bus.server import NatsServer, free_port
from projections.embedded import EmbeddedPostgres, reachable_database_url, start_embedded_postgres

DEFAULT_NATS_PORT = 14222


def pool_home() -> Path:
    return Path(os.environ.get("POOL_HOME", "./.pool")).resolve()


@dataclass
class Embedded:
    """The servers of one `pool up`: which were started here and which were found."""

    home: Path
    nats_url: str
    database_url: str
    nats: NatsServer | None = None
    postgres: EmbeddedPostgres | None = None
    notes: list[str] = field(default_factory=list)

    def stop(self) -> None:
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        if self.postgres is not None:
            self.postgres.stop()
            self.postgres = None
        endpoints = self.home / "endpoints.json"
        if endpoints.exists():
            endpoints.unlink()

    def write_endpoints(self) -> Path:
        path = self.home / "endpoints.json"
        path.write_text(
            json.dumps({"nats_url": self.nats_url, "database_url": self.database_url}, indent=2)
            + "\n"
        )
        return path


def start(home: Path | None = None, *, with_postgres: bool = True) -> Embedded:
    """Start (or find) NATS and PostgreSQL for this machine; data stays under `home`."""
    home = home or pool_home()
    home.mkdir(parents=True, exist_ok=True)
    nats_url = os.environ.get("POOL_NATS_URL")
    server: NatsServer | None = None
    notes: list[str] = []
    if nats_url:
        notes.append(f"nats: using {nats_url} (POOL_NATS_URL)")
    else:
        port = int(os.environ.get("POOL_NATS_PORT", DEFAULT_NATS_PORT))
        try:
            server = NatsServer(store_dir=home / "nats", port=port, server_name="pool-embedded")
            server.start()
        except Exception:
            # the preferred port is taken by something that is not ours: take a free one
            server = NatsServer(store_dir=home / "nats", port=free_port(), server_name="pool-embedded")
            server.start()
        nats_url = server.url
        notes.append(f"nats: {nats_url} (embedded nats-server 2.15, JetStream in {home / 'nats'})")
    database_url = os.environ.get("POOL_DATABASE_URL", "")
    pg: EmbeddedPostgres | None = None
    if database_url:
        if reachable_database_url(database_url) is None:
            if server is not None:
                server.stop()
            from projections.embedded import DatabaseUnavailable

            raise DatabaseUnavailable(f"POOL_DATABASE_URL={database_url} does not answer")
        notes.append(f"postgres: using {database_url} (POOL_DATABASE_URL)")
    elif with_postgres:
        try:
            pg = start_embedded_postgres(home / "pg")
        except Exception:
            if server is not None:
                server.stop()
            raise
        database_url = pg.url
        notes.append(f"postgres: {database_url} (embedded pgserver, data in {home / 'pg'})")
    emb = Embedded(home, nats_url, database_url, server, pg, notes)
    emb.write_endpoints()
    return emb


def endpoints(home: Path | None = None) -> tuple[str, str]:
    """NATS and database URLs for a client command: env first, then a running `pool up`."""
    home = home or pool_home()
    nats_url = os.environ.get("POOL_NATS_URL", "")
    db_url = os.environ.get("POOL_DATABASE_URL", "")
    path = home / "endpoints.json"
    if (not nats_url or not db_url) and path.exists():
        data = json.loads(path.read_text())
        nats_url = nats_url or data.get("nats_url", "")
        db_url = db_url or data.get("database_url", "")
    return nats_url, db_url
