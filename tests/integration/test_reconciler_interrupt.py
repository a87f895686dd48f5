"""A stopping plane ends its reconciler's wait for fired timers at once, instead of sitting
out the fetch's whole timeout on every stop."""

from __future__ import annotations

import threading
import time

from bus.agentbus import ControlLink
from bus.local.server import NatsServer


def test_interrupt_ends_a_wait_for_fired_timers_and_every_later_one(
        fresh_nats: NatsServer) -> None:
    link = ControlLink(fresh_nats.url)
    link.ensure_streams()
    assert link.fetch_due(timeout=0.2) == []  # the consumer is bound; nothing has fired
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(link.fetch_due(timeout=20)))
    waiter.start()
    time.sleep(0.5)  # the fetch is under way
    started = time.monotonic()
    link.interrupt()
    waiter.join(15)
    assert not waiter.is_alive(), "the wait went on after interrupt()"
    assert got == [[]]
    assert time.monotonic() - started < 10  # a 20 s fetch cut short, far inside its timeout
    began = time.monotonic()
    assert link.fetch_due(timeout=20) == []  # a later wait does not start at all
    assert time.monotonic() - began < 10
    link.close()
