"""Checkpoints of the scheduler's and the dispatcher's folds: written at a log position and,
at start-up, read back and verified so that only the events after it are folded
(docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import copyreg
import gc
import hashlib
import hmac
import inspect
import io
import json
import logging
import pickle
import sys
import threading
import time
import types
import uuid
import zlib
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

from workers.pending import QueuedLease

log = logging.getLogger(__name__)

FORMAT = 1
# a checkpoint is due once this many events were folded since the last, or this many seconds
# passed with at least one; it is taken when a cycle found nothing to do, or at the end of a
# busy cycle once it has waited BUSY_LIMIT_SECONDS for such a moment
EVERY_EVENTS = 100_000
EVERY_SECONDS = 120.0
BUSY_LIMIT_SECONDS = 600.0
# and never sooner than this many times the last one held the scheduler's lock
PAUSE_SHARE = 100
# the scheduler's attributes that are not its fold: connections, threads, settings given by
# whoever made it, the batch being built; everything else in the scheduler is checkpointed
TRANSIENT = frozenset({
    "app", "recorder", "clock", "leads", "_lock", "_placing", "_inflight", "_decode",
    "_read_ahead", "_prefetch", "_read_timeout", "_holds", "_held", "_ends", "pages_read_ahead",
    "pages_read_ahead_unused", "checkpoints", "max_examined_per_cycle", "backfill",
    "max_preemption_plans_per_cycle", "_plans_left", "decisions",
})  # (the scheduler's fold, workers.scheduler.folding, has only some of them now)
# what a checkpoint may be made of, by module: the fold's own types and plain data
_MODULES = ("domain", "workers", "eventsourcing", "numpy", "collections", "datetime", "uuid",
            "decimal", "enum", "copyreg", "_codecs")
_BUILTINS = frozenset({"set", "frozenset", "dict", "list", "tuple", "bytes", "bytearray", "int",
                       "float", "str", "complex", "bool", "slice", "range", "object"})
_ROOT = Path(__file__).resolve().parents[2]
# the code whose objects a checkpoint holds or whose fold made them: any change to it makes
# older checkpoints foreign
_SOURCES = ("domain", "workers/scheduler", "workers/pending.py", "workers/reservations.py",
            "workers/quotas.py", "workers/dispatcher.py", "workers/feed.py")


class Folded(Protocol):
    """What the checkpoint reads and writes: a fold of the log with its position (the
    scheduler, workers.scheduler.Scheduler, or its fold; the dispatcher,
    workers.dispatcher.Dispatcher): its state as a dict (None while it is in the middle of
    something), and that state put back (False: not taken, it said why)."""

    position: int
    app: Any

    def checkpoint_state(self) -> dict[str, Any] | None: ...

    def restore_checkpoint(self, state: dict[str, Any]) -> bool | None: ...


class Checkpointed(Folded, Protocol):
    """A fold whose checkpoint is taken (`Checkpointer.take`): under its `checkpoint_lock`,
    held from its state to its pickle, so that nothing changes the fold meanwhile."""

    @property
    def checkpoint_lock(self) -> contextlib.AbstractContextManager[Any]: ...


class Store(Protocol):
    def get(self) -> tuple[bytes, bytes] | None: ...

    def put(self, head: bytes, body: bytes) -> None: ...


def code_stamp() -> str:
    """A digest of the checkpoint format, the interpreter, the libraries whose objects it
    holds, and the source of the fold: a checkpoint from other code is never read."""
    h = hashlib.sha256(f"format {FORMAT}; python {sys.version}".encode())
    for dist in ("eventsourcing", "numpy"):
        try:
            h.update(f"{dist} {metadata.version(dist)}".encode())
        except metadata.PackageNotFoundError:
            h.update(dist.encode())
    for name in _SOURCES:
        path = _ROOT / name
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            h.update(str(f.relative_to(_ROOT)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _uuid(value: int) -> uuid.UUID:
    """A UUID from its integer, as UUID(int=…) makes it, without its checks (a checkpoint
    holds one per lease and aggregate: the library's own reduction doubled the pickling)."""
    u = object.__new__(uuid.UUID)
    object.__setattr__(u, "int", value)
    object.__setattr__(u, "is_safe", uuid.SafeUUID.unknown)
    return u


def _reduce_uuid(u: uuid.UUID) -> tuple[Any, ...]:
    return _uuid, (u.int,)


def _reduce_queued(q: QueuedLease) -> tuple[Any, ...]:
    """A compact queued lease by its constructor's arguments, not its slots' state."""
    return QueuedLease, (q.id, q.requested, q.created_on, q.queued_on, q.queued_at, q.end)


_DISPATCH: dict[type, Callable[[Any], Any]] = {
    **copyreg.dispatch_table, uuid.UUID: _reduce_uuid, QueuedLease: _reduce_queued}


class _Bound:
    """A method of the scheduler that its pools hold (a backfill's `ends`), by name: bound
    again to the scheduler that restores the checkpoint."""

    def __init__(self, name: str) -> None:
        self.name = name


def _parts(s: Any) -> list[Any]:
    """The objects a pool's state is made of (PoolState's fields)."""
    return [part for ps in s.pools.values() for part in vars(ps).values()
            if hasattr(part, "__dict__")]


def _bound_methods(s: Any) -> list[tuple[Any, str, str]]:
    """(object, attribute, method name) for each method its pools' parts hold that `s`
    answers by that name (its own, or its fold's)."""
    return [(part, attr, value.__name__) for part in _parts(s)
            for attr, value in vars(part).items()
            if inspect.ismethod(value) and getattr(s, value.__name__, None) == value]


def rebind(s: Any) -> None:
    """The methods a restored checkpoint's pools held, bound again to `s` by name."""
    for part in _parts(s):
        for attr, value in list(vars(part).items()):
            if isinstance(value, _Bound):
                setattr(part, attr, getattr(s, value.name))


def _unpicklable(state: dict[str, Any]) -> str:
    """The attributes of `state` that do not pickle, by name."""
    bad = []
    for name, value in state.items():
        try:
            pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - any failure names the attribute
            bad.append(name)
    return ", ".join(bad) or "state"


class _Unpickler(pickle.Unpickler):
    """Only the fold's own types and plain data: a verified checkpoint has nothing else, and
    anything else is refused even if a key leaked."""

    def find_class(self, module: str, name: str) -> Any:
        top = module.split(".", 1)[0]
        # a dotted name would reach through a module's imports (`workers.plane` + `os.system`)
        if "." not in name and ((module == "builtins" and name in _BUILTINS) or (
                module != "builtins" and top in _MODULES)):
            found = super().find_class(module, name)
            if not isinstance(found, types.ModuleType):
                return found
        raise pickle.UnpicklingError(f"a checkpoint may not hold {module}.{name}")


class Refused(Exception):
    """A checkpoint that is not used: why, in one line."""


class Checkpointer:
    """Writes the scheduler's fold to `store` now and then (`after_cycle`) and reads it back
    once, before the first catch-up (`restore`). `key` signs and verifies each checkpoint."""

    def __init__(self, store: Store, key: bytes, *,
                 every_events: int = EVERY_EVENTS, every_seconds: float = EVERY_SECONDS,
                 busy_limit_seconds: float = BUSY_LIMIT_SECONDS,
                 may_write: Callable[[], bool] = lambda: True,
                 purpose: str = "scheduler") -> None:
        self.store = store
        self.purpose = purpose  # whose fold: in the log lines and in what the MAC signs
        self.key = key
        self.every_events = every_events
        self.every_seconds = every_seconds
        self.busy_limit_seconds = busy_limit_seconds
        self.may_write = may_write
        self.stamp = code_stamp()
        self.tried = False  # restore is attempted once, at the first catch-up
        self.restored_at: int | None = None  # the position a start-up continued from
        self.written = 0  # checkpoints stored by this process
        self.last_position = 0  # of the last checkpoint taken or restored
        self._last_at = time.monotonic()
        self._writer: threading.Thread | None = None
        self.last_pause_seconds = 0.0  # the scheduler's lock held to take the last one
        self.last_bytes = 0

    # -- reading -------------------------------------------------------------------------------

    def restore(self, s: Folded) -> bool:
        """Put the stored checkpoint's fold into `s` (one that has folded nothing yet), if it
        verifies; else leave `s` as it is for a full replay, saying why in one log line."""
        if self.tried or s.position:
            return False
        self.tried = True
        t0 = time.perf_counter()
        try:
            state = self.load(s.app)
        except Refused as e:
            log.warning("%s checkpoint not used, replaying the log from the start: %s",
                        self.purpose, e)
            return False
        except Exception as e:  # noqa: BLE001 - a bus or decoding failure: replay instead
            log.warning("%s checkpoint not read (%r), replaying the log from the start",
                        self.purpose, e)
            return False
        if state is None:
            log.info("no %s checkpoint: replaying the log from the start", self.purpose)
            return False
        if s.restore_checkpoint(state) is False:
            return False  # it said why
        # the fold is long-lived: out of the cyclic collector's sight, as after a replay
        gc.freeze()
        self.restored_at = self.last_position = s.position
        self._last_at = time.monotonic()
        log.info("%s checkpoint at log position %d restored in %.1f s", self.purpose,
                 s.position, time.perf_counter() - t0)
        return True

    def load(self, app: Any) -> dict[str, Any] | None:
        """The verified fold of the stored checkpoint (None: there is none); Refused when it
        fails verification, is from other code, or lies beyond the log this app reads."""
        got = self.store.get()
        if got is None:
            return None
        raw_head, body = got
        try:
            head = json.loads(raw_head)
            mac = bytes.fromhex(head.pop("mac"))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise Refused("its head is not readable") from e
        if not hmac.compare_digest(mac, self._mac(head, body)):
            raise Refused("its signature does not verify (another key, or altered)")
        if head.get("format") != FORMAT or head.get("code") != self.stamp:
            raise Refused("it was written by other code")
        position = int(head["position"])
        at = head.get("at")
        if position < 1 or at is None or self._at(app, position) != at:
            raise Refused(f"the log no longer holds its position {position} as it was "
                          "(truncated or reset)")
        collecting = gc.isenabled()
        gc.disable()  # millions of containers, none garbage: no collection while they arrive
        try:
            state = _Unpickler(io.BytesIO(zlib.decompress(body))).load()
        finally:
            if collecting:
                gc.enable()
        if not isinstance(state, dict) or state.get("position") != position:
            raise Refused("its body does not match its head")
        return state

    # -- writing -------------------------------------------------------------------------------

    def due(self, s: Folded, *, idle: bool) -> bool:
        """Whether `after_cycle` would take a checkpoint now (if it may write): a run loop
        settles its batch in flight first, as `take` takes none while one is."""
        if self._writer is not None and self._writer.is_alive():
            return False
        events = s.position - self.last_position
        waited = time.monotonic() - self._last_at
        if events <= 0 or (events < self.every_events and waited < self.every_seconds):
            return False
        if waited < PAUSE_SHARE * self.last_pause_seconds:
            return False  # a deep fold pauses placing for long: at most 1/PAUSE_SHARE of the time
        return idle or waited >= self.busy_limit_seconds

    def after_cycle(self, s: Checkpointed, *, idle: bool) -> bool:
        """Take a checkpoint if one is due: at an idle moment, or past the busy limit. The
        fold is pickled under the scheduler's lock (that is the copy); compressing, signing
        and storing happen on a thread of their own. True when one was taken."""
        if not self.due(s, idle=idle) or not self.may_write():
            return False
        try:
            taken = self.take(s)
        except Exception:  # the scheduler goes on; the next one is due later
            self._last_at = time.monotonic()
            log.exception("%s checkpoint not taken", self.purpose)
            return False
        if taken is None:
            return False
        position, data = taken
        self._writer = threading.Thread(target=self._write, args=(s.app, position, data),
                                        name=f"{self.purpose}-checkpoint", daemon=True)
        self._writer.start()
        return True

    def take(self, s: Checkpointed) -> tuple[int, bytes] | None:
        """(position, pickled fold) now, or None while a batch is in flight or being built."""
        t0 = time.perf_counter()
        with s.checkpoint_lock:
            state = s.checkpoint_state() if s.position else None
            if state is None:
                return None
            bound = _bound_methods(s)
            try:
                for part, attr, name in bound:
                    setattr(part, attr, _Bound(name))
                buffer = io.BytesIO()
                pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
                pickler.dispatch_table = _DISPATCH
                pickler.dump(state)
                data = buffer.getvalue()
            except (TypeError, AttributeError, pickle.PicklingError) as e:
                raise TypeError(f"the {self.purpose}'s {_unpicklable(state)} cannot be "
                                f"checkpointed: {e}") from e
            finally:
                for part, attr, name in bound:
                    setattr(part, attr, getattr(s, name))
            position = s.position
        self.last_pause_seconds = time.perf_counter() - t0
        self.last_position = position
        self._last_at = time.monotonic()
        return position, data

    def write_now(self, s: Checkpointed) -> bool:
        """Take and store a checkpoint at once, in this thread (tests, tools)."""
        taken = self.take(s)
        if taken is None:
            return False
        self._write(s.app, *taken)
        return True

    def wait(self, timeout: float | None = None) -> None:
        """Until the checkpoint being stored, if any, is stored (or failed)."""
        if self._writer is not None:
            self._writer.join(timeout)

    def _write(self, app: Any, position: int, data: bytes) -> None:
        try:
            at = self._at(app, position)
            if at is None:
                log.warning("%s checkpoint at log position %d not stored: the log does "
                            "not show that position", self.purpose, position)
                return
            body = zlib.compress(data, 1)
            head: dict[str, Any] = {"format": FORMAT, "code": self.stamp, "position": position,
                                    "at": at, "bytes": len(body), "written_at": time.time()}
            head["mac"] = self._mac(head, body).hex()
            self.store.put(json.dumps(head, sort_keys=True).encode(), body)
            self.written += 1
            self.last_bytes = len(body)
            log.info("%s checkpoint at log position %d stored (%d bytes)", self.purpose,
                     position, len(body))
        except Exception:
            log.exception("%s checkpoint at log position %d not stored", self.purpose, position)

    def _mac(self, head: dict[str, Any], body: bytes) -> bytes:
        signed = json.dumps({k: v for k, v in head.items() if k != "mac"}, sort_keys=True)
        h = hmac.new(self.key, f"computepool {self.purpose} checkpoint\0".encode(),
                     hashlib.sha256)
        h.update(signed.encode())
        h.update(b"\0")
        h.update(body)
        return h.digest()

    @staticmethod
    def _at(app: Any, position: int) -> list[Any] | None:
        """What the log holds at `position`: its notification id, aggregate and version (the
        same log again, not one reset and grown past it)."""
        got = app.recorder.select_notifications(start=position, limit=1)
        if not got or got[0].id != position:
            return None
        n = got[0]
        return [n.id, str(n.originator_id), n.originator_version]
