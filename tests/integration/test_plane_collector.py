"""The cyclic collector's thresholds in the processes that answer commands."""

from __future__ import annotations

import gc

from bus.local.server import NatsServer
from workers.plane import ControlPlane
from workers.scheduler.state import GC_THRESHOLDS


def test_a_plane_that_answers_commands_raises_the_collector_thresholds(
        fresh_nats: NatsServer) -> None:
    # at CPython's defaults the commands process ran a full pass every few seconds, each one
    # stalling every request in flight: a responder without the scheduler is tuned as well
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        cp = ControlPlane(fresh_nats.url, roles=["commands"], data_plane=False).start()
        try:
            assert gc.get_threshold() == GC_THRESHOLDS
        finally:
            cp.stop()
        gc.set_threshold(700, 10, 10)
        # a role that neither schedules nor answers commands keeps what the process had
        cp = ControlPlane(fresh_nats.url, roles=["reconciler"], data_plane=False).start()
        try:
            assert gc.get_threshold() == (700, 10, 10)
        finally:
            cp.stop()
    finally:
        gc.set_threshold(*before)
