"""The gateway's throttle on failed token checks, by the clock: a source past its failures waits
until the oldest leaves the window, others never wait, and memory stays bounded."""

from __future__ import annotations

from gateway.throttle import LoginThrottle


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_source_past_its_failures_waits_until_the_oldest_leaves_the_window() -> None:
    clock = Clock()
    t = LoginThrottle(3, 60.0, clock=clock)
    for step in range(3):
        assert t.retry_after("a") == 0
        t.failed("a")
        clock.now += 10
    assert t.retry_after("a") == 30  # at 1030: the first failure, at 1000, leaves at 1060
    assert t.retry_after("b") == 0
    clock.now = 1060.0
    assert t.retry_after("a") == 0  # one more try, then it waits for the second
    t.failed("a")
    assert t.retry_after("a") == 10


def test_sources_past_the_bound_forget_the_oldest() -> None:
    t = LoginThrottle(1, 60.0, max_sources=2, clock=Clock())
    for source in ("a", "b", "c"):
        t.failed(source)
    assert (t.retry_after("a"), t.retry_after("b") > 0, t.retry_after("c") > 0) == (0, True, True)
