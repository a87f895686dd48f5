"""The projector process: keeps the PostgreSQL views (projections/views/) up with the log.
A batch and its position commit together, so a restart resumes there (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from control.application import PoolApp
from control.bootstrap import app_env
from projections.errors import PositionMoved
from projections.views import DEFAULT_BATCH, DEFAULT_SCHEMA, VIEWS, PoolViews

log = logging.getLogger(__name__)


# a catch-up at least this long ends with gc.freeze() (see run_forever)
FREEZE_AFTER_EVENTS = 20_000
# while behind (the last read came back full), batches of up to this many times batch_size:
# fewer rows per event to write (an account, node or lease touched again within the batch is
# written once) and fewer transactions (docs/performance-log.md)
CATCH_UP_FACTOR = 4

class Projector:
    """Folds the "pool" log into the views, batch by batch, until stopped."""

    def __init__(self, nats_url: str, database_url: str, *, schema: str = DEFAULT_SCHEMA,
                 batch_size: int = DEFAULT_BATCH, views: Sequence[str] = VIEWS,
                 poll_seconds: float = 0.1) -> None:
        self.nats_url = nats_url
        self.app = PoolApp(env=app_env(nats_url))
        self.views = PoolViews(self.app, database_url, schema=schema, views=views)
        self.batch_size = batch_size
        self.poll_seconds = poll_seconds
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.position = 0

    def step(self) -> int:
        """Apply at most one batch; returns the number of notifications fetched."""
        start = self.views.position() + 1
        batch = self.app.recorder.select_notifications(start, self.batch_size)
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
        recorder = self.app.recorder
        watch = getattr(recorder, "watch", None)
        unwatch = watch(self._wake.set) if watch is not None else None
        prefetch = getattr(recorder, "prefetch", None)
        ahead: tuple[int, Any] | None = None  # (start, the read of the batch from there)
        size = self.batch_size  # of the next read: larger while behind (CATCH_UP_FACTOR)
        folded = 0  # events applied since the last catch-up ended
        writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pool-projector-w")
        # the write in flight and the last id of its batch; the views' positions once it commits
        inflight: tuple[concurrent.futures.Future[int], int] | None = None
        pos: dict[str, tuple[int, int]] | None = None
        gc_was: bool | None = None  # whether the collector ran before this catch-up paused it

        def pause_gc() -> None:
            nonlocal gc_was
            if gc_was is None:
                gc_was = gc.isenabled()
                gc.disable()

        def resume_gc(freeze: bool = False) -> None:
            nonlocal gc_was
            if gc_was is not None:
                if freeze:
                    # what the catch-up built sits in the youngest generation, unscanned: moved
                    # out of the collector's sight first, or its next pass walks all of it
                    gc.freeze()
                if gc_was:
                    gc.enable()
                gc_was = None

        def settle() -> None:
            """Wait for the write in flight (its error raises here)."""
            nonlocal inflight
            if inflight is not None:
                fut, last = inflight
                inflight = None
                fut.result()
                self.position = last

        def reset() -> None:
            """After a failure: nothing in flight, no fold ahead of the committed views."""
            nonlocal ahead, pos
            try:
                settle()
            except Exception:  # its batch is read again from the positions
                log.debug("projector write failed", exc_info=True)
            ahead = None
            pos = None
            self.views.folder.clear()

        try:
            while not stop.is_set():
                # cleared before reading: an append from now on wakes the wait below
                self._wake.clear()
                try:
                    if pos is None:
                        settle()
                        pos = self.views.view_positions()
                    start = min((at for at, _ in pos.values()), default=0) + 1
                    if ahead is not None and ahead[0] == start:
                        batch = ahead[1].result()
                    else:
                        size = self.batch_size
                        batch = recorder.select_notifications(start, size)
                    ahead = None
                    behind = len(batch) >= size
                    size = self.batch_size * CATCH_UP_FACTOR if behind else self.batch_size
                    if behind:
                        pause_gc()
                    else:
                        resume_gc(freeze=folded >= FREEZE_AFTER_EVENTS)
                    if not batch:
                        settle()
                        self.position = start - 1
                        if folded >= FREEZE_AFTER_EVENTS:
                            # caught up after a long fold: what the views keep in memory lives
                            # on; move it out of the cyclic collector's sight, as the scheduler
                            # does, or every full collection re-walks it (docs/performance-log.md)
                            gc.freeze()
                        folded = 0
                        self._wake.wait(self.poll_seconds)
                        continue
                    if prefetch is not None and behind:
                        ahead = (batch[-1].id + 1, prefetch(batch[-1].id + 1, size))
                    prepared = self.views.prepare(batch, pos)  # while the previous one writes
                    settle()
                    inflight = (writer.submit(self.views.process, batch, read_from=start,
                                              prepared=prepared), batch[-1].id)
                    pos = prepared.after
                    folded += len(batch)
                except PositionMoved:
                    reset()
                except Exception:  # the bus or the database may be away; retry
                    log.exception("projector batch failed; retrying")
                    reset()
                    self.views.close()
                    stop.wait(1.0)
            try:
                settle()
            except Exception:  # stopping: the next run resumes from the views
                log.warning("projector's last write failed", exc_info=True)
        finally:
            writer.shutdown(wait=True)
            resume_gc()
            if unwatch is not None:
                unwatch()

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


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pool-projector")
    p.add_argument("--nats-url", required=True)
    p.add_argument("--database-url", required=True)
    p.add_argument("--schema", default=DEFAULT_SCHEMA)
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH)
    args = p.parse_args(argv)
    run(args.nats_url, args.database_url, args.schema, args.batch_size)
    return 0


def run(nats_url: str, database_url: str, schema: str, batch_size: int,
        announce: Any = None) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    proj = Projector(nats_url, database_url, schema=schema, batch_size=batch_size)
    if announce:
        announce(f"projecting {nats_url} into schema {schema}: Ctrl-C to stop")
    try:
        proj.run_forever(stop)
    finally:
        proj.stop()
        from bus.runtime import close_runtime

        close_runtime(nats_url)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
