"""The tenants' sealed job secrets in KV bucket `pool_secrets` (`<tenant>.<name>`, a few
versions kept): only the command role reads or writes it; what it holds is ciphertext."""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NoKeysError

from bus.errors import BusError
from bus.junk import junk_values
from bus.runtime import BusRuntime, get_runtime
from bus.streams import ensure_kv_bucket
from bus.subjects import SECRETS_BUCKET, token

# versions of one secret kept, so a job committed against a version gets that version even
# after the tenant set a newer one (an older one than this is refused `secret_unknown`)
SECRET_HISTORY = 8


class SecretRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One stored version of a secret: its name and version in clear, its value sealed."""

    name: str
    version: int
    key_id: str
    sealed: str  # base64 of nonce + AES-GCM ciphertext (workers.sealing)
    size_bytes: int
    updated_at: float


class SecretWriteConflict(BusError):
    """Another writer changed the secret between its read and this write."""

    code = "write_conflict"


async def ensure_secrets_bucket(js: Any, *, replicas: int = 1) -> None:
    """The operator's: `pool up` and `pool cluster init` make it."""
    await ensure_kv_bucket(js, SECRETS_BUCKET, replicas=replicas, history=SECRET_HISTORY)


def secret_key(tenant: str, name: str) -> str:
    return f"{token(tenant)}.{token(name)}"


def _record(entry: Any) -> SecretRecord | None:
    """The stored version in a KV entry; None (reported) when it is not one: a server's answer
    some client aimed at the key as its reply subject."""
    try:
        return msgspec.json.decode(entry.value, type=SecretRecord)
    except (msgspec.DecodeError, msgspec.ValidationError):
        junk_values().report(int(entry.revision or 0), f"$KV.{SECRETS_BUCKET}.{entry.key}")
        return None


async def _newest_kept(kv: Any, key: str) -> SecretRecord | None:
    """The newest real version among those the bucket keeps of `key`."""
    try:
        entries = await kv.history(key)
    except (KeyNotFoundError, NoKeysError):
        return None
    for entry in reversed(entries):
        record = _record(entry) if entry.value else None
        if record is not None:
            return record
    return None


class SecretStore:
    """A synchronous facade on a bus runtime over the secrets bucket."""

    def __init__(self, url: str, *, runtime: BusRuntime | None = None) -> None:
        self.rt = runtime or get_runtime(url)
        self._kv: Any = None

    async def _bucket(self) -> Any:
        if self._kv is None:
            js = await self.rt.jetstream()
            self._kv = await js.key_value(SECRETS_BUCKET)
        return self._kv

    def latest(self, tenant: str, name: str) -> tuple[SecretRecord, int] | None:
        """The secret's newest version and its KV revision, or None."""

        async def go() -> tuple[SecretRecord, int] | None:
            kv = await self._bucket()
            try:
                entry = await kv.get(secret_key(tenant, name))
            except KeyNotFoundError:
                return None
            if not entry.value:
                return None
            record = _record(entry)
            if record is None:  # junk over it: the newest version kept, the key's revision
                record = await _newest_kept(kv, secret_key(tenant, name))
            return (record, int(entry.revision)) if record is not None else None

        return self.rt.run(go())

    def version(self, tenant: str, name: str, version: int) -> SecretRecord | None:
        """The stored `version` of the secret (the newest or one of the few kept), or None."""
        found = self.latest(tenant, name)
        if found is None:
            return None
        if found[0].version == version:
            return found[0]

        async def go() -> SecretRecord | None:
            kv = await self._bucket()
            try:
                entries = await kv.history(secret_key(tenant, name))
            except (KeyNotFoundError, NoKeysError):
                return None
            for entry in entries:
                rec = _record(entry) if entry.value else None
                if rec is not None and rec.version == version:
                    return rec
            return None

        return self.rt.run(go())

    def put(self, tenant: str, record: SecretRecord, *, last_revision: int | None) -> None:
        """Store a version; `last_revision` None: only if the secret does not exist."""

        async def go() -> None:
            kv = await self._bucket()
            key = secret_key(tenant, record.name)
            data = msgspec.json.encode(record)
            try:
                if last_revision is None:
                    await kv.create(key, data)
                else:
                    await kv.update(key, data, last=last_revision)
            except KeyWrongLastSequenceError as e:
                raise SecretWriteConflict(f"secret {record.name!r} changed meanwhile") from e

        self.rt.run(go())

    def listing(self, tenant: str) -> list[SecretRecord]:
        """The tenant's secrets, newest version of each, by name."""

        async def go() -> list[SecretRecord]:
            kv = await self._bucket()
            watcher = await kv.watch(f"{token(tenant)}.*", ignore_deletes=True)
            out: list[SecretRecord] = []
            try:
                async for entry in watcher:
                    if entry is None:
                        break
                    if entry.value:
                        record = _record(entry) or await _newest_kept(kv, entry.key)
                        if record is not None:
                            out.append(record)
            finally:
                await watcher.stop()
            return sorted(out, key=lambda r: r.name)

        return self.rt.run(go(), timeout=30)

    def every(self) -> list[tuple[str, SecretRecord, int]]:
        """Every tenant's secrets, newest version of each: (tenant token, record, revision)."""

        async def go() -> list[tuple[str, SecretRecord, int]]:
            kv = await self._bucket()
            watcher = await kv.watch(">", ignore_deletes=True)
            out: list[tuple[str, SecretRecord, int]] = []
            try:
                async for entry in watcher:
                    if entry is None:
                        break
                    record = (_record(entry) or await _newest_kept(kv, entry.key)
                              if entry.value else None)
                    if record is not None:
                        out.append((str(entry.key).split(".", 1)[0], record,
                                    int(entry.revision)))
            finally:
                await watcher.stop()
            return out

        return self.rt.run(go(), timeout=120)

    def purge(self, tenant: str, name: str) -> bool:
        """Remove every kept version of the secret; False when there was none."""
        if self.latest(tenant, name) is None:
            return False

        async def go() -> None:
            kv = await self._bucket()
            with contextlib.suppress(KeyNotFoundError):
                await kv.purge(secret_key(tenant, name))

        self.rt.run(go())
        return True


__all__ = ["SECRET_HISTORY", "SecretRecord", "SecretStore", "SecretWriteConflict",
           "ensure_secrets_bucket", "secret_key"]
