"""The machine line every benchmark prints: cores, memory, disk kind and its fsync time,
detected, never typed."""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

# a small append and its fsync, this many times or for this long at most
FSYNC_PROBES = 100
FSYNC_PROBE_S = 1.0


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / (1024 * 1024)
    except (OSError, ValueError, IndexError):
        return None
    return None


def _disk_kind(path: str) -> str:
    """Whether sysfs calls the block device holding `path` rotational; unknown when not found."""
    try:
        dev = os.stat(path).st_dev
        sys_dev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
        for node in (sys_dev, sys_dev.parent):
            rot = node / "queue" / "rotational"
            if rot.exists():
                rotational = rot.read_text().strip() == "1"
                return "rotational disk" if rotational else "non-rotational disk"
    except OSError:
        pass
    return "unknown disk"


def fsync_ms(path: str | None = None) -> float | None:
    """The median time, in ms, of an fsync after a 256-byte append to a file in the directory
    `path` (the temporary directory, where the benchmarks' servers keep their stores); None
    where no file can be written there. Every acknowledged write of the event log waits for
    one, so figures from machines or sittings whose disks differ here do not compare."""
    times: list[float] = []
    try:
        with tempfile.NamedTemporaryFile(dir=path or tempfile.gettempdir(),
                                         prefix=".fsync-probe-") as f:
            fd = f.fileno()
            until = time.monotonic() + FSYNC_PROBE_S
            while len(times) < FSYNC_PROBES and time.monotonic() < until:
                os.write(fd, b"x" * 256)
                t0 = time.perf_counter()
                os.fsync(fd)
                times.append(time.perf_counter() - t0)
    except OSError:
        return None
    return statistics.median(times) * 1000 if times else None


def machine_line(path: str | None = None) -> str:
    """`4 cores, 15.6 GiB, non-rotational disk (fsync 0.20 ms); Linux 6.1 x86_64; Python
    3.11.7` for this machine."""
    where = path or tempfile.gettempdir()
    mem = _memory_gib()
    fsync = fsync_ms(where)
    return (f"{os.cpu_count() or '?'} cores, "
            f"{'?' if mem is None else f'{mem:.1f}'} GiB, "
            f"{_disk_kind(where)} (fsync {'?' if fsync is None else f'{fsync:.2f}'} ms); "
            f"{platform.system()} {platform.release().split('-')[0]} {platform.machine()}; "
            f"Python {platform.python_version()}")
