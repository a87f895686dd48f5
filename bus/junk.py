"""Messages and KV values that no writer of their stream stored: a server's answer (a PubAck, a
JetStream API reply) that some client aimed there by naming it as its reply subject. Readers
skip them and report them here, so one junk message stops no loop and replaces no state.
(The event log's own strays are bus.jetstream.strays.)"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from bus.headers import HDR_SEQUENCE, HDR_STREAM

log = logging.getLogger(__name__)

_KEEP = 1000  # the latest junk values named; the count covers all of them
_LOG_EVERY_S = 60.0


@dataclass
class Junk:
    """How many junk messages this process has passed over, and the latest (sequence or KV
    revision, subject)."""

    count: int = 0
    seen: deque[tuple[int, str]] = field(default_factory=lambda: deque(maxlen=_KEEP))
    _logged_at: float = float("-inf")
    _logged_count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def report(self, revision: int, subject: str, *, stored: bool = True) -> None:
        """Count one; a `stored` message read again (its sequence and subject seen) once."""
        with self._lock:
            if stored and (revision, subject) in self.seen:
                return  # the same value read again
            self.count += 1
            self.seen.append((revision, subject))
            now = time.monotonic()
            if now - self._logged_at < _LOG_EVERY_S:
                return
            since, self._logged_count, self._logged_at = (self.count - self._logged_count,
                                                          self.count, now)
        log.warning("skipped %d message(s) that no writer of their stream stored (latest: "
                    "sequence %d on %r): a server's answer aimed there as a reply subject",
                    since, revision, subject[:200])


_JUNK = Junk()


def junk_values() -> Junk:
    """This process's record of skipped junk messages and KV values."""
    return _JUNK


def int_value(value: bytes | None, revision: int | None, subject: str) -> int | None:
    """A position stored as a decimal integer; None (reported) when `value` is not one."""
    text = (value or b"0").strip()
    if text.isdigit():
        return int(text)
    junk_values().report(revision or 0, subject)
    return None


def live_answer(headers: dict[str, str] | None, subject: str) -> bool:
    """Whether a live message a client published to `subject` is instead a direct get's answer
    someone aimed there as the reply subject (the server stamps `Nats-Stream` on that answer,
    never on a client's core publish); reported when it is."""
    if not headers or HDR_STREAM not in headers:
        return False
    at = headers.get(HDR_SEQUENCE, "")  # the asker's own stream's: not stored here
    junk_values().report(int(at) if at.isdigit() else 0, subject, stored=False)
    return True
