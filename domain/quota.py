"""Quotas in the Kueue model: per-dimension limits, nominal quota, cohorts that borrow and lend.
Arithmetic over usage the caller passes in; the rules: docs/quotas.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from domain.resources import SCALAR_DIMENSIONS, Resources

Limits = tuple[tuple[str, int], ...]  # sorted (dimension, amount): only the named dimensions

RECLAIM_POLICIES: tuple[str, ...] = ("any", "never")


def limits(value: Mapping[str, int] | Resources | Limits | None) -> Limits | None:
    """A quota's limits from a mapping (the dimensions it names), from the pairs themselves, or
    from a `Resources` (its non-zero dimensions: the form events carried before limits had a
    shape of their own, when every unnamed dimension was recorded as 0)."""
    if value is None:
        return None
    if isinstance(value, Resources):
        return tuple(sorted((d, value.get(d)) for d in value.dimensions() if value.get(d)))
    pairs = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((str(d), int(v)) for d, v in pairs))


def limits_from_event(value: dict[str, Any] | None) -> Limits | None:
    """Limits as an event stored them: a flat {dimension: amount}, or the older Resources form
    (recognised by its `extended` key)."""
    if value is None:
        return None
    if "extended" in value:
        return limits(Resources.from_dict(value))
    return limits({str(k): int(v) for k, v in value.items()})


def limits_to_dict(value: Limits | None) -> dict[str, int] | None:
    return None if value is None else {d: v for d, v in value}


def limit_problems(name: str, value: Limits | None) -> list[str]:
    if value is None:
        return []
    found = []
    for d, v in value:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            found.append(f"{name} {d} must be a non-negative integer")
        if d not in SCALAR_DIMENSIONS and not d.startswith("gpu/"):
            found.append(f"{name} names an unknown dimension {d!r}")
    return found


def exceeded(usage: Resources, request: Resources, quota: Limits | None) -> list[str]:
    """Dimensions in which usage + request would pass the quota's limits (sorted)."""
    if quota is None:
        return []
    return [d for d, limit in quota if usage.get(d) + request.get(d) > limit]


# Cohorts --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TenantQuota:
    """One tenant's quota in a pool. `nominal` None: unlimited. In a cohort, `borrow_limit`
    caps what it may use past its nominal (a dimension not named: no cap), `lend_limit` what
    of its nominal others may borrow (not named: all of it)."""

    tenant: str
    nominal: Limits | None = None
    borrow_limit: Limits | None = None
    lend_limit: Limits | None = None
    cohort: str | None = None

    def nominal_of(self, dim: str) -> int | None:
        return None if self.nominal is None else dict(self.nominal).get(dim)

    def guaranteed(self, dim: str) -> int:
        """The part of its nominal in `dim` it never lends."""
        nominal = self.nominal_of(dim) or 0
        lend = None if self.lend_limit is None else dict(self.lend_limit).get(dim)
        return 0 if lend is None else max(0, nominal - min(lend, nominal))

    def lendable(self, dim: str) -> int:
        return (self.nominal_of(dim) or 0) - self.guaranteed(dim)

    def ceiling(self, dim: str) -> int | None:
        """The most it may use of `dim` (None: no ceiling); nominal + borrow limit in a cohort."""
        nominal = self.nominal_of(dim)
        if nominal is None:
            return None
        if self.cohort is None:
            return nominal
        borrow = None if self.borrow_limit is None else dict(self.borrow_limit).get(dim)
        return None if borrow is None else nominal + borrow


@dataclass(frozen=True)
class CohortQuota:
    """A cohort: its own shared nominal quota (lent to members, owned by none) and whether an
    owner may preempt borrowers to reclaim its nominal quota."""

    name: str
    nominal: Limits = ()
    reclaim: str = "any"


@dataclass(frozen=True)
class QuotaVerdict:
    """Why a request does not fit its tenant's quota now: the dimensions over its own ceiling
    (`over_ceiling`), those the cohort has no room for (`cohort_full`), who borrows there, and
    whether the tenant asks only for its own nominal quota (then it may reclaim)."""

    over_ceiling: tuple[str, ...] = ()
    cohort_full: tuple[str, ...] = ()
    borrowers: dict[str, dict[str, int]] = field(default_factory=dict)
    within_nominal: bool = False

    @property
    def fits(self) -> bool:
        return not self.over_ceiling and not self.cohort_full

    @property
    def may_reclaim(self) -> bool:
        return not self.over_ceiling and bool(self.cohort_full) and self.within_nominal

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.over_ceiling:
            out["over_limit"] = list(self.over_ceiling)
        if self.cohort_full:
            out["cohort_full"] = list(self.cohort_full)
        if self.borrowers:
            out["borrowed_by"] = self.borrowers
        return out


