"""The digest cache of work directories with a real nats-server: an unchanged tree is not
packed again to learn its digest, and any change to a file the pack would read (its bytes
with size and mtime kept, its inode, an ignore file) is noticed and packed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from bus.objects import FileStore, ensure_tenant_buckets_sync
from client import workdir, workdir_cache
from client.api import PoolClient
from client.workdir import pack, upload
from client.workdir_cache import DigestCache


@pytest.fixture()
def store(nats_url: str, unique: str) -> Iterator[tuple[FileStore, str]]:
    tenant = f"d{unique}"
    # a small quota: each bucket's is reserved from the shared server's store
    ensure_tenant_buckets_sync(nats_url, [tenant], quota_bytes=16 << 20)
    with PoolClient(nats_url) as c:
        yield c.files(), tenant


class Packs:
    """`pack`, counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        real = workdir.pack

        def counted(*a: object, **kw: object) -> workdir.Packed:
            self.n += 1
            return real(*a, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(workdir, "pack", counted)


def _tree(tmp: Path) -> Path:
    d = tmp / "src"
    d.mkdir()
    (d / "train.py").write_text("print('v1')\n")
    (d / "data.csv").write_bytes(os.urandom(300_000))
    (d / "skip.log").write_text("left out\n")
    (d / ".poolignore").write_text("*.log\n")
    return d


@pytest.fixture()
def not_racy(monkeypatch: pytest.MonkeyPatch) -> None:
    # files written by the test this instant: trusted at once (the racy check has its own test)
    monkeypatch.setattr(workdir_cache, "RACY_NS", -(1 << 62))


def test_an_unchanged_tree_is_not_packed_again_to_learn_its_digest(
        store: tuple[FileStore, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        not_racy: None) -> None:
    files, tenant = store
    src = _tree(tmp_path)
    cache = DigestCache(tmp_path / "cache" / "workdirs.json")
    packs = Packs(monkeypatch)
    first = upload(files, tenant, src, cache=cache)
    again = upload(files, tenant, src, cache=cache)
    assert first.uploaded and not again.uploaded and packs.n == 1
    assert again.job_ref() == first.job_ref()
    assert oct((tmp_path / "cache" / "workdirs.json").stat().st_mode & 0o777) == "0o600"


@pytest.mark.parametrize("change", ["same_size_and_mtime", "replaced", "ignore_file", "new"])
def test_a_changed_tree_is_noticed_and_packed_again(
        store: tuple[FileStore, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        not_racy: None, change: str) -> None:
    files, tenant = store
    src = _tree(tmp_path)
    cache = DigestCache(tmp_path / "workdirs.json")
    first = upload(files, tenant, src, cache=cache)
    csv = src / "data.csv"
    if change == "same_size_and_mtime":  # bytes changed in place, size and mtime put back
        st = csv.stat()
        with open(csv, "r+b") as f:
            f.write(b"changed!")
        os.utime(csv, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert (csv.stat().st_size, csv.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    elif change == "replaced":  # an editor's save: a new file renamed over the old
        (src / "train.tmp").write_text("print('v2')\n")
        os.replace(src / "train.tmp", src / "train.py")
    elif change == "ignore_file":  # the same files, but skip.log is no longer left out
        (src / ".poolignore").write_text("# nothing\n")
    else:
        (src / "more.txt").write_text("x\n")
    packs = Packs(monkeypatch)
    second = upload(files, tenant, src, cache=cache)
    assert packs.n == 1 and second.uploaded
    assert second.packed.digest != first.packed.digest
    assert second.packed.digest == pack(src, tmp_path / "check.tar").digest


def test_a_tree_written_just_before_its_pack_is_not_trusted_to_the_cache(
        store: tuple[FileStore, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files, tenant = store
    src = _tree(tmp_path)  # this instant: a write within the same timestamp tick is unseen
    cache = DigestCache(tmp_path / "workdirs.json")
    upload(files, tenant, src, cache=cache)
    packs = Packs(monkeypatch)
    assert not upload(files, tenant, src, cache=cache).uploaded
    assert packs.n == 1  # packed again: nothing was recorded


def test_an_object_gone_from_the_bucket_is_sent_again_whatever_the_cache_says(
        store: tuple[FileStore, str], tmp_path: Path, not_racy: None) -> None:
    from bus.objects import work_bucket

    files, tenant = store
    src = _tree(tmp_path)
    cache = DigestCache(tmp_path / "workdirs.json")
    first = upload(files, tenant, src, cache=cache)
    assert files.delete(work_bucket(tenant), first.packed.digest)
    again = upload(files, tenant, src, cache=cache)
    assert again.uploaded and again.packed.digest == first.packed.digest
    assert files.info(work_bucket(tenant), first.packed.digest) is not None
