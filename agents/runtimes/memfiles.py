"""A job's secret files for a runtime that can only bind a host directory (docker): a
directory in the host's memory (/dev/shm), owned by the workload's uid alone, wiped at the end."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from agents.runtimes.contract import WorkloadError

SHM_ROOT = Path("/dev/shm/computepool-secrets")


def _dir(key: str, root: Path) -> Path:
    return root / key.replace("/", "_")


def write(key: str, files: Iterable[tuple[str, bytes]], *, uid: int, gid: int,
          root: Path = SHM_ROOT) -> Path:
    """The directory holding each file (by its name under /run/secrets), mode 0500/0400 and
    owned by `uid`:`gid`; nothing else on the host but root reads it. WorkloadError
    secrets_unsupported when this agent may not give files to another uid (not root)."""
    if os.geteuid() != 0:
        raise WorkloadError("the agent runs unprivileged, so it cannot hand a container's uid "
                            "files no other user reads", code="secrets_unsupported")
    if not Path("/dev/shm").is_dir() and root == SHM_ROOT:
        raise WorkloadError("no /dev/shm on this node: secret files would reach its disk",
                            code="secrets_unsupported")
    root.mkdir(mode=0o711, parents=True, exist_ok=True)
    os.chmod(root, 0o711)  # traversed by the workload's uid, listed by no one but root
    target = _dir(key, root)
    wipe(key, root=root)
    target.mkdir(mode=0o700)
    try:
        for path, data in files:
            name = Path(path).name
            fd = os.open(target / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                         0o400)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chown(target / name, uid, gid)
        os.chown(target, uid, gid)
        os.chmod(target, 0o500)
    except OSError as e:
        wipe(key, root=root)
        raise WorkloadError(f"could not hold the job's secret files in memory: {e}",
                            code="secrets_failed") from e
    return target


def wipe(key: str, *, root: Path = SHM_ROOT) -> None:
    """Remove the job's secret files (its memory is freed with them)."""
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(_dir(key, root))
