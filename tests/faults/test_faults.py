"""The fault suite at its --quick sizes, one test per scenario (`pytest -m faults`).

Each runs real processes (nats-servers, `pool serve`, projectors, an agent, PostgreSQL) and
judges the run from the log; the failure message is the scenario's line of figures.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from chaos.harness import percentile
from chaos.suite import NAMES, run_scenario
from projections.decisions import check_placements

# judged on their timing beside a run of the same load alone (a p99 within 2×, a failover's
# time): the README's test command runs these after the rest, with nothing beside them
ALONE = {1, 10}


@pytest.mark.faults
@pytest.mark.parametrize("number", [
    pytest.param(n, marks=[pytest.mark.alone] if n in ALONE else [], id=f"{n}-{NAMES[n]}")
    for n in sorted(NAMES)])
def test_the_quick_fault_scenario_holds(number: int) -> None:
    outcome = run_scenario(number, quick=True)
    if outcome.skipped is not None:
        pytest.skip(outcome.line())
    assert outcome.passed, outcome.line()


def test_p99_is_the_nearest_rank_so_a_few_samples_report_their_worst() -> None:
    assert percentile([0.5, 2.0, 1.0], 99) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0
    assert percentile([], 99) == 0.0


class _FakeLog:
    """Just enough of a PoolApp for the replay: notifications and their decoded events."""

    def __init__(self, events: list[tuple[str, dict[str, object]]]) -> None:
        self.rows = [SimpleNamespace(id=i + 1, topic=f"domain.node:Node.{name}",
                                     originator_id=fields.pop("node"), event=fields)
                     for i, (name, fields) in enumerate(events)]
        self.recorder = SimpleNamespace(select_notifications=self._select)
        self.mapper = SimpleNamespace(
            to_domain_event=lambda n: SimpleNamespace(originator_id=n.originator_id, **n.event))

    def _select(self, start: int, limit: int) -> list[SimpleNamespace]:
        return self.rows[start - 1:start - 1 + limit]


def test_the_replay_finds_a_node_over_its_allocatable_and_a_lease_held_twice() -> None:
    cpu = {"cpu_millis": 4000, "memory_mib": 4096}
    one = {"cpu_millis": 3000, "memory_mib": 1024}
    log = _FakeLog([
        ("NodeRegistered", {"node": "n1", "node_id": "n1", "capabilities": {"allocatable": cpu}}),
        ("NodeRegistered", {"node": "n2", "node_id": "n2", "capabilities": {"allocatable": cpu}}),
        ("CapacityAllocated", {"node": "n1", "lease_id": "a", "resources": one}),
        ("CapacityFreed", {"node": "n1", "lease_id": "a"}),
        ("CapacityAllocated", {"node": "n1", "lease_id": "b", "resources": one}),
        ("CapacityAllocated", {"node": "n1", "lease_id": "c", "resources": one}),  # 6000 > 4000
        ("CapacityAllocated", {"node": "n2", "lease_id": "b", "resources": one}),  # b twice
    ])
    report = check_placements(log)
    assert report.placements == 4
    assert len(report.over_allocations) == 1 and "n1" in report.over_allocations[0]
    assert len(report.double_holds) == 1 and "lease b" in report.double_holds[0]
    assert report.double_placements == 2


def test_the_replay_checks_each_lease_of_a_batched_node_allocation() -> None:
    cpu = {"cpu_millis": 4000, "memory_mib": 4096}
    one = {"cpu_millis": 1500, "memory_mib": 1024}
    log = _FakeLog([
        ("NodeRegistered", {"node": "n1", "node_id": "n1", "capabilities": {"allocatable": cpu}}),
        ("NodeRegistered", {"node": "n2", "node_id": "n2", "capabilities": {"allocatable": cpu}}),
        ("CapacityAllocatedBatch", {"node": "n1", "allocations": [["a", one], ["b", one]]}),
        ("CapacityAllocatedBatch", {"node": "n2", "allocations": [["c", one], ["a", one]]}),
        ("CapacityAllocatedBatch", {"node": "n1", "allocations": [["d", one]]}),  # 4500 > 4000
    ])
    report = check_placements(log)
    assert report.placements == 5
    assert len(report.double_holds) == 1 and "lease a" in report.double_holds[0]
    assert len(report.over_allocations) == 1 and "n1" in report.over_allocations[0]
