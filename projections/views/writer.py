"""The projection: the log folded into the views, each batch and its position in one transaction."""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import psycopg

from bus.recorders import LogRecorder, log_recorder
from bus.transcoder import EventDecoder
from domain.account import Account
from domain.fold import Fold
from domain.lease import TERMINAL_STATES, Lease
from domain.node import Node
from projections.errors import PositionMoved
from projections.views.history import event_times
from projections.views.retention import HISTORY_MAX_AGE_S, PRUNE_BATCH, prune_history
from projections.views.rows import (
    UNSEEN,
    account_row,
    as_columns,
    credit_extractor,
    emit_rows,
    lease_state_row,
    node_row,
    queue_row,
    statement,
)
from projections.views.schema import (
    DEFAULT_BATCH,
    DEFAULT_SCHEMA,
    TRACKING_DDL,
    VIEWS,
    WAITING_STATES,
    check_view,
    create_schema,
    drop_view,
    formatted,
    lock_key,
    positions,
)

_CACHE_LIMIT = 100_000


class Folder:
    """Folds notifications into aggregates, in memory, loading from the log on a cache miss."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.aggregates: dict[UUID, Any] = {}
        self._fold = Fold(self.aggregates)
        self._is_lease: dict[type, bool] = {}

    def clear(self) -> None:
        self.aggregates.clear()

    def forget_finished(self, folded: Iterable[tuple[int, Any, Any]]) -> None:
        """Drop the leases of a batch that ended (released, cancelled, …): a view's next rows
        for them come from an event they rarely get (a preempted lease's requeue), and if one
        does, `apply` reads the lease at that version from the log. Kept, they are most of a
        long log's heap, which every full pass of the cycle collector walks (seconds-long
        pauses at a million events)."""
        aggregates = self.aggregates
        is_lease = self._is_lease
        for _seq, _ev, agg in folded:
            cls = type(agg)
            lease = is_lease.get(cls)
            if lease is None:
                lease = is_lease[cls] = issubclass(cls, Lease)
            if lease and agg.state in TERMINAL_STATES:
                aggregates.pop(agg.id, None)

    def apply(self, event: Any) -> Any:
        """The aggregate after `event`: the one fold's step over the cache, or, where that
        cannot say (an aggregate not cached, or a step that raised), the log's own fold of it
        at that version."""
        aggregates = self.aggregates
        if len(aggregates) >= _CACHE_LIMIT:
            aggregates.clear()
        try:
            agg = self._fold.step(event)
        except Exception:  # noqa: BLE001 - fall back to the log's own fold
            agg = None
        if agg is None:
            agg = aggregates[event.originator_id] = self.app.repository.get(
                event.originator_id, version=event.originator_version)
        return agg


_LEASE, _ACCOUNT, _NODE, _OTHER = 1, 2, 3, 4


@dataclass
class Prepared:
    """A folded batch's statements for views at `expected` (see PoolViews.prepare)."""

    expected: dict[str, tuple[int, int]]  # view → (position, events applied) it was built for
    after: dict[str, tuple[int, int]]  # the same once it is written
    statements: list[tuple[str, Any]]  # (statement kind, parameters), in write order
    tracked: list[tuple[str, int, int]]  # (view, new position, events applied)
    taken: int  # what process() returns for it


class _Slice:
    """What one batch (from one position on) changed, as `PoolViews._slice` coalesced it."""

    __slots__ = ("accounts", "count", "credits", "last_seq", "leases", "nodes")

    def __init__(self, count: int, last_seq: int) -> None:
        self.count = count  # events in the slice
        self.last_seq = last_seq  # the notification id of its last event
        self.leases: list[tuple[int, Lease]] = []  # (seq of its last event, final lease)
        self.accounts: list[tuple[int, Account]] = []
        self.nodes: list[tuple[int, Node]] = []
        # (seq, tenant, lease id, held, charged, released, shortfall deltas) per credit event of
        # an account, in log order
        self.credits: list[tuple[int, str, str, int, int, int, int]] = []


