"""A reused idempotency key or transfer id is a retry only when it repeats its request exactly."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from uuid import UUID

import pytest

from bus.local.server import NatsServer
from client.api import PoolClient
from schemas import v1
from schemas.codec import decode_command
from tests.control_plane import lease_body, setup_pool
from workers.application import PoolApp
from workers.bootstrap import app_env
from workers.errors import IdempotencyConflict
from workers.plane import ControlPlane


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[tuple[PoolClient, PoolClient]]:
    cp = ControlPlane(fresh_nats.url, roles=["commands"], data_plane=False).start()
    admin, alpha = PoolClient(fresh_nats.url), PoolClient(fresh_nats.url, "alpha")
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0})
    yield admin, alpha
    admin.close()
    alpha.close()
    cp.stop()


def _events(cp_url: str, lease_id: str) -> int:
    app = PoolApp(env=app_env(cp_url))
    try:
        return len(list(app.events.get(UUID(lease_id))))
    finally:
        app.close()


@pytest.mark.parametrize("change", [
    {"priority_class": "high"},
    {"maximum_runtime_seconds": 7200},
    {"image": "docker.io/library/alpine:3.20"},
    {"checkpointable": True},
])
def test_a_reused_idempotency_key_with_another_body_is_a_conflict(
    plane: tuple[PoolClient, PoolClient], fresh_nats: NatsServer, change: dict[str, Any],
) -> None:
    _, alpha = plane
    first = alpha.request_lease(lease_body("k1"))
    assert first["ok"], first
    lease_id = first["lease"]["lease_id"]
    before = _events(fresh_nats.url, lease_id)
    assert before >= 1
    again = alpha.request_lease({**lease_body("k1"), **change})
    assert not again["ok"] and again["error"]["code"] == "idempotency_conflict", again
    assert _events(fresh_nats.url, lease_id) == before  # nothing appended
    # the same body, however spelled, is still a retry answered with the same lease
    retry = alpha.request_lease({**lease_body("k1"), "command": [], "env": {}})
    assert retry["ok"] and retry["lease"]["lease_id"] == lease_id


def test_a_create_that_loses_the_race_to_another_body_is_a_conflict(
    plane: tuple[PoolClient, PoolClient], fresh_nats: NatsServer,
) -> None:
    _, alpha = plane
    assert alpha.request_lease(lease_body("k2"))["ok"]
    req = decode_command("lease.request", json.dumps(lease_body("k2", priority="high")))
    assert isinstance(req, v1.LeaseRequest)
    # a second service that has not seen the first lease: its save is refused by the log (the
    # subject is taken), which is the path a concurrent request of the same key takes
    app = PoolApp(env=app_env(fresh_nats.url))
    try:
        with pytest.raises(IdempotencyConflict):
            app.request_lease("alpha", req)
        same = decode_command("lease.request", json.dumps(lease_body("k2")))
        assert isinstance(same, v1.LeaseRequest)
        assert app.request_lease("alpha", same).idempotency_key == "k2"
    finally:
        app.close()


def test_a_credit_grant_reusing_a_transfer_id_with_another_amount_is_a_conflict(
    plane: tuple[PoolClient, PoolClient],
) -> None:
    admin, _ = plane
    grant = {"tenant": "alpha", "amount_microcredits": 500, "transfer_id": "t-1"}
    first = admin.admin("credits.grant", grant)
    assert first["ok"], first
    assert admin.admin("credits.grant", grant)["result"] == first["result"]  # a retry
    bigger = admin.admin("credits.grant", {**grant, "amount_microcredits": 5_000_000})
    assert not bigger["ok"] and bigger["error"]["code"] == "transfer_conflict", bigger
    assert admin.admin("credits.grant", grant)["result"] == first["result"]  # nothing moved


def test_a_credit_grant_reusing_a_transfer_id_for_another_tenant_is_a_conflict(
    plane: tuple[PoolClient, PoolClient],
) -> None:
    admin, _ = plane
    grant = {"tenant": "alpha", "amount_microcredits": 500, "transfer_id": "t-2"}
    assert admin.admin("credits.grant", grant)["ok"]
    before = admin.admin("credits.grant", {"tenant": "beta", "amount_microcredits": 1,
                                           "transfer_id": "probe-beta"})["result"]
    other = admin.admin("credits.grant", {**grant, "tenant": "beta"})
    assert not other["ok"] and other["error"]["code"] == "transfer_conflict", other
    assert "tenant" in other["error"]["reasons"]
    after = admin.admin("credits.grant", {"tenant": "beta", "amount_microcredits": 1,
                                          "transfer_id": "probe-beta"})["result"]
    assert after == before  # beta got nothing
