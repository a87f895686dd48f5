"""The application's store: the log's recorder and repository, one atomic save per decision,
retries on conflict, cached policy reads and the loads every command service shares."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar
from uuid import UUID

from eventsourcing.application import (
    AggregateNotFoundError,
    Application,
    ProcessingEvent,
    Repository,
)
from eventsourcing.domain import Aggregate, BaseAggregate
from eventsourcing.persistence import (
    EventStore,
    IntegrityError,
    Notification,
    Recording,
    StoredEvent,
)

from bus.errors import BusTimeout
from bus.recorders import LogRecorder, log_recorder, snapshots_available
from domain.account import Account
from domain.copies import copy_aggregate
from domain.fold import lean_paths
from domain.lease import Lease
from domain.pool import Pool
from domain.resources import TenantId
from workers.application.repository import PoolRepository
from workers.application.snapshotting import Snapshots, SnapshotStore, snapshot_intervals
from workers.errors import UnknownLease, UnknownPool, WriteConflict

log = logging.getLogger(__name__)

A = TypeVar("A", bound=Aggregate)
C = TypeVar("C")
R = TypeVar("R")
P = ParamSpec("P")


class OverStore(Protocol):
    """A command service: whatever works over the one store."""

    @property
    def store(self) -> Store: ...


S = TypeVar("S", bound=OverStore)


def retried(
    command: Callable[Concatenate[S, P], R],
) -> Callable[Concatenate[S, P], R]:
    """A load-decide-save command, run again when a concurrent writer got there first (OCC)."""

    @functools.wraps(command)
    def run(service: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return service.store.retrying(lambda: command(service, *args, **kwargs))

    return run


APPLICATION_NAME = "pool"
# the plane's application as the log and the environment know it: the class name PoolApp had
# when it was the library's Application (the library names a subclass after itself), kept by
# its store so that snapshot subjects (pool.snap.poolapp.<id>) and environment keys (POOLAPP_*,
# never the POOL_NATS_URL that `pool serve` reads without a role's credentials) stay as they were
PLANE_APPLICATION_NAME = "PoolApp"
WEIGHT_SCALE = 1000
# how long a request may use a cached policy without a word from the log (a lost invalidation)
POLICY_CACHE_SECONDS = 5.0  # tenant weights travel as floats and are kept as integer thousandths


def new_transfer_id() -> str:
    return uuid.uuid4().hex


class PendingSave:
    """A save in flight (`Store.save_nowait`)."""

    def __init__(self, app: Store, pe: ProcessingEvent[UUID], stored: list[StoredEvent],
                 future: concurrent.futures.Future[list[int]]) -> None:
        self.app = app
        self.aggregates = list(pe.aggregates.values())
        self.messages = len(stored)
        self._pe = pe
        self._stored = stored
        self._future = future
        self._ids: list[int] | None = None
        self._recordings: list[Recording[UUID]] | None = None

    def add_done_callback(self, fn: Callable[[bool], None]) -> None:
        """`fn(acknowledged)` once the server has answered or the save failed (on the bus's
        loop thread: keep it short)."""
        self._future.add_done_callback(
            lambda f: fn(not f.cancelled() and f.exception() is None))

    def wait(self) -> None:
        """Wait for the acknowledgement (or raise the save's error) and finish the save as
        `save` would; the recordings are only built if the app listens for them."""
        if self._ids is not None:
            return
        timeout = self.app.log_recorder.timeout + 5
        try:
            ids = self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            self._future.cancel()
            raise BusTimeout(f"save not acknowledged within {timeout}s") from None
        self._ids = ids
        pe, app = self._pe, self.app
        cache = app.repository.cache
        if cache and not app.repository.fastforward:
            for aggregate_id, aggregate in pe.aggregates.items():
                cache.put(aggregate_id, aggregate)
        # Application._notify does nothing: a Notification per event is only worth building
        # (frozen dataclasses, a few µs each) for an app that overrides it
        listening = type(app)._notify is not Application._notify
        app._recorded(pe, self.result() if listening else [])  # the app's after-save steps

    @property
    def ids(self) -> list[int]:
        """The notification ids of the saved events, in order (after `wait`)."""
        self.wait()
        assert self._ids is not None
        return self._ids

    def result(self) -> list[Recording[UUID]]:
        """Wait for the acknowledgement; the recordings, or the save's error."""
        self.wait()
        if self._recordings is None:
            assert self._ids is not None
            self._recordings = [
                Recording(d, Notification(originator_id=s.originator_id,
                                          originator_version=s.originator_version,
                                          topic=s.topic, state=s.state, id=n))
                for d, s, n in zip(self._pe.events, self._stored, self._ids, strict=True)
            ]
        return self._recordings


class _OnLoop:
    """One command running on the bus's own loop (Store.on_loop): its saves, held to be
    awaited once it returns, and what awaited reads brought for its next run."""

    __slots__ = ("held", "read", "topics")

    def __init__(self) -> None:
        self.held: list[tuple[Any, ...]] = []
        self.read: dict[UUID, Aggregate | None] = {}  # by id; None: there is none
        self.topics: dict[UUID, str | None] = {}


# the command running on the bus's own loop; None elsewhere. A context variable: each
# asyncio task, and each thread, sees its own
_ON_LOOP: ContextVar[_OnLoop | None] = ContextVar("pool_on_loop", default=None)


class NeedsRead(Exception):
    """A command running on the bus's loop needed to read the log: on_loop reads what it
    names (an aggregate, or the last topics of some) and runs it again, or the caller runs it
    on a thread."""

    def __init__(self, what: str, *, aggregate_id: UUID | None = None,
                 topics: Sequence[UUID] = ()) -> None:
        super().__init__(what)
        self.aggregate_id = aggregate_id
        self.topics = topics


class Store(Application[UUID]):
    """The log as every command service reads and writes it: loading, saving (whole or in
    flight), retrying and cached policy reads. It decides nothing: no command lives here."""

    name = APPLICATION_NAME
    # accounts, nodes and pools are snapshotted (workers.application.snapshotting), by this
    # class's own rule rather than the library's snapshotting_intervals
    is_snapshotting_enabled = True

    def __init__(self, env: dict[str, str] | None = None, *, name: str | None = None) -> None:
        """`name`, when given, replaces the class's: the library prefixes the environment's
        keys with it (`<NAME>_NATS_URL` before `NATS_URL`) and the snapshots' subjects
        carry it (`pool.snap.<name>.<id>`)."""
        if name is not None:
            self.name = name
        self.snapshotting = Snapshots(self, {})
        super().__init__(env)
        # the log's recorder as the plane uses it (bus.recorders): the fast paths below call
        # it directly; over another persistence module, its plain path
        self.log_recorder: LogRecorder = log_recorder(self.recorder)
        if self.snapshots is not None:
            self.snapshotting.intervals = snapshot_intervals(self.env)
        # pools and tenant policies as requests read them (see cached): id → (it, good until)
        self._policies: dict[UUID, tuple[Any, float]] = {}
        self._policy_changes: dict[UUID, int] = {}
        self._policy_watches: dict[UUID, Callable[[], None]] = {}
        self._policies_lock = threading.Lock()
        self._refreshing: set[UUID] = set()  # policies being read again past their time

    def construct_repository(self) -> Repository[UUID]:
        """The library's repository, as PoolRepository (a cached aggregate copied under its
        lock), with the same settings."""
        made = super().construct_repository()
        return PoolRepository(
            event_store=made.event_store, snapshot_store=made.snapshot_store,
            cache_maxsize=None if made.cache is None else getattr(made.cache, "maxsize", 0),
            fastforward=made.fastforward, fastforward_skipping=made.fastforward_skipping,
            deepcopy_from_cache=made.deepcopy_from_cache)

    def save(self, *objs: Any, **kwargs: Any) -> list[Recording[UUID]]:
        """The library's `save`, without its runtime-checkable Protocol `isinstance` checks
        (~20 µs an aggregate on Python 3.11): aggregates are known by their class; events and
        keyword arguments go the library's way."""
        run = _ON_LOOP.get()
        if run is not None and not kwargs:
            run.held.append(objs)  # on the loop: awaited by on_loop once the command returns
            return []
        if kwargs or not lean_paths():
            return super().save(*objs, **kwargs)  # the library's own (POOL_FAST_PATHS=off)
        pe = self._collect(objs)
        recordings = self._record(pe)
        self._recorded(pe, recordings)
        return recordings

    def save_nowait(self, *aggs: Aggregate) -> PendingSave:
        """`save` whose atomic batch is under way when this returns: the events are taken
        from the aggregates and encoded here; `PendingSave.result()` waits for the
        acknowledgement (IntegrityError on a conflict, as `save`). A later save that shares
        a subject must wait for this one's result first, else its expectation is stale."""
        pe = self._collect(aggs)
        stored = [self.mapper.to_stored_event(e) for e in pe.events]
        # (over another persistence module: saved now, answered later)
        return PendingSave(self, pe, stored, self.log_recorder.insert_events_nowait(stored))

    async def on_loop(self, command: Callable[[], R], *, reads: Sequence[UUID] = (),
                      runs: int = 1, saves: int = 1) -> R | None:
        """`command()` run on the bus's own loop (the command service's fast path), its saves
        awaited in order through the recorder's group commit: no thread on the way.

        `reads`: aggregates read (concurrently, awaited) before it runs. A command that needs
        another read is run again once it is read, up to `runs` runs in all; the copies read
        are handed out afresh each run. None when it would need more, would read what only a
        thread can (a policy not cached, an aggregate not cached), saves more than `saves`
        times, or a save was refused: the caller then runs the command on a thread, which
        answers every case. A command allowed more than one save must be one that a thread may
        run again after its earlier saves landed (each save is atomic, the run is not)."""
        recorder = self.log_recorder
        if not recorder.awaits_on_loop or not isinstance(self.repository, PoolRepository):
            return None
        insert, select = recorder.insert_async, recorder.select_async
        run = _OnLoop()
        if reads and not await self._read_on_loop(run, select, reads):
            return None
        for attempt in range(1, runs + 1):
            run.held = []
            token = _ON_LOOP.set(run)
            try:
                result = command()
            except NeedsRead as e:
                if attempt == runs or not await self._read_on_loop(
                        run, select, [e.aggregate_id] if e.aggregate_id else [], e.topics):
                    return None
                continue
            finally:
                _ON_LOOP.reset(token)
            break
        else:
            return None
        if len(run.held) > saves:
            return None
        for objs in run.held:
            pe = self._collect(objs)
            stored = [self.mapper.to_stored_event(e) for e in pe.events]
            try:
                ids = await insert(stored)
            except IntegrityError:
                return None
            done: concurrent.futures.Future[list[int]] = concurrent.futures.Future()
            done.set_result(ids)
            PendingSave(self, pe, stored, done).wait()  # the save's after-steps, as `save` does
        return result

    async def _read_on_loop(self, run: _OnLoop, select: Any, ids: Sequence[UUID],
                            topics: Sequence[UUID] = ()) -> bool:
        """Read `ids` (through `select`) and the last `topics` into `run`, awaited; False when
        something could not be read there, or nothing was asked (the caller gives up)."""
        assert isinstance(self.repository, PoolRepository)
        if not ids and not topics:
            return False
        ids = list(dict.fromkeys(ids))  # an id twice would wait for its own read's lock
        if len(ids) == 1:
            got = [await self.repository.get_on_loop(ids[0], select)]
        else:
            got = await asyncio.gather(*(self.repository.get_on_loop(i, select) for i in ids))
        for aggregate_id, (ok, aggregate) in zip(ids, got, strict=True):
            if not ok:
                return False
            run.read[aggregate_id] = aggregate
        if topics:
            last = await self.log_recorder.last_topics_async(topics)
            if last is None:
                return False
            run.topics.update(last)
        return True

    def last_topics(self, aggregate_ids: Sequence[UUID]) -> dict[UUID, str | None] | None:
        """The topic of each aggregate's last event (the recorder's `last_topics`); None when
        the recorder cannot say."""
        run = _ON_LOOP.get()
        if run is not None:
            missing = [i for i in aggregate_ids if i not in run.topics]
            if missing:
                raise NeedsRead("last topics", topics=missing)
            return {i: run.topics[i] for i in aggregate_ids}
        return self.log_recorder.last_topics(aggregate_ids)

    def _collect(self, objs: tuple[Any, ...]) -> ProcessingEvent[UUID]:
        """The events and aggregates of a save: aggregates known by their class when the fast
        paths are on, else collected as the library's `save` does."""
        pe: ProcessingEvent[UUID] = ProcessingEvent()
        if not lean_paths():
            pe.collect_events(*objs)  # the library's way (POOL_FAST_PATHS=off)
            return pe
        for obj in objs:
            if obj is None:
                continue
            if isinstance(obj, BaseAggregate):
                pe.events.extend(obj.collect_events())
                pe.aggregates[obj.id] = obj
            else:
                pe.collect_events(obj)
        return pe

    def construct_snapshot_store(self) -> EventStore[UUID]:
        recorder = self.factory.aggregate_recorder(purpose="snapshots")
        return SnapshotStore(self.mapper, recorder, self.snapshotting,
                             available=snapshots_available(recorder))

    def _take_snapshots(self, processing_event: ProcessingEvent[UUID]) -> None:
        """Queue a snapshot of each saved aggregate that is due one (taken on a thread): only
        an application that saves takes snapshots, so a reader never writes to the log."""
        for aggregate in processing_event.aggregates.values():
            self.snapshotting.consider(aggregate)

    def _recorded(self, pe: ProcessingEvent[UUID], recordings: list[Recording[UUID]]) -> None:
        """What the library's `save` does once the events are recorded."""
        self._take_snapshots(pe)
        self._notify(recordings)
        self.notify(pe.events)  # deprecated in the library, still called by its save

    def find(self, cls: type[A], aggregate_id: UUID) -> A | None:
        run = _ON_LOOP.get()
        if run is not None:
            if aggregate_id not in run.read:
                raise NeedsRead(f"{cls.__name__} {aggregate_id}", aggregate_id=aggregate_id)
            read = run.read[aggregate_id]
            # a copy each time: an earlier run of the command may have changed the last one
            return copy_aggregate(read) if isinstance(read, cls) else None
        try:
            agg: object = self.repository.get(aggregate_id)
        except AggregateNotFoundError:
            return None
        if not isinstance(agg, cls):
            return None
        return agg

    def retrying(self, decide: Callable[[], R], attempts: int = 5) -> R:
        """Run load-decide-save again when a concurrent writer got there first (OCC)."""
        for _ in range(attempts):
            try:
                return decide()
            except IntegrityError:
                continue
        raise WriteConflict("the lease kept changing under this command; try again")

    def pool(self, pool_id: str) -> Pool:
        pool = self.find(Pool, Pool.create_id(pool_id))
        if pool is None:
            raise UnknownPool(f"no pool named {pool_id!r}")
        return pool

    def pool_settings(self, pool_id: str) -> Pool:
        """The pool as requests read it (`cached`), for a command that only reads its
        settings (prices, image policy): every commit and release read it from the log, one
        command at a time behind the pool's fast-forward lock."""
        return self.cached(Pool.create_id(pool_id), lambda: self.pool(pool_id))

    def lease_if(self, lease_id: str, owned: Callable[[Lease], bool], where: str) -> Lease:
        """The lease `lease_id` when `owned` says it belongs to the asker; else UnknownLease
        (someone else's lease reads as missing: ids are not secrets, ownership is)."""
        try:
            uid = UUID(lease_id)
        except ValueError:
            raise UnknownLease(f"no lease {lease_id!r}") from None
        lease = self.find(Lease, uid)
        if lease is None or not owned(lease):
            raise UnknownLease(f"no lease {lease_id!r} {where}")
        return lease

    def tenant_lease(self, tenant: str, lease_id: str) -> Lease:
        """The lease `lease_id` of `tenant` (another tenant's reads as UnknownLease)."""
        return self.lease_if(lease_id, lambda lease: lease.tenant_id == tenant,
                              f"for tenant {tenant!r}")

    def account(self, tenant: str, now: float) -> Account:
        """The tenant's account, or a new one opened `now` (not saved)."""
        acc = self.find(Account, Account.create_id(tenant))
        return acc if acc is not None else Account.open(tenant_id=TenantId(tenant), now=now)

    def cached(self, aggregate_id: UUID, load: Callable[[], C]) -> C:
        """A policy aggregate (a pool, a tenant's policy) as requests read it: cached, and
        dropped from the cache when the log stores an event of it, so a request never pays a
        read of a policy it has seen. Without a persistence module that can watch, every
        request reads it. A request only reads what it gets (the object is shared)."""
        hit = self._policies.get(aggregate_id)
        if hit is not None and hit[1] > time.monotonic():
            return hit[0]  # type: ignore[no-any-return]
        if _ON_LOOP.get() is not None:  # no read, and no lock a worker may hold, on the loop
            if hit is not None:
                # past its time but not changed (a change drops it): answered from it while
                # a thread reads it again, so every request in flight does not leave the loop
                self._refresh(aggregate_id, load)
                return hit[0]  # type: ignore[no-any-return]
            raise NeedsRead(f"policy {aggregate_id}")
        with self._policies_lock:
            watched = aggregate_id in self._policy_watches
            if not watched:
                def forget(key: UUID = aggregate_id) -> None:
                    self._policy_changes[key] = self._policy_changes.get(key, 0) + 1
                    self._policies.pop(key, None)

                unwatch = self.log_recorder.watch_appends(aggregate_id, forget)
                if unwatch is not None:
                    self._policy_watches[aggregate_id] = unwatch
                    watched = True
        if not watched:  # a recorder that cannot watch (bus.recorders' plain path)
            return load()
        changes = self._policy_changes.get(aggregate_id, 0)
        value = load()
        if self._policy_changes.get(aggregate_id, 0) == changes:  # nothing stored meanwhile
            self._policies[aggregate_id] = (value, time.monotonic() + POLICY_CACHE_SECONDS)
        return value

    def _refresh(self, aggregate_id: UUID, load: Callable[[], C]) -> None:
        """Read a cached policy again on a thread of its own, one read per policy at a time."""
        with self._policies_lock:
            if aggregate_id in self._refreshing:
                return
            self._refreshing.add(aggregate_id)

        def read() -> None:
            try:
                self.cached(aggregate_id, load)
            except Exception:  # the next request past its time tries again
                log.warning("policy %s not read again", aggregate_id, exc_info=True)
            finally:
                with self._policies_lock:
                    self._refreshing.discard(aggregate_id)

        threading.Thread(target=read, name="pool-policy-read", daemon=True).start()

    def cached_now(self, aggregate_id: UUID) -> Any | None:
        """The policy `cached` holds for `aggregate_id`, whatever its time, without a read
        (None: none is held); for the bus's loop, where nothing may be read."""
        hit = self._policies.get(aggregate_id)
        return None if hit is None else hit[0]

    def close(self) -> None:
        self.snapshotting.close()
        for unwatch in self._policy_watches.values():
            unwatch()
        self._policy_watches.clear()
        super().close()
