"""What a lease command reads from the log: not the pool's settings it has seen."""

from __future__ import annotations

from typing import Any
from uuid import UUID

import pytest

from client.api import PoolClient
from domain.pool import Pool
from tests.control_plane import Plane, lease_body, node_body, setup_pool

JOB = {"job": {"image": "local/job@sha256:" + "a" * 64, "command": ["true"]}}


def test_commit_and_release_read_the_pools_settings_once_not_per_command(
    plane: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    cp, admin, _clock = plane
    setup_pool(admin)
    assert admin.admin("pool.prices", {"pool_id": "p1", "cpu_core_second": 1})["ok"]
    admin.admin("node.register", node_body("n1", cpu_millis=64_000, memory_mib=65_536))
    read: list[UUID] = []
    select = cp.app.recorder.select_events

    def counting(originator_id: UUID, *args: Any, **kwargs: Any) -> Any:
        read.append(originator_id)
        return select(originator_id, *args, **kwargs)

    monkeypatch.setattr(cp.app.recorder, "select_events", counting)
    with PoolClient(cp.nats_url, "alpha") as a:
        got = a.request_lease({**lease_body("k", max_runtime=3600), "count": 4})
        ids = list(got["result"]["lease_ids"])
        cp.scheduler.cycle()
        for lid in ids:
            assert a.lease(lid, "commit", JOB)["ok"]
            assert a.lease(lid, "release", {"exit_code": 0})["ok"], lid
    # eight commands that read the pool's image policy or prices: one read of the pool
    assert read.count(Pool.create_id("p1")) <= 1, read.count(Pool.create_id("p1"))
