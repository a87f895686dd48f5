"""The machine line every benchmark prints: cores, memory and disk kind, detected, never typed."""

from __future__ import annotations

import os
import platform
from pathlib import Path


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


def machine_line(path: str | None = None) -> str:
    """`4 cores, 15.6 GiB, non-rotational disk; Linux 6.1 x86_64; Python 3.11.7` for this machine."""
    import tempfile

    mem = _memory_gib()
    return (f"{os.cpu_count() or '?'} cores, "
            f"{'?' if mem is None else f'{mem:.1f}'} GiB, "
            f"{_disk_kind(path or tempfile.gettempdir())}; "
            f"{platform.system()} {platform.release().split('-')[0]} {platform.machine()}; "
            f"Python {platform.python_version()}")
