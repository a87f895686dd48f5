"""Credits and prices: integer micro-credits, idempotent transfers, holds that cover charges.

Also the pool's price functions and tenant policy, since holds and charges are priced there.
"""

from __future__ import annotations

from typing import Any

import pytest

from domain import (
    Account,
    InsufficientCredits,
    InvalidAmount,
    InvalidConfiguration,
    LeaseId,
    Pool,
    PoolConfig,
    PoolId,
    PreemptionSettings,
    PriceList,
    PriceNotListed,
    QuotaExceeded,
    Resources,
    Shape,
    TenantId,
    TenantPolicy,
    UnknownHold,
    UnknownPriorityClass,
)
from domain.errors import TransferConflict

LEASE = LeaseId("lease-1")


def funded(amount: int = 1_000) -> Account:
    account = Account.open(tenant_id=TenantId("acme"), now=0)
    account.grant("grant-1", amount, now=1)
    return account


def state_of(agg: Any) -> dict[str, Any]:
    return {k: v for k, v in agg.__dict__.items() if k != "_pending_events"}


def replay(agg: Any) -> Any:
    rebuilt = None
    for e in agg.pending_events:
        rebuilt = e.mutate(rebuilt)
    return rebuilt


# Account ------------------------------------------------------------------------------------


def test_an_account_id_is_derived_from_its_tenant() -> None:
    assert funded().id == Account.create_id("acme") != Account.create_id("other")


def test_a_hold_sets_credits_aside_and_available_drops() -> None:
    account = funded()
    assert account.hold("hold-1", LEASE, 300, now=2) is True
    assert (account.granted, account.held, account.spent, account.available) == (1000, 300, 0, 700)
    assert account.hold_for(LEASE) == 300 and account.balance == 1000


def test_a_hold_beyond_available_credits_is_refused() -> None:
    account = funded()
    account.hold("hold-1", LEASE, 800, now=2)
    with pytest.raises(InsufficientCredits) as raised:
        account.hold("hold-2", LeaseId("lease-2"), 201, now=3)
    assert raised.value.code == "insufficient_credits"
    assert (raised.value.available, raised.value.requested) == (200, 201)
    assert not account.has_seen("hold-2")  # a refused transfer may be retried later
    account.hold("hold-2", LeaseId("lease-2"), 200, now=3)
    assert account.available == 0


def test_many_holds_are_one_event_that_folds_as_the_holds_one_by_one() -> None:
    many, one_by_one = funded(), funded()
    holds = [("hold-1", LEASE, 300), ("hold-2", LeaseId("lease-2"), 200),
             ("hold-3", LEASE, 100)]  # a second hold for a lease adds to it, as `hold` does
    assert many.hold_many(holds, now=2) == 3
    for transfer_id, lease_id, amount in holds:
        one_by_one.hold(transfer_id, lease_id, amount, now=2)
    events = [type(e).__name__ for e in many.pending_events]
    assert events == ["AccountOpened", "CreditsGranted", "CreditsHeldBatch"]
    assert (many.held, many.available, many.hold_for(LEASE), many.hold_for(LeaseId("lease-2"))) \
        == (one_by_one.held, one_by_one.available, 400, 200) == (600, 400, 400, 200)
    assert many.transfer_ids == one_by_one.transfer_ids
    assert state_of(replay(many)) == state_of(many)  # the library's own fold gives the same
    # every hold of the batch can be settled or released on its own afterwards
    many.settle("settle-1", LEASE, 150, now=3)
    many.release_hold("release-2", LeaseId("lease-2"), now=3)
    assert (many.held, many.spent, many.available) == (0, 150, 850)


