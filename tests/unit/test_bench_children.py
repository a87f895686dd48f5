"""A benchmark's wait for a child ends when the child dies, not when its timeout runs out;
its children end within one grace period, not one each."""

from __future__ import annotations

import multiprocessing
import sys
import time

import pytest

from bench.children import ChildDied, await_ready, end_children

CTX = multiprocessing.get_context("spawn")


def _say(ready: object) -> None:
    ready.put("ready")  # type: ignore[attr-defined]


def test_a_child_that_dies_ends_the_wait_at_once() -> None:
    ready = CTX.Queue()
    child = CTX.Process(target=sys.exit, args=(3,), daemon=True)
    child.start()
    t0 = time.monotonic()
    with pytest.raises(ChildDied, match="exited with code 3 while the bench waited for the fleet"):
        await_ready(ready, [child], "fleet", 120)
    assert time.monotonic() - t0 < 30  # not the wait's 120 s


def test_a_child_that_answered_and_ended_is_read_not_mourned() -> None:
    ready = CTX.Queue()
    child = CTX.Process(target=_say, args=(ready,), daemon=True)
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert await_ready(ready, [child], "client", 120) == "ready"
    # and once it has been read, its clean end with nothing more said ends the next wait
    with pytest.raises(ChildDied, match="code 0"):
        await_ready(ready, [child], "client", 120)


def test_a_live_child_that_says_nothing_times_out() -> None:
    ready = CTX.Queue()
    with pytest.raises(TimeoutError, match="plane was not ready in 0.2 s"):
        await_ready(ready, [], "plane", 0.2)


def test_children_that_ignore_stop_are_killed_after_one_grace_for_all() -> None:
    stop = CTX.Event()
    deaf = [CTX.Process(target=time.sleep, args=(120,), daemon=True) for _ in range(4)]
    for p in deaf:
        p.start()
    t0 = time.monotonic()
    end_children(stop, deaf, 2.0)
    took = time.monotonic() - t0
    assert not any(p.is_alive() for p in deaf)
    assert took < 6.0  # one grace of 2 s, not 2 s for each of the four
