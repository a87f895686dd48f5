"""A cohort of tenants in one pool: its own shared nominal quota and its reclaim policy.
Membership and borrowing: docs/quotas.md.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any
from uuid import UUID

from eventsourcing.domain import Aggregate, event

from domain.errors import InvalidConfiguration
from domain.quota import (
    RECLAIM_POLICIES,
    CohortQuota,
    limit_problems,
    limits,
    limits_from_event,
    limits_to_dict,
)
from domain.resources import PoolId

_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:computepool:cohort")


class Cohort(Aggregate):
    """One cohort's settings; each change an event (CohortSet)."""

    @staticmethod
    def create_id(pool_id: str, name: str) -> UUID:
        return uuid.uuid5(_NAMESPACE, json.dumps([str(pool_id), str(name)]))

    @classmethod
    def create(cls, *, pool_id: PoolId, name: str, now: float,
               nominal: Mapping[str, int] | None = None, reclaim: str = "any") -> Cohort:
        fields = _settings(nominal, reclaim)
        return cls(pool_id=str(pool_id), name=str(name), created_at=float(now), **fields)

    @event("CohortCreated")
    def __init__(self, pool_id: str, name: str, created_at: float,
                 nominal: dict[str, Any], reclaim: str) -> None:
        self.pool_id = PoolId(pool_id)
        self.name = name
        self.nominal = limits_from_event(nominal) or ()
        self.reclaim = reclaim

    def configure(self, *, now: float, nominal: Mapping[str, int] | None = None,
                  reclaim: str = "any") -> None:
        """Replace the cohort's settings as a whole."""
        self._set(at=float(now), **_settings(nominal, reclaim))

    @property
    def quota(self) -> CohortQuota:
        return CohortQuota(self.name, self.nominal, self.reclaim)

    @event("CohortSet")
    def _set(self, at: float, nominal: dict[str, Any], reclaim: str) -> None:
        self.nominal = limits_from_event(nominal) or ()
        self.reclaim = reclaim


def _settings(nominal: Mapping[str, int] | None, reclaim: str) -> dict[str, Any]:
    value = limits(nominal) or ()
    found = limit_problems("cohort nominal", value)
    if reclaim not in RECLAIM_POLICIES:
        found.append(f"reclaim must be one of {', '.join(RECLAIM_POLICIES)}")
    if found:
        raise InvalidConfiguration("; ".join(found), reasons=found)
    return {"nominal": limits_to_dict(value) or {}, "reclaim": reclaim}
