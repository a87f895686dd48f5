"""Per-workload cgroups for the process runtime: CPU, memory and pids limits from the shape.
Files under cgroup v1 and v2: docs/security.md; why: docs/adr/009-sandbox-egress-and-limits.md.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

CONTROLLERS = ("cpu", "memory", "pids")
GROUP = "computepool"
_CPU_PERIOD_US = 100_000


@dataclass
class Cgroups:
    """The controllers this machine lets us limit, and how to make a group per workload."""

    root: Path = Path("/sys/fs/cgroup")
    version: int = 0  # 0: no usable cgroups
    enforced: tuple[str, ...] = ()
    problems: list[str] = field(default_factory=list)

    @classmethod
    def probe(cls, root: Path | None = None) -> Cgroups:
        """What can be enforced under `root` ($POOL_CGROUP_ROOT, else /sys/fs/cgroup): a v2
        root or delegated subtree whose controllers we may enable, else v1 controllers we may
        write, else none (and why, in `problems`)."""
        base = Path(root or os.environ.get("POOL_CGROUP_ROOT") or "/sys/fs/cgroup")
        got = cls(root=base)
        if (base / "cgroup.controllers").exists():
            got._probe_v2()
        else:
            got._probe_v1()
        return got

    def _probe_v2(self) -> None:
        available = (self.root / "cgroup.controllers").read_text().split()
        wanted = [c for c in CONTROLLERS if c in available]
        group = self.root / GROUP
        try:
            _write(self.root / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
            group.mkdir(exist_ok=True)
            _write(group / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
            enabled = (group / "cgroup.subtree_control").read_text().split()
        except OSError as e:
            self.problems.append(f"cgroup v2 at {self.root} is not delegated to us ({e.strerror})")
            return
        self.version = 2
        self.enforced = tuple(c for c in CONTROLLERS if c in enabled)

    def _probe_v1(self) -> None:
        ok = []
        for c in CONTROLLERS:
            d = self.root / c
            if not (d / "cgroup.procs").exists():
                self.problems.append(f"no cgroup v1 {c} controller at {d}")
                continue
            try:
                (d / GROUP).mkdir(exist_ok=True)
            except OSError as e:
                self.problems.append(f"cgroup v1 {c} controller not writable ({e.strerror})")
                continue
            ok.append(c)
        if ok:
            self.version = 1
            self.enforced = tuple(ok)

    def _dirs(self, key: str) -> dict[str, Path]:
        if self.version == 2:
            return {c: self.root / GROUP / key for c in self.enforced}
        return {c: self.root / c / GROUP / key for c in self.enforced}

    def create(self, key: str, *, cpu_millis: int, memory_mib: int, pids: int) -> list[str]:
        """A group for workload `key` with its limits set; the `cgroup.procs` files the workload
        must join (before it execs). Raises OSError when a limit cannot be set."""
        memory = memory_mib * 1024 * 1024
        quota = max(1000, cpu_millis * _CPU_PERIOD_US // 1000)
        dirs = self._dirs(key)
        for c, d in dirs.items():
            d.mkdir(parents=True, exist_ok=True)
            if self.version == 2:
                if c == "cpu":
                    _write(d / "cpu.max", f"{quota} {_CPU_PERIOD_US}")
                elif c == "memory":
                    _write(d / "memory.max", str(memory))
                    if (d / "memory.swap.max").exists():
                        _write(d / "memory.swap.max", "0")
                else:
                    _write(d / "pids.max", str(pids))
            elif c == "cpu":
                _write(d / "cpu.cfs_period_us", str(_CPU_PERIOD_US))
                _write(d / "cpu.cfs_quota_us", str(quota))
            elif c == "memory":
                _write(d / "memory.limit_in_bytes", str(memory))
                if (d / "memory.memsw.limit_in_bytes").exists():  # no swap beyond the limit
                    _write(d / "memory.memsw.limit_in_bytes", str(memory))
            else:
                _write(d / "pids.max", str(pids))
        return sorted({str(d / "cgroup.procs") for d in dirs.values()})

    def procs_files(self, key: str) -> list[str]:
        """The `cgroup.procs` files of workload `key`'s groups: what a process joins to count
        against its limits (an exec into the workload)."""
        return sorted(str(d / "cgroup.procs") for d in self._dirs(key).values())

    def pids(self, key: str) -> list[int]:
        """Every process left in the workload's group (a job that left its process group too)."""
        out: set[int] = set()
        for d in self._dirs(key).values():
            with contextlib.suppress(OSError, ValueError):
                out.update(int(x) for x in (d / "cgroup.procs").read_text().split())
        return sorted(out)

    def remove(self, key: str, wait_s: float = 2.0) -> bool:
        """Remove the workload's groups once their killed processes are gone (waiting up to
        `wait_s`); False when one is still busy (it is left for the next start-up to find)."""
        deadline = time.monotonic() + wait_s
        left = list(self._dirs(key).values())
        while left:
            busy = []
            for d in left:
                try:
                    d.rmdir()
                except FileNotFoundError:
                    pass
                except OSError:
                    busy.append(d)
            left = busy
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        return not left


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def join(procs_files: list[str]) -> None:
    """In the workload's child process, before exec: move itself into its groups. Only os
    calls: it runs between fork and exec."""
    pid = str(os.getpid()).encode()
    for p in procs_files:
        fd = os.open(p, os.O_WRONLY)
        try:
            os.write(fd, pid)
        finally:
            os.close(fd)
