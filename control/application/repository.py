"""The application's repository: the library's, with a cached aggregate copied under its lock."""

from __future__ import annotations

from copy import deepcopy
from typing import Any
from uuid import UUID

from eventsourcing.application import AggregateNotFoundError, Repository, project_aggregate


class PoolRepository(Repository[UUID]):
    """The library's Repository, except that a cached aggregate is fast-forwarded and copied
    under the same per-aggregate lock. The library copies it after letting go of the lock, so
    a command copying it while another thread fast-forwarded the same object in place failed
    with "dictionary changed size during iteration"."""

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
                    aggregate = projector_func(aggregate, new_events)
                    if aggregate is None:
                        raise AggregateNotFoundError(aggregate_id)
                return deepcopy(aggregate) if copy else aggregate
        finally:
            self._disuse_fastforward_lock(aggregate_id)
