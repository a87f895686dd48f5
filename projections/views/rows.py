"""The views' rows: what each aggregate makes of a row, and the one statement per view that
writes a batch's rows."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
from psycopg import sql

from domain.account import Account
from domain.lease import Lease
from domain.node import Node
from projections.views.history import event_times_sql, queue_delete, recorded
from projections.views.schema import DIMENSIONS, formatted

_CREDIT_KINDS = {"CreditsHeld": "held", "CreditsSettled": "settled", "HoldReleased": "released",
                 "CreditsHeldBatch": "held_batch"}


UNSEEN: Any = object()


def credit_extractor(cls: type) -> Any:
    """For an Account's credit events of class `cls` (CreditsHeld, CreditsHeldBatch,
    CreditsSettled, HoldReleased, by name), a function of the event giving a list of (lease id,
    and the deltas on its lease's row: held, charged, released, shortfall) — one per lease the
    event moves credits of; None for any other class."""
    kind = _CREDIT_KINDS.get(cls.__name__)
    if kind is None:
        return None
    if kind == "held":
        return lambda ev: ((ev.lease_id, int(ev.amount), 0, 0, 0),)
    if kind == "held_batch":
        return lambda ev: [(str(lid), int(amount), 0, 0, 0) for _tid, lid, amount in ev.holds]
    if kind == "released":
        return lambda ev: ((ev.lease_id, -int(ev.amount), 0, int(ev.amount), 0),)

    def settled(ev: Any) -> tuple[tuple[str, int, int, int, int]]:
        charged, released = int(ev.charged), int(ev.released)
        return ((ev.lease_id, -(charged + released), charged, released, int(ev.shortfall)),)
    return settled


# One batch's changes are coalesced per row first (a dict keyed by the view's primary key holding
# the row's final state, plus the summed credit deltas of each lease), then each view is written
# with ONE statement: INSERT … SELECT FROM jsonb_array_elements(<the rows as one JSON array of
# arrays>) ON CONFLICT … DO UPDATE, and the queue's deletes with one DELETE … WHERE lease_id =
# ANY(%s). Keys are unique within each statement, so every row is affected at most once, exactly
# as the per-row upserts it replaces. The rows travel as one JSON text encoded by msgspec (C):
# psycopg dumps an array parameter value by value in Python, which costs more per row than the
# JSON (figures: docs/performance-log.md), and PostgreSQL's cost per row is the same either way.
# Numbers go through JSON's text exactly (integers as they are, floats by shortest round-trip
# repr), jsonb columns are nested JSON values, and SQL NULL is JSON null.
_encode_json = msgspec.json.encode


def _f(value: Any) -> float | None:
    return None if value is None else float(value)


_LEASE_STATE_COLS: tuple[tuple[str, str], ...] = (
    ("lease_id", "text"), ("tenant", "text"), ("pool", "text"), ("state", "text"),
    ("node_id", "text"), ("priority_class", "text"), ("shape", "jsonb"), ("epoch", "integer"),
    ("attempts", "integer"), ("maximum_runtime_seconds", "integer"),
    ("requested_at", "float8"), ("queued_at", "float8"), ("reserved_at", "float8"),
    ("started_at", "float8"), ("run_ended_at", "float8"), ("ended_at", "float8"),
    ("deadline", "float8"), ("last_heartbeat_at", "float8"), ("hold_microcredits", "bigint"),
    ("end_reason", "text"), ("exit_code", "integer"), ("version", "integer"),
    ("gang_id", "text"), ("gang_member", "integer"), ("name", "text"), ("labels", "jsonb"),
)


_CREDIT_COLS: tuple[tuple[str, str], ...] = (
    ("credits_held", "bigint"), ("credits_charged", "bigint"), ("credits_released", "bigint"),
    ("credits_shortfall", "bigint"), ("last_seq", "bigint"),
)


_QUEUE_COLS: tuple[tuple[str, str], ...] = (
    ("lease_id", "text"), ("pool", "text"), ("tenant", "text"), ("priority_class", "text"),
    ("state", "text"), ("shape", "jsonb"), ("attempts", "integer"),
    ("requested_at", "float8"), ("queued_at", "float8"), ("last_seq", "bigint"),
)


_BALANCE_COLS: tuple[tuple[str, str], ...] = (
    ("tenant", "text"), ("granted", "bigint"), ("held", "bigint"), ("spent", "bigint"),
    ("available", "bigint"), ("shortfall", "bigint"), ("holds", "integer"),
    ("version", "integer"), ("last_seq", "bigint"),
)


_CAPACITY_COLS: tuple[tuple[str, str], ...] = (
    ("node_id", "text"), ("pool", "text"), ("state", "text"), ("state_reason", "text"),
    ("zone", "text"), ("failure_domain", "text"), ("gpu_model", "text"),
    *((f"{d}_{k}", "bigint") for d in DIMENSIONS for k in ("allocatable", "allocated")),
    ("extended_allocatable", "jsonb"), ("extended_allocated", "jsonb"),
    ("allocations", "integer"), ("last_heartbeat_at", "float8"), ("version", "integer"),
    ("last_seq", "bigint"),
)


def _upsert_sql(schema: str, table: str, cols: Sequence[tuple[str, str]],
                sets: Sequence[str]) -> sql.Composed:
    """INSERT INTO schema.table (cols) SELECT <each column from its place in a row> FROM
    jsonb_array_elements(%s) ON CONFLICT (first col) DO UPDATE SET <sets>, where each of `sets`
    is raw SQL with {t} for the table; the parameter is the rows as one JSON array of arrays."""
    t = sql.Identifier(schema, table)
    return sql.SQL(
        "INSERT INTO {t} ({cols}) SELECT {values} FROM jsonb_array_elements(%s::jsonb) AS r "
        "ON CONFLICT ({key}) DO UPDATE SET {sets}"
    ).format(
        t=t,
        cols=sql.SQL(", ").join(sql.Identifier(c) for c, _ in cols),
        values=sql.SQL(", ").join(
            sql.SQL(f"(r->{i})" if typ == "jsonb" else f"(r->>{i})::{typ}")
            for i, (_, typ) in enumerate(cols)),
        key=sql.Identifier(cols[0][0]),
        sets=sql.SQL(", ").join(sql.SQL(s).format(t=t) for s in sets),
    )


def _set_excluded(names: Iterable[str]) -> list[str]:
    return [f'"{n}" = EXCLUDED."{n}"' for n in names]


_CREDIT_SETS = [f'{c} = {{t}}.{c} + EXCLUDED.{c}' for c, _ in _CREDIT_COLS[:-1]] + [
    "last_seq = GREATEST({t}.last_seq, EXCLUDED.last_seq)"]


_SQL_CACHE: dict[tuple[str, str], sql.Composed] = {}
# the statements whose rows are recorded in the history, and the view each writes
_RECORDED = {"leases": "leases", "credits": "leases", "queue": "queue", "balance": "balance",
             "capacity": "capacity"}


def statement(schema: str, kind: str) -> sql.Composed:
    got = _SQL_CACHE.get((schema, kind))
    if got is None:
        if kind == "leases":  # lease state (replaced) + credit deltas (added)
            got = _upsert_sql(schema, "leases", _LEASE_STATE_COLS + _CREDIT_COLS,
                              _set_excluded(c for c, _ in _LEASE_STATE_COLS[1:]) + _CREDIT_SETS)
        elif kind == "credits":  # credit deltas only, for leases with no state in the batch
            got = _upsert_sql(schema, "leases", (("lease_id", "text"), ("tenant", "text"),
                                                 *_CREDIT_COLS), _CREDIT_SETS)
        elif kind == "queue":
            got = _upsert_sql(schema, "queue", _QUEUE_COLS,
                              _set_excluded(c for c, _ in _QUEUE_COLS[1:]))
        elif kind == "positions":
            got = formatted("SELECT view_name, notification_id, events_applied FROM {s}.tracking "
                       "FOR UPDATE", schema)
        elif kind == "tracking":
            got = formatted("UPDATE {s}.tracking AS t SET notification_id = u.n, "
                       "events_applied = u.a, updated_at = now() FROM unnest("
                       "%s::text[], %s::bigint[], %s::bigint[]) AS u(v, n, a) "
                       "WHERE t.view_name = u.v", schema)
        elif kind == "queue_delete":  # with each key's seq: a tombstone in the history
            got = queue_delete(schema)
        elif kind == "event_times":
            got = event_times_sql(schema)
        elif kind == "balance":
            got = _upsert_sql(schema, "balance", _BALANCE_COLS,
                              _set_excluded(c for c, _ in _BALANCE_COLS[1:]))
        elif kind == "capacity":
            got = _upsert_sql(schema, "capacity", _CAPACITY_COLS,
                              _set_excluded(c for c, _ in _CAPACITY_COLS[1:]))
        else:  # pragma: no cover
            raise KeyError(kind)
        if kind in _RECORDED:  # every row version the view takes goes to its history too
            got = recorded(got, schema, _RECORDED[kind])
        if len(_SQL_CACHE) > 1000:
            _SQL_CACHE.clear()
        _SQL_CACHE[(schema, kind)] = got
    return got


def as_columns(rows: Sequence[Sequence[Any]], width: int) -> list[list[Any]]:
    """Row tuples → one list per column (the unnest arrays)."""
    if not rows:
        return [[] for _ in range(width)]
    return [list(c) for c in zip(*rows)]


def emit_rows(emit: Any, kind: str, rows: Sequence[Sequence[Any]]) -> None:
    if rows:
        emit(kind, (_encode_json(rows).decode(),))


def lease_state_row(lease: Lease) -> tuple[Any, ...]:
    return (
        str(lease.id), lease.tenant_id, lease.pool_id, str(lease.state), lease.node_id,
        lease.priority_class, lease.shape.to_dict(), lease.epoch, lease.attempts,
        lease.maximum_runtime_seconds, _f(lease.requested_at), _f(lease.queued_at),
        _f(lease.reserved_at), _f(lease.started_at), _f(lease.run_ended_at),
        _f(lease.ended_at), _f(lease.deadline), _f(lease.last_heartbeat_at),
        lease.hold_microcredits, lease.end_reason, lease.exit_code, lease.version,
        *((None, None) if lease.gang is None else (lease.gang.gang_id, lease.gang.member)),
        lease.name, dict(lease.labels),
    )


def queue_row(lease: Lease, state: str, seq: int) -> tuple[Any, ...]:
    return (str(lease.id), lease.pool_id, lease.tenant_id, lease.priority_class, state,
            lease.requested_shape.to_dict(), lease.attempts, _f(lease.requested_at),
            _f(lease.queued_at), seq)


def account_row(acc: Account, seq: int) -> tuple[Any, ...]:
    return (acc.tenant_id, acc.granted, acc.held, acc.spent, acc.available, acc.shortfall,
            len(acc.holds), acc.version, seq)


def node_row(node: Node, seq: int) -> tuple[Any, ...]:
    caps = node.capabilities
    alloc = node.allocated
    allocatable = node.allocatable
    dims: list[Any] = []
    for d in DIMENSIONS:
        dims += [getattr(allocatable, d), getattr(alloc, d)]
    return (node.node_id, node.pool_id, str(node.state), node.state_reason, caps.zone,
            caps.failure_domain, caps.gpu_model, *dims, dict(allocatable.extended),
            dict(alloc.extended), len(node.allocations), _f(node.last_heartbeat_at),
            node.version, seq)
