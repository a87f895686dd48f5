"""Usage reports over the leases and capacity views: resource-hours per dimension, credits
charged, leases by end reason and queue waits, grouped by tenant, pool, GPU model or day.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

GROUPINGS = ("tenant", "pool", "gpu-model", "day")
DAY = 86_400
NO_GPU = "none"  # the gpu-model group of leases that hold no GPU


class UsageError(ValueError):
    """A usage report asked for with a grouping or a time range that cannot be answered."""

    code = "invalid_report"


@dataclass
class UsageRow:
    """One group's usage within the report's window."""

    key: str
    cpu_core_hours: float = 0.0
    memory_gib_hours: float = 0.0
    gpu_hours: float = 0.0
    local_disk_gib_hours: float = 0.0
    leases_started: int = 0
    leases_ended: int = 0
    credits_charged_microcredits: int = 0
    end_reasons: dict[str, int] = field(default_factory=dict)
    wait_p50_seconds: float | None = None
    wait_p99_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key, "cpu_core_hours": self.cpu_core_hours,
            "memory_gib_hours": self.memory_gib_hours, "gpu_hours": self.gpu_hours,
            "local_disk_gib_hours": self.local_disk_gib_hours,
            "leases_started": self.leases_started, "leases_ended": self.leases_ended,
            "credits_charged_microcredits": self.credits_charged_microcredits,
            "end_reasons": dict(sorted(self.end_reasons.items())),
            "wait_p50_seconds": self.wait_p50_seconds, "wait_p99_seconds": self.wait_p99_seconds,
        }


CSV_COLUMNS = ("key", "cpu_core_hours", "memory_gib_hours", "gpu_hours", "local_disk_gib_hours",
               "leases_started", "leases_ended", "credits_charged_microcredits",
               "wait_p50_seconds", "wait_p99_seconds", "end_reasons")


def to_csv(rows: Sequence[UsageRow]) -> str:
    """The rows as CSV with a header; end reasons as `reason=count;…`."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for r in rows:
        d = r.to_dict()
        d["end_reasons"] = ";".join(f"{k}={v}" for k, v in d["end_reasons"].items())
        w.writerow(["" if d[c] is None else d[c] for c in CSV_COLUMNS])
    return out.getvalue()


def _key(by: str, *, at: str) -> sql.Composable:
    """The SQL expression a lease row `l` (with its node's capacity row `c`) is grouped by;
    `at` names the time column a per-day grouping takes the day of."""
    if by == "tenant":
        return sql.SQL("l.tenant")
    if by == "pool":
        return sql.SQL("COALESCE(l.pool, '')")
    if by == "gpu-model":
        return sql.SQL(
            "CASE WHEN COALESCE((l.shape->'resources'->>'gpu_count')::bigint, 0) = 0 "
            "THEN {none} ELSE COALESCE(l.shape->>'gpu_model', c.gpu_model, 'unknown') END"
        ).format(none=sql.Literal(NO_GPU))
    if by == "day":
        return sql.SQL("to_char(to_timestamp(floor({at} / 86400) * 86400) AT TIME ZONE 'UTC', "
                       "'YYYY-MM-DD')").format(at=sql.SQL(at))
    raise UsageError(f"--by must be one of {', '.join(GROUPINGS)}, not {by!r}")


_RES = ("(l.shape->'resources'->>'cpu_millis')::float8 / 1000",
        "(l.shape->'resources'->>'memory_mib')::float8 / 1024",
        "(l.shape->'resources'->>'gpu_count')::float8",
        "(l.shape->'resources'->>'local_disk_gib')::float8")


