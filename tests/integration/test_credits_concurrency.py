"""Credits under concurrency: retried grants and racing settlers never double-spend."""

from __future__ import annotations

import threading

from bus.local.server import NatsServer
from domain.account import Account
from domain.resources import LeaseId
from schemas import v1
from workers.application import PoolApp
from workers.bootstrap import app_env


def _race(n: int, target) -> None:  # type: ignore[no-untyped-def]
    barrier = threading.Barrier(n)

    def run(i: int) -> None:
        barrier.wait()
        target(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def test_a_grant_retried_from_many_processes_lands_once(fresh_nats: NatsServer) -> None:
    apps = [PoolApp(env=app_env(fresh_nats.url)) for _ in range(4)]
    try:
        _race(4, lambda i: apps[i].grant("acme", 5_000_000, "purchase-17"))
        for _ in range(3):  # and again later, after the race
            apps[0].grant("acme", 5_000_000, "purchase-17")
        acc = apps[1].repository.get(Account.create_id("acme"))
        assert acc.granted == 5_000_000 and acc.available == 5_000_000
    finally:
        for a in apps:
            a.close()


def test_racing_settlers_of_one_hold_charge_it_once(fresh_nats: NatsServer) -> None:
    apps = [PoolApp(env=app_env(fresh_nats.url)) for _ in range(4)]
    try:
        apps[0].grant("acme", 10_000_000, "g1")
        acc = apps[0].repository.get(Account.create_id("acme"))
        acc.hold("hold-l1-1", LeaseId("l1"), 6_000_000, 1.0)
        apps[0].save(acc)
        outcomes: list[str] = []

        def settle(i: int) -> None:
            def go() -> None:
                a = apps[i].repository.get(Account.create_id("acme"))
                if a.has_hold(LeaseId("l1")):
                    a.settle("settle-l1-1", LeaseId("l1"), 2_000_000 + i, 2.0)
                    apps[i].save(a)
                    outcomes.append(f"settled by {i}")

            apps[i].retrying(go)

        _race(4, settle)
        final = apps[2].repository.get(Account.create_id("acme"))
        assert outcomes and len(outcomes) == 1, outcomes  # OCC let exactly one settler through
        assert final.held == 0 and final.granted == 10_000_000
        assert 2_000_000 <= final.spent <= 2_000_003
        assert final.available == 10_000_000 - final.spent >= 0
    finally:
        for a in apps:
            a.close()


def test_a_credit_grant_body_is_validated_at_the_edge() -> None:
    import pytest

    from schemas.codec import SchemaError, decode_command

    with pytest.raises(SchemaError) as e:
        decode_command("admin.credits.grant", b'{"tenant":"acme","amount_microcredits":-5,"transfer_id":"t"}')
    assert e.value.code == "invalid_field"
    ok = decode_command("admin.credits.grant", b'{"tenant":"acme","amount_microcredits":5,"transfer_id":"t"}')
    assert isinstance(ok, v1.CreditGrant)
