"""The application's repository: the library's, with a cached aggregate copied under its lock."""

from __future__ import annotations

import datetime
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from uuid import UUID

from eventsourcing.application import AggregateNotFoundError, Repository, project_aggregate
from eventsourcing.persistence import StoredEvent

from domain.copies import copy_aggregate, share_values
from domain.fold import mutate

share_values(datetime.datetime)  # the aggregates' created_on and modified_on


class PoolRepository(Repository[UUID]):
    """The library's Repository, except that a cached aggregate is fast-forwarded and copied
    under the same per-aggregate lock. The library copies it after letting go of the lock, so
    a command copying it while another thread fast-forwarded the same object in place failed
    with "dictionary changed size during iteration". The cached aggregate is brought up to date
    by the lean fold of its new events (domain.fold) and copied by domain.copies, not deeply."""

    def get(self, aggregate_id: UUID, *, version: int | None = None,
            projector_func: Any = project_aggregate, fastforward_skipping: bool = False,
            deepcopy_from_cache: bool = True) -> Any:
        if (self.cache is None or version is not None or not self.fastforward
                or fastforward_skipping or self.fastforward_skipping):
            return super().get(aggregate_id, version=version, projector_func=projector_func,
                               fastforward_skipping=fastforward_skipping,
                               deepcopy_from_cache=deepcopy_from_cache)
        copy = deepcopy_from_cache and self.deepcopy_from_cache
        lock = self._use_fastforward_lock(aggregate_id)
        try:
            with lock:
                try:
                    aggregate = self.cache.get(aggregate_id)
                except KeyError:
                    aggregate = self._reconstruct_aggregate(aggregate_id, None, projector_func)
                    self.cache.put(aggregate_id, aggregate)
                else:
                    new_events = self.event_store.get(originator_id=aggregate_id,
                                                      gt=aggregate.version)
                    if projector_func is project_aggregate:
                        for new_event in new_events:
                            aggregate = mutate(new_event, aggregate)  # type: ignore[arg-type]
                    else:
                        aggregate = projector_func(aggregate, new_events)
                    if aggregate is None:
                        raise AggregateNotFoundError(aggregate_id)
                return copy_aggregate(aggregate) if copy else aggregate
        finally:
            self._disuse_fastforward_lock(aggregate_id)

    async def get_on_loop(
        self, aggregate_id: UUID,
        select: Callable[[UUID, int], Awaitable[Sequence[StoredEvent]]],
    ) -> tuple[bool, Any]:
        """`get` for a caller on the bus's loop, the new events read by awaiting `select`:
        (True, a copy of the aggregate), or (False, None) when only a thread can read it (it is
        not cached, or a thread is bringing it up to date: the lock is never waited for here).
        The cached aggregate is brought up to date as `get` does."""
        if self.cache is None or not self.fastforward or self.fastforward_skipping:
            return False, None
        lock = self._use_fastforward_lock(aggregate_id)
        try:
            if not lock.acquire(blocking=False):
                return False, None
            try:
                try:
                    aggregate = self.cache.get(aggregate_id)
                except KeyError:
                    return False, None
                to_event = self.event_store.mapper.to_domain_event
                for stored in await select(aggregate_id, aggregate.version):
                    aggregate = mutate(to_event(stored), aggregate)  # type: ignore[arg-type]
                    if aggregate is None:  # discarded: as `get`, which a thread runs
                        return False, None
                return True, copy_aggregate(aggregate)
            finally:
                lock.release()
        finally:
            self._disuse_fastforward_lock(aggregate_id)
