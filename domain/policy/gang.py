"""Gang placement: N members (one per node) placed all-or-nothing under topology constraints,
the reasons a gang waits or can never fit, and the hold that keeps a head gang from starving.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from domain.policy.placement import NodeTable
    from domain.resources import Shape

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
STRATEGIES: tuple[str, ...] = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# the node labels a gang may be packed into or spread over
TOPOLOGY_KEYS: tuple[str, ...] = ("rack", "block", "nvlink_domain", "zone", "failure_domain")
DEFAULT_PACK_KEY = "rack"
DEFAULT_SPREAD_KEY = "failure_domain"

GANG_INCOMPLETE = "gang_incomplete"
GANG_NEVER_FITS = "gang_never_fits"
GANG_HOLDING = "gang_holding"
# how long a live gang at the head may keep the free nodes of its best domain from others,
# then as long again before it may hold again (docs/gpus.md)
LIVE_HOLD_SECONDS = 600.0


@dataclass(frozen=True)
class GangSpec:
    """What a gang asks: `members` nodes of one shape, packed into one value of `same` or
    spread over distinct values of `spread`, hard (STRICT_*) or as a preference."""

    members: int
    strategy: Strategy = "PACK"
    same: str | None = None
    spread: str | None = None

    def __post_init__(self) -> None:
        if self.members < 1:
            raise ValueError("a gang has at least one member")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}")
        for key in (self.same, self.spread):
            if key is not None and key not in TOPOLOGY_KEYS:
                raise ValueError(f"unknown topology key {key!r}")
        if self.same is not None and self.spread is not None:
            raise ValueError("a gang is packed (same) or spread, not both")
        if self.same is not None and self.strategy in ("SPREAD", "STRICT_SPREAD"):
            raise ValueError("`same` packs a gang: use PACK or STRICT_PACK")
        if self.spread is not None and self.strategy in ("PACK", "STRICT_PACK"):
            raise ValueError("`spread` spreads a gang: use SPREAD or STRICT_SPREAD")

    @classmethod
    def build(cls, members: int, *, same: str | None = None, spread: str | None = None,
              strategy: str | None = None) -> GangSpec:
        """`--same rack` alone means STRICT_PACK, `--spread failure_domain` STRICT_SPREAD."""
        if strategy is None:
            strategy = "STRICT_PACK" if same else "STRICT_SPREAD" if spread else "PACK"
        return cls(members=members, strategy=strategy, same=same,  # type: ignore[arg-type]
                   spread=spread)

    @property
    def packs(self) -> bool:
        return self.strategy in ("PACK", "STRICT_PACK")

    @property
    def strict(self) -> bool:
        return self.strategy.startswith("STRICT_")

    @property
    def key(self) -> str:
        """The label the constraint is over."""
        if self.packs:
            return self.same or DEFAULT_PACK_KEY
        return self.spread or DEFAULT_SPREAD_KEY


@dataclass(frozen=True)
class Candidate:
    """A node as gang placement sees it: its labels, whether one member's shape could ever
    run there (static filters), whether it fits now, and the filters it fails if not."""

    node_id: str
    labels: Mapping[str, str]
    eligible: bool = True
    fits_now: bool = True
    failures: tuple[str, ...] = ()

    def value(self, key: str) -> str:
        return self.labels.get(key, f"(no {key})")


@dataclass(frozen=True)
class GangDecision:
    """The nodes for every member (placed), or why the gang waits, or why it never fits."""

    nodes: tuple[str, ...] = ()
    reason: str | None = None  # a one-line reason when not placed
    never_fits: bool = False
    filters: dict[str, int] = field(default_factory=dict)  # per-filter node counts
    best_domain: str | None = None  # where it would go (what a hold keeps for it)
    best_nodes: tuple[str, ...] = ()  # the fitting nodes of that domain, gathered so far

    @property
    def placed(self) -> bool:
        return bool(self.nodes)


def _groups(nodes: Iterable[Candidate], key: str) -> dict[str, list[Candidate]]:
    out: dict[str, list[Candidate]] = {}
    for c in nodes:
        out.setdefault(c.value(key), []).append(c)
    return out


def place_gang(spec: GangSpec, candidates: Sequence[Candidate],
               blocked: Iterable[str] = ()) -> GangDecision:
    """Choose one node per member, all or nothing. `candidates` come in the pool's ranking
    order (best node first) and are kept in it within a domain; `blocked` nodes (held for
    another gang) are not used. Strict constraints that no set of eligible nodes could ever
    meet reject the gang at once, with per-filter counts of the nodes that failed."""
    n = spec.members
    key = spec.key
    eligible = [c for c in candidates if c.eligible]
    filters = Counter(f for c in candidates if not c.eligible for f in c.failures)
    # -- can it ever fit? ---------------------------------------------------------------------
    by_domain = _groups(eligible, key)
    if spec.strategy == "STRICT_PACK":
        biggest = max((len(v) for v in by_domain.values()), default=0)
        if biggest < n:
            return GangDecision(
                reason=f"{GANG_NEVER_FITS}: the largest {key} holds {biggest} eligible node(s) "
                       f"of {n}", never_fits=True, filters=dict(filters))
    elif spec.strategy == "STRICT_SPREAD":
        if len(by_domain) < n:
            return GangDecision(
                reason=f"{GANG_NEVER_FITS}: {len(by_domain)} {key} value(s) have an eligible "
                       f"node, {n} needed", never_fits=True, filters=dict(filters))
    elif len(eligible) < n:
        return GangDecision(reason=f"{GANG_NEVER_FITS}: {len(eligible)} eligible node(s) of {n}",
                            never_fits=True, filters=dict(filters))
    # -- does it fit now? ---------------------------------------------------------------------
    held = set(blocked)
    free = {d: [c for c in cs if c.fits_now and c.node_id not in held]
            for d, cs in by_domain.items()}
    if spec.packs:
        whole = [d for d, cs in free.items() if len(cs) >= n]
        if whole:
            # best fit: the domain with the fewest free nodes that holds the gang, so larger
            # free domains stay whole for larger gangs
            fit = min(whole, key=lambda d: (len(free[d]), d))
            return GangDecision(nodes=tuple(c.node_id for c in free[fit][:n]), best_domain=fit)
        order = sorted(free, key=lambda d: (-len(free[d]), d))
        best = order[0] if order else None
        have = len(free[best]) if best is not None else 0
        gathered = tuple(c.node_id for c in free[best]) if best is not None else ()
        if spec.strict:
            return GangDecision(reason=f"{GANG_INCOMPLETE}: best {key} {best} holds {have} of {n}",
                                best_domain=best, best_nodes=gathered)
        chosen = [c.node_id for d in order for c in free[d]][:n]
        if len(chosen) == n:
            return GangDecision(nodes=tuple(chosen), best_domain=best)
        return GangDecision(reason=f"{GANG_INCOMPLETE}: the pool holds {len(chosen)} free "
                                   f"node(s) of {n}", best_domain=best, best_nodes=gathered)
    # spread: one node per domain first (the domains with the most free nodes first, keeping
    # the load even), then — unless strict — more per domain, round robin
    order = sorted((d for d in free if free[d]), key=lambda d: (-len(free[d]), d))
    rounds = max((len(free[d]) for d in order), default=0) if not spec.strict else 1
    chosen = []
    for r in range(rounds):
        for d in order:
            if r < len(free[d]) and len(chosen) < n:
                chosen.append(free[d][r].node_id)
    if len(chosen) == n:
        return GangDecision(nodes=tuple(chosen))
    if spec.strict:
        return GangDecision(reason=f"{GANG_INCOMPLETE}: {len(order)} {key} value(s) have a "
                                   f"free node, {n} needed")
    return GangDecision(reason=f"{GANG_INCOMPLETE}: the pool holds {len(chosen)} free node(s) "
                               f"of {n}")


@dataclass
class GangHolds:
    """The starvation guard: the gang at the head of its priority level keeps the free nodes
    of its best domain from smaller requests while it gathers the rest, for at most
    `max_hold_seconds`; then the hold is dropped and the gang may not hold again for as long
    (so a gang that cannot gather in time does not block the domain forever either)."""

    max_hold_seconds: float = 120.0
    holds: dict[str, tuple[float, frozenset[str]]] = field(default_factory=dict)
    cooldown_until: dict[str, float] = field(default_factory=dict)
    expired: int = 0  # holds that ran out without the gang placing

    def blocked(self, now: float, *, except_for: str | None = None) -> set[str]:
        """The nodes held, at `now`, for gangs other than `except_for`."""
        self._expire(now)
        out: set[str] = set()
        for gang, (_since, nodes) in self.holds.items():
            if gang != except_for:
                out |= nodes
        return out

    def hold(self, gang: str, nodes: Iterable[str], now: float) -> bool:
        """Hold (or widen the hold on) `nodes` for `gang`; False while it cools down."""
        self._expire(now)
        if self.cooldown_until.get(gang, 0.0) > now:
            return False
        since, have = self.holds.get(gang, (now, frozenset()))
        self.holds[gang] = (since, have | frozenset(nodes))
        return True

    def release(self, gang: str) -> None:
        """The gang placed (or left): its hold ends at once."""
        self.holds.pop(gang, None)
        self.cooldown_until.pop(gang, None)

    def held_for(self, gang: str) -> frozenset[str]:
        return self.holds.get(gang, (0.0, frozenset()))[1]

    def _expire(self, now: float) -> None:
        for gang, (since, _nodes) in list(self.holds.items()):
            if now - since >= self.max_hold_seconds:
                del self.holds[gang]
                self.cooldown_until[gang] = now + self.max_hold_seconds
                self.expired += 1


@dataclass(frozen=True)
class MemberPlacement:
    """A live gang's placement: one node per member in member order, or why not."""

    nodes: tuple[str, ...] = ()
    reason: str | None = None
    never_fits: bool = False
    filters: dict[str, int] = field(default_factory=dict)
    best_nodes: tuple[str, ...] = ()  # a waiting gang's fitting nodes of its best domain

    @property
    def placed(self) -> bool:
        return bool(self.nodes)


