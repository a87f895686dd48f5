"""A docker job's output as the agent reads it: the engine's log, read by entry times, held to
the lease's `max_output_bytes` (then one marker line, as the `process` runtime's supervisor)."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from datetime import datetime

from docker.types import LogConfig

from agents.output import dropped_marker

# `docker logs --timestamps`: each entry (a line, or the last part of one) after its time
_STAMPED = re.compile(rb"(?:^|(?<=\n))(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d{1,9})?Z ")
# the engine's log of one job, whatever its cap: two files of at most this many bytes (JSON)
LOG_FILE_MAX_BYTES = 10 << 20
LOG_FILE_MIN_BYTES = 64 << 10

Entries = Callable[[int], list[tuple[int, bytes]]]  # (after ns) -> entries since then


def log_config(cap_bytes: int) -> LogConfig:
    """The engine's log for a job whose output is capped at `cap_bytes`: two files, each of
    about the cap (its JSON framing included), never over 10 MiB: what the node keeps."""
    size = min(LOG_FILE_MAX_BYTES, max(LOG_FILE_MIN_BYTES, cap_bytes + 4096))
    return LogConfig(type="json-file", config={"max-size": str(size), "max-file": "2"})


def parse_docker_time(value: str | None) -> float | None:
    """Docker's RFC 3339 timestamps carry nanoseconds; Python parses microseconds."""
    if not value or value.startswith("0001-"):
        return None
    m = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$", value)
    if m is None:
        return None
    frac = (m.group(2) or ".0")[:7]
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    return datetime.fromisoformat(m.group(1) + frac + zone).timestamp()


def _epoch_ns(stamp: bytes, fraction: bytes | None) -> int:
    """Nanoseconds since the epoch of a log entry's UTC time (docker writes up to nine digits)."""
    whole = datetime.fromisoformat(stamp.decode() + "+00:00").timestamp()
    digits = (fraction or b".")[1:].decode()
    return int(whole) * 1_000_000_000 + int((digits + "000000000")[:9])


def stamped_entries(raw: bytes) -> list[tuple[int, bytes]]:
    """`docker logs --timestamps` output as (time in ns, the entry's bytes), in order."""
    parts = _STAMPED.split(raw)
    # [before the first stamp, stamp, fraction, text, stamp, fraction, text, …]
    return [(_epoch_ns(parts[i], parts[i + 1]), parts[i + 2])
            for i in range(1, len(parts) - 2, 3)]


class Output:
    """How far one workload's output was read: the agent's offset after what it was given,
    the time of the last entry read from the engine, and what was read but not yet given."""

    __slots__ = ("after_ns", "offset", "pending")

    def __init__(self, offset: int, after_ns: int, pending: bytes) -> None:
        self.offset = offset
        self.after_ns = after_ns
        self.pending = pending


def read(state: Output | None, entries: Entries, offset: int, limit: int,
         cap_bytes: int) -> tuple[bytes, Output | None]:
    """Up to `limit` bytes from `offset` of a log of which only the first `cap_bytes` are
    given, then the marker line (when more was written), then nothing; and the state after.
    The engine is asked only for entries since the last one read (by their times); an offset
    not given from `state` (a restarted agent's) is found by reading the log from its start."""
    if offset >= cap_bytes:
        marker = dropped_marker(cap_bytes).encode()
        if offset == cap_bytes:  # the marker only for output past the cap: is there any?
            more, state = _read(state, entries, offset, 1)
            if not more:
                return b"", state
        return marker[offset - cap_bytes:][:limit], state
    return _read(state, entries, offset, min(limit, cap_bytes - offset))


def _read(state: Output | None, entries: Entries, offset: int,
          limit: int) -> tuple[bytes, Output]:
    if state is None or state.offset != offset:
        found = entries(0)
        data = b"".join(text for _, text in found)
        state = Output(offset, found[-1][0] if found else 0, data[offset:])
    elif len(state.pending) < limit:
        found = [e for e in entries(state.after_ns) if e[0] > state.after_ns]
        if found:
            state.pending += b"".join(text for _, text in found)
            state.after_ns = found[-1][0]
    out, state.pending = state.pending[:limit], state.pending[limit:]
    state.offset += len(out)
    return out, state


class Readers:
    """The read states of one workload's log, one a reader (the output shipper, each attach),
    each found by the offset its reader asks from. Reads of one log take turns: two readers
    at one offset sharing one state took each other's entries, and one of them was told the
    log had ended while its last line was still to come."""

    MAX_STATES = 8  # readers of one job's log at once; the oldest state past them is dropped

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[int, Output] = {}

    def read(self, entries: Entries, offset: int, limit: int, cap_bytes: int) -> bytes:
        """`read` for the reader at `offset`, with that reader's own state."""
        with self._lock:
            out, state = read(self._states.pop(offset, None), entries, offset, limit, cap_bytes)
            if state is not None:
                self._states[state.offset] = state
                while len(self._states) > self.MAX_STATES:
                    del self._states[next(iter(self._states))]
            return out
