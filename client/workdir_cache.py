"""The digests of work directories already packed, kept in the user's cache folder: a tree
whose every file has the same (path, size, mtime, ctime, inode) as when it was packed is not
packed again just to learn its digest."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

FORMAT = 1  # of the packed tar: a new one makes every recorded digest stale
KEPT = 64  # directories remembered, the least recently packed out first
# a file changed within this long before it was read could change again within the same
# timestamp tick, unseen by its stat: such a tree is packed, not remembered (git's racy check)
RACY_NS = 1_000_000_000


def default_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "computepool" / "workdirs.json"


def stamp(root: Path, entries: list[tuple[str, Path]],
          also: tuple[str, ...] = ()) -> tuple[str, int]:
    """A hash of every entry's name and stat (and a link's target), and of the files `also`
    names under `root` (the ignore files, packed or not); and the newest mtime or ctime among
    them (ns)."""
    h = hashlib.sha256(f"format={FORMAT}\0{os.path.realpath(root)}\0".encode())
    newest = 0
    paths = [(rel, path) for rel, path in entries]
    paths += [(f"\0{name}", Path(root) / name) for name in also]
    for rel, path in paths:
        try:
            st = path.lstat()
        except OSError:
            h.update(f"{rel}\0-\n".encode())
            continue
        target = os.readlink(path) if path.is_symlink() else ""
        h.update(f"{rel}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0"
                 f"{st.st_ino}\0{st.st_dev}\0{target}\n".encode())
        newest = max(newest, st.st_mtime_ns, st.st_ctime_ns)
    return h.hexdigest(), newest


class DigestCache:
    """Work directories' digests by their stamp, in one JSON file (mode 0600, replaced
    atomically); a missing or unreadable file is an empty cache."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path if path is not None else default_path()

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, root: Path, key: str) -> dict[str, Any] | None:
        """What was recorded for `root` under `key` (digest, size_bytes, files,
        content_bytes, skipped); None if nothing is."""
        row = self._load().get(os.path.realpath(root))
        if not isinstance(row, dict) or row.get("stamp") != key:
            return None
        return row

    def put(self, root: Path, key: str, newest_ns: int, row: dict[str, Any],
            started_ns: int) -> bool:
        """Record `row` for `root` under `key`, unless a file of it changed within RACY_NS of
        `started_ns` (when its read began). False when not recorded."""
        if newest_ns >= started_ns - RACY_NS:
            return False
        rows = self._load()
        rows.pop(os.path.realpath(root), None)
        rows[os.path.realpath(root)] = {**row, "stamp": key, "at": time.time()}
        kept = dict(list(rows.items())[-KEPT:])
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(kept, f)
            tmp.replace(self.path)
        except OSError:  # a cache that cannot be written only costs the next pack
            with contextlib.suppress(OSError):
                tmp.unlink()
            return False
        return True
