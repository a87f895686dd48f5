"""A timer's due time is written as RFC 3339 in UTC to the millisecond, truncated."""

from __future__ import annotations

import datetime as dt
import random

from bus.agentbus import _rfc3339


def _reference(at: float) -> str:
    t = dt.datetime.fromtimestamp(at, tz=dt.UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def test_a_due_time_is_written_as_strftime_writes_it() -> None:
    rng = random.Random(3)
    edges = [0.0, 0.0009, 0.999999, 1e9, 1_764_950_400.0, 1_764_950_400.9995,
             1_764_950_400.999999, 4_102_444_799.999]
    for at in edges + [rng.uniform(0, 4.1e9) for _ in range(20_000)]:
        assert _rfc3339(at) == _reference(at), at
    assert _rfc3339(1_764_950_400.123456) == "2025-12-05T16:00:00.123Z"