def test_many_holds_are_all_or_nothing_and_skip_transfer_ids_seen_before() -> None:
    account = funded()
    account.hold("hold-1", LEASE, 300, now=2)
    with pytest.raises(InsufficientCredits):  # 300 + 500 + 300 > 1000: none is taken
        account.hold_many([("hold-2", LeaseId("l2"), 500), ("hold-3", LeaseId("l3"), 300)], now=3)
    assert account.held == 300 and not account.has_seen("hold-2")
    # seen before, or twice in the list: skipped; one fresh hold is a plain CreditsHeld
    assert account.hold_many([("hold-1", LEASE, 300), ("hold-2", LeaseId("l2"), 500),
                              ("hold-2", LeaseId("l2"), 500)], now=4) == 1
    assert type(account.pending_events[-1]).__name__ == "CreditsHeld"
    assert account.held == 800
    assert account.hold_many([("hold-1", LEASE, 1), ("hold-2", LeaseId("l2"), 1)], now=5) == 0
    with pytest.raises(InvalidAmount):
        account.hold_many([("hold-4", LeaseId("l4"), -1), ("hold-5", LeaseId("l5"), 1)], now=6)
    assert account.held == 800 and state_of(replay(account)) == state_of(account)


def test_settle_charges_the_actual_amount_and_releases_the_rest_in_one_event() -> None:
    account = funded()
    account.hold("hold-1", LEASE, 300, now=2)
    account.settle("settle-1", LEASE, 120, now=3)
    event = account.pending_events[-1]
    assert type(event).__name__ == "CreditsSettled"
    assert (event.charged, event.released, event.shortfall) == (120, 180, 0)  # type: ignore[attr-defined]
    assert (account.held, account.spent, account.available) == (0, 120, 880)
    assert not account.has_hold(LEASE)


def test_settle_never_charges_more_than_the_hold_and_records_the_shortfall() -> None:
    account = funded()
    account.hold("hold-1", LEASE, 300, now=2)
    account.settle("settle-1", LEASE, 450, now=3)
    event = account.pending_events[-1]
    assert (event.charged, event.released, event.shortfall) == (300, 0, 150)  # type: ignore[attr-defined]
    assert (account.spent, account.shortfall, account.available) == (300, 150, 700)


def test_a_repeated_transfer_id_changes_nothing() -> None:
    account = funded()
    account.hold("hold-1", LEASE, 300, now=2)
    account.settle("settle-1", LEASE, 100, now=3)
    before, events = state_of(account), len(account.pending_events)
    assert account.grant("grant-1", 1_000, now=4) is False
    assert account.hold("hold-1", LEASE, 300, now=4) is False
    assert account.settle("settle-1", LEASE, 100, now=4) is False
    assert account.release_hold("settle-1", LEASE, now=4) is False  # ids are account-wide
    assert state_of(account) == before and len(account.pending_events) == events


def test_a_grant_reusing_a_transfer_id_with_another_amount_is_a_conflict() -> None:
    account = funded()
    account.hold("hold-1", LEASE, 300, now=2)
    before, events = state_of(account), len(account.pending_events)
    for transfer_id, amount in (("grant-1", 5_000), ("hold-1", 300)):
        with pytest.raises(TransferConflict) as e:
            account.grant(transfer_id, amount, now=4)
        assert e.value.code == "transfer_conflict"
    assert state_of(account) == before and len(account.pending_events) == events


def test_holds_for_the_same_lease_add_up() -> None:
    account = funded()
    account.hold("hold-1", LEASE, 100, now=2)
    account.hold("hold-2", LEASE, 50, now=3)
    assert account.hold_for(LEASE) == 150 and account.held == 150


def test_releasing_a_hold_returns_it_whole() -> None:
    account = funded()
    account.hold("hold-1", LEASE, 300, now=2)
    account.release_hold("void-1", LEASE, now=3)
    assert (account.held, account.spent, account.available) == (0, 0, 1000)
    assert [type(e).__name__ for e in account.pending_events] == [
        "AccountOpened", "CreditsGranted", "CreditsHeld", "HoldReleased",
    ]
    assert state_of(replay(account)) == state_of(account)


def test_settling_or_releasing_without_a_hold_is_refused() -> None:
    account = funded()
    with pytest.raises(UnknownHold) as raised:
        account.settle("settle-1", LEASE, 1, now=2)
    assert raised.value.code == "unknown_hold"
    with pytest.raises(UnknownHold):
        account.release_hold("release-1", LEASE, now=2)


@pytest.mark.parametrize("amount", [0, -5, 1.5, True, "10"])
def test_grants_must_be_positive_integer_micro_credits(amount: Any) -> None:
    account = funded()
    with pytest.raises(InvalidAmount) as raised:
        account.grant("grant-2", amount, now=2)
    assert raised.value.code == "invalid_amount"


