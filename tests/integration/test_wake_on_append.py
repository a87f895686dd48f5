"""Idle workers wake when the log stores an event: the append signal, and the scheduler on it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from uuid import UUID

import pytest

from bus.appends import AppendSignal
from bus.local.server import NatsServer
from client.api import PoolClient
from domain.lease import LeaseState
from tests.control_plane import FakeClock, lease_body, node_body, setup_pool, start
from workers.application import PoolApp
from workers.plane import ControlPlane, app_env
from workers.scheduler import Scheduler
from workers.wake import IdleWait

# the scheduler's poll when no append wakes it: far longer than the bound asserted below, so
# only the signal can place a request in time
SLOW_POLL_SECONDS = 5.0
PLACED_WITHIN_SECONDS = 1.0  # generous: a cycle here takes milliseconds


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[tuple[ControlPlane, PoolClient]]:
    cp = start(fresh_nats.url, FakeClock())
    admin = PoolClient(fresh_nats.url)
    yield cp, admin
    admin.close()
    cp.stop()


def _reserved_after(app: PoolApp, lease_id: str, since: float, bound: float) -> float:
    """Seconds from `since` until the log holds `lease_id` reserved (polled every 2 ms)."""
    while time.perf_counter() - since < bound:
        if app.repository.get(UUID(lease_id)).state is LeaseState.RESERVED:
            return time.perf_counter() - since
        time.sleep(0.002)
    return float("inf")


def test_an_armed_signal_wakes_on_the_next_stored_event_and_only_once(
        plane: tuple[ControlPlane, PoolClient]) -> None:
    cp, admin = plane
    signal = AppendSignal(cp.nats_url)
    try:
        assert signal.arm() and signal.armed
        assert not signal.wait(0.2)  # nothing stored: no wake-up, the interest stays armed
        assert signal.armed
        setup_pool(admin)  # several events stored: one wake-up, then the interest is gone
        assert signal.wait(5.0)
        assert not signal.armed and signal.wakes == 1
        admin.admin("node.register", node_body("n1"))
        assert not signal.wait(0.2)  # not armed again: an append wakes nothing
        assert signal.wakes == 1
    finally:
        signal.close()


def test_an_idle_wait_steps_once_more_after_arming_and_then_waits_for_an_append() -> None:
    class Recorded:
        def __init__(self) -> None:
            self.armed = False
            self.waits: list[float] = []

        def arm(self) -> bool:
            self.armed = True
            return True

        def wait(self, timeout: float) -> bool:
            self.waits.append(timeout)
            return False

        def wake(self) -> None:
            pass

    signal = Recorded()
    idle = IdleWait(threading.Event(), signal, fallback_seconds=2.0)
    idle()  # arms and returns at once: the caller's next step reads anything stored meanwhile
    assert signal.armed and signal.waits == []
    idle(due_in=0.25)  # armed: waits, no longer than the caller's next deadline
    idle(due_in=-3.0)  # a deadline already due: the shortest wait, never a negative one
    idle()
    assert signal.waits == [0.25, 0.001, 2.0]


def test_an_idle_scheduler_places_a_request_within_a_cycle_of_its_event_landing(
        plane: tuple[ControlPlane, PoolClient]) -> None:
    cp, admin = plane
    setup_pool(admin)
    admin.admin("node.register", node_body("n1", cpu_millis=64_000, memory_mib=65_536))
    scheduler = Scheduler(PoolApp(env=app_env(cp.nats_url)))
    signal = AppendSignal(cp.nats_url)
    stop = threading.Event()
    worker = threading.Thread(target=scheduler.run, args=(stop,),
                              kwargs={"interval": SLOW_POLL_SECONDS, "signal": signal})
    worker.start()
    delays: list[float] = []
    try:
        with PoolClient(cp.nats_url, "alpha") as alpha:
            for i in range(5):
                time.sleep(0.3)  # let the scheduler go idle and wait
                reply = alpha.request_lease(lease_body(f"w{i}"))
                landed = time.perf_counter()  # the reply comes once the event is stored
                assert reply["ok"], reply
                delays.append(_reserved_after(cp.app, reply["lease"]["lease_id"], landed,
                                              PLACED_WITHIN_SECONDS + 1.0))
    finally:
        stop.set()
        signal.close()
        worker.join(10)
        scheduler.close()
        scheduler.app.close()
    assert not worker.is_alive()
    assert max(delays) < PLACED_WITHIN_SECONDS, delays
    assert signal.wakes >= 5
