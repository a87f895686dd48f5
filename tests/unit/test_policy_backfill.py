"""EASY backfill: reservations at the earliest end that frees enough, and placements that cannot
delay them."""

from __future__ import annotations

from domain.lease import Lease
from domain.policy.backfill import Backfill, LeaseEnd, band_of, lease_end_estimate
from domain.policy.placement import NodeTable
from domain.resources import NodeCapabilities, NodeId, PoolId, Resources, Shape, TenantId


def gpus(n: int) -> Resources:
    return Resources(gpu_count=n)


def shape(n: int) -> Shape:
    return Shape.build(gpu_count=n)


class Pool:
    """A NodeTable plus the end estimate of every lease on it."""

    def __init__(self, *nodes: tuple[str, int]) -> None:
        self.table = NodeTable()
        self.ends: dict[str, LeaseEnd] = {}
        for node_id, count in nodes:
            self.table.add_or_update_node(node_id, NodeCapabilities(allocatable=gpus(count)))

    def run(self, node_id: str, lease_id: str, count: int, end: float | None) -> None:
        self.table.allocate(node_id, lease_id, gpus(count))
        self.ends[lease_id] = (gpus(count), end)

    def backfill(self, now: float = 0.0) -> Backfill:
        bf = Backfill(self.table, self.ends.get)
        bf.begin(now, queued=lambda _lid: True)
        return bf


def test_a_blocked_head_is_reserved_when_enough_capacity_frees() -> None:
    pool = Pool(("a", 8))
    pool.run("a", "x", 4, end=100.0)
    pool.run("a", "y", 4, end=200.0)
    bf = pool.backfill()
    r = bf.blocked("head", shape(6), band=0)
    assert r is not None
    assert (r.node_id, r.start_at) == ("a", 200.0)  # 4 free at 100 is not enough for 6


def test_the_earliest_node_is_chosen_for_the_reservation() -> None:
    pool = Pool(("late", 8), ("soon", 8))
    pool.run("late", "x", 8, end=500.0)
    pool.run("soon", "y", 8, end=50.0)
    r = pool.backfill().blocked("head", shape(8), band=0)
    assert r is not None and (r.node_id, r.start_at) == ("soon", 50.0)


def test_a_later_request_that_would_delay_the_reservation_is_held_back() -> None:
    pool = Pool(("a", 8))
    pool.run("a", "x", 6, end=100.0)
    bf = pool.backfill()
    assert bf.blocked("wide", shape(8), band=0) is not None
    node, _, held = bf.place(shape(2), 300.0, packing="best-fit", allowed_trust_levels=None)
    assert (node, held) == (None, True)


def test_a_later_request_that_ends_before_the_reservation_is_placed() -> None:
    pool = Pool(("a", 8))
    pool.run("a", "x", 6, end=100.0)
    bf = pool.backfill()
    assert bf.blocked("wide", shape(8), band=0) is not None
    node, _, held = bf.place(shape(2), 90.0, packing="best-fit", allowed_trust_levels=None)
    assert (node, held) == ("a", False)


def test_a_later_request_that_fits_beside_the_reservation_is_placed() -> None:
    pool = Pool(("a", 8))
    pool.run("a", "x", 6, end=100.0)
    bf = pool.backfill()
    assert bf.blocked("half", shape(4), band=0) is not None  # at 100: 8 free, 4 promised
    assert bf.admits("a", gpus(2), end_at=None)  # 8 - 4 - 2 ≥ 0 even if it never ends
    pool.run("a", "long", 2, end=None)
    assert not bf.admits("a", gpus(3), end_at=1000.0)  # would leave 8 - 2 - 4 - 3 < 0


def test_a_request_goes_to_another_node_rather_than_delay_the_reservation() -> None:
    pool = Pool(("full", 8), ("small", 4))
    pool.run("full", "x", 7, end=100.0)  # best fit for 1 GPU: the fuller node
    bf = pool.backfill()
    r = bf.blocked("wide", shape(8), band=0)
    assert r is not None and r.node_id == "full"
    node, _, held = bf.place(shape(1), 500.0, packing="best-fit", allowed_trust_levels=None)
    assert (node, held) == ("small", False)


def test_the_head_keeps_its_reservation_while_others_fail_after_it() -> None:
    pool = Pool(("a", 8))
    pool.run("a", "x", 8, end=100.0)
    bf = pool.backfill()
    assert bf.blocked("first", shape(8), band=0) is not None
    assert bf.blocked("second", shape(1), band=0) is None  # waits behind the head
    bf.begin(10.0, queued=lambda _lid: True)  # the next cycle: the head is kept
    assert bf.blocked("second", shape(1), band=0) is None
    held = bf.reservation_of("first")
    assert held is not None and held.start_at == 100.0


