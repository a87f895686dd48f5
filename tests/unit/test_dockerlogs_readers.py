"""A docker job's log read by two readers at once (the output shipper and an attach)."""

from __future__ import annotations

import threading

from agents.runtimes.dockerlogs import Readers

CAP = 1 << 20


def test_two_readers_at_one_offset_each_get_the_last_line() -> None:
    """The shipper and an attach that began where it stood read the job's last line at the
    same time: each gets it (before, they shared one state, and the one that lost the race
    was told the log had ended; the attach then sent the job's exit without its last line)."""
    log = [(1, b"ready\n")]
    readers = Readers()
    assert readers.read(lambda after: [e for e in log if e[0] > after], 0, 100, CAP) \
        == b"ready\n"
    log.append((2, b"eof\n"))
    both_in = threading.Barrier(2)

    def entries(after: int) -> list[tuple[int, bytes]]:
        try:
            both_in.wait(0.5)  # meet the other reader inside the engine's answer, if it can
        except threading.BrokenBarrierError:
            pass
        return [e for e in log if e[0] > after]

    got: dict[str, bytes] = {}

    def read(name: str) -> None:
        got[name] = readers.read(entries, 6, 100, CAP)

    threads = [threading.Thread(target=read, args=(n,)) for n in ("shipper", "attach")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert got == {"shipper": b"eof\n", "attach": b"eof\n"}


def test_readers_far_apart_keep_their_own_places() -> None:
    log = [(i, f"line {i}\n".encode()) for i in range(1, 6)]
    readers = Readers()
    calls: list[int] = []

    def entries(after: int) -> list[tuple[int, bytes]]:
        calls.append(after)
        return [e for e in log if e[0] > after]

    a = readers.read(entries, 0, 7, CAP)  # one line a read
    b = readers.read(entries, 0, 100, CAP)  # all of it
    a += readers.read(entries, len(a), 7, CAP)
    assert (a, b) == (b"line 1\nline 2\n", b"".join(t for _, t in log))
    assert calls == [0, 0]  # the slow reader's second read came from its own state
