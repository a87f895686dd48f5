"""Fixtures that chain store dir → real nats-server on a free port → connection URL.

No fake NATS and no fake database: servers are real processes, cleaned up after each use.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from bus.local.server import NatsServer

# The processes the suite starts (`pool up`, its workers, agents, the CLI) keep their compiled
# bytecode as an installed Python does: where the machine sets PYTHONDONTWRITEBYTECODE, every
# one of them would compile the project from source again (about 0.3 s a process).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


@pytest.fixture(scope="session", autouse=True)
def no_saved_contexts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A config home of the session's own: a context the developer saved with `pool login`
    must not send the suite's `pool` commands to their gateway (the `pool` processes the tests
    start inherit it)."""
    previous = os.environ.get("XDG_CONFIG_HOME")
    os.environ["XDG_CONFIG_HOME"] = str(tmp_path_factory.mktemp("config"))
    yield
    if previous is None:
        os.environ.pop("XDG_CONFIG_HOME", None)
    else:
        os.environ["XDG_CONFIG_HOME"] = previous


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """One nats-server 2.15 (from the wheel) for the whole session, JetStream on file storage."""
    server = NatsServer(store_dir=tmp_path_factory.mktemp("nats"), server_name="pool-test")
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def fresh_nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server of its own for a test that must start from an empty log or kill it."""
    server = NatsServer(store_dir=tmp_path / "nats", server_name="pool-fresh")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture()
def unique() -> str:
    """A short unique token for stream, subject and schema names within a shared server."""
    return uuid.uuid4().hex[:10]


@pytest.fixture(scope="session")
def database_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real PostgreSQL: $POOL_TEST_DATABASE_URL, else 127.0.0.1:5432/test, else pgserver."""
    from projections.postgres.embedded import reachable_database_url, start_embedded_postgres

    url = os.environ.get("POOL_TEST_DATABASE_URL") or reachable_database_url(
        "postgresql://postgres@127.0.0.1:5432/test"
    )
    if url:
        yield url
        return
    pg = start_embedded_postgres(tmp_path_factory.mktemp("pg"))
    yield pg.url
    pg.stop()


@pytest.fixture()
def schema(database_url: str, unique: str) -> Iterator[str]:
    """A views schema of this test's own, dropped after it (and the `_rebuilt` one beside it)."""
    from projections.views import drop_schema

    name = f"views_{unique}"
    yield name
    for s in (name, f"{name}_rebuilt"):
        drop_schema(database_url, s)