def place_members(spec: GangSpec, shapes: Sequence[Shape], table: NodeTable,
                  labels: Callable[[str], Mapping[str, str]], *, packing: str = "best-fit",
                  allowed_trust_levels: Iterable[str] | None = None,
                  blocked: Iterable[str] = ()) -> MemberPlacement:
    """One node per member (member i gets `nodes[i]`), all or nothing, from a pool's node
    table. Members of different shapes are placed on nodes that could take any of them (a
    node is a candidate only when every distinct shape passes its filters), ranked for the
    first member's shape. The gang never fits only when that verdict cannot change: every
    node that could ever take a member is ready (a cordoned one may come back)."""
    allowed = None if allowed_trust_levels is None else tuple(allowed_trust_levels)
    distinct = list(dict.fromkeys(shapes))
    could: set[int] | None = None
    now: set[int] | None = None
    filters: Counter[str] = Counter()
    complete = True
    for shape in distinct:
        fr = table.filter(shape, allowed_trust_levels=allowed)
        filters.update(fr.failures)
        ready_could = {int(i) for i in fr.eligible} | {int(i) for i in fr.busy}
        complete &= fr.fit_when_empty == len(ready_could)
        could = ready_could if could is None else could & ready_could
        fits = {int(i) for i in fr.eligible}
        now = fits if now is None else now & fits
    could, now = could or set(), now or set()
    ranked = [int(i) for i in table.rank(shapes[0], sorted(now), packing)]  # type: ignore[arg-type]
    order = ranked + sorted(could - now)
    candidates = [Candidate(node_id=(nid := table.node_id_at(i)), labels=labels(nid),
                            fits_now=i in now) for i in order]
    decision = place_gang(spec, candidates, blocked)
    if decision.placed:
        return MemberPlacement(nodes=decision.nodes)
    never = decision.never_fits and complete
    reason = decision.reason or GANG_INCOMPLETE
    if decision.never_fits and not never:
        reason = (f"{GANG_INCOMPLETE}: " + reason.split(": ", 1)[-1]
                  + " (nodes that could take it are not ready)")
    return MemberPlacement(reason=reason, never_fits=never, filters=dict(filters),
                           best_nodes=() if never else decision.best_nodes)