class QuotaBook:
    """The quotas of one pool: tenants' limits and cohorts, and the admission arithmetic."""

    def __init__(self) -> None:
        self.tenants: dict[str, TenantQuota] = {}
        self.cohorts: dict[str, CohortQuota] = {}
        # cohort → its members with a nominal quota, kept as tenants change (checked per
        # request: never a scan of every tenant of the pool)
        self._members: dict[str, dict[str, TenantQuota]] = {}

    def set_tenant(self, quota: TenantQuota) -> None:
        old = self.tenants.get(quota.tenant)
        if old is not None and old.cohort is not None:
            self._members.get(old.cohort, {}).pop(quota.tenant, None)
        self.tenants[quota.tenant] = quota
        if quota.cohort is not None and quota.nominal is not None:
            self._members.setdefault(quota.cohort, {})[quota.tenant] = quota

    def set_cohort(self, cohort: CohortQuota) -> None:
        self.cohorts[cohort.name] = cohort

    def limited(self, tenant: str) -> bool:
        q = self.tenants.get(tenant)
        return q is not None and q.nominal is not None

    def members(self, cohort: str) -> list[TenantQuota]:
        """The cohort's members that have a nominal quota, in the order they joined."""
        return list(self._members.get(cohort, {}).values())

    def capacity(self, cohort: str, dim: str) -> int:
        """What the cohort can lend in `dim`: its own nominal plus its members' lendable."""
        own = dict(self.cohorts[cohort].nominal).get(dim, 0) if cohort in self.cohorts else 0
        return own + sum(m.lendable(dim) for m in self.members(cohort)
                         if m.nominal_of(dim) is not None)

    def borrowed(self, cohort: str, dim: str, usage: Mapping[str, Resources]) -> int:
        """What the cohort's members use of `dim` past the part of their nominal they keep."""
        zero = Resources()
        return sum(max(0, usage.get(m.tenant, zero).get(dim) - m.guaranteed(dim))
                   for m in self.members(cohort) if m.nominal_of(dim) is not None)

    def borrowing(self, tenant: str, usage: Resources) -> dict[str, int]:
        """What `tenant` uses past its nominal, per dimension it is limited in."""
        q = self.tenants.get(tenant)
        if q is None or q.nominal is None:
            return {}
        return {d: usage.get(d) - n for d, n in q.nominal if usage.get(d) > n}

    def check(self, tenant: str, request: Resources,
              usage: Mapping[str, Resources]) -> QuotaVerdict:
        """Whether `request` fits `tenant`'s quota given every tenant's current usage."""
        q = self.tenants.get(tenant)
        if q is None or q.nominal is None:
            return QuotaVerdict()
        zero = Resources()
        mine = usage.get(tenant, zero)
        over: list[str] = []
        full: list[str] = []
        within = True
        for dim, nominal in q.nominal:
            want = mine.get(dim) + request.get(dim)
            if want > nominal:
                within = False
            ceiling = q.ceiling(dim)
            if ceiling is not None and want > ceiling:
                over.append(dim)
                continue
            if q.cohort is None or request.get(dim) == 0:
                continue
            g = q.guaranteed(dim)
            extra = max(0, want - g) - max(0, mine.get(dim) - g)
            if extra and self.borrowed(q.cohort, dim, usage) + extra > self.capacity(q.cohort,
                                                                                     dim):
                full.append(dim)
        borrowers: dict[str, dict[str, int]] = {}
        if full and q.cohort is not None:
            for m in self.members(q.cohort):
                if m.tenant == tenant:
                    continue
                b = {d: v for d, v in self.borrowing(m.tenant, usage.get(m.tenant, zero)).items()
                     if d in full}
                if b:
                    borrowers[m.tenant] = b
        return QuotaVerdict(tuple(over), tuple(full), borrowers, within)

    def in_force(self) -> dict[str, Any]:
        """Every limit in force, for `pool admin pool show`."""
        return {
            "tenants": {t: {"nominal": limits_to_dict(q.nominal),
                            "borrow_limit": limits_to_dict(q.borrow_limit),
                            "lend_limit": limits_to_dict(q.lend_limit),
                            "cohort": q.cohort}
                        for t, q in sorted(self.tenants.items())},
            "cohorts": {c.name: {"nominal": limits_to_dict(c.nominal), "reclaim": c.reclaim,
                                 "members": sorted(m.tenant for m in self.members(c.name))}
                        for c in sorted(self.cohorts.values(), key=lambda c: c.name)},
        }


def holding_past_limits(book: QuotaBook, usage: Mapping[str, Resources],
                        tenants: Iterable[str]) -> list[str]:
    """For the log replay check: each of `tenants` using more than its ceiling, and each of
    their cohorts with more in use of its shared quota than it has, as sentences (empty:
    within quota)."""
    found = []
    zero = Resources()
    cohorts: set[str] = set()
    for t in tenants:
        q = book.tenants.get(t)
        if q is None or q.nominal is None:
            continue
        u = usage.get(t, zero)
        for dim, _n in q.nominal:
            ceiling = q.ceiling(dim)
            if ceiling is not None and u.get(dim) > ceiling:
                found.append(f"tenant {t} holds {u.get(dim)} {dim}, past its limit {ceiling}")
        if q.cohort is not None:
            cohorts.add(q.cohort)
    for c in sorted(cohorts):
        dims = {d for m in book.members(c) for d, _ in (m.nominal or ())}
        for dim in sorted(dims):
            lent, can = book.borrowed(c, dim, usage), book.capacity(c, dim)
            if lent > can:
                found.append(f"cohort {c} has {lent} {dim} in use of its shared {can}")
    return found
