"""Which processes a process has started, read from /proc (for tests of process lifecycles)."""

from __future__ import annotations

from pathlib import Path


def children(pid: int, *, marked: bytes | None = None) -> list[int]:
    """The pids whose parent is `pid`; with `marked`, only those whose command line holds it."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != pid or (marked is not None and marked not in
                               (entry / "cmdline").read_bytes()):
                continue
        except (OSError, IndexError, ValueError):
            continue
        out.append(int(entry.name))
    return out
