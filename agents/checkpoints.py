"""The jobs' checkpoint folders on a node (`state_dir/checkpoints/<lease_id>`), and their removal
once their lease ended for good or they sat untouched past the retention.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
import uuid
from collections.abc import Callable, Collection
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_RETENTION_SECONDS = 7 * 86_400
SWEEP_SECONDS = 600.0  # how often the folders' ages are looked at (an ended lease's: at once)
FUTURE_SECONDS = 60.0  # a time further ahead than this was set to keep a folder: it is left out
GONE = ".removing-"  # a folder decided on is renamed first: a new start of its lease makes anew
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def newest_mtime(path: Path, *, not_after: float) -> float:
    """The newest modification time of `path` and of everything under it, each entry's own
    (a link or a FIFO is looked at as an entry: never followed, never opened). A time past
    `not_after` (set ahead to keep the folder) and what cannot be read do not count; 0.0 when
    nothing does. Walked with a list, not recursion: a tree of any depth is walked."""
    newest = 0.0
    try:
        st = os.lstat(path)
    except OSError:
        return newest
    if st.st_mtime <= not_after:
        newest = st.st_mtime
    todo = [os.fspath(path)] if stat.S_ISDIR(st.st_mode) else []
    while todo:
        try:
            with os.scandir(todo.pop()) as entries:
                for e in entries:
                    try:
                        m = e.stat(follow_symlinks=False).st_mtime
                        if e.is_dir(follow_symlinks=False):
                            todo.append(e.path)
                    except OSError:
                        continue
                    if newest < m <= not_after:
                        newest = m
        except OSError:  # gone, unreadable, or a path too long: it does not count
            continue
    return newest


def remove_tree(path: Path) -> None:
    """Remove `path` and everything under it. A link, FIFO, socket or device is unlinked as an
    entry (never followed, never opened); only directories are opened, with O_NOFOLLOW, and
    relative to their parent. Each pass unlinks the files one level down and renames the
    directories there up into `path`, so two descriptors remove a tree of any depth, whatever
    its paths' length (shutil.rmtree recurses: a deep enough tree stopped it). A directory the
    job made unwritable is made writable first. Raises OSError."""
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        os.unlink(path)  # a link is removed, its target never touched
        return
    os.chmod(path, 0o700)  # the lstat just said a directory; no job of it runs any more
    top = os.open(path, _DIRECTORY)
    token = uuid.uuid4().hex[:12]  # the names moved up: none the job could have planted
    moved = 0
    try:
        while True:
            with os.scandir(top) as entries:
                found = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
            if not found:
                break
            for name, is_dir in found:
                if not is_dir:
                    os.unlink(name, dir_fd=top)
                    continue
                try:
                    os.rmdir(name, dir_fd=top)
                    continue
                except OSError:
                    pass  # not empty (or not searchable): its entries move up, then it goes
                os.chmod(name, 0o700, dir_fd=top)
                sub = os.open(name, _DIRECTORY, dir_fd=top)
                try:
                    with os.scandir(sub) as entries:
                        inside = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
                    for child, child_is_dir in inside:
                        if child_is_dir:  # writable: a move updates its `..`
                            os.chmod(child, 0o700, dir_fd=sub)
                            moved += 1
                            os.rename(child, f"{GONE}{token}-{moved}", src_dir_fd=sub,
                                      dst_dir_fd=top)
                        else:
                            os.unlink(child, dir_fd=sub)
                finally:
                    os.close(sub)
                os.rmdir(name, dir_fd=top)
    finally:
        os.close(top)
    os.rmdir(path)


class CheckpointSweeper:
    """Removes the checkpoint folders no job of this node will read again: their lease ended
    for good (`ended`), or they sat untouched past the retention; never one whose lease runs
    here. Ticked from the agent's loop; a sweep runs on a thread of its own, one at a time, so
    a tenant's millions of files never hold up the heartbeats or the orders."""

    def __init__(self, root: Path, *, retention_seconds: float, lock: threading.RLock,
                 running: Callable[[], Collection[str]], clock: Callable[[], float] = time.time,
                 every: float = SWEEP_SECONDS,
                 on_removed: Callable[[int], None] = lambda n: None) -> None:
        self.root = root
        self.retention_seconds = retention_seconds
        # the agent's lock: a start of a lease and the removal of its folder never interleave
        self._lock = lock
        self._running = running
        self.clock = clock
        self.every = max(1.0, min(every, retention_seconds))
        self._on_removed = on_removed
        self._ended: set[str] = set()
        self._next_age = 0.0  # the first sweep looks at every age (a restart finds old ones)
        self._thread: threading.Thread | None = None

    def folder(self, lease_id: str) -> Path:
        return self.root / lease_id

    def ended(self, lease_id: str) -> None:
        """The lease ended for good: no job of it runs again, here or elsewhere."""
        with self._lock:
            self._ended.add(lease_id)

    def tick(self) -> None:
        """Start a sweep when one is due (an ended lease, or the ages' turn) and none runs."""
        if self._thread is not None and self._thread.is_alive():
            return
        if not self._ended and self.clock() < self._next_age:
            return
        self._thread = threading.Thread(target=self._sweep_logged, name="checkpoint-sweep",
                                        daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _sweep_logged(self) -> None:
        try:
            self.sweep()
        except Exception:  # the next tick tries again
            log.exception("checkpoint sweep failed")

    def sweep(self) -> int:
        """One pass over the folders; how many were removed."""
        now = self.clock()
        with self._lock:
            ended, self._ended = self._ended, set()
        ages = now >= self._next_age
        if ages:
            self._next_age = now + self.every
        try:
            names = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return 0
        removed = 0
        for name in names:
            if name.startswith(GONE):  # decided on by a sweep cut short
                self._remove(self.root / name)
                continue
            if name not in ended and not (ages and self._old(name, now)):
                continue
            aside = self._set_aside(name)
            if aside is not None and self._remove(aside):
                removed += 1
                log.info("checkpoint folder of lease %s removed (%s)", name,
                         "ended" if name in ended else "past its retention")
        if removed:
            self._on_removed(removed)
        return removed

    def _old(self, name: str, now: float) -> bool:
        if name in self._running():  # looked at again under the lock before it goes
            return False
        newest = newest_mtime(self.root / name, not_after=now + FUTURE_SECONDS)
        return newest < now - self.retention_seconds

    def _set_aside(self, name: str) -> Path | None:
        """Rename the folder out of its lease's way, unless the lease runs here."""
        with self._lock:
            if name in self._running():
                return None
            aside = self.root / f"{GONE}{name}.{uuid.uuid4().hex[:8]}"
            try:
                os.rename(self.root / name, aside)
            except OSError as e:
                log.warning("checkpoint folder of lease %s not removed: %s", name, e)
                return None
            return aside

    def _remove(self, path: Path) -> bool:
        try:
            remove_tree(path)
        except OSError as e:
            log.warning("checkpoint folder %s not removed (tried again later): %s", path, e)
            return False
        return True
