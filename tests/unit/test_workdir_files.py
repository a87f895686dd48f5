"""A job's files without a server: the pack is deterministic and leaves out what it should, an
unsafe archive is refused whole, and the node's cache keeps to its size, oldest out first."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest

from agents.workdir import JobFiles, WorkdirRejected, unpack
from bus.objects import StoredObject
from client.workdir import pack


def test_the_same_tree_packs_to_the_same_digest_whoever_touched_it(tmp_path: Path) -> None:
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "a.py").write_text("print(1)\n")
    (d / "sub" / "b.csv").write_text("x\n")
    (d / "debug.log").write_text("noise\n")
    (d / "keep.log").write_text("kept\n")
    (d / ".gitignore").write_text("*.log\n")
    (d / ".poolignore").write_text("!keep.log\n")
    (d / "inside").symlink_to("a.py")
    (d / "outside").symlink_to("/etc/passwd")
    first = pack(d, tmp_path / "1.tar")
    os.utime(d / "a.py", (1, 1))
    second = pack(d, tmp_path / "2.tar")
    assert first.digest == second.digest
    # the digest and size are the tar file's own (hashed as it was written)
    data = (tmp_path / "1.tar").read_bytes()
    assert first.digest == "sha256:" + hashlib.sha256(data).hexdigest()
    assert first.size_bytes == len(data)
    with tarfile.open(tmp_path / "1.tar") as tar:
        names = tar.getnames()
    assert names == [".gitignore", ".poolignore", "a.py", "inside", "keep.log", "sub",
                     "sub/b.csv"]
    assert first.skipped == {"ignored": 1, "link_outside": 1}


def _tar(tmp_path: Path, *members: tuple[str, bytes, str]) -> Path:
    out = tmp_path / "x.tar"
    with tarfile.open(out, "w") as tar:
        for name, kind, target in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind == tarfile.SYMTYPE or kind == tarfile.LNKTYPE:
                info.linkname = target
                tar.addfile(info)
            else:
                info.size = len(target)
                tar.addfile(info, io.BytesIO(target.encode()))
    return out


@pytest.mark.parametrize("members", [
    [("ok.txt", tarfile.REGTYPE, "fine"), ("../up.txt", tarfile.REGTYPE, "x")],
    [("/abs.txt", tarfile.REGTYPE, "x")],
    [("etc", tarfile.SYMTYPE, "/etc"), ("etc/x", tarfile.REGTYPE, "x")],
    [("up", tarfile.SYMTYPE, "../.."), ],
    [("dev", tarfile.CHRTYPE, "")],
    [("fifo", tarfile.FIFOTYPE, "")],
])
def test_an_unsafe_archive_is_refused_before_anything_is_written(
        tmp_path: Path, members: list[tuple[str, bytes, str]]) -> None:
    archive = _tar(tmp_path, *members)
    dest = tmp_path / "job"
    with pytest.raises(WorkdirRejected):
        unpack(archive, dest)
    assert not dest.exists() or not any(dest.iterdir())


class _Store:
    """Stands in for the bucket: every object is `size` bytes of its name."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.fetched: list[str] = []
        self.blobs: dict[str, bytes] = {}

    def add(self, n: int) -> str:
        data = bytes([n]) * self.size
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        self.blobs[digest] = data
        return digest

    def get(self, bucket: str, name: str, dest: Path) -> StoredObject:
        self.fetched.append(name)
        data = self.blobs[name]
        dest.write_bytes(data)
        # as the bucket's get: the SHA-256 the bytes were stored with, which they hash to
        return StoredObject(name=name, size_bytes=len(data),
                            sha256=hashlib.sha256(data).hexdigest())


def test_the_cache_fetches_once_per_digest_and_keeps_to_its_size(tmp_path: Path) -> None:
    store = _Store(1000)
    files = JobFiles(tmp_path, store, cache_bytes=2500)  # type: ignore[arg-type]
    a, b, c = store.add(1), store.add(2), store.add(3)
    files.fetch("t", a, 1000)
    files.fetch("t", b, 1000)
    files.fetch("t", a, 1000)  # a hit: fetched once, and now the newest
    os.utime(files.cache / f"{b[7:]}.tar", (1, 1))
    files.fetch("t", c, 1000)  # over 2,500 bytes: the least recently used (b) goes
    assert store.fetched == [a, b, c]
    assert sorted(p.name for p in files.cache.glob("*.tar")) == sorted(
        f"{d[7:]}.tar" for d in (a, c))


def test_bytes_that_do_not_hash_to_their_name_never_enter_the_cache(tmp_path: Path) -> None:
    store = _Store(10)
    wrong = "sha256:" + "0" * 64
    store.blobs[wrong] = b"not these"
    files = JobFiles(tmp_path, store)  # type: ignore[arg-type]
    with pytest.raises(WorkdirRejected):
        files.fetch("t", wrong, 9)
    assert not list(files.cache.glob("*"))
