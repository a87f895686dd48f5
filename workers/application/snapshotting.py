"""Snapshots of accounts, nodes and pools: when one is due, and the thread that takes it from
the recorded state, off every command's and the scheduler's path."""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator
from itertools import chain
from typing import Any
from uuid import UUID

from eventsourcing.application import project_aggregate
from eventsourcing.persistence import EventStore, IntegrityError

from bus.errors import SnapshotsUnavailable
from domain.account import Account
from domain.node import Node
from domain.pool import Pool
from domain.snapshots import StateSnapshot

log = logging.getLogger(__name__)

# the aggregates that live long enough to snapshot, each snapshotted once this many of its events
# were stored after its last snapshot: an account's snapshot holds its transfer window, so it
# is the largest and taken the least often (POOL_SNAPSHOT_INTERVAL sets one interval for all;
# 0 turns snapshots off)
SNAPSHOT_INTERVALS: dict[type[Any], int] = {Account: 2_000, Node: 500, Pool: 500}
SNAPSHOTTED: tuple[type[Any], ...] = tuple(SNAPSHOT_INTERVALS)
# the aggregates whose latest snapshot version one process remembers, at most
KNOWN_MAX = 100_000
# the snapshots waiting to be taken, at most (more are dropped: the next save asks again)
QUEUE_MAX = 1_000


def snapshot_intervals(env: Any) -> dict[type[Any], int]:
    """Per snapshotted type its interval, POOL_SNAPSHOT_INTERVAL (env, else the process's
    environment) overriding them all."""
    value = env.get("POOL_SNAPSHOT_INTERVAL") if env is not None else None
    if value is None:
        value = os.environ.get("POOL_SNAPSHOT_INTERVAL")
    if value in (None, ""):
        return dict(SNAPSHOT_INTERVALS)
    return dict.fromkeys(SNAPSHOT_INTERVALS, int(value))


class SnapshotStore(EventStore[UUID]):
    """The snapshot store a load reads: a snapshot this code cannot rebuild (an old schema with
    no upcast, a newer one, one that does not decode) is passed over, so the aggregate loads
    from its whole history; the version of the one it gives is remembered (`known`)."""

    def __init__(self, mapper: Any, recorder: Any, known: Snapshots, *,
                 available: Callable[[], bool]) -> None:
        super().__init__(mapper, recorder)
        self.known = known
        # whether snapshots can be read and saved now (bus.recorders.snapshots_available:
        # bus.jetstream's snapshot stream may be missing)
        self.available = available

    def get(self, originator_id: UUID, *, gt: int | None = None, lte: int | None = None,
            desc: bool = False, limit: int | None = None) -> Iterator[Any]:
        stored = self.recorder.select_events(originator_id=originator_id, gt=gt, lte=lte,
                                             desc=desc, limit=limit)
        usable = []
        for s in stored:
            try:
                snapshot = self.mapper.to_domain_event(s)
            except Exception as e:  # noqa: BLE001 - an undecodable snapshot: full load
                log.warning("snapshot of %s v%s not decoded (%s): loading its history",
                            originator_id, s.originator_version, e)
                continue
            if isinstance(snapshot, StateSnapshot) and not snapshot.usable():
                log.info("snapshot of %s v%s has an old schema: loading its history",
                         originator_id, s.originator_version)
                continue
            usable.append(snapshot)
        if desc and limit == 1 and lte is None:
            self.known.seen(originator_id, usable[0].originator_version if usable else 0)
        return iter(usable)


