"""How long the views keep their past (the row versions `--at` reads): the projector prunes
what is older, a small batch at a time, keeping each row's version in force at the cut."""

from __future__ import annotations

import argparse
import datetime as dt
import os
from typing import Any

import psycopg

from projections.views.history import KEYS, formatted

# the views' past is kept 30 days, as the scheduler's decisions are (bus.streams)
HISTORY_MAX_AGE_S = 30 * 24 * 3600.0
# row versions (and event-time seconds) deleted per statement: each a short transaction
PRUNE_BATCH = 2000

# The versions made since the last prune up to the cut, a batch of them in log order, each
# row's newest of them deleting its row's older versions (and itself, if it is a removal: the
# row was not in the view from then on). What is left at or before the cut is each row's
# version in force at the cut, and the versions looked at are never looked at again.
_BATCH_END = """SELECT max(seq), count(*) FROM (SELECT seq FROM {s}.history WHERE view_name = %(v)s
    AND seq > %(p)s AND seq <= %(q)s ORDER BY seq LIMIT %(n)s) b"""
_PRUNE = """DELETE FROM {s}.history h USING (SELECT DISTINCT ON (key) key, seq, kind FROM
    {s}.history WHERE view_name = %(v)s AND seq > %(p)s AND seq <= %(top)s
    ORDER BY key, seq DESC) d
    WHERE h.view_name = %(v)s AND h.key = d.key AND (h.seq < d.seq OR (d.kind = 'd'
    AND h.seq = d.seq))"""


def cut_of(conn: psycopg.Connection[Any], schema: str,
           keep_from: float) -> tuple[int, float] | None:
    """The last event made at or before `keep_from`, and its time (None: none that old)."""
    row = conn.execute(formatted(
        "SELECT seq, at FROM {s}.event_times WHERE at <= %s ORDER BY second DESC LIMIT 1",
        schema), (keep_from,)).fetchone()
    return None if row is None else (int(row[0]), float(row[1]))


def prune_history(conn: psycopg.Connection[Any], schema: str, views: tuple[str, ...], *,
                  now: float, max_age_s: float = HISTORY_MAX_AGE_S,
                  batch: int = PRUNE_BATCH) -> int:
    """One batch of pruning, in the caller's transaction: each view's history is said to begin
    at the last event made `max_age_s` before `now` (so `--at` before it is refused, naming the
    retention), then the next `batch` of its versions made up to then are looked at, each
    deleting its row's older versions, and as many event-time seconds before it are deleted.
    Returns the rows looked at and deleted: `batch` or more means there may be more to do."""
    cut = cut_of(conn, schema, now - max_age_s)
    if cut is None:
        return 0
    seq, at = cut
    looked = 0
    for view in views:
        row = conn.execute(formatted(
            "UPDATE {s}.history_since SET seq = GREATEST(seq, %s), kept_from = %s, "
            "max_age_s = %s WHERE view_name = %s RETURNING pruned_seq", schema),
            (seq, at, max_age_s, view)).fetchone()
        if view not in KEYS or row is None:
            continue
        args = {"v": view, "p": int(row[0] or 0), "q": seq, "n": batch}
        top, count = conn.execute(formatted(_BATCH_END, schema), args).fetchone() or (None, 0)
        if top is None:
            continue
        conn.execute(formatted(_PRUNE, schema), {**args, "top": top})
        conn.execute(formatted("UPDATE {s}.history_since SET pruned_seq = %s "
                               "WHERE view_name = %s", schema), (top, view))
        looked += int(count)
    cur = conn.execute(formatted(
        "DELETE FROM {s}.event_times WHERE second = ANY(ARRAY(SELECT second FROM "
        "{s}.event_times WHERE seq < %s ORDER BY second LIMIT %s))", schema), (seq, batch))
    return looked + max(cur.rowcount, 0)


def retention_text(kept_from: float | None, max_age_s: float | None) -> str:
    """`kept 30 days: from 2026-11-07 03:00:00 UTC on`, or '' where nothing was pruned."""
    if kept_from is None or max_age_s is None:
        return ""
    when = dt.datetime.fromtimestamp(kept_from, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"its past is kept {max_age_s / 86400:g} days (history retention): from {when} on"


def history_days(text: str) -> float:
    """`--history-days`: a number of days above 0 (fractions allowed), at most 100 years."""
    try:
        days = float(text)
    except ValueError:
        days = float("nan")
    if not 0 < days <= 36500:
        raise argparse.ArgumentTypeError(f"{text!r}: want a number of days above 0, at most "
                                         "36500 (e.g. 30)")
    return days


def history_max_age_from_env() -> float:
    """The retention a projector keeps: `POOL_HISTORY_DAYS` days, else 30 (a bad value is
    refused at start, naming the variable)."""
    text = os.environ.get("POOL_HISTORY_DAYS", "").strip()
    if not text:
        return HISTORY_MAX_AGE_S
    try:
        return history_days(text) * 86400
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"POOL_HISTORY_DAYS={e}") from None
