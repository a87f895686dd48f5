"""What one recorder knows of its subjects: their names, each one's last (version, sequence) and
where a read after a snapshot starts, kept on the runtime's loop thread."""

from __future__ import annotations

import itertools
from uuid import UUID

from bus.headers import HDR_TRACKING_ID, HDR_VERSION
from bus.jetstream.wire import REQUEST_TIMEOUT, SubjectState, originator_token
from bus.runtime import BusRuntime
from bus.subjects import EVENTS_PREFIX, EVENTS_STREAM, event_subject, token, tracking_subject

# the subjects whose end one recorder remembers (for its writes' expectations), at most
SUBJECT_CACHE_MAX = 50_000
# where to start reading an aggregate after its snapshot, remembered for at most this many
SEEK_HINTS_MAX = 10_000


class SubjectCache:
    """State shared by the recorders: runtime, stream and the subject space of one recorder."""

    def __init__(
        self,
        runtime: BusRuntime,
        *,
        stream: str = EVENTS_STREAM,
        kind: str = "default",
        tracking_owner: str = "default",
        timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        self.runtime = runtime
        self.stream = stream
        # `kind` is the aggregate-type token: select_events gets only an id, so the type token must
        # be fixed per recorder (the application's name; snapshots have subjects of their own,
        # bus.jetstream.snapshots)
        self.kind = token(kind)
        self._subject_prefix = event_subject(self.kind, "x")[:-1]
        self.tracking_owner = token(tracking_owner)
        self.timeout = timeout
        # only touched on the runtime's loop thread, so it needs no lock; at most
        # SUBJECT_CACHE_MAX subjects (trim_cache)
        self._cache: dict[str, SubjectState] = {}
        # per subject this process wrote, the end its last save expected: still a true point
        # of the subject after that save landed or was refused, so the fast-forward of a copy
        # at that version reads only what came after it, not the subject from its start
        # (bounded with the cache, trim_cache)
        self._before: dict[str, SubjectState] = {}
        # a writer that follows the whole log (the scheduler) sets this: read-ahead pages then
        # record every subject's end they pass, as direct gets do, so its next write to an
        # aggregate it only read carries the right expectation without a look-up first
        self.remember_subjects_read = False
        # the stream's replica count, asked once; see `_replicated`
        self._replicas: int | None = None
        # the log messages this recorder has read (direct gets and batches), for tests and
        # benchmarks that check what a load costs
        self.messages_read = 0
        # a snapshot recorder: the recorder of the aggregates' events (same runtime), whose
        # subject ends it writes into each snapshot and tells where a load may start
        self.events: SubjectCache | None = None
        # per event subject (version, sequence) of the event a snapshot was read at (loop
        # thread only): a load for the events after that version starts after that sequence
        self._seek: dict[str, SubjectState] = {}
        # per subject (version, sequence) of the last event a read of it returned (loop thread):
        # what a snapshot of the aggregate just loaded is at, whatever was saved since
        self._last_read: dict[str, SubjectState] = {}


    # -- subjects ----------------------------------------------------------------------------

    def subject_for(self, originator_id: UUID | str) -> str:
        if type(originator_id) is UUID:
            # a UUID's text is already a token (lowercase hex and dashes): skip the re-checks
            return f"{self._subject_prefix}{originator_id}"
        return event_subject(self.kind, originator_token(originator_id))

    @property
    def events_filter(self) -> str:
        return f"{EVENTS_PREFIX}.{self.kind}.>"

    def tracking_subject_for(self, upstream: str) -> str:
        # per downstream owner and upstream name: processors sharing a stream never collide
        return tracking_subject(f"{self.tracking_owner}--{token(upstream)}")


    # -- what is remembered of them (loop thread) --------------------------------------------

    def _version_in(self, headers: dict[str, str]) -> int | None:
        """The version (or tracking id) a subject's last message records, for the next write's
        check; None: none this recorder counts."""
        v = headers.get(HDR_VERSION) or headers.get(HDR_TRACKING_ID)
        return int(v) if v is not None else None

    def seek_from(self, subject: str, version: int, seq: int) -> None:
        """Say that `subject`'s event at `version` is at log sequence `seq` (from a snapshot):
        the next read of its events after `version` starts there (loop thread)."""
        hints = self._seek
        hints[subject] = SubjectState(version, seq)
        if len(hints) > SEEK_HINTS_MAX:
            del hints[next(iter(hints))]


    def _remember(self, subject: str, state: SubjectState) -> None:
        cache = self._cache
        known = cache.get(subject)
        # a slower concurrent call must not move the cache backwards
        if known is None or state.last_seq >= known.last_seq:
            if known is not None:
                del cache[subject]  # to the end: trim_cache forgets the least recently used
            cache[subject] = state
            if known is None and len(cache) > SUBJECT_CACHE_MAX:
                self.trim_cache()

    def trim_cache(self) -> None:
        """Forget the least recently remembered quarter of the subjects: a forgotten subject
        is looked up again by its next write, as after a conflict, so the cache stays bounded
        however many aggregates the log holds."""
        for cache in (self._cache, self._before):
            keep = SUBJECT_CACHE_MAX * 3 // 4
            for subject in list(itertools.islice(cache, max(0, len(cache) - keep))):
                del cache[subject]

    def forget(self, originator_id: UUID | str) -> None:
        """Drop what this process remembers of an aggregate's subject (one it will not write
        again, e.g. an ended lease): a later write looks it up first. From any thread."""
        subject = self.subject_for(originator_id)

        def drop() -> None:
            self._cache.pop(subject, None)
            self._before.pop(subject, None)

        self.runtime.call_soon(drop)


    def remember_ends(self, ends: dict[UUID, tuple[int, int]]) -> None:
        """Remember where each aggregate's subject ends ((version, sequence) by id), as its
        reader learnt it, unless something later is known, as the most recently used: its next
        write then needs no look-up. A wrong end costs what a stale cache does, a refused save.
        From any thread; before a save submitted after this call."""
        known = {self.subject_for(oid): SubjectState(v, seq) for oid, (v, seq) in ends.items()}

        def learn() -> None:
            for subject, state in known.items():
                self._remember(subject, state)

        self.runtime.call_soon(learn)