@pytest.mark.parametrize("amount", [-1, 0.5, False])
def test_holds_and_charges_must_be_non_negative_integers(amount: Any) -> None:
    account = funded()
    with pytest.raises(InvalidAmount):
        account.hold("hold-1", LEASE, amount, now=2)
    account.hold("hold-1", LEASE, 0, now=2)  # a free pool holds nothing, but still holds
    with pytest.raises(InvalidAmount):
        account.settle("settle-1", LEASE, amount, now=3)


# Prices -------------------------------------------------------------------------------------

PRICES = PriceList(
    cpu_core_second=10,
    memory_gib_second=2,
    gpu_second=(("H100", 1000), ("A100", 600)),
    gpu_partition_second=(("1g.10gb", 100),),
)


def priced_pool() -> Pool:
    return Pool.create(pool_id=PoolId("gpu"), now=0, price_list=PRICES)


def test_a_charge_sums_every_dimension_in_micro_credits() -> None:
    shape = Shape.build(cpu_millis=1500, memory_mib=1536, gpu_count=1, gpu_model="H100")
    # 1.5 cores × 10 × 10 s + 1.5 GiB × 2 × 10 s + 1 GPU × 1000 × 10 s
    assert priced_pool().charge_for(shape, 10) == 150 + 30 + 10_000


def test_prices_round_up_so_a_hold_always_covers_its_charge() -> None:
    pool = priced_pool()
    assert pool.charge_for(Shape.build(cpu_millis=1), 1) == 1  # 0.01 rounds up
    assert pool.charge_for(Shape.build(cpu_millis=1000), 2.1) == 30  # per started second
    assert pool.charge_for(Shape.build(cpu_millis=1000), 0) == 0
    assert isinstance(pool.charge_for(Shape.build(cpu_millis=333), 7.7), int)


def test_a_hold_for_an_unpinned_gpu_uses_the_dearest_model() -> None:
    pool = priced_pool()
    any_gpu = Shape.build(gpu_count=1)
    assert pool.hold_for(any_gpu, 60) == 60_000
    assert pool.charge_for(any_gpu, 60, gpu_model="A100") == 36_000


def test_an_unlisted_gpu_model_without_a_fallback_is_refused() -> None:
    with pytest.raises(PriceNotListed) as raised:
        priced_pool().charge_for(Shape.build(gpu_count=1, gpu_model="T4"), 1)
    assert raised.value.code == "price_not_listed"
    fallback = PriceList(gpu_second=(("H100", 1000), ("*", 50)))
    assert fallback.charge(Resources(gpu_count=1), 1, gpu_model="T4") == 50


def test_gpu_partitions_are_priced_by_profile() -> None:
    shape = Shape.build(gpu_partition="1g.10gb", gpu_count=2)
    assert priced_pool().charge_for(shape, 10) == 2 * 100 * 10


def test_a_new_pool_is_free() -> None:
    pool = Pool.create(pool_id=PoolId("free"), now=0)
    assert pool.hold_for(Shape.build(cpu_millis=4000, gpu_count=8), 3600) == 0


def test_a_price_list_change_is_versioned() -> None:
    pool = priced_pool()
    assert pool.price_list_version == 1
    assert pool.set_price_list(PriceList(cpu_core_second=20), now=5) == 2
    assert pool.charge_for(Shape.build(cpu_millis=1000), 1) == 20
    assert [type(e).__name__ for e in pool.pending_events] == ["PoolCreated", "PriceListSet"]
    with pytest.raises(InvalidConfiguration):
        pool.set_price_list(PriceList(cpu_core_second=-1), now=6)
    assert state_of(replay(pool)) == state_of(pool)


# Pool config ---------------------------------------------------------------------------------


def test_an_invalid_pool_config_is_refused_with_every_reason() -> None:
    bad = PoolConfig(packing="random", commit_timeout_seconds=0, default_priority_class="vip")
    with pytest.raises(InvalidConfiguration) as raised:
        Pool.create(pool_id=PoolId("p"), now=0, config=bad)
    assert raised.value.code == "invalid_configuration"
    assert len(raised.value.reasons) == 3


