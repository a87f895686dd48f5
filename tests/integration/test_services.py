"""Each command service built alone over one store on a real nats-server: no PoolApp, and only
the collaborators it is handed (docs/architecture.md, the application's parts)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bus.local.server import NatsServer
from bus.runtime import close_runtime
from domain.account import Account
from domain.errors import TransferConflict
from domain.lease import Lease, LeaseState
from domain.node import Node, NodeState
from domain.pool import Pool
from domain.resources import PoolId
from schemas import v1
from workers.application import (
    AccountService,
    AdminService,
    GangService,
    LeaseService,
    NodeService,
    PoolApp,
    Store,
    WorkflowService,
)
from workers.bootstrap import app_env
from workers.errors import UnknownNode, UnknownPool, UnknownTenant

NOW = 1_700_000_000.0


def clock() -> float:
    return NOW


@pytest.fixture()
def store(fresh_nats: NatsServer) -> Iterator[Store]:
    made = Store(env=app_env(fresh_nats.url))
    yield made
    made.close()
    close_runtime(fresh_nats.url)


def test_the_account_service_alone_grants_a_transfer_once(store: Store) -> None:
    accounts = AccountService(store, clock)
    with pytest.raises(UnknownTenant):
        accounts.grant("acme", 5_000_000, "t-0", known_only=True)  # no tenant set anywhere
    accounts.grant("acme", 5_000_000, "t-1")
    accounts.grant("acme", 5_000_000, "t-1")  # a retry: nothing more
    with pytest.raises(TransferConflict):
        accounts.grant("other", 5_000_000, "t-1")  # the id is claimed across accounts
    acc = store.find(Account, Account.create_id("acme"))
    assert acc is not None and acc.granted == 5_000_000


def test_the_admin_service_alone_sets_a_pool_and_a_tenant(store: Store) -> None:
    admin = AdminService(store, clock)
    with pytest.raises(UnknownPool):
        admin.set_tenant(v1.TenantConfig(tenant="acme", pool_id="p1"))
    admin.create_pool(v1.PoolConfig(pool_id="p1"))
    admin.set_tenant(v1.TenantConfig(tenant="acme", pool_id="p1", weight=2.5))
    settings = admin.pool_settings("p1")
    assert settings["quotas"]["tenants"]["acme"]["weight"] == 2.5
    # the tenant's account opened with its first pool, in the same save
    assert store.find(Account, Account.create_id("acme")) is not None


def test_the_lease_service_takes_requests_with_only_the_services_it_is_handed(
        store: Store) -> None:
    admin = AdminService(store, clock)
    admin.create_pool(v1.PoolConfig(pool_id="p1"))
    leases = LeaseService(store, clock, gangs=GangService(store),
                          accounts=AccountService(store, clock),
                          workflows=WorkflowService(store), admin=admin)
    req = v1.LeaseRequest(pool_id="p1", shape=v1.ResourceShape(cpu_millis=1000, memory_mib=512),
                          maximum_runtime_seconds=60, idempotency_key="k1", count=3)
    made = leases.request_leases("acme", req)
    assert [lease.state for lease in made] == [LeaseState.QUEUED] * 3
    assert [str(lease.id) for lease in leases.request_leases("acme", req)] == [
        str(lease.id) for lease in made]  # a retry answers what the first made
    cancelled = leases.cancel("acme", str(made[0].id), v1.CancelLease())
    assert cancelled.state is LeaseState.CANCELLED
    found = store.find(Lease, made[0].id)
    assert found is not None and found.state is LeaseState.CANCELLED


def test_the_node_service_alone_registers_a_node_and_loses_it_when_silent(
        store: Store) -> None:
    now = [NOW]
    nodes = NodeService(store, lambda: now[0], gangs=GangService(store),
                        accounts=AccountService(store, lambda: now[0]))
    store.save(Pool.create(pool_id=PoolId("p1"), now=NOW))  # the pool, straight into the log
    with pytest.raises(UnknownNode):
        nodes.node_state("n1", "cordon")
    nodes.register_node(v1.NodeRegistration(node_id="n1", pool_id="p1", capabilities=(
        v1.NodeCapabilitiesSpec(allocatable=v1.ResourceAmounts(cpu_millis=4000,
                                                               memory_mib=8192)))))
    assert nodes.node_due("n1") == []  # heard from just now
    due = nodes.node_next_due("n1")
    assert due is not None
    now[0] = due + 1
    assert nodes.node_due("n1") == ["node_lost"]
    found = store.find(Node, Node.create_id("n1"))
    assert found is not None and found.state is NodeState.LOST


def test_the_planes_application_keeps_the_name_the_log_and_environment_know(
        fresh_nats: NatsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before its split PoolApp was the library's Application, named after its class: its
    store keeps that name, so its snapshots stay on pool.snap.poolapp.<id> and a role's
    process, whose POOL_NATS_URL carries no credentials, still connects with NATS_URL's."""
    monkeypatch.setenv("POOL_NATS_URL", "nats://127.0.0.1:1")  # nothing listens there
    app = PoolApp(env=app_env(fresh_nats.url))
    try:
        assert app.name == app.store.name == "PoolApp"
        assert app.factory.url == fresh_nats.url  # type: ignore[attr-defined]
        AccountService(app.store, clock).grant("acme", 1, "t-1")  # the log answers
    finally:
        app.close()
        close_runtime(fresh_nats.url)
