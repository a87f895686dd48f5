"""A work directory packed for a job: a tar of its files in sorted order, with owners, times
and modes normalised, so the same tree always makes the same bytes and so the same digest.

What is left out: `.git/`, and what `.gitignore` and `.poolignore` at its top name (gitignore
syntax; `.poolignore` comes last, so it may take back with `!` what `.gitignore` left out).
Symbolic links that stay inside the directory are kept; others, and anything that is neither a
file nor a directory, are left out.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, cast

import pathspec

from bus.objects import FileStore, Progress, StoredObject, work_bucket
from client.workdir_cache import DigestCache, stamp

IGNORE_FILES = (".gitignore", ".poolignore")
ALWAYS_IGNORED = (".git/",)


@dataclass(frozen=True)
class Packed:
    """A packed work directory: where its tar is, its SHA-256 (`sha256:<hex>`), its size, and
    how many files it holds (what was left out, by reason, in `skipped`)."""

    path: Path
    digest: str
    size_bytes: int
    files: int
    content_bytes: int
    skipped: dict[str, int] = field(default_factory=dict)


def ignore_spec(root: Path) -> pathspec.GitIgnoreSpec:
    lines: list[str] = list(ALWAYS_IGNORED)
    for name in IGNORE_FILES:
        try:
            lines += (root / name).read_text().splitlines()
        except (OSError, UnicodeDecodeError):
            continue
    return pathspec.GitIgnoreSpec.from_lines(lines)


def _link_inside(rel: str, target: str) -> bool:
    if posixpath.isabs(target):
        return False
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
    return resolved != ".." and not resolved.startswith("../")


def _info(name: str, kind: bytes, mode: int, size: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.size = size
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


class _Hashing:
    """A file written through: the bytes hashed as they go, so the tar is not read again."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.h = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.h.update(data)
        self.size += len(data)
        return self.raw.write(data)

    def tell(self) -> int:
        return self.size


Entries = list[tuple[str, Path]]  # (name in the tar, `/`-ended for a folder; path on disk)


def select(root: Path) -> tuple[Entries, dict[str, int]]:
    """What `pack` would consider, in name order, and what the ignore files left out (by
    reason); a link or a special file is still here, decided when packed."""
    root = Path(root)
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a directory")
    spec = ignore_spec(root)
    skipped: dict[str, int] = {}
    entries: list[tuple[str, Path]] = []
    for here, dirs, names in os.walk(root, followlinks=False):
        rel_dir = Path(here).relative_to(root).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        kept_dirs = []
        for d in sorted(dirs):
            rel = rel_dir + d
            if (Path(here) / d).is_symlink():
                names.append(d)  # a link to a directory is a link, decided below
            elif spec.match_file(rel + "/"):
                skipped["ignored"] = skipped.get("ignored", 0) + 1
            else:
                kept_dirs.append(d)
                entries.append((rel + "/", Path(here) / d))
        dirs[:] = kept_dirs
        for n in sorted(set(names)):
            rel = rel_dir + n
            if spec.match_file(rel):
                skipped["ignored"] = skipped.get("ignored", 0) + 1
                continue
            entries.append((rel, Path(here) / n))
    entries.sort(key=lambda e: e[0])
    return entries, skipped


