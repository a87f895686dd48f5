"""A job's files on its node: work directories fetched from the tenant's bucket once per digest
into a node-local cache, verified, and unpacked safely as the job's /work; and at the job's end
its artifacts, stored back in the tenant's bucket. A job is hostile: nothing here follows a
path the job could have written.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import shutil
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from agents.runtimes.contract import WorkloadError
from bus.errors import BucketQuotaExceeded, BusError
from bus.objects import FileStore, artifacts_bucket, work_bucket

log = logging.getLogger(__name__)

WORKDIR_IN_SANDBOX = "/work"
CACHE_BYTES = 10 << 30  # the node's cache of work directories, least recently used out first


class WorkdirRejected(WorkloadError):
    """The work directory's archive is unsafe (a path out of it, a link, a device) or is not
    the bytes its digest names; nothing of it was used."""

    code = "workdir_rejected"


class WorkdirUnavailable(WorkloadError):
    """The work directory could not be fetched from the tenant's bucket."""

    code = "workdir_unavailable"


def artifact_name(lease_id: str, rel: str) -> str:
    """An artifact's object name in the tenant's bucket: under its lease."""
    return f"{lease_id}/{rel}"


def check_archive(archive: Path, dest: Path) -> list[tarfile.TarInfo]:
    """Every member of `archive`, each checked as tarfile's `data` filter checks it (nothing
    outside `dest`, no link out of it, no device or FIFO), and no absolute or `..` name, no
    sparse file; WorkdirRejected naming the first member that fails."""
    members: list[tarfile.TarInfo] = []
    try:
        with tarfile.open(archive, "r:") as tar:
            for m in tar:
                if m.issparse() or not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
                    raise WorkdirRejected(f"{m.name!r} is not a file, directory or link")
                # the filter would strip a leading `/`; an archive that has one is refused
                if m.name.startswith("/") or ".." in m.name.split("/") or "\x00" in m.name:
                    raise WorkdirRejected(f"unsafe member name {m.name[:200]!r}")
                try:
                    tarfile.data_filter(m, str(dest))
                except tarfile.FilterError as e:
                    raise WorkdirRejected(f"unsafe member: {e}") from e
                members.append(m)
    except tarfile.TarError as e:
        raise WorkdirRejected(f"not a tar archive: {e}") from e
    return members


def unpack(archive: Path, dest: Path) -> int:
    """Unpack `archive` into the empty directory `dest`: checked whole first, then extracted
    with the `data` filter (which checks each member again against what is on disk by then).
    Returns the number of members."""
    members = check_archive(archive, dest)
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(archive, "r:") as tar:
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, OSError) as e:
        shutil.rmtree(dest, ignore_errors=True)
        raise WorkdirRejected(f"could not unpack: {e}") from e
    return len(members)


@dataclass
class Stored:
    """What storing a job's artifacts came to."""

    files: int = 0
    bytes: int = 0
    left_out: dict[str, int] = field(default_factory=dict)  # reason -> files
    error: str = ""

    def attrs(self) -> dict[str, int | str]:
        out: dict[str, int | str] = {"artifacts": self.files, "artifact_bytes": self.bytes}
        for reason, n in self.left_out.items():
            out[f"artifacts_left_out_{reason}"] = n
        if self.error:
            out["artifacts_error"] = self.error[:500]
        return out


def _matches(rel: str, globs: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(rel, g) for g in globs)


