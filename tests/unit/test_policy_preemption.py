"""choose_victims: least work lost, minimal sets, priority, fair share, minimum runtime.

Times are plain seconds; `now` is passed in.
"""

from __future__ import annotations

from domain.policy import NodeCandidate, NodeTable, RunningLease, choose_victims
from domain.resources import NodeCapabilities, Resources, Shape

NOW = 10_000.0
WANT4 = Shape.build(cpu_millis=4000)


def lease(lid: str, cpu: int, started: float, *, rank: int = 0, tenant: str = "t",
          ckpt: float | None = None, checkpointable: bool = False) -> RunningLease:
    return RunningLease(lid, tenant, rank, Resources(cpu_millis=cpu), started, ckpt,
                        checkpointable)


def node(nid: str, free: int, *leases: RunningLease) -> NodeCandidate:
    return NodeCandidate(nid, Resources(cpu_millis=free), leases)


def choose(*nodes: NodeCandidate, rank: int = 1, over: set[str] | None = None,
           min_runtime: float = 0.0, tenant: str | None = None) -> tuple[str, list[str]] | None:
    plan = choose_victims(WANT4, nodes, rank, over or set(), min_runtime, NOW,
                          requester_tenant=tenant)
    return None if plan is None else (plan.node_id, sorted(plan.victim_ids))


def test_preemption_picks_the_victim_that_loses_least_work() -> None:
    n = node("n", 0, lease("old", 4000, NOW - 5000), lease("young", 4000, NOW - 100))
    assert choose(n) == ("n", ["young"])


def test_preemption_picks_the_node_whose_plan_loses_least_in_total() -> None:
    a = node("a", 2000, lease("a1", 2000, NOW - 300))
    b = node("b", 0, lease("b1", 2000, NOW - 100), lease("b2", 2000, NOW - 100))
    plan = choose_victims(WANT4, [a, b], 1, set(), 0, NOW)
    assert plan is not None and plan.node_id == "b" and plan.work_lost_seconds == 200


def test_ties_in_work_lost_go_to_the_plan_with_fewer_victims() -> None:
    a = node("a", 0, lease("a1", 2000, NOW - 50), lease("a2", 2000, NOW - 50))
    b = node("b", 0, lease("b1", 4000, NOW - 100))
    assert choose(a, b) == ("b", ["b1"])


def test_the_victim_set_is_minimal() -> None:
    # Greedy by least loss takes small1, small2, then big; big alone suffices with small1.
    n = node("n", 0, lease("small1", 1000, NOW - 10), lease("small2", 1000, NOW - 20),
             lease("big", 3000, NOW - 30))
    assert choose(n) == ("n", ["big", "small1"])


def test_preemption_respects_min_runtime() -> None:
    n = node("n", 0, lease("fresh", 4000, NOW - 30), lease("settled", 4000, NOW - 600))
    assert choose(n, min_runtime=60) == ("n", ["settled"])
    assert choose(node("n", 0, lease("fresh", 4000, NOW - 30)), min_runtime=60) is None


def test_preemption_never_takes_equal_or_higher_priority_of_a_fair_tenant() -> None:
    n = node("n", 0, lease("same", 4000, NOW - 10, rank=1), lease("higher", 4000, NOW, rank=2))
    assert choose(n, rank=1) is None
    assert choose(node("n", 0, lease("lower", 4000, NOW - 9999, rank=0)), rank=1) == (
        "n", ["lower"])


def test_a_tenant_above_its_fair_share_can_lose_same_priority_leases() -> None:
    n = node("n", 0, lease("greedy", 4000, NOW - 10, rank=1, tenant="g"))
    assert choose(n, rank=1) is None
    assert choose(n, rank=1, over={"g"}) == ("n", ["greedy"])
    assert choose(n, rank=1, over={"g"}, tenant="g") is None  # not its own leases
    high = node("n", 0, lease("greedy-high", 4000, NOW - 10, rank=2, tenant="g"))
    assert choose(high, rank=1, over={"g"}) is None


def test_preemption_prefers_a_recently_checkpointed_victim() -> None:
    n = node(
        "n", 0,
        lease("no-ckpt", 4000, NOW - 600),
        lease("ckpt", 4000, NOW - 6000, ckpt=NOW - 60, checkpointable=True),
        # A checkpoint time on a lease that cannot restore from it counts for nothing.
        lease("fake-ckpt", 4000, NOW - 3000, ckpt=NOW - 1, checkpointable=False),
    )
    plan = choose_victims(WANT4, [n], 1, set(), 0, NOW)
    assert plan is not None and plan.victim_ids == ("ckpt",) and plan.work_lost_seconds == 60


def test_no_plan_when_preemptible_leases_cannot_free_enough() -> None:
    n = node("n", 1000, lease("a", 1000, NOW - 10), lease("keep", 2000, NOW - 10, rank=5))
    assert choose(n) is None
    assert choose() is None


def test_a_node_that_already_fits_needs_no_victims() -> None:
    plan = choose_victims(WANT4, [node("n", 4000, lease("a", 1000, NOW))], 1, set(), 0, NOW)
    assert plan is not None and plan.victims == () and plan.work_lost_seconds == 0


def test_busy_nodes_from_the_table_feed_preemption() -> None:
    table = NodeTable()
    table.add_or_update_node("n1", NodeCapabilities(Resources(cpu_millis=4000)))
    table.add_or_update_node("tiny", NodeCapabilities(Resources(cpu_millis=1000)))
    table.allocate("n1", "l1", Resources(cpu_millis=3000))
    res = table.filter(WANT4)
    assert not res.satisfiable_now and res.busy.tolist() == [0]
    running = {"l1": lease("l1", 3000, NOW - 100)}
    cands = [
        NodeCandidate(table.node_id_at(int(i)), table.free_resources(table.node_id_at(int(i))),
                      tuple(running[lid] for lid in table.leases_on(table.node_id_at(int(i)))))
        for i in res.busy
    ]
    plan = choose_victims(WANT4, cands, 1, set(), 0, NOW)
    assert plan is not None and plan.node_id == "n1" and plan.victim_ids == ("l1",)