def pack(root: Path, dest: Path, selected: tuple[Entries, dict[str, int]] | None = None,
         ) -> Packed:
    """Pack the directory `root` (what `select` chose, or `selected`) into the tar file `dest`;
    the same tree always gives the same bytes (and digest), whoever owns it and whenever its
    files were touched."""
    entries, skipped = selected if selected is not None else select(root)
    skipped = dict(skipped)
    files = 0
    content = 0
    with open(dest, "wb") as raw, \
        tarfile.open(fileobj=cast(BinaryIO, hashed := _Hashing(raw)), mode="w",
                     format=tarfile.PAX_FORMAT) as tar:
        for rel, path in entries:
            st = path.lstat()
            if rel.endswith("/"):
                tar.addfile(_info(rel.rstrip("/"), tarfile.DIRTYPE, 0o755))
            elif path.is_symlink():
                target = os.readlink(path)
                if not _link_inside(rel, target):
                    skipped["link_outside"] = skipped.get("link_outside", 0) + 1
                    continue
                info = _info(rel, tarfile.SYMTYPE, 0o777)
                info.linkname = target
                tar.addfile(info)
            elif path.is_file():
                mode = 0o755 if st.st_mode & 0o111 else 0o644
                with open(path, "rb") as f:
                    tar.addfile(_info(rel, tarfile.REGTYPE, mode, st.st_size), f)
                files += 1
                content += st.st_size
            else:
                skipped["special"] = skipped.get("special", 0) + 1
    return Packed(path=dest, digest=f"sha256:{hashed.h.hexdigest()}", size_bytes=hashed.size,
                  files=files, content_bytes=content, skipped=skipped)


@dataclass(frozen=True)
class Uploaded:
    """What storing a work directory came to: the job's `workdir` and what was sent."""

    packed: Packed
    uploaded: bool  # False: the bucket held these bytes already

    def job_ref(self) -> dict[str, int | str]:
        """The job's `workdir` (schemas/v1.py WorkdirRef)."""
        return {"digest": self.packed.digest, "size_bytes": self.packed.size_bytes,
                "files": self.packed.files}

    def line(self) -> str:
        """What `pool lease run` says about it."""
        if not self.uploaded:
            return f"workdir: unchanged ({self.packed.files} files, {self.packed.digest[:19]})"
        return (f"workdir: {self.packed.files} files, {self.packed.size_bytes} bytes uploaded "
                f"({self.packed.digest[:19]})")


def _known(row: dict[str, Any] | None) -> Packed | None:
    """A packed directory recorded in the digest cache (no tar: `path` is `Path()`)."""
    if row is None:
        return None
    try:
        return Packed(path=Path(), digest=str(row["digest"]), size_bytes=int(row["size_bytes"]),
                      files=int(row["files"]), content_bytes=int(row["content_bytes"]),
                      skipped={str(k): int(v) for k, v in dict(row["skipped"]).items()})
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def upload(store: FileStore, tenant: str, root: Path, *,
           progress_for: Callable[[int], Progress] | None = None,
           cache: DigestCache | None = None) -> Uploaded:
    """Pack `root` and store it in the tenant's work bucket under its digest, unless the
    bucket holds it already (an unchanged directory sends nothing). A tree whose files' stats
    are those `cache` (default: the user's) recorded at its last pack is not packed again to
    learn its digest. `progress_for(total)` gives the callback told the bytes sent so far."""
    import tempfile

    cache = cache if cache is not None else DigestCache()
    bucket = work_bucket(tenant)
    selected = select(root)
    key, newest = stamp(root, selected[0], IGNORE_FILES)
    known = _known(cache.get(root, key))
    if known is not None and _holds(store.info(bucket, known.digest), known):
        return Uploaded(known, uploaded=False)
    started = time.time_ns()
    with tempfile.TemporaryDirectory(prefix="pool-workdir-") as tmp:
        packed = pack(root, Path(tmp) / "workdir.tar", selected)
        row = {"digest": packed.digest, "size_bytes": packed.size_bytes, "files": packed.files,
               "content_bytes": packed.content_bytes, "skipped": packed.skipped}
        if known is None or known.digest != packed.digest:
            have = store.info(bucket, packed.digest)
            if _holds(have, packed):
                cache.put(root, key, newest, row, started)
                return Uploaded(packed, uploaded=False)
        store.put(bucket, packed.digest, packed.path,
                  progress=progress_for(packed.size_bytes) if progress_for else None)
        cache.put(root, key, newest, row, started)
        return Uploaded(packed, uploaded=True)


def _holds(have: StoredObject | None, packed: Packed) -> bool:
    return have is not None and have.sha256 == packed.digest.removeprefix("sha256:") \
        and have.size_bytes == packed.size_bytes
