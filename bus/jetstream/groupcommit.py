"""Group commit: concurrent saves of one recorder share an atomic batch, each with its answer.
How batches form and what a refused one fails: docs/adr/010-group-commit-of-commands.md.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from eventsourcing.persistence import IntegrityError, StoredEvent

from bus.jetstream.wire import MAX_BATCH

if TYPE_CHECKING:
    from bus.jetstream.saves import Saves


# a round of up to this many single-event saves goes out as plain publishes, one each; a
# larger one as an atomic batch, cheaper per save once there are many
EACH_AT_MOST = 16


@dataclass
class _Save:
    """One caller's save: its events, rendered messages and the future of its ids."""

    events: Sequence[StoredEvent]
    future: asyncio.Future[list[int]]
    messages: list[tuple[str, bytes, str]]
    subjects_of: list[str]
    by_subject: dict[str, StoredEvent]
    expects: dict[str, int] = field(default_factory=dict)


class GroupCommitter:
    """The queue of one recorder's saves and the one task that drains it."""

    def __init__(self, recorder: Saves) -> None:
        self.recorder = recorder
        self._queue: deque[_Save] = deque()
        self._draining = False
        # figures for tests and metrics: batches sent, saves they carried, refusals sorted out
        self.batches = 0
        self.saves = 0
        self.refused_batches = 0
        # rounds of single-event saves sent as plain publishes, and those refused among them
        self.rounds = 0
        self.refused_messages = 0

    async def insert(self, stored_events: Sequence[StoredEvent]) -> list[int]:
        """Queue the save and wait for its own answer: its notification ids, or its error."""
        messages, subjects_of, by_subject = self.recorder._render(stored_events)
        save = _Save(stored_events, asyncio.get_running_loop().create_future(), messages,
                     subjects_of, by_subject)
        self._queue.append(save)
        if not self._draining:
            self._draining = True
            asyncio.ensure_future(self._drain())
        return await save.future

    async def _drain(self) -> None:
        try:
            while self._queue:
                await self._commit(self._take())
        except BaseException as e:  # whoever still waits must hear of it
            for save in self._queue:
                _fail(save, e)
            self._queue.clear()
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            self._draining = False

    def _take(self) -> list[_Save]:
        """The next batch: queued saves in order while they fit; a save sharing a subject
        with one already taken waits for the next batch (its expectation would be stale)."""
        taken: list[_Save] = []
        later: list[_Save] = []
        used: set[str] = set()
        size = 0
        while self._queue:
            save = self._queue[0]
            if save.future.done():  # its caller gave up before it was sent
                self._queue.popleft()
                continue
            if taken and size + len(save.messages) > MAX_BATCH:
                break
            self._queue.popleft()
            if used.intersection(save.by_subject):
                later.append(save)
                continue
            used.update(save.by_subject)
            size += len(save.messages)
            taken.append(save)
        self._queue.extendleft(reversed(later))
        return taken

    async def _commit(self, taken: list[_Save]) -> None:
        rec = self.recorder
        everything: dict[str, StoredEvent] = {}
        for save in taken:
            everything.update(save.by_subject)
        await rec._look_up(list(everything), everything)
        ready: list[_Save] = []
        for save in taken:
            try:
                for s, first_event in save.by_subject.items():
                    if s not in rec._cache and first_event.originator_version != 1:
                        await rec._subject_state(s)
                save.expects = rec._expectations(save.by_subject)
            except Exception as e:  # noqa: BLE001 - that save's own answer
                _fail(save, e)
                continue
            ready.append(save)
        if not ready:
            return
        messages = [m for save in ready for m in save.messages]
        expects = {s: seq for save in ready for s, seq in save.expects.items()}
        if 1 < len(ready) <= EACH_AT_MOST and len(messages) == len(ready):
            await self._commit_each(ready, messages, expects)
            return
        self.batches += 1
        try:
            first = await rec._publish(messages, expects)
        except IntegrityError as e:
            self.refused_batches += 1
            await self._sort_out(ready, e)
            return
        except asyncio.CancelledError as e:
            for save in ready:
                _fail(save, e)
            raise
        except Exception as e:  # noqa: BLE001 - the batch's outcome is its saves' answer
            for save in ready:
                _fail(save, e)
            return
        self.saves += len(ready)
        for save in ready:
            ids = rec._remember_saved(save.subjects_of, save.events, first)
            first += len(save.events)
            if not save.future.done():
                save.future.set_result(ids)

    async def _commit_each(self, ready: list[_Save], messages: list[tuple[str, bytes, str]],
                           expects: dict[str, int]) -> None:
        """Saves of one event each, on distinct subjects: a plain publish each, all in flight
        together, rather than an atomic batch, which costs the server far more than the
        messages it carries. Each message is atomic alone and answers its own save."""
        rec = self.recorder
        self.rounds += 1
        try:
            results = await rec._publish_each(messages, expects)
        except asyncio.CancelledError as e:
            for save in ready:
                _fail(save, e)
            raise
        except Exception as e:  # noqa: BLE001 - nothing was sent: every save's answer
            for save in ready:
                _fail(save, e)
            return
        for save, got in zip(ready, results, strict=True):
            if isinstance(got, BaseException):
                self.refused_messages += isinstance(got, IntegrityError)
                _fail(save, got)
                continue
            self.saves += 1
            ids = rec._remember_saved(save.subjects_of, save.events, got)
            if not save.future.done():
                save.future.set_result(ids)

    async def _sort_out(self, ready: list[_Save], refusal: IntegrityError) -> None:
        """A batch was refused for a stale expectation: nothing of it was written. Each save
        whose expectation no longer matches the subject's end is refused; the others are
        queued again, first, in their order."""
        if len(ready) == 1:
            _fail(ready[0], refusal)
            return
        rec = self.recorder
        subjects = {s for save in ready for s in save.expects}
        for s in subjects:
            rec._cache.pop(s, None)
        await asyncio.gather(*(rec._subject_state(s) for s in subjects))
        stale = [save for save in ready
                 if any(rec._cache[s].last_seq != seq for s, seq in save.expects.items()
                        if s in rec._cache)]
        # a subject only moves forward, so a refused batch has a stale save; if none shows,
        # whatever refused it is not known here: each caller hears of it and may retry
        for save in stale or ready:
            _fail(save, IntegrityError(f"concurrent write detected: {refusal}"))
        again = [save for save in ready if save not in stale] if stale else []
        self._queue.extendleft(reversed(again))


def _fail(save: _Save, error: BaseException) -> None:
    if not save.future.done():
        save.future.set_exception(error)
