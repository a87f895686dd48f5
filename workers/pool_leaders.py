"""Which pools this scheduler process places: one leader election per pool (bus.leader), the
pools shared out over the live scheduler processes, taken over when their leader dies.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from bus.errors import BusError
from bus.leader import LeaderElection
from bus.subjects import token

log = logging.getLogger(__name__)

MEMBER_PREFIX = "scheduler-member-"
POOL_PREFIX = "scheduler-pool-"


def pool_election_name(pool_id: str) -> str:
    return f"{POOL_PREFIX}{token(pool_id)}"


def assigned(pools: Iterable[str], members: Iterable[str]) -> dict[str, str]:
    """pool → the member that should lead it: the pools in order dealt round the members in
    order, so every live process gets its share (differing by at most one)."""
    ordered = sorted(members)
    if not ordered:
        return {}
    return {pool: ordered[i % len(ordered)] for i, pool in enumerate(sorted(pools))}


class PoolLeadership:
    """Campaigns for pools on one thread: this process's membership is itself an election it
    always holds (its heartbeat); each pool is an election of its own.

    Every `ttl/3` it renews what it leads and reads the live members. A pool dealt to this
    process is campaigned for at once; any other pool only once it has stood vacant for a
    whole TTL (its process died, or never came), so a dead process's pools are taken over.
    A pool led here but dealt to another member that is alive and renewing is handed over
    (released), which spreads the pools again when a process joins."""

    def __init__(self, nats_url: str, holder_id: str, pools: Callable[[], Iterable[str]], *,
                 ttl_seconds: float = 3.0,
                 on_change: Callable[[str, bool], None] | None = None,
                 halt: threading.Event | None = None) -> None:
        self.url = nats_url
        self.holder_id = holder_id
        self.member = f"{MEMBER_PREFIX}{token(holder_id)}"
        self.ttl = ttl_seconds
        self._pools = pools
        self._on_change = on_change
        self._membership = LeaderElection(nats_url, name=self.member, holder_id=holder_id,
                                          ttl_seconds=ttl_seconds)
        self.elections: dict[str, LeaderElection] = {}
        self._vacant_since: dict[str, float] = {}
        self._member_revisions: dict[str, tuple[int, float]] = {}  # member → (rev, changed at)
        self._led: set[str] = set()
        self._stop = threading.Event()
        # the process's own stop: once set, nothing is renewed (the leases run out), as when
        # the process dies; `stop()` then releases them
        self._halt = halt or threading.Event()
        self._thread: threading.Thread | None = None

    # -- what the scheduler asks -----------------------------------------------------------------

    def leads(self, pool_id: str) -> bool:
        election = self.elections.get(pool_id)
        return election is not None and election.is_leader

    def led(self) -> set[str]:
        return {p for p, e in list(self.elections.items()) if e.is_leader}

    # -- running --------------------------------------------------------------------------------

    def start(self) -> PoolLeadership:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"pool-leaders[{self.holder_id}]")
        self._thread.start()
        return self

    def stop(self, *, release: bool = True) -> None:
        """Stop campaigning; with `release`, give every lease up at once (a clean shutdown),
        else leave them to expire (as a crash would)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.ttl + 5.0)
            self._thread = None
        for pool, election in list(self.elections.items()):
            if release:
                try:
                    election.release()
                except BusError as e:
                    log.warning("releasing pool %s failed: %s", pool, e)
            self._report(pool, False)
        if release:
            try:
                self._membership.release()
            except BusError as e:
                log.warning("releasing scheduler membership failed: %s", e)

    def _run(self) -> None:
        while not self._stop.is_set() and not self._halt.is_set():
            try:
                self.tick()
            except BusError as e:
                log.debug("pool leadership round failed: %s", e)
            except Exception:
                log.exception("pool leadership round failed")
            for pool in list(self.elections):  # a lease that ran out is reported at once
                self._report(pool, self.leads(pool))
            self._stop.wait(self.ttl / 3.0)

    def tick(self) -> None:
        """One round: keep the membership, read the members, campaign, hand over."""
        self._membership.try_acquire()
        now = time.monotonic()
        members = self._membership.names_held(MEMBER_PREFIX)
        renewing = set()
        for name, rev in members.items():
            seen = self._member_revisions.get(name)
            if seen is None or seen[0] != rev:
                self._member_revisions[name] = (rev, now)
            if name == self.member or now - self._member_revisions[name][1] < self.ttl:
                renewing.add(name)
        pools = sorted(set(self._pools()))
        dealt = assigned(pools, set(members) | {self.member})
        held = self._membership.names_held(POOL_PREFIX)
        for pool in pools:
            election = self.elections.get(pool)
            if election is None:
                election = self.elections[pool] = LeaderElection(
                    self.url, name=pool_election_name(pool), holder_id=self.holder_id,
                    ttl_seconds=self.ttl)
            mine = dealt.get(pool) == self.member
            if election.is_leader:
                owner = dealt.get(pool)
                if not mine and owner in renewing:
                    election.release()  # its process is alive: let it lead its share
                    log.info("pool %s handed over to %s", pool, owner)
                else:
                    election.try_acquire()  # renew
            elif mine:
                election.try_acquire()
            elif pool_election_name(pool) not in held:
                since = self._vacant_since.setdefault(pool, now)
                if now - since >= self.ttl:
                    election.try_acquire()  # nobody took it in a whole TTL: take over
            if pool_election_name(pool) in held or election.is_leader:
                self._vacant_since.pop(pool, None)
            self._report(pool, election.is_leader)

    def _report(self, pool: str, leading: bool) -> None:
        if leading == (pool in self._led):
            return
        if leading:
            self._led.add(pool)
        else:
            self._led.discard(pool)
        log.info("scheduler %s %s pool %s", self.holder_id,
                 "leads" if leading else "no longer leads", pool)
        if self._on_change is not None:
            try:
                self._on_change(pool, leading)
            except Exception:
                log.exception("pool leadership callback failed")