def test_reconfiguring_a_pool_records_the_whole_config() -> None:
    pool = priced_pool()
    config = PoolConfig(
        packing="spread",
        priority_classes=(("batch", 0), ("prod", 10)),
        default_priority_class="batch",
        preemption=PreemptionSettings(enabled=True, min_runtime_seconds=60, grace_seconds=20),
        aging_seconds_per_rank=120,
    )
    pool.configure(config, now=5)
    assert pool.config == config and pool.config_version == 2
    assert state_of(replay(pool)) == state_of(pool)


def test_aging_raises_the_effective_rank_of_a_waiting_request() -> None:
    pool = priced_pool()
    pool.configure(PoolConfig(priority_classes=(("default", 0), ("prod", 10)),
                              aging_seconds_per_rank=120), now=1)
    assert pool.rank_of("prod") == 10
    assert pool.effective_rank("default", waited_seconds=119) == 0
    assert pool.effective_rank("default", waited_seconds=600) == 5
    with pytest.raises(UnknownPriorityClass):
        pool.rank_of("vip")


# Tenant policy -------------------------------------------------------------------------------


def test_a_tenant_policy_is_one_per_pool_and_tenant() -> None:
    ids = {TenantPolicy.create_id("p1", "t1"), TenantPolicy.create_id("p2", "t1"),
           TenantPolicy.create_id("p1", "t2")}
    assert len(ids) == 3
    policy = TenantPolicy.set(pool_id=PoolId("p1"), tenant_id=TenantId("t1"), now=0, weight=3)
    assert policy.id == TenantPolicy.create_id("p1", "t1") and policy.quota is None


def test_a_quota_names_the_dimensions_it_would_exceed() -> None:
    policy = TenantPolicy.set(pool_id=PoolId("p"), tenant_id=TenantId("t"), now=0,
                              quota=Resources(cpu_millis=4000, gpu_count=1))
    policy.check_quota(Resources(cpu_millis=2000), Resources(cpu_millis=2000, gpu_count=1))
    with pytest.raises(QuotaExceeded) as raised:
        policy.check_quota(Resources(cpu_millis=3000, gpu_count=1),
                           Resources(cpu_millis=2000, gpu_count=1))
    assert raised.value.code == "quota_exceeded"
    assert raised.value.dimensions == ("cpu_millis", "gpu_count")
    policy.update(weight=2, quota=None, now=1)
    policy.check_quota(Resources(gpu_count=10), Resources(gpu_count=10))
    assert state_of(replay(policy)) == state_of(policy)


def test_a_tenant_weight_must_be_a_positive_integer() -> None:
    with pytest.raises(InvalidConfiguration):
        TenantPolicy.set(pool_id=PoolId("p"), tenant_id=TenantId("t"), now=0, weight=0)


def test_a_replayed_lease_movement_inside_the_window_is_refused_and_the_ids_stay_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import domain.account as account_module

    monkeypatch.setattr(account_module, "TRANSFER_WINDOW", 50)
    account = funded(10**9)
    for i in range(500):  # far more lease movements than the window holds
        lid = LeaseId(f"lease-{i}")
        assert account.hold(f"hold-{i}", lid, 10, now=2 + i)
        assert account.settle(f"settle-{i}", lid, 4, now=2 + i)
    assert len(account.recent_transfers) == 50
    assert len(account.transfer_ids) == 51  # the window and the grant, which is kept for good
    # inside the window a replay is refused as before: nothing recorded, nothing moved
    before = (account.held, account.spent, len(account.pending_events))
    assert not account.settle("settle-499", LeaseId("lease-499"), 4, now=600)
    assert not account.hold("hold-499", LeaseId("lease-499"), 10, now=600)
    assert (account.held, account.spent, len(account.pending_events)) == before
    # the grant's id outlives the window: a retry is still one, another amount a conflict
    assert not account.grant("grant-1", 10**9, now=600)
    with pytest.raises(TransferConflict):
        account.grant("grant-1", 5, now=600)
    # the oldest ids left the window; a fold of the same events keeps the same window
    assert not account.has_seen("hold-0") and account.has_seen("settle-499")
    assert list(replay(account).recent_transfers) == list(account.recent_transfers)
