"""The feed publisher: turns the lease events the dispatcher folds into one record per lease state
change, and writes them to the tenants' feed (bus.feed) once, across restarts and rivals."""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from bus.feed import BATCH_MAX, FeedConflict, FeedWriter
from bus.subjects import feed_lease_prefix
from domain.dependency import WAITING_FOR_DEPENDENCY
from domain.lease import Lease, LeaseState
from schemas.feed import FeedRecord
from workers.pending import QueuedLease

log = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode
# what a reader is told about: a change of any of these is one record
_Seen = tuple[str, int | None, str | None, str | None, int] | tuple[
    str, int | None, str | None, str | None, int, int]


def _seen(lease: Lease) -> _Seen:
    if lease.attempts == 1:
        return (str(lease.state), lease.exit_code, lease.end_reason, lease.node_id, lease.epoch)
    return (str(lease.state), lease.exit_code, lease.end_reason, lease.node_id, lease.epoch,
            lease.attempts)


def _event_at(event: Any) -> float:
    """The domain's time of the event (the `now` it was decided at), else when it was
    recorded."""
    for name in ("at", "requested_at"):
        at = getattr(event, name, None)
        if isinstance(at, (int, float)):
            return float(at)
    return float(event.timestamp.timestamp())


class FeedPublisher:
    """Fed every lease event in log order (`observe`) by a follower of the log that folds them
    (the dispatcher), it keeps the records of changes past the feed's position in an outbox
    until `flush` stored them. The feed's own last record says how far it is written, so a
    restarted publisher writes nothing twice; a rival that wrote first is noticed by the
    stream (the expected last sequence) and its records are dropped from this outbox."""

    def __init__(self, writer: FeedWriter) -> None:
        self.writer = writer
        self._last: dict[Any, _Seen] = {}  # what each live lease's last record said
        self._outbox: list[tuple[str, bytes, int]] = []
        self._prefixes: dict[str, str] = {}  # a tenant's feed subject, but for the lease id
        self.written_upto = 0  # the log sequence the feed holds records up to
        self.feed_seq = 0  # the feed's last stored sequence
        self.records_written = 0
        self._unsaved = False

    def start(self) -> None:
        """Read where the feed stands; the follower folds the log from its start after this."""
        self.writer.ensure()
        at = self.writer.position()
        self.feed_seq, self.written_upto = at.feed_seq, at.log_seq
        self._last.clear()
        self._outbox.clear()

    def observe(self, event: Any, lease: Lease | QueuedLease | bool, log_seq: int) -> None:
        """`event` (at `log_seq`) was folded into `lease`: the whole Lease, or, held compactly,
        the QueuedLease its LeaseQueued (or its queued request) made, or True for a
        LeaseRequested that waits for its LeaseQueued."""
        record = self._record(event, lease, log_seq, wanted=log_seq > self.written_upto)
        if record is not None:
            prefix = self._prefixes.get(record.tenant)
            if prefix is None:
                prefix = self._prefixes[record.tenant] = feed_lease_prefix(record.tenant)
            # a lease id is a UUID's text: a subject token as it is
            self._outbox.append((prefix + record.lease_id, _encode(record), log_seq))

    def flush(self, position: int) -> None:
        """Store the outbox, then note that the feed is written up to `position` (the log
        sequence the follower has folded). A bus failure leaves the rest for the next flush."""
        while self._outbox:
            chunk = self._outbox[:BATCH_MAX]
            try:
                self.feed_seq = self.writer.append(chunk, expect_last=self.feed_seq)
            except FeedConflict as e:
                # written by a rival, or by this one when the answer was lost: skip what is there
                at = self.writer.position()
                log.info("the feed moved on to log sequence %d: %s", at.log_seq, e)
                self.feed_seq = at.feed_seq
                self.written_upto = max(self.written_upto, at.log_seq)
                self._outbox = [r for r in self._outbox if r[2] > self.written_upto]
                continue
            del self._outbox[:len(chunk)]
            self.records_written += len(chunk)
        if position > self.written_upto:
            self.written_upto = position
            self._unsaved = True

    def checkpoint_state(self, position: int) -> dict[str, Any] | None:
        """What a checkpoint of its follower's fold at `position` keeps of this publisher;
        None while records up to there are not all stored."""
        if self._outbox or self.written_upto < position:
            return None
        return {"last": self._last}

    def restore_checkpoint(self, state: Any, position: int) -> bool:
        """Take `state` from a checkpoint at `position`, after `start`; False when the feed
        does not hold records that far (then the follower folds from the start)."""
        if not isinstance(state, dict) or self.written_upto < position:
            log.warning("the lease feed is written up to log sequence %d, short of the "
                        "checkpoint's %d: replaying the log from the start",
                        self.written_upto, position)
            return False
        self._last = state["last"]
        return True

    def idle(self) -> None:
        """The follower is caught up: keep the position for when the feed's last record has
        aged out of the stream."""
        if self._unsaved and not self._outbox:
            self.writer.save_position(self.written_upto)
            self._unsaved = False

    def _record(self, event: Any, lease: Lease | QueuedLease | bool, log_seq: int, *,
                wanted: bool) -> FeedRecord | None:
        """The record of the change `event` made, if it made one and it is `wanted` (past the
        feed's position); what the lease's last record said is kept either way."""
        oid = event.originator_id
        name = type(event).__name__
        if lease is True:  # a LeaseRequested, held compactly
            # held (waiting for other leases) or, before a LeaseQueued, requested
            workflow = getattr(event, "workflow", None)
            held = (WAITING_FOR_DEPENDENCY if isinstance(workflow, dict)
                    and workflow.get("after") else None)
            state = "requested" if held is None else "held"
            self._last[oid] = (state, None, None, None, 0)
            if not wanted:
                return None
            at = _event_at(event)
            return FeedRecord(lease_id=str(oid), tenant=event.tenant_id, pool_id=event.pool_id,
                              state=state, event=name, version=1, log_sequence=log_seq,
                              at=at, held_reason=held)
        if isinstance(lease, QueuedLease):
            before_queued = self._last.get(oid)
            self._last[oid] = ("queued", None, None, None, 0)
            if not wanted:
                return None
            at = _event_at(event)
            # queued by its LeaseQueued (version 2), or by its own request (one event)
            return FeedRecord(lease_id=str(oid), tenant=lease.tenant_id, pool_id=lease.pool_id,
                              state="queued",
                              # requested, or held (waiting for other leases)
                              previous_state=((before_queued or ("requested",))[0]
                                              if lease.version == 2 else None),
                              event=name, version=lease.version, log_sequence=log_seq, at=at)
        if not isinstance(lease, Lease):
            return None
        before = self._last.get(oid)
        now = _seen(lease)
        if lease.is_terminal and lease.state is not LeaseState.PREEMPTED:
            self._last.pop(oid, None)  # nothing more happens to it (a preempted one may requeue)
        else:
            self._last[oid] = now
        if before == now or not wanted:
            return None
        at = _event_at(event)
        return FeedRecord(
            lease_id=str(oid), tenant=lease.tenant_id, pool_id=lease.pool_id,
            state=str(lease.state), previous_state=None if before is None else before[0],
            event=name, end_reason=lease.end_reason, stop_reason=lease.stop_reason,
            rejection_code=lease.rejection_code, node_id=lease.node_id,
            devices=list(lease.devices), epoch=lease.epoch, exit_code=lease.exit_code,
            version=lease.version, log_sequence=log_seq, at=at, attempt=lease.attempts,
            attempt_end_reason=(lease.attempt_ends[-1][1]
                                if name == "LeaseRetried" and lease.attempt_ends else None),
            held_reason=lease.held_reason)