class Snapshots:
    """Which aggregates are due a snapshot, and the one thread that takes them: it loads the
    aggregate from the stores (latest snapshot and the events after it, never a cached or
    folded copy) and saves its snapshot. A snapshot that cannot be saved (another process
    saved one first, or it is larger than a message may be) is skipped."""

    def __init__(self, app: Any, intervals: dict[type[Any], int]) -> None:
        self.app = app
        self.intervals = intervals
        self._known: dict[UUID, int] = {}
        self._pending: set[UUID] = set()
        # (aggregate, the version that made it due, its interval)
        self._queue: queue.Queue[tuple[UUID, int, int] | None] = queue.Queue(QUEUE_MAX)
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self.taken = 0

    def seen(self, aggregate_id: UUID, version: int) -> None:
        """The latest snapshot of `aggregate_id` is at `version` (0: none)."""
        known = self._known
        if version >= known.get(aggregate_id, -1):
            known[aggregate_id] = version
        if len(known) > KNOWN_MAX:
            for k in list(known)[: KNOWN_MAX // 4]:
                known.pop(k, None)

    def consider(self, aggregate: Any) -> None:
        """Queue a snapshot of `aggregate` when its type's interval of its events or more were
        stored since its latest snapshot this process knows of."""
        interval = self.intervals.get(type(aggregate), 0)
        if interval <= 0:
            return
        aid = aggregate.id
        if aggregate.version - self._known.get(aid, 0) < interval:
            return
        with self._lock:
            if aid in self._pending:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pool-snapshots",
                                                daemon=True)
                self._thread.start()
            try:
                self._queue.put_nowait((aid, aggregate.version, interval))
            except queue.Full:
                return
            self._pending.add(aid)

    def wait(self, timeout: float = 30.0) -> bool:
        """Wait until no snapshot is waiting or being taken; whether that happened in time."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._pending, timeout)

    def close(self) -> None:
        thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(10)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            aid, version, interval = item
            try:
                if not self._fresh(aid, version, interval):
                    self.take(aid)
            except Exception as e:  # noqa: BLE001 - a snapshot is never worth stopping for
                log.warning("no snapshot of %s: %s", aid, e)
            finally:
                with self._lock:
                    self._pending.discard(aid)
                    self._lock.notify_all()

    def _fresh(self, aggregate_id: UUID, version: int, interval: int) -> bool:
        """Whether the latest stored snapshot (read, not decoded) is within `interval` of
        `version`: another process took it, or this one before it started. A scheduler that
        starts with many long-lived aggregates asks once about each, and loads none of them."""
        store: SnapshotStore | None = self.app.snapshots
        if store is None:
            return True
        if not store.available():
            # no snapshot stream (said once, by the recorder): no load for nothing, and none
            # asked for again before another interval of its events
            self.seen(aggregate_id, version)
            return True
        stored = store.recorder.select_events(aggregate_id, desc=True, limit=1)
        if not stored or version - stored[0].originator_version >= interval:
            return False
        self.seen(aggregate_id, stored[0].originator_version)
        return True

    def take(self, aggregate_id: UUID) -> int | None:
        """Load `aggregate_id` as the repository does and save its snapshot; the version saved
        (None: nothing to snapshot). An aggregate the repository's cache holds is read from it
        (brought up to date, copied); any other from the stores, and not added to the cache:
        a process that only saves what it folded (the scheduler) keeps no copies for this."""
        app = self.app
        store = app.snapshots
        if store is None:
            return None
        gt: int | None = None
        if self._cached(aggregate_id):
            aggregate = app.repository.get(aggregate_id)
        else:
            snapshots = list(store.get(aggregate_id, desc=True, limit=1))
            gt = snapshots[0].originator_version if snapshots else None
            aggregate = project_aggregate(
                None, chain(snapshots, app.events.get(aggregate_id, gt=gt)))
        if aggregate is None or type(aggregate) not in SNAPSHOTTED or (
                gt is not None and aggregate.version <= gt):
            return None
        try:
            store.put([type(aggregate).Snapshot.take(aggregate)])
        except IntegrityError:
            pass  # another process saved a snapshot at this version or later
        except SnapshotsUnavailable:
            pass  # no snapshot stream: the recorder said so once
        except Exception as e:  # noqa: BLE001 - e.g. larger than a message may be: not again
            log.warning("snapshot of %s v%s not saved: %s", aggregate_id, aggregate.version, e)
        else:
            self.taken += 1
        self.seen(aggregate_id, aggregate.version)
        return int(aggregate.version)

    def _cached(self, aggregate_id: UUID) -> bool:
        cache = self.app.repository.cache
        if cache is None:
            return False
        try:
            cache.get(aggregate_id)
        except KeyError:
            return False
        return True
