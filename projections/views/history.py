"""The views' past: every row version a batch writes, kept beside the view, and each second's
last event; a view as it was at a time is read from them (`as_of`, docs/audit.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql


def formatted(text: str, schema: str) -> sql.Composed:
    return sql.SQL(text).format(s=sql.Identifier(schema))


# One table for the four views: (view, key, the last_seq of the row version, how the row came
# to be: c created, u updated, d gone from the view, the row as JSON, NULL where it left the
# view). The view's own upsert writes it, in one statement with a data-modifying CTE, so a
# version is exactly the row the view then held.
HISTORY_DDL = """CREATE TABLE IF NOT EXISTS {s}.history (
    view_name TEXT NOT NULL, key TEXT NOT NULL, seq BIGINT NOT NULL, kind "char" NOT NULL,
    row_data JSONB);
    CREATE INDEX IF NOT EXISTS history_key ON {s}.history (view_name, key, seq);
    CREATE INDEX IF NOT EXISTS history_seq ON {s}.history (view_name, seq) INCLUDE (key, kind);
    CREATE TABLE IF NOT EXISTS {s}.event_times (
        second BIGINT PRIMARY KEY, seq BIGINT NOT NULL, at DOUBLE PRECISION NOT NULL);
    CREATE TABLE IF NOT EXISTS {s}.history_since (
        view_name TEXT PRIMARY KEY, seq BIGINT NOT NULL);
    ALTER TABLE {s}.history_since ADD COLUMN IF NOT EXISTS kept_from DOUBLE PRECISION,
        ADD COLUMN IF NOT EXISTS max_age_s DOUBLE PRECISION,
        ADD COLUMN IF NOT EXISTS pruned_seq BIGINT NOT NULL DEFAULT 0"""

KEYS = {"queue": "lease_id", "balance": "tenant", "capacity": "node_id", "leases": "lease_id"}


def create_history(conn: psycopg.Connection[Any], schema: str, view: str) -> None:
    """The history tables, and where `view`'s history begins: its position now (a view built
    before its history was kept answers `as_of` only from then on)."""
    for stmt in HISTORY_DDL.split(";"):
        conn.execute(formatted(stmt, schema))
    conn.execute(formatted(
        "INSERT INTO {s}.history_since SELECT view_name, notification_id FROM {s}.tracking "
        "WHERE view_name = %s ON CONFLICT (view_name) DO NOTHING", schema), (view,))


def drop_history(conn: psycopg.Connection[Any], schema: str, view: str) -> None:
    for stmt in ("DELETE FROM {s}.history WHERE view_name = %s",
                 "DELETE FROM {s}.history_since WHERE view_name = %s"):
        try:
            with conn.transaction():
                conn.execute(formatted(stmt, schema), (view,))
        except psycopg.errors.UndefinedTable:
            return


def recorded(upsert: sql.Composed, schema: str, view: str) -> sql.Composed:
    """`upsert` (an INSERT … ON CONFLICT into `view`) writing each row it leaves into the
    history too."""
    return sql.SQL(
        "WITH up AS ({upsert} RETURNING *, (xmax = 0) AS created_) "
        "INSERT INTO {h} (view_name, key, seq, kind, row_data) SELECT {v}, up.{k}, up.last_seq, "
        "CASE WHEN up.created_ THEN 'c' ELSE 'u' END, to_jsonb(up) - 'created_' FROM up").format(
        upsert=upsert, h=sql.Identifier(schema, "history"), v=sql.Literal(view),
        k=sql.Identifier(KEYS[view]))


def queue_delete(schema: str) -> sql.Composed:
    """The queue's deletes (keys, and the seq each left at), each a tombstone in the history."""
    return formatted(
        "WITH g AS (SELECT * FROM unnest(%s::text[], %s::bigint[]) AS g(k, q)), "
        "d AS (DELETE FROM {s}.queue USING g WHERE lease_id = g.k RETURNING lease_id, g.q) "
        "INSERT INTO {s}.history (view_name, key, seq, kind, row_data) "
        "SELECT 'queue', lease_id, q, 'd', NULL FROM d", schema)


def event_times_sql(schema: str) -> sql.Composed:
    return formatted(
        "INSERT INTO {s}.event_times (second, seq, at) SELECT * FROM unnest(%s::bigint[], "
        "%s::bigint[], %s::float8[]) ON CONFLICT (second) DO UPDATE SET seq = GREATEST("
        "{s}.event_times.seq, EXCLUDED.seq), at = GREATEST({s}.event_times.at, EXCLUDED.at)",
        schema)


