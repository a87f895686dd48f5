"""Reads of the views: what `pool.cmd.<tenant>.query.<view>` and the CLI tables answer.
Tenant scoping, filters and paging: docs/architecture.md#the-views.
"""

from __future__ import annotations

import json
import math
import threading
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from projections.catalog import COLUMNS, FILTERS, KEYS, LABEL_FILTER, MAX_LIMIT, TENANT_VIEWS
from projections.errors import BadQuery, BeforeHistory, ViewsUnavailable
from projections.views import DEFAULT_SCHEMA
from projections.views.history import KEYS as HISTORY_KEYS
from projections.views.history import as_of, history_since, seq_at
from projections.views.schema import check_readable


def query(conn: psycopg.Connection[Any], view: str, *, tenant: str | None,
          filters: dict[str, str] | None = None, limit: int = 100, cursor: str | None = None,
          schema: str = DEFAULT_SCHEMA, at: float | None = None) -> dict[str, Any]:
    """One page of a view: {"view", "rows", "next_cursor"}; `tenant` None reads every tenant;
    `at` (epoch seconds): the view as it was then (its "as_of": the last event made by then)."""
    check_readable(view)
    key = KEYS[view]
    _check(view, tenant=tenant, filters=filters or {}, limit=limit, cursor=cursor)
    where: list[sql.Composable] = []
    params: list[Any] = []
    if tenant is not None:
        where.append(sql.SQL("tenant = %s"))
        params.append(tenant)
    for name, value in sorted((filters or {}).items()):
        if name == LABEL_FILTER:
            where.append(sql.SQL("labels @> %s::jsonb"))
            params.append(json.dumps(label_pairs(value)))
            continue
        where.append(sql.SQL("{} = %s").format(sql.Identifier(name)))
        params.append(value)
    if cursor:
        where.append(sql.SQL("{} > %s").format(sql.Identifier(key)))
        params.append(cursor)
    source: sql.Composable = sql.Identifier(schema, view)
    as_of_seq = None
    if at is not None:
        as_of_seq, position = _seq_then(conn, schema, view, at)
        # read from the side with fewer versions: those before the time (early in the log),
        # else the view now and those after it (the history grows about evenly in seq)
        source = as_of(schema, view, as_of_seq, early=2 * as_of_seq < position)
        # the changed rows' keys are hashed: in memory, not spilled, up to a few million
        conn.execute("SET LOCAL work_mem = '64MB'")
    stmt = sql.SQL("SELECT {cols} FROM {t}{w} ORDER BY {k} LIMIT %s").format(
        cols=sql.SQL(", ").join(map(sql.Identifier, COLUMNS[view])),
        t=source,
        w=(sql.SQL(" WHERE ") + sql.SQL(" AND ").join(where)) if where else sql.SQL(""),
        k=sql.Identifier(key),
    )
    params.append(limit + 1)
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(stmt, params).fetchall()
    conn.commit()
    more = len(rows) > limit
    rows = rows[:limit]
    page: dict[str, Any] = {"view": view, "rows": rows,
            "next_cursor": str(rows[-1][key]) if more and rows else None}
    if as_of_seq is not None:
        page["at"], page["as_of_seq"] = at, as_of_seq
    return page


def _seq_then(conn: psycopg.Connection[Any], schema: str, view: str,
              at: float) -> tuple[int, int]:
    """The last event made at or before `at`, refused where `view` kept no past then, and the
    view's position now."""
    if view not in HISTORY_KEYS:
        raise BadQuery(f"view {view} has no past to read: --at reads "
                       f"{', '.join(HISTORY_KEYS)}")
    if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at):
        raise BadQuery(f"at must be a time in epoch seconds, not {at!r}")
    kept = history_since(conn, schema, view)
    seq = seq_at(conn, schema, at)
    conn.commit()
    if kept is None:
        raise BeforeHistory(f"the {view} view keeps no past yet")
    if kept[0] > 0 and seq < kept[0]:
        from projections.views.retention import retention_text

        cut = retention_text(kept[2], kept[3])
        raise BeforeHistory(f"the {view} view keeps its past only from event {kept[0]} on"
                            + (f": {cut}" if cut else ""))
    return seq, kept[1]


def label_pairs(text: str) -> dict[str, str]:
    """`team=vision,env=prod` as the labels a lease must hold (each pair)."""
    pairs: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise BadQuery(f"label filter {text!r}: each label is KEY=VALUE, pairs joined by ','")
        pairs[key.strip()] = value.strip()
    return pairs


def _check(view: str, *, tenant: str | None, filters: dict[str, str], limit: int,
           cursor: str | None) -> None:
    """Refuse what the view cannot answer before any SQL is sent."""
    if tenant is not None and view not in TENANT_VIEWS:
        raise BadQuery(f"view {view} has no tenant column: it is shared by every tenant "
                       f"(tenant views: {', '.join(TENANT_VIEWS)})")
    for name in sorted(filters):
        if name not in FILTERS[view]:
            raise BadQuery(f"view {view} cannot be filtered on {name!r}; "
                           f"it offers {', '.join(FILTERS[view]) or 'no filters'}")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise BadQuery(f"limit must be a whole number of rows from 1 to {MAX_LIMIT}, not {limit!r}")
    if LABEL_FILTER in filters:
        label_pairs(filters[LABEL_FILTER])
    texts = {"tenant": tenant, "cursor": cursor, **filters}
    for name, value in texts.items():
        if value is not None and (not isinstance(value, str) or "\x00" in value):
            raise BadQuery(f"{name} must be text without NUL characters")


class ViewReader:
    """One lazily opened connection, shared under a lock (the command service has threads)."""

    def __init__(self, database_url: str, schema: str = DEFAULT_SCHEMA) -> None:
        self.database_url = database_url
        self.schema = schema
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()

    def query(self, view: str, **kw: Any) -> dict[str, Any]:
        with self._lock:
            for attempt in (1, 2):
                try:
                    if self._conn is None or self._conn.closed:
                        self._conn = psycopg.connect(self.database_url, connect_timeout=5)
                    return query(self._conn, view, schema=self.schema, **kw)
                except psycopg.OperationalError:
                    if self._conn is not None:
                        self._conn.close()
                    self._conn = None
                    if attempt == 2:
                        raise ViewsUnavailable("the views' database is unreachable") from None
                except psycopg.Error as e:
                    if self._conn is not None:
                        self._conn.rollback()
                    raise ViewsUnavailable(f"the views could not be read: {e}") from e
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def query_url(database_url: str, view: str, **kwargs: Any) -> dict[str, Any]:
    """`query` for callers outside projections/ (the CLI), which hold a URL, not a connection;
    database failures come back as ViewsUnavailable."""
    schema = kwargs.get("schema", DEFAULT_SCHEMA)
    try:
        with psycopg.connect(database_url, connect_timeout=5) as conn:
            return query(conn, view, **kwargs)
    except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName):
        raise ViewsUnavailable(f"the views are not built in schema {schema!r} yet: start the "
                               "projector (`pool up`, `pool serve --role projector`) or run "
                               "`pool projections rebuild`") from None
    except psycopg.OperationalError as e:
        raise ViewsUnavailable(f"the views' database does not answer: {e}".strip()) from None
    except psycopg.Error as e:
        raise ViewsUnavailable(f"the views could not be read: {e}".strip()) from e


__all__ = ["COLUMNS", "FILTERS", "KEYS", "MAX_LIMIT", "TENANT_VIEWS", "BadQuery", "ViewReader",
           "ViewsUnavailable", "query", "query_url"]
