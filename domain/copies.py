"""Cheap copies of aggregates: immutable values shared, containers copied, so that mutating a
copy never changes its original (or the reverse)."""

from __future__ import annotations

import decimal
import enum
from copy import deepcopy
from typing import Any, TypeVar
from uuid import UUID

from domain.account import TransferWindow
from domain.gang import GangMembership
from domain.jobspec import JobSpec
from domain.lease import Job
from domain.poolconfig import PoolConfig, PreemptionSettings
from domain.prices import PriceList
from domain.resources import Device, NodeCapabilities, Resources, Shape

T = TypeVar("T")

# types whose instances never change: shared by a copy, never copied. The frozen records hold
# only such values (scalars, enums, tuples of them, other frozen records)
_VALUES: set[type] = {
    int, float, str, bool, bytes, type(None), complex, UUID, decimal.Decimal,
    Resources, Shape, Device, NodeCapabilities, Job, JobSpec, GangMembership,
    PoolConfig, PreemptionSettings, PriceList,
}


def share_values(*types: type) -> None:
    """Also share instances of `types` (immutable ones, such as the aggregates' timestamps,
    which the domain does not import) between a copy and its original."""
    _VALUES.update(types)


def _is_value(v: Any) -> bool:
    t = type(v)
    if t in _VALUES or isinstance(v, enum.Enum):
        return True
    if t is tuple or t is frozenset:
        return all(_is_value(x) for x in v)
    return False


def copy_value(v: Any) -> Any:
    """`v` as a copy would hold it: itself when immutable, its containers copied, anything
    else deep-copied."""
    t = type(v)
    if t in _VALUES:
        return v
    if t is dict:
        if all(_is_value(k) for k in v):
            return {k: copy_value(x) for k, x in v.items()}
    elif t is list:
        return [copy_value(x) for x in v]
    elif t is TransferWindow:
        return v.copy()
    elif _is_value(v):
        return v
    elif t is set and all(_is_value(x) for x in v):
        return set(v)
    return deepcopy(v)


def copy_aggregate(agg: T) -> T:
    """A copy of `agg` (an aggregate: its state in its __dict__) that shares nothing mutable
    with it; equal to `deepcopy(agg)` in every attribute."""
    if not hasattr(agg, "__dict__") or hasattr(type(agg), "__deepcopy__"):
        return deepcopy(agg)
    new: T = object.__new__(type(agg))
    new.__dict__.update({k: copy_value(v) for k, v in agg.__dict__.items()})
    return new
