"""Leader election on JetStream KV: one active holder (a scheduler) per name (a pool id).

How a lease is taken, renewed, fenced and lost: docs/adr/011-leader-election.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import nats.js.errors
from nats.js import api
from nats.js.kv import KeyValue

from bus.errors import BusError
from bus.junk import junk_values
from bus.runtime import BusRuntime, get_runtime

log = logging.getLogger(__name__)

DEFAULT_BUCKET = "pool_leaders"
DEFAULT_TTL_SECONDS = 3.0  # the control plane's election TTL (ControlPlane's leader_ttl_seconds)


async def ensure_leader_bucket(js: Any, *, replicas: int = 1, bucket: str = DEFAULT_BUCKET,
                               ttl_seconds: float = DEFAULT_TTL_SECONDS) -> None:
    """Create the leader bucket ahead of any election at `replicas` (a cluster's R3), with the
    control plane's TTL as its max_age (a longer election TTL would be refused: see above)."""
    from bus.streams import ensure_kv_bucket

    await ensure_kv_bucket(js, bucket, replicas=replicas, history=1, ttl_seconds=ttl_seconds)


class LeaderBucketMismatch(BusError):
    """The leader bucket exists with a TTL (max_age) shorter than this election's TTL."""

    code = "leader_bucket_mismatch"


def _record_ttl(value: bytes | None) -> float:
    """The TTL the holder declared in its record (it may be longer than ours); 0 if unreadable."""
    try:
        ttl = json.loads(value or b"{}").get("ttl")
        return float(ttl) if ttl else 0.0
    except (ValueError, TypeError, AttributeError):
        return 0.0


def _is_record(value: bytes | None) -> bool:
    """Whether `value` is a candidate's record (`_value`: one naming its holder), never a
    server's answer (a PubAck names a stream, an API answer its type, neither a holder)."""
    try:
        rec = json.loads(value or b"")
    except ValueError:
        return False
    return isinstance(rec, dict) and "holder" in rec


class LeaderElection:
    """One candidate (`holder_id`) in the election for `name`."""

    def __init__(
        self,
        runtime_or_url: BusRuntime | str,
        *,
        name: str,
        holder_id: str,
        ttl_seconds: float = 3.0,
        bucket: str = DEFAULT_BUCKET,
    ) -> None:
        if ttl_seconds <= 0:
            raise ValueError("ttl_seconds must be positive")
        self._rt = (
            get_runtime(runtime_or_url) if isinstance(runtime_or_url, str) else runtime_or_url
        )
        self.name = name
        self.holder_id = holder_id
        self.ttl = float(ttl_seconds)
        self.bucket = bucket
        self._kv: KeyValue | None = None
        self._alock: asyncio.Lock | None = None  # created on the loop; serialises KV operations
        # lease state (mutated only on the loop, under _alock)
        self._revision: int | None = None  # our latest accepted revision while leading
        self._epoch: int | None = None  # revision at acquisition
        self._deadline = 0.0  # monotonic; the lease is ours until then
        # standby's view of the current holder: (revision, first seen at monotonic)
        self._seen: tuple[int, float] | None = None
        # keeper
        self._keeper: threading.Thread | None = None
        self._stop = threading.Event()
        self._on_change: Callable[[bool], None] | None = None
        self._reported = False  # what on_change last said
        self._reported_epoch: int | None = None

    # -- state -------------------------------------------------------------------------------

    @property
    def renew_interval(self) -> float:
        return self.ttl / 3.0

    @property
    def is_leader(self) -> bool:
        return self._revision is not None and time.monotonic() < self._deadline

    @property
    def epoch(self) -> int | None:
        """The fencing token (KV revision at acquisition) while leading, else None."""
        return self._epoch if self.is_leader else None

    # -- sync API ----------------------------------------------------------------------------

    def try_acquire(self, timeout: float | None = None) -> bool:
        """Become leader if there is no live leader, or renew if we lead. True if we lead now.

        Raises BusUnavailable / BusTimeout if the server cannot be reached (our lease, if any,
        still runs out at its deadline).
        """
        return self._rt.run(self._try_acquire(), self._timeout(timeout))

    def release(self, timeout: float | None = None) -> bool:
        """Give the lease up (delete the key only if it is still ours). True if we deleted it."""
        return self._rt.run(self._release(), self._timeout(timeout))

    def current_leader(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The stored holder record ({'holder', 'epoch', 'revision', ...}) or None if vacant."""
        return self._rt.run(self._current(), self._timeout(timeout))

    def names_held(self, prefix: str, timeout: float | None = None) -> dict[str, int]:
        """Every name in this election's bucket that starts with `prefix` and has a holder
        record now (not released, not expired), with its record's revision: a holder that
        keeps renewing shows a new revision each time."""
        return self._rt.run(self._names_held(prefix), self._timeout(timeout))

    def start(self, on_change: Callable[[bool], None] | None = None) -> None:
        """Run the keeper: acquire when vacant, renew every ttl/3 while leading, step down on
        failure. `on_change(bool)` is called from the keeper thread on every transition."""
        if self._keeper is not None and self._keeper.is_alive():
            return
        self._on_change = on_change
        self._stop.clear()
        self._keeper = threading.Thread(
            target=self._keep, name=f"leader-keeper[{self.name}:{self.holder_id}]", daemon=True
        )
        self._keeper.start()

    def stop(self, release: bool = False) -> None:
        """Stop the keeper. Without `release`, the lease is simply left to expire (as on a crash);
        this process still stops claiming leadership at once."""
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(self.ttl + 5.0)
            self._keeper = None
        if release:
            try:
                self.release()
            except BusError as e:
                log.warning("leader release of %s failed: %s", self.name, e)
        else:
            self._revision = None
            self._epoch = None
        self._notify(False)

    # -- keeper ------------------------------------------------------------------------------

    def _timeout(self, timeout: float | None) -> float:
        return timeout if timeout is not None else self._call_timeout()

    def _call_timeout(self) -> float:
        # a call that outlives our lease is useless; give it until the deadline (with a floor)
        if self._revision is not None:
            return max(0.1, min(self.ttl, self._deadline - time.monotonic()))
        return max(5.0, self.ttl)  # a candidate may wait longer (first connect, bucket creation)

    def _keep(self) -> None:
        while not self._stop.is_set():
            try:
                self.try_acquire()
            except LeaderBucketMismatch as e:
                log.warning("leader keeper %s/%s: %s", self.name, self.holder_id, e)
            except BusError as e:
                log.debug("leader keeper %s/%s: %s", self.name, self.holder_id, e)
            except Exception:
                log.exception("leader keeper %s/%s failed", self.name, self.holder_id)
            if self._stop.is_set():
                break
            epoch = self.epoch
            if epoch is not None and self._reported and epoch != self._reported_epoch:
                self._notify(False)  # lost and re-won between two keeper rounds
            self._notify(epoch is not None)
            self._reported_epoch = epoch
            leading = epoch is not None
            wait = self.renew_interval
            if leading:  # wake at the deadline at the latest, to step down on time
                wait = min(wait, max(0.0, self._deadline - time.monotonic()))
            self._stop.wait(wait)

    def _notify(self, leading: bool) -> None:
        if leading == self._reported:
            return
        self._reported = leading
        cb = self._on_change
        if cb is not None:
            try:
                cb(leading)
            except Exception:
                log.exception("leader on_change callback failed")

    # -- loop side ---------------------------------------------------------------------------

    async def _bucket(self) -> KeyValue:
        if self._kv is not None:
            return self._kv
        js = await self._rt.jetstream()
        try:
            kv = await js.key_value(self.bucket)
        except nats.js.errors.BucketNotFoundError:
            try:
                kv = await js.create_key_value(
                    api.KeyValueConfig(bucket=self.bucket, history=1, ttl=self.ttl)
                )
            except nats.js.errors.BadRequestError:
                # created concurrently (possibly with another TTL): use what is there
                kv = await js.key_value(self.bucket)
        si = await js.stream_info(f"KV_{self.bucket}")
        max_age = si.config.max_age or 0.0
        if max_age and max_age + 1e-6 < self.ttl:
            raise LeaderBucketMismatch(
                f"bucket {self.bucket!r} expires keys after {max_age}s,"
                f" shorter than ttl {self.ttl}s"
            )
        self._kv = kv
        return kv

    def _lock(self) -> asyncio.Lock:
        if self._alock is None:
            self._alock = asyncio.Lock()
        return self._alock

    def _value(self, epoch: int | None) -> bytes:
        return json.dumps(
            {"holder": self.holder_id, "epoch": epoch, "ttl": self.ttl}, sort_keys=True
        ).encode()

    async def _try_acquire(self) -> bool:
        async with self._lock():
            kv = await self._bucket()
            if self._revision is not None:
                if time.monotonic() < self._deadline:
                    return await self._renew(kv)
                # lease lapsed locally (unreachable server): step down, compete afresh
                self._step_down("lease deadline passed")
            return await self._acquire(kv)

    async def _renew(self, kv: KeyValue) -> bool:
        assert self._revision is not None
        sent = time.monotonic()
        try:
            rev: int | None = await kv.update(self.name, self._value(self._epoch),
                                              last=self._revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            rev = await self._over_junk(kv)
        if rev is None:
            self._step_down("renewal CAS lost")
            return False
        self._revision = rev
        self._deadline = sent + self.ttl
        return True

    async def _over_junk(self, kv: KeyValue) -> int | None:
        """The new revision when the value over ours is no candidate's record but a server's
        answer some client aimed at the key (a reply subject is not permission-checked): it is
        counted and renewed over; None when a rival's record (or nothing) is there."""
        try:
            entry = await kv.get(self.name)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        if _is_record(entry.value):
            return None
        junk_values().report(entry.revision or 0, f"$KV.{self.bucket}.{self.name}")
        try:
            return await kv.update(self.name, self._value(self._epoch), last=entry.revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            return None

    async def _acquire(self, kv: KeyValue) -> bool:
        sent = time.monotonic()
        try:
            rev = await kv.create(self.name, self._value(None))
        except nats.js.errors.KeyWrongLastSequenceError:
            return await self._maybe_take_stale(kv)
        except nats.js.errors.KeyNotFoundError:
            return False  # a tombstone expired while create looked at it; retry next time
        return await self._won(kv, rev, sent)

    async def _maybe_take_stale(self, kv: KeyValue) -> bool:
        """Key exists: take it over only if its revision has not changed for a whole TTL."""
        try:
            entry = await kv.get(self.name)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            self._seen = None  # vanished meanwhile; the next attempt will create it
            return False
        rev = entry.revision or 0
        now = time.monotonic()
        if self._seen is None or self._seen[0] != rev:
            self._seen = (rev, now)
            return False
        if now - self._seen[1] < max(self.ttl, _record_ttl(entry.value)):
            return False
        sent = time.monotonic()
        try:
            new_rev = await kv.update(self.name, self._value(None), last=rev)
        except nats.js.errors.KeyWrongLastSequenceError:
            self._seen = None  # someone else moved first
            return False
        log.info("leader %s: took over stale lease rev %s as %s", self.name, rev, self.holder_id)
        return await self._won(kv, new_rev, sent)

    async def _won(self, kv: KeyValue, rev: int, sent: float) -> bool:
        self._revision = rev
        self._epoch = rev
        self._deadline = sent + self.ttl
        self._seen = None
        # record the epoch in the value too; a CAS like any renewal
        return await self._renew(kv)

    async def _release(self) -> bool:
        async with self._lock():
            rev = self._revision
            self._revision = None
            self._epoch = None
            if rev is None:
                return False
            kv = await self._bucket()
            try:
                await kv.delete(self.name, last=rev)
            except nats.js.errors.APIError as e:
                # kv.delete does not map a failed revision check to KeyWrongLastSequenceError
                if isinstance(e, nats.js.errors.KeyWrongLastSequenceError) or e.err_code in (
                    10071,
                    10164,
                ):
                    return False  # no longer ours: leave the new holder's key alone
                raise
            return True

    async def _names_held(self, prefix: str) -> dict[str, int]:
        kv = await self._bucket()
        try:
            keys = await kv.keys()
        except nats.js.errors.NoKeysError:
            return {}
        out: dict[str, int] = {}
        for key in keys:
            if not key.startswith(prefix):
                continue
            try:
                entry = await kv.get(key)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                continue  # gone between the listing and the read
            out[key] = entry.revision or 0
        return out

    async def _current(self) -> dict[str, Any] | None:
        kv = await self._bucket()
        try:
            entry = await kv.get(self.name)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        try:
            rec: dict[str, Any] = json.loads(entry.value or b"{}")
        except ValueError:
            rec = {}
        rec["revision"] = entry.revision
        return rec

    def _step_down(self, why: str) -> None:
        if self._revision is not None:
            log.warning("leader %s: %s steps down (%s)", self.name, self.holder_id, why)
        self._revision = None
        self._epoch = None
