"""A saved batch's placements in the scheduler's Prometheus series (workers.metrics)."""

from __future__ import annotations

import uuid

from workers.metrics import PROCESS, placed_many


def test_a_batch_counts_each_placement_and_its_wait_under_its_own_pool() -> None:
    a, b = f"pa-{uuid.uuid4().hex[:8]}", f"pb-{uuid.uuid4().hex[:8]}"
    placed_many([(a, 0.5), (b, 2.0), (a, 1.5), (a, -1.0)])  # a wait is never below zero

    def value(name: str, pool: str) -> float | None:
        return PROCESS.get_sample_value(name, {"pool": pool})

    assert value("pool_scheduler_placements_total", a) == 3.0
    assert value("pool_scheduler_placements_total", b) == 1.0
    assert value("pool_scheduler_request_to_reserved_seconds_count", a) == 3.0
    assert value("pool_scheduler_request_to_reserved_seconds_sum", a) == 2.0
    assert value("pool_scheduler_request_to_reserved_seconds_sum", b) == 2.0
    placed_many([])  # a batch of no placements leaves every series as it was
    assert value("pool_scheduler_placements_total", a) == 3.0
