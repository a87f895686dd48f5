"""The simulated fleet beats as each node falls due, not in fixed rounds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from agents.simulate import MIN_ROUND_SECONDS, ROUND_SECONDS, SimulatedFleet, round_wait


def test_a_round_waits_until_the_next_beat_is_due_within_its_bounds() -> None:
    assert round_wait([100.04, 100.5], 100.0) == pytest.approx(0.04)
    # never longer than a round, never a spin on a beat already overdue
    assert round_wait([103.0], 100.0) == ROUND_SECONDS
    assert round_wait([99.0, 100.5], 100.0) == MIN_ROUND_SECONDS
    assert round_wait([], 100.0) == ROUND_SECONDS


def test_only_nodes_with_something_to_do_step() -> None:
    fleet = SimulatedFleet.__new__(SimulatedFleet)  # no connection: only its choice is tested
    node = {  # (commands waiting, workloads running, next beat)
        "idle": ([], {}, 105.0), "commanded": (["start"], {}, 105.0),
        "running": ([], {"l1": object()}, 105.0), "due": ([], {}, 100.0),
        "overdue": ([], {}, 90.0),
    }
    fleet.links = {n: SimpleNamespace(inbox=v[0]) for n, v in node.items()}
    fleet.agents = {n: SimpleNamespace(running=v[1], _next_beat=v[2]) for n, v in node.items()}
    assert fleet._busy(list(node), 100.0) == ["commanded", "running", "due", "overdue"]


def test_a_fleet_of_a_thousand_is_dealt_over_connections_under_the_servers_cap() -> None:
    from agents.simulate import FLEET_THREADS, NODES_PER_CONNECTION, connection_shares, fleet
    from bus.local.server import MAX_SUBSCRIPTIONS_PER_CONNECTION

    # a node's pull subscription each, and an inbox per request in flight, on one connection
    assert NODES_PER_CONNECTION + FLEET_THREADS + 1 < MAX_SUBSCRIPTIONS_PER_CONNECTION
    nodes = fleet(1000, "cpu")
    shares = connection_shares(nodes)
    assert all(0 < len(s) <= NODES_PER_CONNECTION for s in shares)
    assert [n for s in shares for n in s] == nodes  # every node once, in order
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert connection_shares(nodes[:5]) == [nodes[:5]]
    with pytest.raises(ValueError, match="at most"):
        SimulatedFleet("nats://127.0.0.1:1", fleet(NODES_PER_CONNECTION + 1, "cpu"),
                       pool_id="p")


def test_fleets_on_several_connections_report_as_one() -> None:
    from agents.simulate import fleets_stats

    def sim(nodes: int, silent: list[str], fetch_s: float) -> SimpleNamespace:
        return SimpleNamespace(stats=lambda: {"nodes": nodes, "silent": silent, "errors": 1,
                                              "last_fetch_s": fetch_s})

    assert fleets_stats([sim(500, ["b"], 0.2), sim(500, ["a"], 0.1)]) == {
        "nodes": 1000, "silent": ["a", "b"], "errors": 2, "last_fetch_s": 0.2}
