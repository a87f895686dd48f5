"""Random command sequences against Lease, Node and Account, legal and illegal alike.

After every step: replaying the stored events rebuilds an identical aggregate, versions run
1..n, a refused command left no trace, and the aggregate's own invariants hold.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from eventsourcing.persistence import DatetimeAsISO, JSONTranscoder, Mapper, UUIDAsHex
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from domain import (
    EXPIRY_REASONS,
    TERMINAL_STATES,
    Account,
    DomainError,
    JobSpec,
    Lease,
    LeaseId,
    LeaseState,
    Node,
    NodeCapabilities,
    NodeId,
    OverAllocation,
    PoolId,
    Resources,
    Shape,
    TenantId,
)
from domain.lease import WORKLOAD_STATES

SETTINGS = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

REFUSED = object()

_transcoder = JSONTranscoder()
_transcoder.register(UUIDAsHex())
_transcoder.register(DatetimeAsISO())
MAPPER: Mapper[Any] = Mapper(transcoder=_transcoder)


def state_of(agg: Any) -> dict[str, Any]:
    return {k: v for k, v in agg.__dict__.items() if k != "_pending_events"}


def replay(events: Sequence[Any]) -> Any:
    agg = None
    for e in events:
        agg = e.mutate(agg)
    return agg


class AggregateMachine(RuleBasedStateMachine):
    """Shared checks; subclasses create `self.agg` in an @initialize rule."""

    agg: Any
    last_error: DomainError | None = None

    def attempt(self, call: Callable[[], Any]) -> Any:
        """Run one command; a refusal must be a DomainError with a code, and change nothing."""
        before = copy.deepcopy(state_of(self.agg))
        count = len(self.agg.pending_events)
        try:
            return call()
        except DomainError as error:
            self.last_error = error
            assert isinstance(error.code, str) and error.code != "domain_error"
            assert state_of(self.agg) == before, f"{error!r} left a trace"
            assert len(self.agg.pending_events) == count
            return REFUSED

    @invariant()
    def replaying_stored_events_rebuilds_an_identical_aggregate(self) -> None:
        stored = [MAPPER.to_domain_event(MAPPER.to_stored_event(e))
                  for e in self.agg.pending_events]
        assert state_of(replay(stored)) == state_of(self.agg)

    @invariant()
    def versions_are_contiguous_from_one(self) -> None:
        versions = [e.originator_version for e in self.agg.pending_events]
        assert versions == list(range(1, len(versions) + 1))
        assert self.agg.version == len(versions)


# Lease ----------------------------------------------------------------------------------------

# Verbs that end a lease early would otherwise cut most runs short.
def _is_four(i: int) -> bool:  # named: Hypothesis parses a lambda's source (see test_schemas)
    return i == 4


rarely = st.integers(0, 4).map(_is_four)
# Mostly the current epoch, so runs get deep; sometimes a stale or a future one.
epochs = st.sampled_from([0, 0, 0, -1, 1])
maybe_epoch = st.none() | epochs
job_specs = st.builds(JobSpec, image=st.sampled_from(["img:1", "img:2"]),
                      command=st.lists(st.sampled_from(["run", "-v"]), max_size=2).map(tuple))


class LeaseMachine(AggregateMachine):
    @initialize(
        max_runtime=st.integers(min_value=1, max_value=900),
        term=st.integers(min_value=1, max_value=600),
        heartbeat_timeout=st.integers(min_value=1, max_value=120),
        preemptible=st.booleans(),
    )
    def request(self, max_runtime: int, term: int, heartbeat_timeout: int,
                preemptible: bool) -> None:
        self.now = 0.0
        self.max_epoch = 0
        self.agg = Lease.request(
            tenant_id=TenantId("t"), pool_id=PoolId("p"), idempotency_key="k",
            shape=Shape.build(cpu_millis=500, memory_mib=256), maximum_runtime_seconds=max_runtime,
            lease_seconds=term, heartbeat_timeout_seconds=heartbeat_timeout, now=self.now,
            preemptible=preemptible,
        )

    @property
    def lease(self) -> Lease:
        return self.agg  # type: ignore[no-any-return]

    def at_epoch(self, offset: int | None) -> int | None:
        return None if offset is None else self.lease.epoch + offset

    def _progress(self, data: st.DataObject) -> None:
        """Take the next step of the happy path, so random runs reach the deep states."""
        lease, now = self.lease, self.now
        def lapse() -> None:  # let the reservation's commit timeout pass, then void it
            assert lease.reservation_deadline is not None
            self.now = max(now, lease.reservation_deadline)
            lease.expire(self.now)

        def running() -> Any:
            pick = data.draw(st.sampled_from(
                ["heartbeat", "heartbeat", "heartbeat", "preempt", "preempt", "lose", "finish"]
            ))
            if pick == "preempt":
                return lease.notice_preemption(now, grace_seconds=10, requeue=data.draw(
                    st.booleans()))
            if pick == "lose":
                return lease.expire(now, "node_lost")
            if pick == "finish":
                return lease.release(now, 0)
            return lease.heartbeat(now, epoch=lease.epoch)

        steps: dict[LeaseState, Callable[[], Any]] = {
            LeaseState.REQUESTED: lambda: lease.queue(now),
            LeaseState.QUEUED: lambda: lease.reserve(
                now, node_id=NodeId("n"), commit_timeout_seconds=30, hold_microcredits=10),
            LeaseState.RESERVED: lambda: (
                lease.commit(now, data.draw(st.none() | job_specs))
                if data.draw(st.integers(0, 4)) != 4 else lapse()
            ),
            LeaseState.RUNNING: running,
            LeaseState.STOPPING: lambda: lease.confirm_stopped(now),
            LeaseState.PREEMPTING: lambda: lease.confirm_stopped(now),
            LeaseState.PREEMPTED: lambda: lease.requeue(now),
            LeaseState.EXPIRED: lambda: lease.begin_reconciliation(now),
            LeaseState.RECONCILING: lambda: lease.confirm_stopped(now),
        }
        step = steps.get(lease.state)
        if step is not None:
            self.attempt(step)

    # Rules are drawn about evenly; three of them give the happy path the weight it needs.
    @rule(data=st.data())
    def progress(self, data: st.DataObject) -> None:
        self._progress(data)

    @rule(data=st.data())
    def progress_more(self, data: st.DataObject) -> None:
        self._progress(data)

    @rule(data=st.data())
    def progress_further(self, data: st.DataObject) -> None:
        self._progress(data)

    @rule(seconds=st.sampled_from([0, 1, 5, 20, 60, 300]))
    def advance(self, seconds: int) -> None:
        self.now += seconds

    @rule()
    def queue(self) -> None:
        self.attempt(lambda: self.lease.queue(self.now))

    @rule(go=rarely)
    def reject(self, go: bool) -> None:
        if go:
            self.attempt(lambda: self.lease.reject(self.now, "quota_exceeded", ["cpu"]))

    @rule(timeout=st.integers(min_value=0, max_value=60), hold=st.integers(-1, 100))
    def reserve(self, timeout: int, hold: int) -> None:
        self.attempt(lambda: self.lease.reserve(self.now, node_id=NodeId("n"),
                                                commit_timeout_seconds=timeout,
                                                hold_microcredits=hold))

    @rule(job=st.none() | job_specs)
    def commit(self, job: JobSpec | None) -> None:
        self.attempt(lambda: self.lease.commit(self.now, job))

    @rule(job=job_specs)
    def run_job(self, job: JobSpec) -> None:
        self.attempt(lambda: self.lease.run_job(self.now, job))

    @rule(epoch=epochs)
    def job_started(self, epoch: int) -> None:
        self.attempt(lambda: self.lease.job_started(self.now, epoch=self.lease.epoch + epoch))

    @rule(epoch=epochs, code=st.integers(0, 2))
    def job_exited(self, epoch: int, code: int) -> None:
        current = self.lease.epoch + epoch
        self.attempt(lambda: self.lease.job_exited(self.now, epoch=current, exit_code=code))

    @rule(epoch=epochs)
    def job_failed(self, epoch: int) -> None:
        current = self.lease.epoch + epoch
        self.attempt(lambda: self.lease.job_failed(self.now, epoch=current, reason="oom"))

    @rule(epoch=epochs, checkpoint=st.booleans())
    def heartbeat(self, epoch: int, checkpoint: bool) -> None:
        at = self.now - 1 if checkpoint else None
        current = self.lease.epoch + epoch
        self.attempt(lambda: self.lease.heartbeat(self.now, epoch=current, checkpoint_at=at))

    @rule(extend=st.none() | st.integers(min_value=-1, max_value=900))
    def renew(self, extend: int | None) -> None:
        before = self.lease.deadline
        if self.attempt(lambda: self.lease.renew(self.now, extend)) is not REFUSED:
            assert before is not None and self.lease.deadline is not None
            assert self.lease.deadline >= before  # a renewal never shortens the term

    @rule(code=st.none() | st.integers(0, 2), epoch=maybe_epoch)
    def release(self, code: int | None, epoch: int | None) -> None:
        self.attempt(lambda: self.lease.release(self.now, code, epoch=self.at_epoch(epoch)))

    @rule(go=rarely)
    def cancel(self, go: bool) -> None:
        if go:
            self.attempt(lambda: self.lease.cancel(self.now))

    @rule(epoch=maybe_epoch)
    def confirm_stopped(self, epoch: int | None) -> None:
        self.attempt(lambda: self.lease.confirm_stopped(self.now, epoch=self.at_epoch(epoch)))

    @rule(reason=st.sampled_from([None, *EXPIRY_REASONS, "bogus"]))
    def expire(self, reason: str | None) -> None:
        due = self.lease.expiry_due(self.now)
        if self.attempt(lambda: self.lease.expire(self.now, reason)) is not REFUSED:
            assert reason in (None, "node_lost") or due is not None

    @rule()
    def void_reservation(self) -> None:
        self.attempt(lambda: self.lease.void_reservation(self.now))

    @rule()
    def begin_reconciliation(self) -> None:
        self.attempt(lambda: self.lease.begin_reconciliation(self.now))

    @rule(grace=st.integers(0, 60), requeue=st.booleans(), min_runtime=st.integers(0, 100))
    def notice_preemption(self, grace: int, requeue: bool, min_runtime: int) -> None:
        self.attempt(lambda: self.lease.notice_preemption(
            self.now, grace_seconds=grace, requeue=requeue, min_runtime_seconds=min_runtime))

    @rule()
    def requeue(self) -> None:
        self.attempt(lambda: self.lease.requeue(self.now))

    @invariant()
    def the_deadline_never_passes_the_maximum_runtime(self) -> None:
        lease = self.lease
        if lease.deadline is not None and lease.runtime_limit_at is not None:
            assert lease.deadline <= lease.runtime_limit_at

    @invariant()
    def the_epoch_counts_reservations_and_never_goes_back(self) -> None:
        reservations = sum(type(e).__name__ == "LeaseReserved" for e in self.agg.pending_events)
        assert self.lease.epoch == reservations >= self.max_epoch
        self.max_epoch = self.lease.epoch

    @invariant()
    def capacity_is_held_only_by_a_placed_live_lease(self) -> None:
        lease = self.lease
        assert isinstance(lease.state, LeaseState)
        if lease.holds_capacity:
            assert lease.node_id is not None and lease.is_live
        if lease.state in TERMINAL_STATES:
            assert not lease.holds_capacity and not lease.is_live

    @invariant()
    def a_job_is_active_only_while_a_workload_may_run(self) -> None:
        job = self.lease.job
        if job is not None and job.is_active:
            assert self.lease.state in WORKLOAD_STATES


# Node -----------------------------------------------------------------------------------------

PARTITION = "gpu/1g.10gb"
capacities = st.builds(
    Resources,
    cpu_millis=st.integers(2000, 8000),
    memory_mib=st.integers(2000, 8000),
    gpu_count=st.integers(1, 4),
    extended=st.sampled_from([(), ((PARTITION, 3),), ((PARTITION, 7),)]),
)
requests = st.builds(
    Resources,
    cpu_millis=st.integers(0, 3000),
    memory_mib=st.integers(0, 3000),
    gpu_count=st.sampled_from([0, 0, 0, 1, 2]),
    extended=st.sampled_from([(), (), ((PARTITION, 1),), ((PARTITION, 3),)]),
)
lease_ids = st.sampled_from([LeaseId(f"l{i}") for i in range(5)])


class NodeMachine(AggregateMachine):
    @initialize(allocatable=capacities)
    def register(self, allocatable: Resources) -> None:
        self.now = 0.0
        self.expected: dict[LeaseId, Resources] = {}
        self.agg = Node.register(node_id=NodeId("n"), pool_id=PoolId("p"),
                                 capabilities=NodeCapabilities(allocatable=allocatable),
                                 now=self.now)

    @property
    def node(self) -> Node:
        return self.agg  # type: ignore[no-any-return]

    @rule(seconds=st.integers(0, 60))
    def advance(self, seconds: int) -> None:
        self.now += seconds

    @rule(lease=lease_ids, amount=requests)
    def allocate(self, lease: LeaseId, amount: Resources) -> None:
        was_ready, known = self.node.is_schedulable, lease in self.expected
        short = (self.node.allocated + amount).exceeded_dimensions(self.node.allocatable)
        result = self.attempt(lambda: self.node.allocate(lease, amount, self.now))
        if result is REFUSED:
            assert not was_ready or known or short
            if isinstance(self.last_error, OverAllocation):
                assert list(self.last_error.dimensions) == short  # names exactly what's short
            return
        assert was_ready and not known and not short
        self.expected[lease] = amount
        assert self.node.allocated.fits_in(self.node.allocatable)  # never over-allocates

    @rule(lease=lease_ids)
    def free(self, lease: LeaseId) -> None:
        freed = self.attempt(lambda: self.node.free(lease, self.now))
        assert freed is (lease in self.expected)
        self.expected.pop(lease, None)

    @rule(allocatable=capacities)
    def reregister(self, allocatable: Resources) -> None:
        self.attempt(lambda: self.node.reregister(NodeCapabilities(allocatable=allocatable),
                                                  self.now))

    @rule()
    def heartbeat(self) -> None:
        self.attempt(lambda: self.node.heartbeat(self.now))

    @rule()
    def cordon(self) -> None:
        self.attempt(lambda: self.node.cordon(self.now))

    @rule()
    def drain(self) -> None:
        self.attempt(lambda: self.node.drain(self.now))

    @rule()
    def uncordon(self) -> None:
        self.attempt(lambda: self.node.uncordon(self.now))

    @rule()
    def enter_maintenance(self) -> None:
        if self.attempt(lambda: self.node.enter_maintenance(self.now)) is not REFUSED:
            assert not self.expected

    @rule()
    def end_maintenance(self) -> None:
        self.attempt(lambda: self.node.end_maintenance(self.now))

    @rule()
    def mark_lost(self) -> None:
        self.attempt(lambda: self.node.mark_lost(self.now))

    @invariant()
    def allocations_match_the_model(self) -> None:
        assert self.node.allocations == self.expected
        total = Resources()
        for amount in self.expected.values():
            total = total + amount
        assert self.node.allocated == total

    @invariant()
    def free_capacity_is_never_negative(self) -> None:
        free = self.node.free_capacity
        assert free.is_non_negative()
        if not self.node.overcommitted_dimensions:
            assert free + self.node.allocated == self.node.allocatable


# Account --------------------------------------------------------------------------------------

def _transfer_id(i: int) -> str:
    return f"t{i}"


transfer_ids = st.integers(0, 24).map(_transfer_id)
account_leases = st.sampled_from([LeaseId(f"l{i}") for i in range(3)])
credits = st.integers(min_value=-5, max_value=500)


class AccountMachine(AggregateMachine):
    @initialize()
    def open(self) -> None:
        self.now = 0.0
        self.seen: set[str] = set()
        self.grants: dict[str, int] = {}  # transfer id -> the amount it granted
        self.holds: dict[LeaseId, int] = {}
        self.granted = self.spent = 0
        self.agg = Account.open(tenant_id=TenantId("t"), now=self.now)

    @property
    def account(self) -> Account:
        return self.agg  # type: ignore[no-any-return]

    def _move(self, transfer_id: str, call: Callable[[], bool], *,
              conflicts: bool = False) -> bool:
        repeated = transfer_id in self.seen
        count = len(self.agg.pending_events)
        before = copy.deepcopy(state_of(self.agg))
        result = self.attempt(call)
        if repeated and conflicts:  # the id moved something else: refused, nothing recorded
            assert result is REFUSED and self.last_error.code == "transfer_conflict"
            return False
        if repeated:  # a repeated transfer id with the same movement is a no-op
            assert result is False
            assert state_of(self.agg) == before and len(self.agg.pending_events) == count
            return False
        if result is REFUSED:
            return False
        assert result is True
        self.seen.add(transfer_id)
        return True

    @rule(transfer=transfer_ids, amount=credits)
    def grant(self, transfer: str, amount: int) -> None:
        conflicts = self.grants.get(transfer) != amount
        if self._move(transfer, lambda: self.account.grant(transfer, amount, self.now),
                      conflicts=conflicts):
            assert amount > 0
            self.granted += amount
            self.grants[transfer] = amount

    @rule(transfer=transfer_ids, lease=account_leases, amount=credits)
    def hold(self, transfer: str, lease: LeaseId, amount: int) -> None:
        available = self.account.available
        if self._move(transfer, lambda: self.account.hold(transfer, lease, amount, self.now)):
            assert 0 <= amount <= available
            self.holds[lease] = self.holds.get(lease, 0) + amount

    @rule(transfer=transfer_ids, lease=account_leases, amount=credits)
    def settle(self, transfer: str, lease: LeaseId, amount: int) -> None:
        if self._move(transfer, lambda: self.account.settle(transfer, lease, amount, self.now)):
            held = self.holds.pop(lease)
            self.spent += min(amount, held)

    @rule(transfer=transfer_ids, lease=account_leases)
    def release_hold(self, transfer: str, lease: LeaseId) -> None:
        if self._move(transfer, lambda: self.account.release_hold(transfer, lease, self.now)):
            self.holds.pop(lease)

    @invariant()
    def no_balance_is_ever_negative(self) -> None:
        account = self.account
        assert account.available >= 0 and account.held >= 0 and account.spent >= 0
        assert all(amount >= 0 for amount in account.holds.values())

    @invariant()
    def the_ledger_matches_the_model(self) -> None:
        account = self.account
        assert account.holds == self.holds
        assert account.held == sum(self.holds.values())
        assert (account.granted, account.spent) == (self.granted, self.spent)
        assert account.available == self.granted - account.held - self.spent


TestLeaseStateMachine = LeaseMachine.TestCase
TestLeaseStateMachine.settings = settings(SETTINGS, max_examples=150)
TestNodeStateMachine = NodeMachine.TestCase
TestNodeStateMachine.settings = SETTINGS
TestAccountStateMachine = AccountMachine.TestCase
TestAccountStateMachine.settings = SETTINGS
