"""Leases that wait for other leases (`--after ID[:ok|:any|:notok]`): what a dependency asks
of the lease it names, and the pure verdict over how those leases ended."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from domain.errors import InvalidAmount

# ok: the named lease succeeded; notok: it ended any other way; any: it ended
DEPENDENCY_CONDITIONS: tuple[str, ...] = ("ok", "any", "notok")
WAITING_FOR_DEPENDENCY = "waiting_for_dependency"
DEPENDENCY_FAILED = "dependency_failed"
MAX_DEPENDENCIES = 64

Verdict = Literal["satisfied", "failed", "waiting"]


@dataclass(frozen=True)
class Dependency:
    """Wait for lease `lease_id` to end as `condition` says."""

    lease_id: str
    condition: str = "ok"

    def __post_init__(self) -> None:
        if self.condition not in DEPENDENCY_CONDITIONS:
            raise InvalidAmount(f"unknown dependency condition {self.condition!r}: one of "
                                f"{', '.join(DEPENDENCY_CONDITIONS)}", reasons=("after",))

    def to_list(self) -> list[str]:
        return [self.lease_id, self.condition]

    @classmethod
    def from_value(cls, value: Any) -> Dependency:
        lease_id, condition = value
        return cls(str(lease_id), str(condition))

    def holds(self, end_reason: str | None) -> bool | None:
        """Whether the dependency is met by a lease that ended with `end_reason`: True, False
        (it never will be), or None while that lease has not ended."""
        if end_reason is None:
            return None
        if self.condition == "any":
            return True
        return (end_reason == "succeeded") == (self.condition == "ok")


def verdict(ends: list[tuple[Dependency, str | None]]) -> tuple[Verdict, str | None]:
    """Over each dependency and how its lease ended (None: not yet): satisfied when all hold,
    failed (naming the first lease that broke it) when any never will, else waiting (naming
    the first lease still waited for)."""
    waiting_for: str | None = None
    for dep, end_reason in ends:
        held = dep.holds(end_reason)
        if held is False:
            return "failed", dep.lease_id
        if held is None and waiting_for is None:
            waiting_for = dep.lease_id
    if waiting_for is not None:
        return "waiting", waiting_for
    return "satisfied", None