def _open_regular(dir_fd: int, name: str) -> int | None:
    """An fd of the regular file `name` in `dir_fd`, never through a link, never blocking on
    a FIFO; None when it is anything else."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


class JobFiles:
    """The node's cache of work directories and the jobs' own directories, under `root`."""

    def __init__(self, root: Path, store: FileStore | None, *,
                 cache_bytes: int = CACHE_BYTES) -> None:
        self.root = Path(root)
        self.cache = self.root / "cache"
        self.jobs = self.root / "jobs"
        self.store = store
        self.cache_bytes = cache_bytes

    def job_dir(self, key: str) -> Path:
        return self.jobs / key

    # -- in -----------------------------------------------------------------------------------

    def fetch(self, tenant: str, digest: str, size_bytes: int) -> Path:
        """The archive named `digest`, from the cache or fetched once from the tenant's bucket;
        it enters the cache only once its bytes hash to `digest`."""
        hexed = digest.removeprefix("sha256:")
        cached = self.cache / f"{hexed}.tar"
        if cached.exists():
            os.utime(cached)  # used: the last to be evicted
            return cached
        if self.store is None:
            raise WorkdirUnavailable("this agent has no connection to the file buckets")
        self.cache.mkdir(parents=True, exist_ok=True)
        part = self.cache / f".{hexed}.{os.getpid()}.fetch"
        try:
            # in place only once its bytes hash to the SHA-256 recorded with it, so that name
            # is the bytes' (no second read of them to hash)
            stored = self.store.get(work_bucket(tenant), digest, part)
        except BusError as e:
            part.unlink(missing_ok=True)
            raise WorkdirUnavailable(f"could not fetch {digest[:19]}… of tenant {tenant}: "
                                     f"[{e.code}] {e}") from e
        got = stored.sha256
        if got != hexed or stored.size_bytes != size_bytes:
            part.unlink(missing_ok=True)
            raise WorkdirRejected(f"the archive fetched as {digest[:19]}… hashes to "
                                  f"sha256:{got[:12]}… ({size_bytes} bytes expected)")
        part.replace(cached)
        self._evict(keep=cached)
        return cached

    def _evict(self, keep: Path) -> None:
        """Remove the least recently used archives until the cache holds at most
        `cache_bytes` (the one just fetched stays, whatever its size)."""
        entries = []
        for f in self.cache.glob("*.tar"):
            try:
                st = f.stat()
            except OSError:
                continue
            entries.append((st.st_mtime, st.st_size, f))
        total = sum(size for _, size, _ in entries)
        for _, size, f in sorted(entries, key=lambda e: e[0]):
            if total <= self.cache_bytes:
                break
            if f != keep:
                f.unlink(missing_ok=True)
                total -= size

    def prepare(self, key: str, tenant: str, digest: str | None, size_bytes: int) -> Path:
        """The job's directory, made anew: its work directory unpacked into it, or empty."""
        dest = self.job_dir(key)
        if dest.exists():
            shutil.rmtree(dest)
        if digest is None:
            dest.mkdir(parents=True)
            return dest
        unpack(self.fetch(tenant, digest, size_bytes), dest)
        return dest

    def remove(self, key: str) -> None:
        shutil.rmtree(self.job_dir(key), ignore_errors=True)

    # -- out ----------------------------------------------------------------------------------

    def store_artifacts(self, key: str, tenant: str, lease_id: str, globs: tuple[str, ...], *,
                        ttl_seconds: int, max_bytes: int) -> Stored:
        """Store the job's regular files matching `globs` (relative to /work) in the tenant's
        bucket under the lease, until `max_bytes` in all; links are never followed, and what
        is not a regular file, or would pass the limit or the bucket's quota, is left out and
        counted."""
        out = Stored()
        top = self.job_dir(key)
        if not globs or not top.is_dir():
            return out
        if self.store is None:
            out.error = "no connection to the file buckets"
            return out
        bucket = artifacts_bucket(tenant)
        staging = self.root / "staging"
        staging.mkdir(parents=True, exist_ok=True)
        for here, dirs, names, dir_fd in os.fwalk(top, follow_symlinks=False):
            dirs.sort()
            rel_dir = os.path.relpath(here, top)
            for name in sorted(names + [d for d in dirs if os.path.islink(os.path.join(here, d))]):
                rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                if not _matches(rel, globs):
                    continue
                fd = _open_regular(dir_fd, name)
                if fd is None:
                    out.left_out["not_regular"] = out.left_out.get("not_regular", 0) + 1
                    continue
                size = os.fstat(fd).st_size
                if out.bytes + size > max_bytes:
                    os.close(fd)
                    out.left_out["max_artifact_bytes"] = \
                        out.left_out.get("max_artifact_bytes", 0) + 1
                    continue
                # a copy the job cannot touch any more is what is stored (and hashed)
                copy = staging / f"{key}.artifact"
                with os.fdopen(fd, "rb") as src, open(copy, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                try:
                    stored = self.store.put(bucket, artifact_name(lease_id, rel), copy,
                                            ttl_seconds=ttl_seconds)
                except BucketQuotaExceeded as e:  # a smaller one may still fit
                    out.left_out[e.code] = out.left_out.get(e.code, 0) + 1
                    log.info("an artifact of %s left out: %s", key, e)
                    continue
                except BusError as e:
                    out.error = f"[{e.code}] {e}"
                    log.warning("artifacts of %s not stored: %s", key, e)
                    return out
                finally:
                    copy.unlink(missing_ok=True)
                out.files += 1
                out.bytes += stored.size_bytes
        return out