def event_times(folded: Sequence[tuple[int, Any, Any]]) -> list[list[Any]]:
    """A batch's (second, last seq in it, that event's time) for each second its events were
    made in, as the three unnest arrays."""
    last: dict[int, tuple[int, float]] = {}
    for seq, ev, _agg in folded:
        stamp = getattr(ev, "timestamp", None)
        if stamp is None:
            continue
        at = stamp.timestamp()
        last[int(at)] = (seq, at)
    return [list(last), [s for s, _ in last.values()], [a for _, a in last.values()]]


def seq_at(conn: psycopg.Connection[Any], schema: str, at: float) -> int:
    """The last event made at or before `at` (0: none), as far as the views know."""
    row = conn.execute(formatted(
        "SELECT max(seq) FROM {s}.event_times WHERE second <= %s AND "
        "(second < %s OR at <= %s)", schema), (int(at), int(at), at)).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def history_since(conn: psycopg.Connection[Any], schema: str,
                  view: str) -> tuple[int, int, float | None, float | None] | None:
    """Where `view`'s history begins, the view's position now, and where retention cut it
    last (the cut's time and the age kept; None, None: never cut). None: it keeps none."""
    try:
        with conn.transaction():
            row = conn.execute(formatted(
                "SELECT h.seq, t.notification_id, h.kept_from, h.max_age_s FROM "
                "{s}.history_since h JOIN {s}.tracking t USING (view_name) "
                "WHERE view_name = %s", schema), (view,)).fetchone()
    except psycopg.errors.UndefinedTable:
        return None
    return None if row is None else (int(row[0]), int(row[1]), row[2], row[3])


def as_of(schema: str, view: str, seq: int, *, early: bool = False) -> sql.Composed:
    """A FROM item standing for `view` as it was after event `seq`: its rows unchanged since,
    and of the rows changed since, each one's last version at or before it (none where it was
    not in the view then). Cost: the view's rows plus the versions written after `seq`."""
    t = sql.Identifier(schema, view)
    h = sql.Identifier(schema, "history")
    k = sql.Identifier(KEYS[view])
    if early:  # fewer versions before than after: each row's last version then, from them
        return sql.SQL(
            "(SELECT r.* FROM (SELECT DISTINCT ON (key) row_data FROM {h} WHERE view_name = {v} "
            "AND seq <= {q} ORDER BY key, seq DESC) p CROSS JOIN LATERAL jsonb_populate_record("
            "NULL::{t}, p.row_data) r WHERE p.row_data IS NOT NULL) AS {a}").format(
            h=h, v=sql.Literal(view), q=sql.Literal(int(seq)), t=t, a=sql.Identifier(view))
    # a row whose versions since hold a creation and no removal did not exist then: no probe
    return sql.SQL(
        "(WITH changed AS MATERIALIZED (SELECT key, bool_or(kind = 'c') AND NOT "
        "bool_or(kind = 'd') AS born FROM {h} WHERE view_name = {v} AND seq > {q} GROUP BY key), "
        "past AS (SELECT p.row_data FROM changed c CROSS JOIN LATERAL (SELECT row_data FROM {h} "
        "WHERE view_name = {v} AND key = c.key AND seq <= {q} ORDER BY seq DESC LIMIT 1) p "
        "WHERE NOT c.born) "
        "SELECT * FROM {t} WHERE NOT EXISTS (SELECT 1 FROM changed c WHERE c.key = {t}.{k}) "
        "UNION ALL SELECT r.* FROM past CROSS JOIN LATERAL jsonb_populate_record("
        "NULL::{t}, past.row_data) r WHERE past.row_data IS NOT NULL) AS {a}").format(
        h=h, v=sql.Literal(view), q=sql.Literal(int(seq)), t=t, k=k, a=sql.Identifier(view))


def history_extent(database_url: str, schema: str) -> tuple[float | None, float | None, int]:
    """(the first and last event time the views know, the row versions kept): for benches."""
    with psycopg.connect(database_url) as conn:
        row = conn.execute(formatted("SELECT min(at), max(at) FROM {s}.event_times",
                                     schema)).fetchone()
        count = conn.execute(formatted("SELECT count(*) FROM {s}.history", schema)).fetchone()
    lo, hi = (row or (None, None))
    return lo, hi, int(count[0]) if count else 0
