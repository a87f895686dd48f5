"""Placement policy: the pool's nodes as numpy columns, vectorised filtering and ranking.
Its cost is measured by bench/placement_micro.py.
"""

from domain.policy.placement.fast import NodeTable, remember_misses
from domain.policy.placement.table import (
    NODE_STATES,
    PREFERENCE_KINDS,
    FilterResult,
    NodeState,
    Packing,
)

__all__ = ["NODE_STATES", "PREFERENCE_KINDS", "FilterResult", "NodeState", "NodeTable", "Packing",
           "remember_misses"]
