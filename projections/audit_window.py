"""The stretch of the log `pool audit decisions --from --to` judges: the events made between
two times, found by their own timestamps, as a run of sequence numbers."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any


def event_time(notification: Any) -> float:
    """When the event was made (its recorded timestamp), as epoch seconds."""
    stamp = json.loads(notification.state)["timestamp"]
    text = stamp["_data_"] if isinstance(stamp, dict) else str(stamp)
    return dt.datetime.fromisoformat(text).timestamp()


@dataclass(frozen=True)
class Window:
    """Events `seqs` (empty: none made in the window) made from `start` to `end`."""

    start: float | None
    end: float | None
    seqs: range

    def text(self) -> str:
        def when(t: float | None, default: str) -> str:
            if t is None:
                return default
            return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")

        span = (f"events {self.seqs.start} to {self.seqs.stop - 1}" if self.seqs
                else "no events")
        return (f"window {when(self.start, 'the log start')} to {when(self.end, 'now')} "
                f"({span})")

    def to_dict(self) -> dict[str, Any]:
        return {"from": self.start, "to": self.end,
                "first_seq": self.seqs.start if self.seqs else None,
                "last_seq": self.seqs.stop - 1 if self.seqs else None}


def _time_at(app: Any, seq: int) -> float:
    """The time of the first event at or after `seq` (a stray message is skipped)."""
    found = app.recorder.select_notifications(seq, 1)
    return event_time(found[0]) if found else float("inf")


def _first_at_or_after(app: Any, last: int, at: float) -> int:
    """The first seq in 1..last made at or after `at` (last + 1: none), by bisection: the log
    is appended in time order (writers' clocks apart by at most their skew)."""
    lo, hi = 1, last + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _time_at(app, mid) < at:
            lo = mid + 1
        else:
            hi = mid
    return lo


def window_of(app: Any, start: float | None, end: float | None) -> Window:
    """The run of `app`'s log from the first event made at or after `start` to the last made at
    or before `end` (either None: the log's own end)."""
    last = int(app.recorder.max_notification_id() or 0)
    first = 1 if start is None else _first_at_or_after(app, last, start)
    stop = last + 1
    if end is not None:
        stop = _first_at_or_after(app, last, end + 1e-6)
    return Window(start, end, range(first, max(first, stop)))
