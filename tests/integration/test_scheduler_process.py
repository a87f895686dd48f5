"""The scheduler's child process (`workers/processes.py`) when it cannot serve."""

from __future__ import annotations

import pytest

from workers.processes import RoleProcess, SchedulerProcessFailed


def test_a_child_that_cannot_serve_is_one_typed_error_and_is_tried_again_later() -> None:
    child = RoleProcess("nats://127.0.0.1:1", start_timeout=60)  # nothing listens there
    try:
        with pytest.raises(SchedulerProcessFailed, match="exited with code 1 before it served"):
            child.start()
        # dead: one more try, which fails too; the next waits for its back-off
        assert child.ensure() is False and child.restarts == 1
        assert child.ensure() is False and child.restarts == 1
    finally:
        child.stop()
    assert child.ensure() is False and child.restarts == 1  # stopped for good
