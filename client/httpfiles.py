"""The tenant's file buckets through the HTTP gateway (gateway/files.py): the calls of
bus.objects.FileStore that the CLI makes, so `--workdir` and `lease artifacts` need only a URL
and a token."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from bus.errors import (
    BucketMissing,
    BucketQuotaExceeded,
    BusError,
    DigestMismatch,
    ObjectMissing,
)
from bus.objects import Progress, StoredObject
from bus.subjects import ARTIFACTS_BUCKET_PREFIX, WORK_BUCKET_PREFIX

WORKDIRS = "/v1/workdirs"
LEASES = "/v1/compute-leases"
SEND_BYTES = 1 << 20
_BY_CODE: dict[str, type[BusError]] = {"object_missing": ObjectMissing,
                                       "digest_mismatch": DigestMismatch,
                                       "bucket_missing": BucketMissing,
                                       "bucket_quota_exceeded": BucketQuotaExceeded}


class FileRefused(BusError):
    """The gateway refused a file operation; `code` is its problem's code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _refused(r: httpx.Response) -> BusError:
    try:
        p = r.json()
    except ValueError:
        p = {}
    code = str(p.get("code") or f"http_{r.status_code}") if isinstance(p, dict) else \
        f"http_{r.status_code}"
    message = str(p.get("detail") or code) if isinstance(p, dict) else code
    known = _BY_CODE.get(code)
    return known(message) if known is not None else FileRefused(code, message)


def _kind(bucket: str) -> str:
    if bucket.startswith(WORK_BUCKET_PREFIX):
        return "work"
    if bucket.startswith(ARTIFACTS_BUCKET_PREFIX):
        return "artifacts"
    raise FileRefused("not_over_http", f"bucket {bucket}: not reachable over the HTTP API")


def _split(name: str) -> tuple[str, str]:
    lease, sep, rel = name.partition("/")
    if not sep or not lease or not rel:
        raise ObjectMissing(f"no artifact {name!r}")
    return lease, rel


class HttpFileStore:
    """A tenant's work directories and artifacts over one gateway client (httpx)."""

    def __init__(self, http: httpx.Client, url: str) -> None:
        self._http = http
        self._url = url

    def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            return self._http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise FileRefused("gateway_unreachable", f"{self._url}: {e or type(e).__name__}") \
                from e

    def info(self, bucket: str, name: str) -> StoredObject | None:
        if _kind(bucket) != "work":
            raise FileRefused("not_over_http", "only a work directory's metadata is read")
        r = self._send("GET", f"{WORKDIRS}/{quote(name, safe=':')}")
        if r.status_code == 404:
            return None
        if not r.is_success:
            raise _refused(r)
        got = r.json()
        return StoredObject(name=name, size_bytes=int(got["size_bytes"]), sha256=got["sha256"])

    def put(self, bucket: str, name: str, source: Path, *, progress: Progress | None = None,
            **_: Any) -> StoredObject:
        if _kind(bucket) != "work":
            raise FileRefused("not_over_http", "only a work directory is stored over HTTP")
        size = source.stat().st_size
        h = hashlib.sha256()

        def chunks() -> Iterator[bytes]:
            sent = 0
            with open(source, "rb") as f:
                while data := f.read(SEND_BYTES):
                    h.update(data)
                    yield data
                    sent += len(data)
                    if progress is not None:
                        progress(sent)

        r = self._send("PUT", f"{WORKDIRS}/{quote(name, safe=':')}", content=chunks(),
                       headers={"Content-Type": "application/octet-stream",
                                "Content-Length": str(size)},
                       timeout=httpx.Timeout(self._http.timeout.connect, read=None,
                                             write=None, pool=None))
        if not r.is_success:
            raise _refused(r)
        return StoredObject(name=name, size_bytes=size, sha256=h.hexdigest())

    def delete(self, bucket: str, name: str) -> bool:
        if _kind(bucket) != "work":
            raise FileRefused("not_over_http", "only a work directory is removed over HTTP")
        r = self._send("POST", f"{WORKDIRS}/{quote(name, safe=':')}/delete")
        if r.status_code == 404:
            return False
        if not r.is_success:
            raise _refused(r)
        return True

    def list(self, bucket: str, prefix: str = "") -> list[StoredObject]:
        if _kind(bucket) != "artifacts":
            raise FileRefused("not_over_http", "only a lease's artifacts are listed")
        lease = prefix.rstrip("/")
        r = self._send("GET", f"{LEASES}/{quote(lease, safe='')}/artifacts")
        if not r.is_success:
            raise _refused(r)
        return [StoredObject(name=f"{lease}/{row['name']}", size_bytes=int(row["size_bytes"]),
                             sha256=str(row["sha256"]), mtime=str(row.get("stored_at") or ""))
                for row in r.json().get("items") or []]

    def get(self, bucket: str, name: str, dest: Path, *,
            progress: Progress | None = None, **_: Any) -> StoredObject:
        """Write the artifact `name` to `dest`, in place only once its bytes hash to the
        SHA-256 the gateway checked them against."""
        if _kind(bucket) != "artifacts":
            raise FileRefused("not_over_http", "only artifacts are fetched over HTTP")
        lease, rel = _split(name)
        tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.part")
        h = hashlib.sha256()
        got = 0
        try:
            with self._http.stream("GET", f"{LEASES}/{quote(lease, safe='')}/artifacts/"
                                   f"{quote(rel, safe='/')}") as r:
                if not r.is_success:
                    r.read()
                    raise _refused(r)
                want = r.headers.get("x-content-sha256", "")
                with open(tmp, "wb") as out:
                    for data in r.iter_bytes(SEND_BYTES):
                        h.update(data)
                        out.write(data)
                        got += len(data)
                        if progress is not None:
                            progress(got)
            if h.hexdigest() != want:
                raise DigestMismatch(f"artifact {name!r}: {got} bytes hashing to "
                                     f"{h.hexdigest()}, recorded as {want}")
            tmp.replace(dest)
        except httpx.HTTPError as e:
            raise FileRefused("gateway_unreachable", f"{self._url}: {e or type(e).__name__}") \
                from e
        finally:
            tmp.unlink(missing_ok=True)
        return StoredObject(name=name, size_bytes=got, sha256=want)
