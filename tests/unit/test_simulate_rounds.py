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
