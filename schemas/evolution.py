"""How stored events evolve: eventsourcing's class_version and upcast_vN_vN+1 convention.
Why history is never rewritten: docs/architecture.md#wire-types-and-their-evolution.
"""

from __future__ import annotations

from typing import Any

from eventsourcing.domain import Aggregate

from schemas.v1 import PoolConfig


class PoolPolicy(Aggregate):
    """A pool's scheduling policy as an event-sourced aggregate (the versioning example)."""

    # Snapshots record the aggregate's class_version too, so old snapshots upcast like events.
    class_version = 2

    def __init__(self, pool_id: str) -> None:
        self.pool_id = pool_id
        self.packing = "best-fit"
        self.commit_timeout_seconds = 30
        self.aging_seconds_per_rank = 0

    @staticmethod
    def upcast_v1_v2(state: dict[str, Any]) -> None:
        # v1 aggregates had no aging; 0 means "aging disabled", exactly v1's behaviour.
        state["aging_seconds_per_rank"] = 0

    class PolicySet(Aggregate.Event):
        """The pool's policy was replaced (v2 added aging_seconds_per_rank)."""

        # Bump with every change to the fields, and add the matching upcast_vN_vN+1.
        class_version = 2

        packing: str
        commit_timeout_seconds: int
        aging_seconds_per_rank: int

        @staticmethod
        def upcast_v1_v2(state: dict[str, Any]) -> None:
            # A v1 writer never aged requests: the default keeps replayed history meaning that.
            state["aging_seconds_per_rank"] = 0

        def apply(self, aggregate: Aggregate) -> None:
            assert isinstance(aggregate, PoolPolicy)
            aggregate.packing = self.packing
            aggregate.commit_timeout_seconds = self.commit_timeout_seconds
            aggregate.aging_seconds_per_rank = self.aging_seconds_per_rank

    def set_policy(self, config: PoolConfig) -> None:
        self.trigger_event(
            self.PolicySet,
            packing=config.packing,
            commit_timeout_seconds=config.commit_timeout_seconds,
            aging_seconds_per_rank=config.aging_seconds_per_rank,
        )
