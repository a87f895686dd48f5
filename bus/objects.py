"""The tenants' file buckets in JetStream's object store: work directories in (named by their
SHA-256) and a job's artifacts out (with a time to live). Buckets, put, get and list.

The layout is the object store's own (`$O.<bucket>.C.<nuid>` chunks, `$O.<bucket>.M.<name>`
metadata), so `nats object` reads these buckets; reads are direct gets, so a reader needs no
consumer, and a writer may give every message a TTL (`Nats-TTL`, nats-server >= 2.11).
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import hashlib
import json
import logging
import secrets
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nats.errors import NoRespondersError
from nats.js.api import (
    DiscardPolicy,
    ObjectInfo,
    ObjectMetaOptions,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, BadRequestError, NoStreamResponseError, NotFoundError

from bus.errors import (
    BucketMissing,
    BucketQuotaExceeded,
    BucketQuotaUnreservable,
    DigestMismatch,
    ObjectMissing,
)
from bus.headers import HDR_NUM_PENDING, HDR_ROLLUP, HDR_SEQUENCE, HDR_STATUS, HDR_TTL
from bus.runtime import run_sync, translate
from bus.subjects import ARTIFACTS_BUCKET_PREFIX, WORK_BUCKET_PREFIX, token

log = logging.getLogger(__name__)

CHUNK_BYTES = 256 * 1024  # well under the server's 1 MiB max_payload
BATCH_CHUNKS = 32  # chunks asked for in one direct get (8 MiB)
_DIGEST_PREFIX = "SHA-256="
# each of a tenant's two buckets holds at most this many bytes unless the operator says
# otherwise (`pool admin tenant bucket-quota`); the stream's max_bytes, with discard new: a full
# bucket refuses the new object and never evicts an old one. The server reserves every
# stream's max_bytes from its JetStream store (max_file_store, by default 75% of the disk),
# so the default is one pool-sized work directory, not more: 10 GiB would let a laptop's
# `pool up` make the buckets of two or three tenants only
DEFAULT_BUCKET_QUOTA_BYTES = 1 << 30
_MAX_BYTES_EXCEEDED = 10077  # JetStream's err_code for a store past max_bytes (discard new)
_NO_ROOM_TO_RESERVE = 10047  # and for a max_bytes its store cannot reserve
_MESSAGE_OVERHEAD = 256  # a chunk's subject, headers and record, counted against max_bytes

Progress = Callable[[int], None]  # bytes moved so far


def work_bucket(tenant: str) -> str:
    return WORK_BUCKET_PREFIX + token(tenant)


def artifacts_bucket(tenant: str) -> str:
    return ARTIFACTS_BUCKET_PREFIX + token(tenant)


def stream_of(bucket: str) -> str:
    return f"OBJ_{bucket}"


def bucket_config(bucket: str, *, replicas: int = 1,
                  quota_bytes: int = DEFAULT_BUCKET_QUOTA_BYTES) -> StreamConfig:
    """The object store's own stream layout, with direct gets (reads need no consumer),
    per-message TTLs (an artifact expires on its own) and the tenant's quota as max_bytes
    (discard new: a full bucket refuses, never evicts)."""
    return StreamConfig(
        name=stream_of(bucket), subjects=[f"$O.{bucket}.C.>", f"$O.{bucket}.M.>"],
        storage=StorageType.FILE, num_replicas=replicas, discard=DiscardPolicy.NEW,
        max_bytes=quota_bytes,
        allow_rollup_hdrs=True, allow_direct=True, allow_msg_ttl=True,
        description=f"computepool files: {bucket}")


@dataclass(frozen=True)
class StoredObject:
    """One object's metadata: its name, size and SHA-256 (hex) of its bytes."""

    name: str
    size_bytes: int
    sha256: str
    chunks: int = 0
    mtime: str = ""


def _meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


def _stored(info: ObjectInfo) -> StoredObject:
    digest = (info.digest or "").removeprefix(_DIGEST_PREFIX)
    try:
        hexed = base64.urlsafe_b64decode(digest).hex()
    except ValueError:
        hexed = ""
    return StoredObject(name=info.name, size_bytes=int(info.size or 0), sha256=hexed,
                        chunks=int(info.chunks or 0), mtime=info.mtime or "")


