"""Quota limits and cohorts (domain.quota), tenant and cohort settings, and the lease flags
preemption reads: pure domain, no I/O."""

from __future__ import annotations

import pytest

from domain.errors import InvalidConfiguration, QuotaExceeded, RuntimeLimitExceeded
from domain.lease import JobSpec, Lease, LeaseState
from domain.pool import Pool, TenantPolicy
from domain.poolconfig import PoolConfig
from domain.quota import (
    CohortQuota,
    QuotaBook,
    TenantQuota,
    holding_past_limits,
    limits,
    limits_from_event,
)
from domain.resources import NodeId, PoolId, Resources, Shape, TenantId

# -- limits --------------------------------------------------------------------------------------


def test_a_quota_limits_only_the_dimensions_it_names() -> None:
    policy = TenantPolicy.set(pool_id=PoolId("p"), tenant_id=TenantId("t"), now=0,
                              quota={"cpu_millis": 4000})
    policy.check_quota(Resources(), Resources(cpu_millis=500, memory_mib=64, gpu_count=3))
    with pytest.raises(QuotaExceeded) as raised:
        policy.check_quota(Resources(cpu_millis=3600), Resources(cpu_millis=500))
    assert raised.value.reasons == ("cpu_millis",)


def test_a_zero_limit_named_explicitly_still_limits() -> None:
    policy = TenantPolicy.set(pool_id=PoolId("p"), tenant_id=TenantId("t"), now=0,
                              quota={"gpu_count": 0})
    with pytest.raises(QuotaExceeded):
        policy.check_quota(Resources(), Resources(gpu_count=1))
    policy.check_quota(Resources(), Resources(cpu_millis=10**6))


def test_an_event_in_the_older_resources_form_limits_only_its_non_zero_dimensions() -> None:
    old = {"cpu_millis": 4000, "memory_mib": 0, "gpu_count": 0, "local_disk_gib": 0,
           "extended": {"gpu/1g.10gb": 2}}
    assert limits_from_event(old) == (("cpu_millis", 4000), ("gpu/1g.10gb", 2))
    assert limits_from_event({"memory_mib": 0}) == (("memory_mib", 0),)
    assert limits_from_event(None) is None


def test_a_quota_naming_an_unknown_dimension_is_refused() -> None:
    with pytest.raises(InvalidConfiguration):
        TenantPolicy.set(pool_id=PoolId("p"), tenant_id=TenantId("t"), now=0,
                         quota={"bogus": 1})
    with pytest.raises(InvalidConfiguration):
        TenantPolicy.set(pool_id=PoolId("p"), tenant_id=TenantId("t"), now=0,
                         quota={"cpu_millis": 1}, borrow_limit={"cpu_millis": 1})  # no cohort
    assert limits({"b": 2, "a": 1}) == (("a", 1), ("b", 2))


# -- runtime and preemption flags ----------------------------------------------------------------


def test_a_pool_refuses_a_runtime_past_its_maximum_naming_it_with_units() -> None:
    pool = Pool.create(pool_id=PoolId("p"), now=0,
                       config=PoolConfig(maximum_runtime_seconds=7200))
    pool.admit_runtime(7200)
    with pytest.raises(RuntimeLimitExceeded) as raised:
        pool.admit_runtime(7201)
    assert raised.value.code == "maximum_runtime_exceeded"
    assert "7200 s (2 h)" in str(raised.value)


def _running(requeue: bool) -> Lease:
    lease = Lease.request(tenant_id=TenantId("t"), pool_id=PoolId("p"), idempotency_key="k",
                          shape=Shape.build(cpu_millis=1000), maximum_runtime_seconds=600,
                          now=0, requeue_when_preempted=requeue, checkpointable=True)
    lease.queue(0)
    lease.reserve(1, node_id=NodeId("n"), commit_timeout_seconds=30, hold_microcredits=0)
    lease.commit(2, JobSpec(image="img", command=("run",)))
    lease.job_started(3, epoch=1)
    return lease


@pytest.mark.parametrize("exit_code, restarts", [(143, True), (0, False)])
def test_a_job_killed_by_its_preemption_restarts_but_one_that_finished_does_not(
        exit_code: int, restarts: bool) -> None:
    lease = _running(requeue=True)
    lease.notice_preemption(10, grace_seconds=5, requeue=lease.requeue_when_preempted)
    lease.job_exited(12, epoch=1, exit_code=exit_code)
    assert lease.confirm_stopped(12, epoch=1) is LeaseState.QUEUED
    assert lease.restarts_on_placement is restarts
    lease.reserve(20, node_id=NodeId("n2"), commit_timeout_seconds=30, hold_microcredits=0)
    lease.commit(21)
    assert (lease.job is not None and lease.job.is_active) is restarts
    if restarts:
        assert lease.job is not None and lease.job.attempts == 2 and lease.job.number == 1


def test_a_lease_that_did_not_ask_for_requeue_ends_preempted() -> None:
    lease = _running(requeue=False)
    assert lease.checkpointable and not lease.requeue_when_preempted
    lease.notice_preemption(10, grace_seconds=5, requeue=lease.requeue_when_preempted)
    assert lease.confirm_stopped(12, epoch=1) is LeaseState.PREEMPTED
    assert not lease.restarts_on_placement


def test_a_priority_class_named_non_preemptible_must_exist() -> None:
    assert PoolConfig(priority_classes=(("gold", 1),),
                      default_priority_class="gold",
                      non_preemptible_classes=("gold",)).problems() == []
    assert PoolConfig(non_preemptible_classes=("gold",)).problems() == [
        "non-preemptible class 'gold' is not defined"]


