"""The projector: keeps the PostgreSQL views (projections/views/) up with the log. A batch
and its position commit together, so a restart resumes there (docs/architecture.md).
"""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bus.recorders import log_recorder
from projections.errors import PositionMoved
from projections.views import DEFAULT_BATCH, DEFAULT_SCHEMA, VIEWS, PoolViews
from projections.views.retention import PRUNE_BATCH, history_max_age_from_env

if TYPE_CHECKING:
    from workers.application import PoolApp

log = logging.getLogger(__name__)


# a catch-up at least this long ends with gc.freeze() (see run_forever)
FREEZE_AFTER_EVENTS = 20_000
# while behind (the last read came back full), batches of up to this many times batch_size:
# fewer rows per event to write (an account, node or lease touched again within the batch is
# written once) and fewer transactions (docs/performance-log.md)
CATCH_UP_FACTOR = 4
# an idle projector prunes the views' past this often (at once again while a batch came back
# full): each time one small batch, so a write never waits long behind it
PRUNE_EVERY_S = 60.0

class Projector:
    """Folds the "pool" log into the views, batch by batch, until stopped."""

    def __init__(self, app: PoolApp, database_url: str, *, schema: str = DEFAULT_SCHEMA,
                 batch_size: int = DEFAULT_BATCH, views: Sequence[str] = VIEWS,
                 poll_seconds: float = 0.1,
                 history_max_age_s: float | None = None) -> None:
        # the application over the log it folds (its own: stop() closes it), made by the
        # composition root (workers/bootstrap.py)
        self.app = app
        self.recorder = log_recorder(app.recorder)  # bus.recorders
        if history_max_age_s is None:  # as `pool serve` and `pool up` run it
            history_max_age_s = history_max_age_from_env()
        self.views = PoolViews(self.app, database_url, schema=schema, views=views,
                               history_max_age_s=history_max_age_s)
        self._next_prune = 0.0  # monotonic time of the next prune while idle
        self.batch_size = batch_size
        self.poll_seconds = poll_seconds
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.position = 0

    def step(self) -> int:
        """Apply at most one batch; returns the number of notifications fetched."""
        start = self.views.position() + 1
        batch = self.recorder.select_notifications(start, self.batch_size)
        if batch:
            self.views.process(batch, read_from=start)
            self.position = batch[-1].id
        else:
            self.position = start - 1
        return len(batch)

    def run_forever(self, stop: threading.Event | None = None) -> None:
        """Apply batches until `stop`. The next batch is read while the current one is written,
        and an idle projector wakes when events are appended (polling only as a fallback).

        Two stages overlap: this thread folds a batch and builds its rows (PoolViews.prepare)
        while a writer thread writes the previous batch in its own transaction (which waits on
        PostgreSQL, not on the interpreter). A batch's transaction is sent only after the
        previous one committed, and only if the views are where the batch was built for, so
        each batch and its position still commit together, in log order; on any failure the
        in-memory fold is dropped and the loop starts again from the committed positions.

        While behind (a read came back full) the cyclic garbage collector is paused, as the
        rebuild and the audit pause it: the fold makes no reference cycles, and its collections
        cost ~8 us per event at 200k events (each batch's events and rows survive the young
        generations, and full passes re-walk the heap); once caught up it runs again, a long
        catch-up's state first frozen out of its sight (with it what cyclic garbage other
        threads left meanwhile: ~300 objects over a 200k-event catch-up here), so no
        collection pauses the projector for the whole heap right after."""
        stop = stop or self._stop
        self.views.setup()
        unwatch = self.recorder.watch(self._wake.set)
        stages = _Stages(self)
        try:
            while not stop.is_set():
                # cleared before reading: an append from now on wakes the wait below
                self._wake.clear()
                try:
                    progressed, more = stages.advance(), False
                    if not stages.behind and time.monotonic() >= self._next_prune:
                        # caught up (a steady trickle of events included): prune once due,
                        # the write in flight settled first (the connection is the writer's)
                        stages.settle()
                        more = self.prune_when_due()
                    if not progressed and not more:
                        self._wake.wait(self.poll_seconds)
                except PositionMoved:
                    stages.reset()
                except Exception:  # the bus or the database may be away; retry
                    log.exception("projector batch failed; retrying")
                    stages.reset()
                    self.views.close()
                    stop.wait(1.0)
            try:
                stages.settle()
            except Exception:  # stopping: the next run resumes from the views
                log.warning("projector's last write failed", exc_info=True)
        finally:
            stages.close()
            unwatch()

    def prune_when_due(self) -> bool:
        """Once caught up (no write in flight): one batch of the views' past past its
        retention pruned, when due; True if there is more (the caller comes straight back)."""
        if time.monotonic() < self._next_prune:
            return False
        more = self.views.prune_history(time.time()) >= PRUNE_BATCH
        self._next_prune = 0.0 if more else time.monotonic() + PRUNE_EVERY_S
        return more

    def wait_until(self, notification_id: int, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.position >= notification_id:
                return True
            time.sleep(0.02)
        return False

    def start(self) -> Projector:
        self._thread = threading.Thread(target=self.run_forever, name="pool-projector",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10)
        self.views.close()
        self.app.close()


class _Stages:
    """One run of `Projector.run_forever`'s two overlapping stages: the read and fold of the
    next batch on the caller's thread, the write of the previous one on a writer thread."""

    def __init__(self, projector: Projector) -> None:
        self.projector = projector
        self.views = projector.views
        self.recorder = projector.recorder
        self.prefetch = self.recorder.prefetch if self.recorder.reads_ahead else None
        self.ahead: tuple[int, Any] | None = None  # (start, the read of the batch from there)
        # of the next read: larger while behind (CATCH_UP_FACTOR)
        self.size = projector.batch_size
        self.folded = 0  # events applied since the last catch-up ended
        self.behind = False  # the last read came back full
        self.writer = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="pool-projector-w")
        # the write in flight and the last id of its batch; the views' positions once it commits
        self.inflight: tuple[concurrent.futures.Future[int], int] | None = None
        self.pos: dict[str, tuple[int, int]] | None = None
        # whether the collector ran before this catch-up paused it
        self.gc_was: bool | None = None

    def pause_gc(self) -> None:
        if self.gc_was is None:
            self.gc_was = gc.isenabled()
            gc.disable()

    def resume_gc(self, freeze: bool = False) -> None:
        if self.gc_was is not None:
            if freeze:
                # what the catch-up built sits in the youngest generation, unscanned: moved
                # out of the collector's sight first, or its next pass walks all of it
                gc.freeze()
            if self.gc_was:
                gc.enable()
            self.gc_was = None

    def settle(self) -> None:
        """Wait for the write in flight (its error raises here)."""
        if self.inflight is not None:
            fut, last = self.inflight
            self.inflight = None
            fut.result()
            self.projector.position = last

    def reset(self) -> None:
        """After a failure: nothing in flight, no fold ahead of the committed views."""
        try:
            self.settle()
        except Exception:  # its batch is read again from the positions
            log.debug("projector write failed", exc_info=True)
        self.ahead = None
        self.pos = None
        self.views.folder.clear()

    def advance(self) -> bool:
        """Read and fold the next batch and hand it to the writer; False when the log had
        nothing new (the caller waits for an append)."""
        batch_size = self.projector.batch_size
        if self.pos is None:
            self.settle()
            self.pos = self.views.view_positions()
        pos = self.pos
        start = min((at for at, _ in pos.values()), default=0) + 1
        if self.ahead is not None and self.ahead[0] == start:
            batch = self.ahead[1].result()
        else:
            self.size = batch_size
            batch = self.recorder.select_notifications(start, self.size)
        self.ahead = None
        behind = self.behind = len(batch) >= self.size
        self.size = batch_size * CATCH_UP_FACTOR if behind else batch_size
        if behind:
            self.pause_gc()
        else:
            self.resume_gc(freeze=self.folded >= FREEZE_AFTER_EVENTS)
        if not batch:
            self.settle()
            self.projector.position = start - 1
            if self.folded >= FREEZE_AFTER_EVENTS:
                # caught up after a long fold: what the views keep in memory lives on; move it
                # out of the cyclic collector's sight, as the scheduler does, or every full
                # collection re-walks it (docs/performance-log.md)
                gc.freeze()
            self.folded = 0
            return False
        if self.prefetch is not None and behind:
            self.ahead = (batch[-1].id + 1, self.prefetch(batch[-1].id + 1, self.size))
        prepared = self.views.prepare(batch, pos)  # while the previous one writes
        self.settle()
        self.inflight = (self.writer.submit(self.views.process, batch, read_from=start,
                                            prepared=prepared), batch[-1].id)
        self.pos = prepared.after
        self.folded += len(batch)
        return True

    def close(self) -> None:
        """Stop the writer thread (after its write) and give the collector back."""
        self.writer.shutdown(wait=True)
        self.resume_gc()