async def ensure_bucket(js: Any, bucket: str, *, replicas: int = 1,
                        quota_bytes: int | None = None) -> None:
    """Make `bucket` if it is missing (the operator's: a tenant never configures a stream),
    with `quota_bytes` (else the default); an existing bucket gets `quota_bytes` when given,
    the default when it has none (made before quotas), and otherwise keeps its own. Lowering
    a quota under what a bucket holds removes nothing: it refuses new objects until room
    comes back."""
    try:
        info = await js.stream_info(stream_of(bucket))
    except NotFoundError:
        info = None
    want = quota_bytes or DEFAULT_BUCKET_QUOTA_BYTES
    try:
        if info is None:
            try:
                await js.add_stream(bucket_config(bucket, replicas=replicas, quota_bytes=want))
                return
            except BadRequestError as e:
                if e.err_code == _NO_ROOM_TO_RESERVE:
                    raise
                info = await js.stream_info(stream_of(bucket))  # made meanwhile
        have = int(info.config.max_bytes or -1)
        if quota_bytes is None and have > 0:
            want = have  # the operator's, kept
        if want != have:
            info.config.max_bytes = want
            await js.update_stream(info.config)
    except APIError as e:
        if e.err_code != _NO_ROOM_TO_RESERVE:
            raise
        raise BucketQuotaUnreservable(
            f"bucket {bucket}: the server cannot reserve its {want}-byte quota (every bucket's "
            "quota is reserved from JetStream's max_file_store): lower the quotas (`pool admin "
            "tenant bucket-quota`) or raise max_file_store") from e


async def ensure_tenant_buckets(js: Any, tenant: str, *, replicas: int = 1,
                                quota_bytes: int | None = None) -> None:
    await ensure_bucket(js, work_bucket(tenant), replicas=replicas, quota_bytes=quota_bytes)
    await ensure_bucket(js, artifacts_bucket(tenant), replicas=replicas,
                        quota_bytes=quota_bytes)


def ensure_tenant_buckets_sync(url: str, tenants: list[str], *, replicas: int = 1,
                               quota_bytes: int | None = None) -> dict[str, tuple[int, int]]:
    """`ensure_tenant_buckets` for each tenant, over a connection of its own as the operator;
    each bucket's (bytes held, quota)."""
    from bus.connection import connect

    async def go() -> dict[str, tuple[int, int]]:
        nc = await connect(url, reconnect=False)
        out: dict[str, tuple[int, int]] = {}
        try:
            js = nc.jetstream()
            for t in tenants:
                await ensure_tenant_buckets(js, t, replicas=replicas, quota_bytes=quota_bytes)
                for b in (work_bucket(t), artifacts_bucket(t)):
                    info = await js.stream_info(stream_of(b))
                    out[b] = (int(info.state.bytes), int(info.config.max_bytes or -1))
        finally:
            await nc.close()
        return out

    return run_sync(go(), timeout=30)


