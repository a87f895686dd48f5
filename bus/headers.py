"""NATS and computepool message header names: the one place that spells them."""

from __future__ import annotations

HDR_ORIGINATOR_ID = "Pool-Originator-Id"
HDR_ID_KIND = "Pool-Originator-Id-Kind"
HDR_VERSION = "Pool-Originator-Version"
HDR_TOPIC = "Pool-Topic"
HDR_TRACKING_ID = "Pool-Tracking-Id"
HDR_UPSTREAM = "Pool-Upstream"
# the event log's sequence a feed record was made from (the feed publisher resumes after it)
HDR_LOG_SEQUENCE = "Pool-Log-Sequence"
# a stored checkpoint's head names its chunks (bus.checkpoints)
HDR_CHECKPOINT_ID = "Pool-Checkpoint-Id"
HDR_CHECKPOINT_CHUNKS = "Pool-Checkpoint-Chunks"
HDR_CHECKPOINT_SLOT = "Pool-Checkpoint-Slot"
# on a snapshot: the log sequence of the aggregate's event at the snapshot's version, so a load
# reads the events after it from there rather than from the subject's start
HDR_EVENT_SEQUENCE = "Pool-Event-Sequence"
# on a snapshot: when the event stream it was taken from was created (its stream info's
# `created`), so a snapshot that outlived its log (the log made anew) is never applied
HDR_LOG_CREATED = "Pool-Log-Created"
HDR_EXPECTED_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
HDR_EXPECTED_LAST_SEQ = "Nats-Expected-Last-Sequence"
HDR_BATCH_ID = "Nats-Batch-Id"
HDR_BATCH_SEQ = "Nats-Batch-Sequence"
HDR_BATCH_COMMIT = "Nats-Batch-Commit"
HDR_MSG_ID = "Nats-Msg-Id"
HDR_SCHEDULE = "Nats-Schedule"
HDR_SCHEDULE_TARGET = "Nats-Schedule-Target"
HDR_SEQUENCE = "Nats-Sequence"
HDR_STREAM = "Nats-Stream"  # set by the server on a republish and a direct get's answer
HDR_SUBJECT = "Nats-Subject"
HDR_NUM_PENDING = "Nats-Num-Pending"
HDR_LAST_CONSUMER = "Nats-Last-Consumer"
# nats-py puts an inline status ("NATS/1.0 404 …") under these two keys
HDR_STATUS = "Status"
HDR_DESCRIPTION = "Description"
# W3C trace context
HDR_TRACEPARENT = "traceparent"
# the object store's metadata replaces its predecessor (keeps only the newest per subject)
HDR_ROLLUP = "Nats-Rollup"
# a message's own time to live on a stream that allows it (nats-server >= 2.11), e.g. "3600s"
HDR_TTL = "Nats-TTL"
