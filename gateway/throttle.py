"""Failed token checks counted per client address: past the limit, a source's requests are
refused (429 `login_throttled`, Retry-After) before any token is looked at, until it passes.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable

# failed token checks one client address may make within the window before it waits
MAX_FAILED_LOGINS = 20
FAILED_LOGIN_WINDOW_SECONDS = 60.0
# addresses remembered at once: past it, the one that failed longest ago is forgotten, so a
# flood from many addresses costs bounded memory
MAX_SOURCES = 10_000


class LoginThrottle:
    """A sliding window of failure times per source; a source with `max_failures` of them in
    the window is refused until the oldest leaves it."""

    def __init__(self, max_failures: int = MAX_FAILED_LOGINS,
                 window_seconds: float = FAILED_LOGIN_WINDOW_SECONDS, *,
                 max_sources: int = MAX_SOURCES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_failures, self.window_seconds = max_failures, window_seconds
        self.max_sources, self.clock = max_sources, clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self.refused = 0  # requests refused without a check, for the metrics and tests

    def retry_after(self, source: str) -> int:
        """Whole seconds until `source` may present a token again; 0 when it may now."""
        times = self._failures.get(source)
        if times is None:
            return 0
        now = self.clock()
        while times and times[0] <= now - self.window_seconds:
            times.popleft()
        if not times:
            del self._failures[source]
            return 0
        if len(times) < self.max_failures:
            return 0
        self.refused += 1
        return max(1, math.ceil(times[0] + self.window_seconds - now))

    def failed(self, source: str) -> None:
        """One more failed token check from `source`."""
        times = self._failures.pop(source, None) or deque(maxlen=self.max_failures)
        times.append(self.clock())
        self._failures[source] = times  # the most recent failure goes last
        while len(self._failures) > self.max_sources:
            self._failures.popitem(last=False)
