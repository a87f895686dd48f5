"""Notices the agent leaves in a folder its job owns (`PREEMPT` in the checkpoint folder),
written so that nothing the job puts there can block the agent or redirect its write.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class NoticeRefused(Exception):
    """What the job left where a notice goes is not a plain file of its own: nothing written."""

    code = "checkpoint_notice_refused"


_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# no O_TRUNC: a file is emptied only once fstat has shown it is one the notice may replace
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_REFUSED_ON_OPEN = {
    errno.ELOOP: "a symbolic link",  # O_NOFOLLOW on a link
    errno.EISDIR: "a directory",
    errno.ENXIO: "a FIFO or socket",  # O_NONBLOCK write-open of a FIFO with no reader
    errno.ENOTDIR: "not a directory",
}


def write_notice(directory: Path, name: str, text: str) -> None:
    """Write `text` as `directory/name`, never opening a path the job could have swapped by
    name: the folder is opened without following a link, the file relative to it with
    O_NOFOLLOW|O_NONBLOCK, and written only when fstat shows a regular file with one link.
    Raises NoticeRefused (a link, FIFO, socket, device, directory or hard link in its place)
    or OSError (the folder is gone)."""
    try:
        dir_fd = os.open(directory, _DIRECTORY_FLAGS)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NoticeRefused(f"{directory} is not a plain directory") from e
        raise
    try:
        try:
            fd = os.open(name, _FILE_FLAGS, 0o644, dir_fd=dir_fd)
        except OSError as e:
            what = _REFUSED_ON_OPEN.get(e.errno or 0)
            if what is None:
                raise
            raise NoticeRefused(f"{directory / name} is {what}") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NoticeRefused(f"{directory / name} is not a regular file "
                                    f"(mode {stat.filemode(st.st_mode)})")
            if st.st_nlink != 1:  # a hard link: the same inode may be a file elsewhere
                raise NoticeRefused(f"{directory / name} has {st.st_nlink} links")
            os.ftruncate(fd, 0)
            os.write(fd, text.encode())
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)


def latest_mtime(d: Path, known: float | None) -> float | None:
    """The newest change in the job's checkpoint folder (its own notice left out), or `known`."""
    latest = known
    try:
        for f in d.iterdir():
            if f.name == "PREEMPT":
                continue
            m = f.stat(follow_symlinks=False).st_mtime  # the job's links lead nowhere
            if latest is None or m > latest:
                latest = m
    except OSError:
        pass
    return latest
