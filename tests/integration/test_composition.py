"""Each role set of the composition root builds what it names, and a plane of it runs."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bus.admin import ensure_all_streams
from bus.local.server import NatsServer
from client.api import PoolClient
from tests.control_plane import lease_body, node_body, setup_pool
from workers.bootstrap import GatewayConfig, PlaneConfig, Role, build, served
from workers.plane import ROLES, ControlPlane
from workers.secrets.settings import SecretSettings
from workers.webhooks.settings import WebhookSettings
from workers.webhooks.signing import plane_key

# every part a composition may hold, and which role sets make it
PARTS = ("app", "log", "scheduler", "checkpoint_store", "handler", "commands", "nodes", "reads",
         "link", "reconciler_link", "dispatcher", "reconciler", "deliverer", "projector",
         "scheduler_signal", "dispatcher_signal", "election", "pool_leadership", "desk",
         "gateway")
LANES = {"app", "handler", "commands", "nodes", "reads"}
PLACING = {"app", "scheduler", "link", "dispatcher", "scheduler_signal", "dispatcher_signal",
           "election", "pool_leadership", "desk"}
TIMERS = {"app", "reconciler_link", "reconciler", "deliverer"}


def _config(url: str, database_url: str, schema: str, tmp_path: Path) -> PlaneConfig:
    return PlaneConfig(url, database_url=database_url, views_schema=schema,
                       checkpoint_every=None, leader_ttl_seconds=1.0,
                       webhooks=WebhookSettings(key=plane_key("composition")),
                       secrets=SecretSettings.with_keys("k1=composition"),
                       gateway=GatewayConfig(url, tmp_path, service_url=url))


@pytest.mark.parametrize(("roles", "built"), [
    (served(["commands"]), LANES),
    (served(["scheduler"]), PLACING),
    (served(["reconciler"]), TIMERS),
    (served(["projector"]), {"app", "projector"}),
    (served(["scheduler", "reconciler"], data_plane=False),
     {"app", "scheduler", "scheduler_signal", "election", "pool_leadership", "desk"}),
    (served(ROLES), LANES | PLACING | TIMERS | {"projector"}),
    ({Role.LOG}, {"log"}),
    ({Role.REPLAY}, {"scheduler"}),
    ({Role.GATEWAY}, {"gateway"}),
])
def test_each_role_set_builds_what_it_names_and_nothing_else(
        fresh_nats: NatsServer, database_url: str, schema: str, tmp_path: Path,
        roles: frozenset[Role], built: set[str]) -> None:
    ensure_all_streams(fresh_nats.url)
    c = build(_config(fresh_nats.url, database_url, schema, tmp_path), roles)
    try:
        assert {p for p in PARTS if getattr(c, p) is not None} == built
    finally:
        if c.projector is not None:
            c.projector.stop()
        c.close()


def test_a_plane_of_the_composition_places_a_lease(fresh_nats: NatsServer,
                                                   tmp_path: Path) -> None:
    ensure_all_streams(fresh_nats.url)
    config = PlaneConfig(fresh_nats.url, leader_ttl_seconds=1.0)
    with ControlPlane(build(config, served(ROLES))) as cp, \
            PoolClient(fresh_nats.url) as admin, PoolClient(fresh_nats.url, "alpha") as alpha:
        assert cp.projector is None  # no database: no projector, whatever the roles say
        setup_pool(admin)
        assert admin.admin("node.register", node_body("n1"))["ok"]
        reply = alpha.request_lease(lease_body("k1"))
        assert reply["ok"], reply
        lid = reply["lease"]["lease_id"]
        deadline = time.monotonic() + 30
        while alpha.lease(lid, "get")["lease"]["state"] != "reserved":
            assert time.monotonic() < deadline, "the lease was never placed"
            time.sleep(0.1)
