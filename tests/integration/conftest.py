"""The `plane` fixture: a plane on a fresh server whose scheduler the test drives by hand
(modules that need another kind of plane define their own)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bus.local.server import NatsServer
from client.api import PoolClient
from tests.control_plane import FakeClock, Plane, start


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[Plane]:
    clock = FakeClock()
    cp = start(fresh_nats.url, clock)
    admin = PoolClient(fresh_nats.url)
    yield cp, admin, clock
    admin.close()
    cp.stop()