def usage_report(conn: psycopg.Connection[Any], *, by: str, start: float, end: float,
                 now: float, schema: str, tenant: str | None = None) -> list[UsageRow]:
    """Usage in [start, end) grouped `by` one of GROUPINGS, from the views in `schema`.

    A run counts from its start until its run ended (or `now`, if it still runs), clipped to
    the window (and to each day, per day). Credits and end reasons count the leases that ended
    in the window; waits (request or requeue to start) the leases that started in it. A lease
    requeued after a preemption is counted by its latest run: the view keeps one row a lease.
    """
    if by not in GROUPINGS:
        raise UsageError(f"--by must be one of {', '.join(GROUPINGS)}, not {by!r}")
    if not end > start:
        raise UsageError("--to must be after --from")
    s = sql.Identifier(schema)
    who = sql.SQL(" AND l.tenant = {}").format(sql.Literal(tenant)) if tenant else sql.SQL("")
    p = {"start": start, "end": end, "now": now}
    stop = "COALESCE(l.run_ended_at, l.ended_at, %(now)s)"
    rows: dict[str, UsageRow] = {}

    def row(key: Any) -> UsageRow:
        k = str(key)
        got = rows.get(k)
        if got is None:
            got = rows[k] = UsageRow(k)
        return got

    sums = sql.SQL(", ").join(sql.SQL(f"SUM(l.seconds * {r}) / 3600") for r in _RES)
    if by == "day":
        # each run split over the days it touches
        overlap = sql.SQL(
            "SELECT l.*, d.day::float8 AS day_start, GREATEST(0, LEAST({stop}, %(end)s, d.day + 86400) "
            "- GREATEST(l.started_at, %(start)s, d.day)) AS seconds "
            "FROM {s}.leases l CROSS JOIN LATERAL generate_series("
            "(floor(GREATEST(l.started_at, %(start)s) / 86400) * 86400)::numeric, "
            "LEAST({stop}, %(end)s)::numeric, 86400) AS d(day) "
            "WHERE l.started_at IS NOT NULL AND l.started_at < %(end)s AND {stop} > %(start)s{who}"
        ).format(stop=sql.SQL(stop), s=s, who=who)
        key = _key("day", at="l.day_start")
    else:
        overlap = sql.SQL(
            "SELECT l.*, GREATEST(0, LEAST({stop}, %(end)s) - GREATEST(l.started_at, %(start)s))"
            " AS seconds FROM {s}.leases l "
            "WHERE l.started_at IS NOT NULL AND l.started_at < %(end)s AND {stop} > %(start)s{who}"
        ).format(stop=sql.SQL(stop), s=s, who=who)
        key = _key(by, at="")
    # the overlap rows are named `l` again, so the grouping reads them as it reads a lease
    q = sql.SQL("SELECT {key} AS k, {sums} FROM ({overlap}) l LEFT JOIN {s}.capacity c "
                "ON c.node_id = l.node_id GROUP BY 1").format(
        key=key, sums=sums, overlap=overlap, s=s)
    for k, cpu, mem, gpu, disk in conn.execute(q, p).fetchall():
        r = row(k)
        r.cpu_core_hours, r.memory_gib_hours = float(cpu or 0), float(mem or 0)
        r.gpu_hours, r.local_disk_gib_hours = float(gpu or 0), float(disk or 0)

    ended = sql.SQL(
        "SELECT {key} AS k, COALESCE(l.end_reason, l.state, ''), COUNT(*), "
        "SUM(l.credits_charged) FROM {s}.leases l LEFT JOIN {s}.capacity c "
        "ON c.node_id = l.node_id WHERE l.ended_at >= %(start)s AND l.ended_at < %(end)s{who} "
        "GROUP BY 1, 2").format(key=_key(by, at="l.ended_at"), s=s, who=who)
    for k, reason, count, charged in conn.execute(ended, p).fetchall():
        r = row(k)
        r.end_reasons[str(reason)] = int(count)
        r.leases_ended += int(count)
        r.credits_charged_microcredits += int(charged or 0)

    waits = sql.SQL(
        "SELECT {key} AS k, COUNT(*), "
        "percentile_cont(0.5) WITHIN GROUP (ORDER BY w), "
        "percentile_cont(0.99) WITHIN GROUP (ORDER BY w) FROM (SELECT l.*, "
        "l.started_at - COALESCE(l.queued_at, l.requested_at) AS w FROM {s}.leases l "
        "WHERE l.started_at >= %(start)s AND l.started_at < %(end)s{who}) l "
        "LEFT JOIN {s}.capacity c ON c.node_id = l.node_id GROUP BY 1"
    ).format(key=_key(by, at="l.started_at"), s=s, who=who)
    for k, count, p50, p99 in conn.execute(waits, p).fetchall():
        r = row(k)
        r.leases_started = int(count)
        r.wait_p50_seconds = None if p50 is None else max(0.0, float(p50))
        r.wait_p99_seconds = None if p99 is None else max(0.0, float(p99))
    return [rows[k] for k in sorted(rows)]


def usage_report_url(database_url: str, **kwargs: Any) -> list[UsageRow]:
    with psycopg.connect(database_url) as conn:
        return usage_report(conn, **kwargs)