# -- cohorts -------------------------------------------------------------------------------------

CPU = "cpu_millis"


def _book(**tenants: dict[str, object]) -> QuotaBook:
    """A cohort "c" of tenants, each given as nominal=, borrow=, lend= cpu amounts."""
    book = QuotaBook()
    book.set_cohort(CohortQuota("c"))
    for name, s in tenants.items():
        book.set_tenant(TenantQuota(
            name, nominal=limits({CPU: s["nominal"]}),  # type: ignore[dict-item]
            borrow_limit=None if s.get("borrow") is None else limits({CPU: s["borrow"]}),  # type: ignore[dict-item]
            lend_limit=None if s.get("lend") is None else limits({CPU: s["lend"]}),  # type: ignore[dict-item]
            cohort="c"))
    return book


def _use(**cpu: int) -> dict[str, Resources]:
    return {t: Resources(cpu_millis=v) for t, v in cpu.items()}


def test_a_tenant_borrows_the_cohorts_unused_quota_up_to_its_borrow_limit_never_past() -> None:
    book = _book(a={"nominal": 4000, "borrow": 3000}, b={"nominal": 8000})
    one = Resources(cpu_millis=1000)
    usage = _use(a=0, b=0)
    granted = 0
    while book.check("a", one, usage).fits:
        usage["a"] = usage["a"] + one
        granted += 1
        assert granted < 100
    assert usage["a"].cpu_millis == 7000  # nominal 4000 + borrow limit 3000
    verdict = book.check("a", one, usage)
    assert verdict.over_ceiling == ("cpu_millis",) and not verdict.may_reclaim
    assert book.borrowing("a", usage["a"]) == {CPU: 3000}


def test_without_a_borrow_limit_a_tenant_borrows_only_what_the_cohort_has_unused() -> None:
    book = _book(a={"nominal": 4000}, b={"nominal": 8000})
    assert book.check("a", Resources(cpu_millis=12_000), _use()).fits
    verdict = book.check("a", Resources(cpu_millis=1000), _use(a=6000, b=6000))
    assert verdict.cohort_full == (CPU,) and verdict.over_ceiling == ()
    assert verdict.borrowers == {}  # a itself is the one borrowing: no one to name
    assert verdict.to_dict() == {"cohort_full": [CPU]}


def test_a_lend_limit_keeps_the_rest_of_a_nominal_quota_for_its_owner() -> None:
    book = _book(a={"nominal": 4000}, b={"nominal": 8000, "lend": 2000})
    assert book.capacity("c", CPU) == 4000 + 2000
    # a may use its own 4000 and borrow b's lendable 2000, never b's kept 6000
    assert book.check("a", Resources(cpu_millis=6000), _use()).fits
    assert not book.check("a", Resources(cpu_millis=6001), _use()).fits
    # b keeps its 6000 whatever a borrows
    assert book.check("b", Resources(cpu_millis=6000), _use(a=6000)).fits


def test_an_owner_within_its_nominal_quota_may_reclaim_what_others_borrowed() -> None:
    book = _book(a={"nominal": 4000}, b={"nominal": 4000})
    usage = _use(a=7000, b=0)  # a borrows 3000 of b's nominal
    verdict = book.check("b", Resources(cpu_millis=2000), usage)
    assert verdict.cohort_full == (CPU,) and verdict.may_reclaim
    assert verdict.borrowers == {"a": {CPU: 3000}}
    # past its own nominal, b could only borrow: no reclaim
    assert not book.check("b", Resources(cpu_millis=4001), usage).may_reclaim


def test_a_cohorts_own_nominal_quota_is_lent_to_its_members() -> None:
    book = _book(a={"nominal": 0})
    book.set_cohort(CohortQuota("c", nominal=limits({CPU: 5000}) or ()))
    assert book.check("a", Resources(cpu_millis=5000), _use()).fits
    assert not book.check("a", Resources(cpu_millis=5001), _use()).fits


def test_a_tenant_outside_any_cohort_is_held_to_its_nominal_quota() -> None:
    book = QuotaBook()
    book.set_tenant(TenantQuota("solo", nominal=limits({CPU: 1000})))
    assert book.check("solo", Resources(cpu_millis=1000), _use()).fits
    assert book.check("solo", Resources(cpu_millis=1001), _use()).over_ceiling == (CPU,)
    assert book.check("unlimited", Resources(cpu_millis=10**9), _use()).fits


def test_the_replay_check_names_a_tenant_past_its_limit_and_an_overdrawn_cohort() -> None:
    book = _book(a={"nominal": 4000, "borrow": 1000}, b={"nominal": 4000})
    assert holding_past_limits(book, _use(a=5000, b=3000), ["a", "b"]) == []
    assert holding_past_limits(book, _use(a=5001), ["a"]) == [
        "tenant a holds 5001 cpu_millis, past its limit 5000"]
    # nothing is kept back (no lend limits): all 8000 is shared, and 9000 is in use
    assert holding_past_limits(book, _use(a=5000, b=4000), ["a", "b"]) == [
        "cohort c has 9000 cpu_millis in use of its shared 8000"]


def test_a_tenant_set_again_without_its_cohort_leaves_it() -> None:
    book = _book(a={"nominal": 4000}, b={"nominal": 4000})
    assert [m.tenant for m in book.members("c")] == ["a", "b"]
    book.set_tenant(TenantQuota("b", nominal=limits({CPU: 4000})))
    assert [m.tenant for m in book.members("c")] == ["a"]
    assert book.capacity("c", CPU) == 4000
    assert not book.check("a", Resources(cpu_millis=4001), _use()).fits
