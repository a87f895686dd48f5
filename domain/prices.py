"""A pool's prices (`PriceList`): integer micro-credits per second of each resource, and the
charge for a shape over a time, always rounded up so a hold covers its charge."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from domain.errors import PriceNotListed
from domain.resources import Resources

FALLBACK = "*"  # price-table key used for a GPU model or partition profile not listed

# Prices are per second of one unit; resources come in millis / MiB, so the sum is kept over a
# common denominator and divided (rounding up) once, never per term.
_CPU_UNIT = 1000  # millis per core
_MEMORY_UNIT = 1024  # MiB per GiB
_DENOMINATOR = _CPU_UNIT * _MEMORY_UNIT


@dataclass(frozen=True)
class PriceList:
    """Micro-credits per second: per core (1000 cpu_millis), per GiB of memory, per GiB of local
    disk, per whole GPU by model and per GPU partition by profile ("*" prices any unlisted)."""

    cpu_core_second: int = 0
    memory_gib_second: int = 0
    local_disk_gib_second: int = 0
    gpu_second: tuple[tuple[str, int], ...] = ((FALLBACK, 0),)  # sorted (model, price)
    gpu_partition_second: tuple[tuple[str, int], ...] = ((FALLBACK, 0),)  # (profile, price)

    def __post_init__(self) -> None:
        for name in ("gpu_second", "gpu_partition_second"):
            table = tuple(sorted((str(k), int(v)) for k, v in dict(getattr(self, name)).items()))
            object.__setattr__(self, name, table)

    def problems(self) -> list[str]:
        prices = [self.cpu_core_second, self.memory_gib_second, self.local_disk_gib_second]
        prices += [v for _, v in self.gpu_second] + [v for _, v in self.gpu_partition_second]
        if any(not isinstance(p, int) or isinstance(p, bool) or p < 0 for p in prices):
            return ["prices must be non-negative integers"]
        return []

    def gpu_price(self, model: str | None) -> int:
        """Price of one GPU-second. An unknown model (None: "any") is priced at the dearest
        listed model, so a hold made before placement still covers the charge."""
        table = dict(self.gpu_second)
        if model is None:
            if not table:
                raise PriceNotListed("no GPU prices are listed", reasons=("gpu_count",))
            return max(table.values())
        return _lookup(table, model, "gpu_count")

    def partition_price(self, profile: str) -> int:
        return _lookup(dict(self.gpu_partition_second), profile, f"gpu/{profile}")

    def charge(self, resources: Resources, seconds: float, *, gpu_model: str | None) -> int:
        """What `resources` cost for `seconds`, billed per started second, rounded up."""
        whole_seconds = max(0, math.ceil(seconds))
        numerator = (
            resources.cpu_millis * self.cpu_core_second * _MEMORY_UNIT
            + resources.memory_mib * self.memory_gib_second * _CPU_UNIT
            + resources.local_disk_gib * self.local_disk_gib_second * _DENOMINATOR
        )
        if resources.gpu_count:
            numerator += resources.gpu_count * self.gpu_price(gpu_model) * _DENOMINATOR
        for dimension, amount in resources.extended:
            if not dimension.startswith("gpu/"):
                raise PriceNotListed(f"no price for dimension {dimension}", reasons=(dimension,))
            numerator += amount * self.partition_price(dimension[4:]) * _DENOMINATOR
        return -(-numerator * whole_seconds // _DENOMINATOR)

    def to_dict(self) -> dict[str, Any]:
        return {
            "cpu_core_second": self.cpu_core_second,
            "memory_gib_second": self.memory_gib_second,
            "local_disk_gib_second": self.local_disk_gib_second,
            "gpu_second": {k: v for k, v in self.gpu_second},
            "gpu_partition_second": {k: v for k, v in self.gpu_partition_second},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PriceList:
        return cls(
            cpu_core_second=int(d.get("cpu_core_second", 0)),
            memory_gib_second=int(d.get("memory_gib_second", 0)),
            local_disk_gib_second=int(d.get("local_disk_gib_second", 0)),
            gpu_second=tuple(dict(d.get("gpu_second", {FALLBACK: 0})).items()),
            gpu_partition_second=tuple(dict(d.get("gpu_partition_second", {FALLBACK: 0})).items()),
        )


def _lookup(table: dict[str, int], key: str, dimension: str) -> int:
    if key in table:
        return table[key]
    if FALLBACK in table:
        return table[FALLBACK]
    raise PriceNotListed(f"no price for {dimension} {key!r}", reasons=(dimension,))
