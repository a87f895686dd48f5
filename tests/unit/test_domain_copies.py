"""A cheap copy of an aggregate (domain.copies) equals a deep copy and shares nothing mutable
with its original: mutating either never changes the other."""

from __future__ import annotations

from copy import deepcopy
from typing import Any

from domain import LeaseId, Node, NodeCapabilities, NodeId, PoolId, Resources, TenantId
from domain.account import TRANSFER_WINDOW, Account, TransferWindow
from domain.copies import copy_aggregate
from tests.unit.test_domain_lease import JOB, new_lease, running_lease

CAPS = NodeCapabilities(allocatable=Resources(cpu_millis=8000, memory_mib=32768, gpu_count=2))
SMALL = Resources(cpu_millis=2000, memory_mib=8192, gpu_count=1)


def state_of(agg: Any) -> dict[str, Any]:
    """The aggregate's state as it is now (deep-copied: later changes do not reach it)."""
    state = deepcopy({k: v for k, v in agg.__dict__.items() if k != "_pending_events"})
    if isinstance(state.get("recent_transfers"), TransferWindow):
        state["recent_transfers"] = list(state["recent_transfers"])
    return state


def saved(agg: Any) -> Any:
    """`agg` as the repository caches it: its events collected."""
    agg.collect_events()
    return agg


def funded() -> Account:
    account = Account.open(tenant_id=TenantId("acme"), now=0)
    account.grant("g1", 1_000, now=1)
    account.hold("h1", LeaseId("l1"), 100, now=2)
    account.hold("h2", LeaseId("l2"), 100, now=3)
    return saved(account)


def test_an_account_copy_equals_a_deep_copy() -> None:
    account = funded()
    assert state_of(copy_aggregate(account)) == state_of(deepcopy(account))


def test_changing_an_account_copy_leaves_its_original_alone() -> None:
    account = funded()
    before = state_of(account)
    copy = copy_aggregate(account)
    copy.settle("s1", LeaseId("l1"), 40, now=4)
    copy.grant("g2", 5, now=5)
    copy.hold("h3", LeaseId("l3"), 10, now=6)
    assert state_of(account) == before
    assert not account.has_seen("s1") and copy.has_seen("s1")
    assert account.hold_for(LeaseId("l1")) == 100 and copy.hold_for(LeaseId("l1")) == 0


def test_changing_an_account_original_leaves_its_copy_alone() -> None:
    account = funded()
    copy = copy_aggregate(account)
    before = state_of(copy)
    account.release_hold("r1", LeaseId("l2"), now=4)
    account.grant("g2", 5, now=5)
    assert state_of(copy) == before
    assert account.has_seen("r1") and not copy.has_seen("r1")


def test_copies_of_copies_keep_their_own_transfer_windows() -> None:
    account = funded()
    first = copy_aggregate(account)
    second = copy_aggregate(first)
    first.release_hold("r1", LeaseId("l1"), now=4)
    second.release_hold("r2", LeaseId("l2"), now=4)
    account.hold("h3", LeaseId("l3"), 1, now=5)
    assert list(account.recent_transfers) == ["h1", "h2", "h3"]
    assert list(first.recent_transfers) == ["h1", "h2", "r1"]
    assert list(second.recent_transfers) == ["h1", "h2", "r2"]


def test_a_shared_transfer_window_still_forgets_its_oldest_when_full() -> None:
    window = TransferWindow(f"t{i}" for i in range(TRANSFER_WINDOW))
    copy = window.copy()
    copy.add("new")
    assert "t0" not in copy and "new" in copy and len(copy) == TRANSFER_WINDOW
    assert "t0" in window and "new" not in window and len(window) == TRANSFER_WINDOW


def new_node() -> Node:
    node = Node.register(node_id=NodeId("n1"), pool_id=PoolId("gpu"), capabilities=CAPS, now=0)
    node.allocate(LeaseId("l1"), SMALL, now=1)
    return saved(node)


def test_a_node_copy_equals_a_deep_copy() -> None:
    node = new_node()
    assert state_of(copy_aggregate(node)) == state_of(deepcopy(node))


def test_changing_a_node_copy_leaves_its_original_alone() -> None:
    node = new_node()
    before = state_of(node)
    copy = copy_aggregate(node)
    copy.allocate(LeaseId("l2"), SMALL, now=2)
    copy.free(LeaseId("l1"), now=3)
    copy.cordon(now=4, reason="test")
    assert state_of(node) == before
    assert node.allocated == SMALL and copy.allocated == SMALL


def test_changing_a_node_original_leaves_its_copy_alone() -> None:
    node = new_node()
    copy = copy_aggregate(node)
    before = state_of(copy)
    node.free(LeaseId("l1"), now=2)
    node.allocate(LeaseId("l3"), SMALL + SMALL, now=3)
    assert state_of(copy) == before


def test_a_lease_copy_equals_a_deep_copy() -> None:
    lease = saved(running_lease())
    assert state_of(copy_aggregate(lease)) == state_of(deepcopy(lease))


def test_changing_a_lease_copy_leaves_its_original_alone() -> None:
    lease = saved(new_lease())
    lease.queue(1)
    saved(lease)
    before = state_of(lease)
    copy = copy_aggregate(lease)
    copy.reserve(2, node_id=NodeId("n1"), commit_timeout_seconds=30, hold_microcredits=500)
    copy.commit(10, JOB)
    copy.release(20, exit_code=0)
    assert state_of(lease) == before
    assert copy.version > lease.version


def test_changing_a_lease_original_leaves_its_copy_alone() -> None:
    lease = saved(running_lease())
    copy = copy_aggregate(lease)
    before = state_of(copy)
    lease.release(20, exit_code=0)
    assert state_of(copy) == before


def test_pending_events_are_not_shared() -> None:
    account = funded()
    copy = copy_aggregate(account)
    copy.grant("g2", 5, now=5)
    assert account.pending_events == [] and len(copy.pending_events) == 1