class FileStore:
    """The file buckets over one connection; every call is synchronous, run on the
    connection's own loop by `run(coroutine, timeout)`."""

    def __init__(self, nc: Any, run: Callable[[Coroutine[Any, Any, Any], float], Any]) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._run = run

    def _call(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        try:
            return self._run(coro, timeout)
        except (ObjectMissing, BucketMissing, BucketQuotaExceeded, DigestMismatch):
            raise
        except Exception as e:
            err = translate(e)
            if err is e:
                raise
            raise err from e

    # -- metadata ---------------------------------------------------------------------------

    async def _info(self, bucket: str, name: str) -> StoredObject | None:
        try:
            msg = await self._js.get_msg(stream_of(bucket), subject=_meta_subject(bucket, name),
                                         direct=True)
        except NotFoundError:
            return None
        except NoRespondersError as e:  # a stream that is not there answers no direct get
            raise BucketMissing(f"no bucket {bucket}") from e
        info = ObjectInfo.from_response(json.loads(msg.data or b"{}"))
        return None if info.deleted else _stored(info)

    def info(self, bucket: str, name: str, *, timeout: float = 10.0) -> StoredObject | None:
        """The object's metadata, or None when the bucket holds no object of that name."""
        return self._call(self._info(bucket, name), timeout)  # type: ignore[no-any-return]

    def list(self, bucket: str, prefix: str = "", *, timeout: float = 30.0) -> list[StoredObject]:
        """The objects whose names start with `prefix`, in the order they were stored."""

        async def go() -> list[StoredObject]:
            out: list[StoredObject] = []
            seq = 1
            while True:
                try:
                    msg = await self._js.get_msg(stream_of(bucket), seq=seq,
                                                 subject=f"$O.{bucket}.M.>", direct=True,
                                                 next=True)
                except NotFoundError:
                    return out
                except NoRespondersError as e:
                    raise BucketMissing(f"no bucket {bucket}") from e
                info = ObjectInfo.from_response(json.loads(msg.data or b"{}"))
                if not info.deleted and info.name.startswith(prefix):
                    out.append(_stored(info))
                seq = int(msg.seq or seq) + 1

        return self._call(go(), timeout)  # type: ignore[no-any-return]

    def delete(self, bucket: str, name: str, *, timeout: float = 10.0) -> bool:
        """Remove the object `name`, its chunks and its metadata (a purge: this user's
        bucket only); False when there was none."""
        stream = stream_of(bucket)

        async def go() -> bool:
            try:
                msg = await self._js.get_msg(stream, subject=_meta_subject(bucket, name),
                                             direct=True)
            except NotFoundError:
                return False
            except NoRespondersError as e:
                raise BucketMissing(f"no bucket {bucket}") from e
            nuid = ObjectInfo.from_response(json.loads(msg.data or b"{}")).nuid
            await self._js.purge_stream(stream, subject=f"$O.{bucket}.C.{nuid}")
            await self._js.purge_stream(stream, subject=_meta_subject(bucket, name))
            return True

        return self._call(go(), timeout)  # type: ignore[no-any-return]

    # -- bytes ------------------------------------------------------------------------------

    async def _direct_batch(self, stream: str, subject: str, seq: int,
                            n: int) -> builtins.list[tuple[bytes, int]]:
        """Up to `n` messages on `subject` from `seq` on, as (data, seq), in one batched direct
        get (nats-server >= 2.11): one round trip, where a get per chunk waits for each."""
        inbox = self._nc.new_inbox()
        sub = await self._nc.subscribe(inbox)
        out: builtins.list[tuple[bytes, int]] = []
        try:
            await self._nc.publish(f"$JS.API.DIRECT.GET.{stream}", json.dumps(
                {"seq": seq, "next_by_subj": subject, "batch": n}).encode(), reply=inbox)
            while True:
                msg = await sub.next_msg(timeout=10)
                headers = msg.headers or {}
                status = headers.get(HDR_STATUS)
                if status == "204" or status == "404":  # end of the batch, or nothing
                    return out
                if status:
                    raise BucketMissing(f"stream {stream}: direct get answered {status}")
                out.append((msg.data or b"", int(headers[HDR_SEQUENCE])))
                if len(out) >= n and headers.get(HDR_NUM_PENDING) is None:
                    return out
        finally:
            await sub.unsubscribe()

    def put(self, bucket: str, name: str, source: Path, *, ttl_seconds: int | None = None,
            progress: Progress | None = None, timeout: float = 60.0) -> StoredObject:
        """Store the file `source` as `name` (replacing an object of that name); with
        `ttl_seconds`, every message of it expires then. A put that fails part-way leaves no
        object (its chunks are purged where the user may, else they expire with their TTL).
        The file is read on the caller's thread; `timeout` bounds each chunk's store."""
        nuid = secrets.token_hex(11)
        stream = stream_of(bucket)
        chunk_subject = f"$O.{bucket}.C.{nuid}"
        headers = {HDR_TTL: f"{int(ttl_seconds)}s"} if ttl_seconds else None
        h = hashlib.sha256()
        size = chunks = 0

        async def publish(subject: str, data: bytes, hdrs: dict[str, str] | None) -> None:
            try:
                await self._js.publish(subject, data, stream=stream, headers=hdrs)
            except (NotFoundError, NoStreamResponseError, NoRespondersError) as e:
                raise BucketMissing(f"no bucket {bucket}") from e
            except APIError as e:  # nats-py calls a full stream "unavailable" (503)
                if e.err_code != _MAX_BYTES_EXCEEDED:
                    raise
                raise await self._over_quota(bucket, source.stat().st_size) from e

        async def purge() -> None:
            try:
                await self._js.purge_stream(stream, subject=chunk_subject)
            except Exception as e:  # noqa: BLE001 - not this user's to purge: its TTL ends it
                log.info("chunks of a failed put to %s left to expire: %r", bucket, e)

        self._call(self._room_for(bucket, source.stat().st_size), timeout)
        try:
            with open(source, "rb") as f:
                while data := f.read(CHUNK_BYTES):
                    h.update(data)
                    self._call(publish(chunk_subject, data, headers), timeout)
                    size += len(data)
                    chunks += 1
                    if progress is not None:
                        progress(size)
            info = ObjectInfo(
                name=name, bucket=bucket, nuid=nuid, size=size, chunks=chunks,
                mtime=datetime.now(UTC).isoformat(),
                digest=_DIGEST_PREFIX + base64.urlsafe_b64encode(h.digest()).decode(),
                options=ObjectMetaOptions(max_chunk_size=CHUNK_BYTES))
            self._call(publish(_meta_subject(bucket, name), json.dumps(info.as_dict()).encode(),
                               {HDR_ROLLUP: "sub", **(headers or {})}), timeout)
        except BaseException:
            if chunks:
                with contextlib.suppress(Exception):
                    self._call(purge(), timeout)
            raise
        return StoredObject(name=name, size_bytes=size, sha256=h.hexdigest(), chunks=chunks,
                            mtime=info.mtime or "")

    async def usage(self, bucket: str) -> tuple[int, int]:
        """The bytes `bucket` holds and its quota (-1: none)."""
        try:
            info = await self._js.stream_info(stream_of(bucket))
        except (NotFoundError, NoRespondersError) as e:
            raise BucketMissing(f"no bucket {bucket}") from e
        return int(info.state.bytes), int(info.config.max_bytes or -1)

    async def _over_quota(self, bucket: str, size: int) -> BucketQuotaExceeded:
        used, quota = await self.usage(bucket)
        return BucketQuotaExceeded(
            f"bucket {bucket} holds {used} bytes of its {quota}-byte quota "
            f"(bucket_quota_bytes); an object of {size} bytes does not fit")

    async def _room_for(self, bucket: str, size: int) -> None:
        """BucketQuotaExceeded before a byte is sent when `size` would not fit: a put refused
        part-way leaves chunks its writer may not purge (a node's expire with their TTL)."""
        used, quota = await self.usage(bucket)
        need = size + (size // CHUNK_BYTES + 2) * _MESSAGE_OVERHEAD
        if quota > 0 and used + need > quota:
            raise await self._over_quota(bucket, size)

    def check_room(self, bucket: str, size: int, *, timeout: float = 10.0) -> None:
        """BucketQuotaExceeded when an object of `size` bytes would not fit in `bucket`."""
        self._call(self._room_for(bucket, size), timeout)

    def get(self, bucket: str, name: str, dest: Path, *, progress: Progress | None = None,
            timeout: float = 60.0) -> StoredObject:
        """Write the object `name` to `dest` (put in place only once every byte is in and
        hashes to the object's recorded SHA-256); raises ObjectMissing or DigestMismatch. The
        file is written on the caller's thread; `timeout` bounds each chunk's fetch."""
        stream = stream_of(bucket)

        async def meta() -> tuple[StoredObject | None, str]:
            found = await self._info(bucket, name)
            if found is None:
                return None, ""
            msg = await self._js.get_msg(stream, subject=_meta_subject(bucket, name),
                                         direct=True)
            return found, str(ObjectInfo.from_response(json.loads(msg.data or b"{}")).nuid)

        async def chunks(subject: str, seq: int, n: int) -> builtins.list[tuple[bytes, int]]:
            got = await self._direct_batch(stream, subject, seq, n)
            if not got:
                raise ObjectMissing(f"object {name!r} in bucket {bucket} lost chunks "
                                    "(expired or purged)")
            return got

        found: StoredObject | None
        found, nuid = self._call(meta(), timeout)
        if found is None:
            raise ObjectMissing(f"no object {name!r} in bucket {bucket}")
        subject = f"$O.{bucket}.C.{nuid}"
        h = hashlib.sha256()
        got = 0
        tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.part")
        try:
            with open(tmp, "wb") as out:
                seq, left = 1, found.chunks
                while left > 0:  # a batch of chunks per round trip, not one
                    batch = self._call(chunks(subject, seq, min(left, BATCH_CHUNKS)), timeout)
                    for data, at in batch[:left]:
                        h.update(data)
                        out.write(data)
                        got += len(data)
                        seq = at + 1
                    left -= len(batch)
                    if progress is not None:
                        progress(got)
            if got != found.size_bytes or h.hexdigest() != found.sha256:
                raise DigestMismatch(f"object {name!r} in bucket {bucket}: {got} bytes hashing "
                                     f"to {h.hexdigest()}, recorded as {found.size_bytes} "
                                     f"bytes, {found.sha256}")
            tmp.replace(dest)
        finally:
            tmp.unlink(missing_ok=True)
        return found