def test_each_band_has_its_own_head() -> None:
    pool = Pool(("a", 8), ("b", 8))
    pool.run("a", "x", 8, end=100.0)
    pool.run("b", "y", 8, end=200.0)
    bf = pool.backfill()
    high = bf.blocked("high", shape(8), band=2)
    low = bf.blocked("low", shape(8), band=0)
    assert high is not None and low is not None
    assert (high.node_id, low.node_id) == ("a", "b")  # a node is not promised twice


def test_a_lower_bands_head_never_holds_back_a_higher_bands_request() -> None:
    """A head kept from an earlier cycle protects its start from its own band and below; a
    request of a higher band, which the queue offers first, is placed over it (a preempted
    low-priority lease once took back the node freed for the request that preempted it)."""
    pool = Pool(("a", 8))
    pool.run("a", "x", 6, end=100.0)
    bf = pool.backfill()
    assert bf.blocked("low", shape(8), band=0) is not None
    bf.begin(10.0, queued=lambda _lid: True)  # the next cycle keeps the low head
    node, _, held = bf.place(shape(2), 300.0, packing="best-fit", allowed_trust_levels=None,
                             band=2)
    assert (node, held) == ("a", False)
    node, _, held = bf.place(shape(2), 300.0, packing="best-fit", allowed_trust_levels=None,
                             band=0)
    assert (node, held) == (None, True)


def test_a_head_the_queue_offers_later_never_holds_back_a_fairer_request() -> None:
    """A head kept from an earlier cycle, when its tenant was the one furthest below its
    share, is re-reserved on the node that frees first; a request of its band that the fair
    queue now offers before it (its tenant is now further below its share) takes that node.
    Kept heads once took every freed node in turn, and weights 3:2 placed as 1:1."""
    pool = Pool(("a", 8), ("b", 8))
    pool.run("a", "x", 8, end=100.0)
    pool.run("b", "y", 8, end=200.0)
    bf = pool.backfill()
    assert bf.blocked("globex-head", shape(8), band=0) is not None
    pool.table.free("x")  # x ended early: node a is free now
    waiting = {"globex-head", "acme-next"}
    bf.begin(10.0, queued=waiting.__contains__)  # the head is kept, re-reserved on a
    held_on = bf.reservation_of("globex-head")
    assert held_on is not None and held_on.node_id == "a"
    node, _, held = bf.place(shape(8), 300.0, packing="best-fit", allowed_trust_levels=None,
                             lease_id="acme-next", band=0)
    assert (node, held) == (None, True)  # without the queue's order, the head holds it back
    waiting.discard("acme-next")  # acme's request is offered first: it is fairer now
    node, _, held = bf.place(shape(8), 300.0, packing="best-fit", allowed_trust_levels=None,
                             lease_id="acme-next", band=0, offered_later=waiting.__contains__)
    assert (node, held) == ("a", False)


def test_a_head_that_left_the_queue_gives_up_its_reservation() -> None:
    pool = Pool(("a", 8))
    pool.run("a", "x", 8, end=100.0)
    bf = pool.backfill()
    assert bf.blocked("gone", shape(8), band=0) is not None
    bf.begin(1.0, queued=lambda lid: lid != "gone")
    assert bf.reservations == {}
    assert bf.blocked("next", shape(8), band=0) is not None


def test_a_placed_head_frees_its_band_for_the_next_one() -> None:
    pool = Pool(("a", 8))
    pool.run("a", "x", 8, end=100.0)
    bf = pool.backfill()
    assert bf.blocked("head", shape(8), band=0) is not None
    bf.placed("head")
    assert bf.reservation_of("head") is None
    assert bf.admits("a", gpus(1), end_at=10_000.0)


def test_the_head_itself_may_use_its_reserved_capacity() -> None:
    pool = Pool(("a", 8))
    pool.run("a", "x", 4, end=100.0)
    bf = pool.backfill()
    assert bf.blocked("head", shape(8), band=0) is not None
    pool.table.free("x")
    node, _, _ = bf.place(shape(8), 900.0, packing="best-fit", allowed_trust_levels=None,
                          lease_id="head")
    assert node == "a"


def test_capacity_held_by_a_lease_with_no_end_never_counts_as_freed() -> None:
    pool = Pool(("a", 8))
    pool.run("a", "forever", 8, end=None)
    assert pool.backfill().blocked("head", shape(1), band=0) is None


def _lease(max_runtime: int = 3600) -> Lease:
    return Lease.request(tenant_id=TenantId("t"), pool_id=PoolId("p"), idempotency_key="k",
                         shape=shape(1), maximum_runtime_seconds=max_runtime, now=0.0)


