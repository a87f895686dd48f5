"""Quota limits and cohorts (domain.quota), tenant and cohort settings, and the lease flags
preemption reads: pure domain, no I/O."""

from __future__ import annotations

import pytest

from domain.errors import InvalidConfiguration, QuotaExceeded, RuntimeLimitExceeded
from domain.lease import JobSpec, Lease, LeaseState
from domain.pool import Pool, PoolConfig, TenantPolicy
from domain.quota import limits, limits_from_event
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