class PoolViews:
    """The four views of one schema, fed by the "pool" application `app` (its recorder reads
    JetStream). `process(notifications)` applies one batch in one transaction."""

    def __init__(self, app: Any, database_url: str, *, schema: str = DEFAULT_SCHEMA,
                 views: Sequence[str] = VIEWS,
                 history_max_age_s: float = HISTORY_MAX_AGE_S) -> None:
        self.app = app
        self.recorder = log_recorder(app.recorder)  # bus.recorders
        self.history_max_age_s = history_max_age_s
        self.database_url = database_url
        self.schema = schema
        self.views = tuple(check_view(v) for v in views)
        self._write_order = sorted(self.views, key=lambda v: v != "leases")
        self.folder = Folder(app)
        self.decode = EventDecoder(app.mapper)
        self._kinds: dict[type, int] = {}
        self._credit_extractors: dict[type, Any] = {}
        self._conn: psycopg.Connection[Any] | None = None

    @property
    def conn(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.database_url)
        return self._conn

    def setup(self) -> None:
        with self.conn.transaction():
            self.conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(self.schema),))
            create_schema(self.conn, self.schema, self.views)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def prune_history(self, now: float, *, batch: int = PRUNE_BATCH) -> int:
        """One small batch of the views' past older than their retention deleted, in its own
        transaction under the projector's lock; returns the rows deleted (`batch` or more:
        there is more to do). Not while a batch is being written on this connection."""
        with self.conn.transaction():
            self.conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(self.schema),))
            return prune_history(self.conn, self.schema, self.views, now=now,
                                 max_age_s=self.history_max_age_s, batch=batch)

    def position(self) -> int:
        """The lowest position among this projection's views: where the next batch starts."""
        return min((at for at, _ in self.view_positions().values()), default=0)

    def view_positions(self) -> dict[str, tuple[int, int]]:
        """view → (notification_id, events_applied) of this projection's views, as committed
        now (0, 0 for a view not created yet)."""
        pos = positions(self.conn, self.schema)
        self.conn.commit()
        return {v: pos.get(v, (0, 0)) for v in self.views}

    def process(self, notifications: Sequence[Any], *, read_from: int | None = None,
                prepared: Prepared | None = None) -> int:
        """Apply one batch; returns how many events some view took (0: all already applied).

        `read_from`: where the batch was read from, after the views' position then. A view now
        behind that was rebuilt meanwhile: nothing is written, and PositionMoved is raised so
        the caller reads again from the view's position instead of leaving a gap.

        `prepared`: the batch as `prepare` folded it and built its rows, for the positions it
        names; it is written only if the views are exactly there (else PositionMoved), and the
        in-memory fold is left alone (the caller clears it on any error: see `prepare`)."""
        if prepared is not None:
            return self._write_prepared(prepared)
        if not notifications:
            return 0
        folded = self._fold(notifications)
        conn = self.conn
        try:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(self.schema),))
                pos = positions(conn, self.schema, lock=True)
                if read_from is not None and any(
                        pos.get(v, (0, 0))[0] < read_from - 1 for v in self.views):
                    raise PositionMoved(f"a view moved back before position {read_from - 1}")
                # the writes go out in pipeline mode: PostgreSQL works on one view's statement
                # while the next one's rows are built here, and nothing waits on a reply until
                # the pipeline's end; the heaviest view (leases) goes first
                with conn.pipeline():  # its end waits for every statement's result
                    schema = self.schema
                    tracked, taken = self._plan(
                        folded, pos, lambda kind, params: conn.execute(statement(schema, kind), params))
                    if tracked:
                        conn.execute(statement(schema, "tracking"), as_columns(tracked, 3))
            self.folder.forget_finished(folded)
            return taken
        except Exception:
            # the view rolled back; the in-memory fold is ahead of nothing useful now
            self.folder.clear()
            raise

    def prepare(self, notifications: Sequence[Any],
                pos: dict[str, tuple[int, int]]) -> Prepared:
        """Fold a batch and build its rows for views at positions `pos` (view → (position,
        events applied)), without touching the database: `process(..., prepared=)` writes them
        later, in one transaction, if the views are still there. The rows are final when this
        returns, so the next batch may be folded (and its aggregates mutated) meanwhile; should
        a write then fail, the caller must `folder.clear()`, the fold being ahead of the views."""
        if not notifications:
            raise ValueError("nothing to prepare")
        folded = self._fold(notifications)
        statements: list[tuple[str, Any]] = []
        try:
            tracked, taken = self._plan(folded, pos, lambda kind, params: statements.append(
                (kind, params)))
            self.folder.forget_finished(folded)
        except Exception:
            self.folder.clear()
            raise
        expected = {v: pos.get(v, (0, 0)) for v in self.views}
        after = dict(expected)
        for view, at, applied in tracked:
            after[view] = (at, applied)
        return Prepared(expected, after, statements, tracked, taken)

    def _write_prepared(self, prepared: Prepared) -> int:
        """One transaction, pipelined: two round trips (the positions under the lock, then the
        rows, the positions and the commit)."""
        conn, schema = self.conn, self.schema
        with conn.pipeline() as pipe, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(schema),))
            cur = conn.execute(statement(schema, "positions"))
            pipe.sync()
            pos = {r[0]: (int(r[1]), int(r[2])) for r in cur.fetchall()}
            if any(pos.get(v, (0, 0)) != at for v, at in prepared.expected.items()):
                raise PositionMoved("a view moved after the batch was prepared")
            for kind, params in prepared.statements:
                conn.execute(statement(schema, kind), params)
            if prepared.tracked:
                conn.execute(statement(schema, "tracking"), as_columns(prepared.tracked, 3))
        return prepared.taken

    def _fold(self, notifications: Sequence[Any]) -> list[tuple[int, Any, Any]]:
        decode, apply = self.decode, self.folder.apply
        try:
            return [(n.id, ev, apply(ev)) for n in notifications for ev in (decode(n),)]
        except Exception:
            self.folder.clear()
            raise

    def _plan(self, folded: list[tuple[int, Any, Any]], pos: dict[str, tuple[int, int]],
              emit: Any) -> tuple[list[tuple[str, int, int]], int]:
        """Each view's statements for a folded batch, given the views' positions, passed to
        `emit(kind, params)` as they are built; returns the new positions and the count taken."""
        taken = 0
        tracked: list[tuple[str, int, int]] = []
        # views at the same position share one slice of the batch and one coalescing
        shared: dict[int, _Slice] = {}
        for view in self._write_order:
            at, applied = pos.get(view, (0, 0))
            got = shared.get(at)
            if got is None:
                fresh = folded if folded[0][0] > at else [f for f in folded if f[0] > at]
                got = shared[at] = self._slice(fresh)
            if not got.count:
                continue
            taken = max(taken, got.count)
            self._statements(view, got, emit)
            tracked.append((view, got.last_seq, applied + got.count))
        if tracked:  # each second's last event: where a view `as_of` a time stands
            emit("event_times", event_times(folded))
        return tracked, taken

    def _kind(self, cls: type) -> int:
        kinds = self._kinds
        got = kinds.get(cls)
        if got is None:
            got = kinds[cls] = (_LEASE if issubclass(cls, Lease) else _ACCOUNT
                                if issubclass(cls, Account) else _NODE
                                if issubclass(cls, Node) else _OTHER)
        return got

    def _slice(self, fresh: list[tuple[int, Any, Any]]) -> _Slice:
        """A batch's events from one position on, coalesced per aggregate: each aggregate touched
        with the position of its last event, by kind (the aggregates are the folded objects,
        final for this batch), and the credit events of accounts in log order."""
        out = _Slice(len(fresh), fresh[-1][0] if fresh else 0)
        # keyed by object: a folded aggregate is one object for as long as it is cached, and a
        # reload (a cache miss) makes a new object whose first event comes after the old one's
        # last, so per key, in first-seen order, the later object's row is written last
        last = {id(agg): (seq, agg) for seq, _ev, agg in fresh}
        kinds = self._kinds
        extractors = self._credit_extractors
        credits = out.credits
        for seq, ev, agg in fresh:
            cls = type(ev)
            extract = extractors.get(cls, UNSEEN)
            if extract is None:
                continue
            if extract is UNSEEN:
                extract = extractors[cls] = credit_extractor(cls)
                if extract is None:
                    continue
            if (kinds.get(type(agg)) or self._kind(type(agg))) == _ACCOUNT:
                tenant = agg.tenant_id
                for moved in extract(ev):
                    credits.append((seq, tenant, *moved))
        by_kind: dict[int, list[Any]] = {_LEASE: out.leases, _ACCOUNT: out.accounts,
                                         _NODE: out.nodes}
        for seq, agg in last.values():
            cls = type(agg)
            rows = by_kind.get(kinds.get(cls) or self._kind(cls))
            if rows is not None:
                rows.append((seq, agg))
        return out

    def _statements(self, view: str, got: _Slice, emit: Any) -> None:
        """A slice's changes to `view`, one row per key, as statements: `emit(kind, params)`."""
        if view == "leases":
            rows: dict[str, list[Any]] = {}
            for seq, agg in got.leases:
                rows[str(agg.id)] = [*lease_state_row(agg), 0, 0, 0, 0, seq]
            credit_only: dict[str, list[Any]] = {}
            for seq, tenant, lid, h, ch, rel, sh in got.credits:
                row = rows.get(lid)
                if row is None:
                    row = credit_only.get(lid)
                    if row is None:
                        credit_only[lid] = [lid, tenant, h, ch, rel, sh, seq]
                        continue
                row[-5] += h
                row[-4] += ch
                row[-3] += rel
                row[-2] += sh
                row[-1] = max(row[-1], seq)
            emit_rows(emit, "leases", list(rows.values()))
            emit_rows(emit, "credits", list(credit_only.values()))
        elif view == "queue":
            waiting: dict[str, tuple[Any, ...]] = {}
            gone: dict[str, int] = {}
            for seq, agg in got.leases:
                state = str(agg.state)
                key = str(agg.id)
                if state in WAITING_STATES:
                    gone.pop(key, None)
                    waiting[key] = queue_row(agg, state, seq)
                else:
                    waiting.pop(key, None)
                    gone[key] = seq
            emit_rows(emit, "queue", list(waiting.values()))
            if gone:
                emit("queue_delete", (list(gone), list(gone.values())))
        elif view == "balance":
            accounts: dict[str, tuple[Any, ...]] = {}
            for seq, acc in got.accounts:
                accounts[acc.tenant_id] = account_row(acc, seq)
            emit_rows(emit, "balance", list(accounts.values()))
        elif view == "capacity":
            nodes: dict[str, tuple[Any, ...]] = {}
            for seq, node in got.nodes:
                nodes[node.node_id] = node_row(node, seq)
            emit_rows(emit, "capacity", list(nodes.values()))

    def catch_up(self, *, batch_size: int = DEFAULT_BATCH, stop: int | None = None) -> int:
        """Apply every batch up to the log's end (or `stop`); returns the events applied. The
        next batch is read while the current one is applied, and folded (`prepare`) while the
        previous one is written by a writer thread, each sent after the previous one committed
        (as the projector does)."""
        total = 0
        with concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="pool-views-writer") as writer:
            while True:
                pos = self.view_positions()
                start = min((at for at, _ in pos.values()), default=0) + 1
                if stop is not None and start > stop:
                    return total
                inflight: concurrent.futures.Future[int] | None = None
                try:
                    for page in read_pages(self.recorder, start, batch_size, stop=stop):
                        prepared = self.prepare(page, pos)
                        if inflight is not None:
                            total += inflight.result()
                        inflight = writer.submit(self.process, page, prepared=prepared)
                        pos = prepared.after
                    if inflight is not None:
                        total += inflight.result()
                    return total
                except BaseException as exc:
                    if inflight is not None:  # wait for it: the connection is its until then
                        with contextlib.suppress(Exception):
                            total += inflight.result()
                    self.folder.clear()  # the fold may be ahead of what was written
                    if not isinstance(exc, PositionMoved):
                        raise


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cycle collector off for a bounded fold of the whole log (a rebuild, the audit).

    Such a fold keeps many objects alive (aggregates, per-lease figures) and makes (almost) no
    reference cycles, so the collector would only re-scan a growing heap (figures:
    docs/performance-log.md). Any cyclic garbage of other threads waits for the end; the previous
    setting comes back."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def read_pages(recorder: LogRecorder, start: int, batch_size: int,
               stop: int | None = None) -> Iterator[Sequence[Any]]:
    """Pages of notifications from `start` up to the end of the log (or `stop`), read until
    one is empty; while the caller works on one page the next is already being read when the
    recorder reads ahead (bus.jetstream's `prefetch`), else (bus.recorders' plain path) pages
    are read one after the other."""

    def fetch(at: int) -> concurrent.futures.Future[list[Any]]:
        return recorder.prefetch(at, batch_size, stop)

    ahead = fetch(start)
    while True:
        page = ahead.result()
        if not page:
            return
        if stop is not None and page[-1].id >= stop:
            yield page
            return
        ahead = fetch(page[-1].id + 1)
        yield page


def rebuild(app: Any, database_url: str, *, schema: str = DEFAULT_SCHEMA,
            views: Sequence[str] = VIEWS, batch_size: int = DEFAULT_BATCH) -> int:
    """Drop the views and fold them again from the first event, up to the log's end now.

    Dropping and re-creating happen in one transaction under the projector's lock, so a live
    projector never sees a half-dropped view; it then waits on the lock between batches."""
    names = tuple(check_view(v) for v in views)
    with psycopg.connect(database_url) as conn, conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(schema),))
        conn.execute(formatted("CREATE SCHEMA IF NOT EXISTS {s}", schema))
        conn.execute(formatted(TRACKING_DDL, schema))
        for v in names:
            drop_view(conn, schema, v)
        create_schema(conn, schema, names)
    proj = PoolViews(app, database_url, schema=schema, views=names)
    try:
        with gc_paused():
            return proj.catch_up(batch_size=batch_size,
                                 stop=app.recorder.max_notification_id() or 0)
    finally:
        proj.close()