def test_a_reserved_lease_ends_by_its_commit_deadline_plus_its_maximum_runtime() -> None:
    lease = _lease()
    lease.queue(0.0)
    lease.reserve(10.0, node_id=NodeId("a"), commit_timeout_seconds=30, hold_microcredits=0)
    assert lease_end_estimate(lease) == 10.0 + 30 + 3600


def test_a_running_lease_ends_by_its_maximum_runtime_whatever_its_term() -> None:
    lease = _lease()
    lease.queue(0.0)
    lease.reserve(10.0, node_id=NodeId("a"), commit_timeout_seconds=30, hold_microcredits=0)
    lease.commit(20.0)
    assert lease_end_estimate(lease) == 20.0 + 3600


def test_aging_moves_a_request_into_a_higher_band() -> None:
    ranks = {"low": 0, "high": 2}
    assert band_of("low", 0.0, 50.0, ranks, 100.0) == 0
    assert band_of("low", 0.0, 250.0, ranks, 100.0) == 2
    assert band_of("unknown", 0.0, 0.0, ranks, 0.0) == 0


def test_on_a_large_pool_only_the_nodes_nearest_to_fitting_are_walked() -> None:
    nodes = [(f"n{i:03d}", 8) for i in range(200)]
    pool = Pool(*nodes)
    for i, (node_id, _) in enumerate(nodes):
        # every node full; n150 has the most free already (2 of 8) and frees soonest
        used = 6 if node_id == "n150" else 8
        pool.run(node_id, f"l{i}", used, end=50.0 if node_id == "n150" else 1000.0 + i)
    asked: list[str] = []
    ends = pool.ends.get

    def counting(lid: str) -> LeaseEnd | None:
        asked.append(lid)
        return ends(lid)

    bf = Backfill(pool.table, counting)
    bf.begin(0.0, queued=lambda _lid: True)
    r = bf.blocked("head", shape(8), band=0)
    assert r is not None and (r.node_id, r.start_at) == ("n150", 50.0)
    assert len(set(asked)) <= 64


def test_a_deeper_band_holds_a_reservation_for_each_of_its_first_blocked_requests() -> None:
    pool = Pool(("a", 8), ("b", 8), ("c", 8))
    for node_id, end in (("a", 100.0), ("b", 200.0), ("c", 300.0)):
        pool.run(node_id, f"on-{node_id}", 8, end=end)
    bf = Backfill(pool.table, pool.ends.get, depth=2)
    bf.begin(0.0, queued=lambda _lid: True)
    first, second = bf.blocked("w1", shape(8), band=0), bf.blocked("w2", shape(8), band=0)
    assert first is not None and second is not None
    assert [(first.node_id, first.start_at), (second.node_id, second.start_at)] == [
        ("a", 100.0), ("b", 200.0)]
    assert bf.blocked("w3", shape(8), band=0) is None  # behind both heads
    bf.placed("w1")
    assert bf.blocked("w3", shape(8), band=0) is not None  # a head's place came free


def test_an_expired_lease_awaiting_its_agent_has_no_end_estimate() -> None:
    lease = _lease()
    lease.queue(0.0)
    lease.reserve(10.0, node_id=NodeId("a"), commit_timeout_seconds=30, hold_microcredits=0)
    lease.commit(20.0)
    lease.expire(20.0 + 3600, "deadline")
    lease.begin_reconciliation(20.0 + 3600)
    assert lease_end_estimate(lease) is None  # held until the agent confirms, however long


def test_a_shape_no_ready_node_could_hold_is_filtered_once_until_a_node_changes() -> None:
    # a deep queue of requests only a cordoned node could hold: the first finds no node to
    # reserve, the rest are told so without filtering every node again for each of them,
    # until a node's state changes (then it is reserved as before)
    pool = Pool(("small", 4), ("big", 8))
    pool.table.set_state("big", "cordoned")
    pool.run("small", "x", 4, end=100.0)
    bf = pool.backfill()
    filters = []
    real = pool.table.filter

    def counted(*args: object, **kw: object) -> object:
        filters.append(args)
        return real(*args, **kw)  # type: ignore[arg-type]

    pool.table.filter = counted  # type: ignore[method-assign]
    assert [bf.blocked(f"r{i}", shape(6), band=0) for i in range(50)] == [None] * 50
    assert len(filters) == 1
    pool.run("small", "y", 0, end=None)  # an allocation: who could ever hold it is the same
    assert bf.blocked("r50", shape(6), band=0) is None and len(filters) == 1
    pool.table.set_state("big", "ready")
    r = bf.blocked("r51", shape(6), band=0)
    assert r is not None and (r.node_id, r.start_at) == ("big", 0.0) and len(filters) == 2
