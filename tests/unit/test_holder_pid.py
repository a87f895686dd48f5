"""A leader election's holder id names the leading process: its pid is read back from it."""

from __future__ import annotations

import os

from workers.plane import holder_id, holder_pid


def test_the_pid_of_a_holder_id_is_the_process_that_made_it() -> None:
    assert holder_pid(holder_id()) == os.getpid()


def test_a_hostname_with_dashes_still_gives_the_pid() -> None:
    assert holder_pid("node-7-rack-2-4242-0a1b2c3d") == 4242


def test_a_holder_that_names_no_process_gives_none() -> None:
    for holder in (None, "", "observer", "bench-observer", "host-pid-0a1b2c3d", "a-b-c-"):
        assert holder_pid(holder) is None, holder
