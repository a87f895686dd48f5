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

# A version at or before the cut goes once a later version of its row is at or before the cut
# too (the later one answers every time from the cut on); a removal (`d`) goes once it is its
# row's only version left at or before the cut: the row was not in the view from the cut on.
_PRUNE = """DELETE FROM {s}.history WHERE ctid = ANY(ARRAY(
    SELECT h.ctid FROM {s}.history h WHERE h.view_name = %(v)s AND h.seq <= %(q)s AND (
        EXISTS (SELECT 1 FROM {s}.history n WHERE n.view_name = h.view_name AND n.key = h.key
                AND n.seq > h.seq AND n.seq <= %(q)s)
        OR (h.kind = 'd' AND NOT EXISTS (SELECT 1 FROM {s}.history o WHERE
            o.view_name = h.view_name AND o.key = h.key AND o.seq < h.seq)))
    ORDER BY h.seq LIMIT %(n)s))"""


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
    retention), then at most `batch` of its versions older than that are deleted, and as many
    event-time seconds. Returns the rows deleted: `batch` or more means there is more to do."""
    cut = cut_of(conn, schema, now - max_age_s)
    if cut is None:
        return 0
    seq, at = cut
    deleted = 0
    for view in views:
        if view not in KEYS:
            continue
        conn.execute(formatted(
            "UPDATE {s}.history_since SET seq = %s, kept_from = %s, max_age_s = %s "
            "WHERE view_name = %s AND seq < %s", schema), (seq, at, max_age_s, view, seq))
        cur = conn.execute(formatted(_PRUNE, schema), {"v": view, "q": seq, "n": batch})
        deleted += max(cur.rowcount, 0)
    cur = conn.execute(formatted(
        "DELETE FROM {s}.event_times WHERE second = ANY(ARRAY(SELECT second FROM "
        "{s}.event_times WHERE seq < %s ORDER BY second LIMIT %s))", schema), (seq, batch))
    return deleted + max(cur.rowcount, 0)


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
