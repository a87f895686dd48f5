"""The scheduler's planner: a pool's queue and state in, plans out — reservations, credit
holds, rejections, preemption notices and every waiting request's reasons — with no I/O, no
clock and no lock (docs/architecture.md#the-scheduler).

`Planner.plan(state, pool, now)` walks the pool's fair queue once and yields a `Plan` each
time one fills an atomic batch (MAX_MESSAGES_PER_BATCH), then the rest: whoever saves a plan
may send it while the next is planned. The planner records its decisions on the leases (the
domain's own events) and on the state it is given (the node table, the queue's usage, the
reasons `why` answers), so the next decision sees them; saving, and undoing a plan whose save
was refused, are the batch writer's (workers.scheduler.batches).
"""

from __future__ import annotations

from workers.scheduler.placing import PoolPass
from workers.scheduler.plan import Plan, PlanState
from workers.scheduler.state import PoolState

__all__ = ["Plan", "PlanState", "Planner", "PoolPass"]


class Planner:
    """The placement policy's settings, and `plan`: one pass over a pool's queue."""

    def __init__(self, *, backfill: bool = True, max_examined_per_cycle: int = 5000,
                 max_preemption_plans_per_cycle: int = 32, estimate_starts: bool = True,
                 stop_when_nothing_fits: bool = False) -> None:
        # EASY backfill (domain.policy.backfill): off, a later request may take capacity a
        # blocked wide one is gathering; waiting requests get a position and a start
        # estimate either way
        self.backfill = backfill
        self.max_examined_per_cycle = max_examined_per_cycle
        # a waiting request's estimated start (its reasons' `queue`, for `why`) is a walk over
        # every candidate node's leases once per shape a cycle; off (the policy simulator,
        # which reads no reasons), only a backfill head's reservation start is given, and the
        # placements are the same (tests/unit/test_planner_misses.py)
        self.estimate_starts = estimate_starts
        # stop a pass without backfill or preemption once every shape still queued fit
        # nowhere (placing.NothingFits): the same placements, but the requests left unpopped
        # keep the last cycle's reasons and positions, so only for a planner that no one asks
        # `why` of (the policy simulator); tests/unit/test_planner_misses.py
        self.stop_when_nothing_fits = stop_when_nothing_fits
        # planning a preemption walks every busy node's leases: bound that work per cycle
        self.max_preemption_plans_per_cycle = max_preemption_plans_per_cycle
        self.plans_left = 0

    def begin_cycle(self) -> None:
        """A new cycle: its budget of preemption plans (all pools together)."""
        self.plans_left = self.max_preemption_plans_per_cycle

    def plan(self, state: PlanState, ps: PoolState, now: float) -> PoolPass:
        """The pass over `ps`'s queue at `now`: iterate it for its plans; once done, its
        `waiting` says how many requests it left in line."""
        return PoolPass(self, state, ps, now)
