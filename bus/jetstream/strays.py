"""Messages on a log subject that the recorder did not write (no event headers): every reader
skips them and they are reported here, so one stray message stops no fold."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

_KEEP = 1000  # the latest strays named; the count covers all of them
_LOG_EVERY_S = 60.0


@dataclass
class Strays:
    """How many stray messages this process has passed over, and the latest (seq, subject)."""

    count: int = 0
    seen: deque[tuple[int, str]] = field(default_factory=lambda: deque(maxlen=_KEEP))
    _logged_at: float = float("-inf")
    _logged_count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def report(self, seq: int, subject: str) -> None:
        with self._lock:
            if (seq, subject) in self.seen:
                return  # the same message read again (another page, another reader)
            self.count += 1
            self.seen.append((seq, subject))
            now = time.monotonic()
            if now - self._logged_at < _LOG_EVERY_S:
                return
            since, self._logged_count, self._logged_at = (self.count - self._logged_count,
                                                          self.count, now)
        log.warning("skipped %d message(s) without event headers on the log (latest: sequence "
                    "%d on %r): something other than the recorder published there", since, seq,
                    subject[:200])


_STRAYS = Strays()


def strays() -> Strays:
    """This process's record of stray log messages."""
    return _STRAYS
