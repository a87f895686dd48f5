"""Raw NATS clients that misbehave on purpose, for the fault suite: publish what a hostile
tenant would, and count what in the streams no control-plane writer made."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from nats.js.errors import NotFoundError

from bus.connection import connect
from bus.headers import HDR_LOG_CREATED, HDR_LOG_SEQUENCE
from bus.jetstream.wire import is_stored_event
from bus.subjects import (
    AGENT_STREAM,
    EVENTS_STREAM,
    FEED_STREAM,
    SCHEDULE_STREAM,
    SNAPSHOTS_STREAM,
)


async def publish_raw(url: str, messages: Sequence[tuple[str, bytes, str]], *, user: str,
                      password: str, inbox_prefix: str,
                      listen: Sequence[str] = ()) -> dict[str, int]:
    """Publish each (subject, body, reply subject) as `user`, unchecked, while subscribed to
    each subject of `listen` (others' feeds, leader questions); how many the server refused as
    permission violations (its refusals come back asynchronously) and how many messages the
    subscriptions got."""
    refused = heard = 0

    async def on_error(e: Exception) -> None:
        nonlocal refused
        if "permissions violation" in str(e).lower():
            refused += 1

    async def on_heard(_msg: object) -> None:
        nonlocal heard
        heard += 1

    nc = await connect(url, user=user, password=password, inbox_prefix=inbox_prefix.encode(),
                       error_cb=on_error)
    for subject in listen:
        await nc.subscribe(subject, cb=on_heard)
    for i, (subject, body, reply) in enumerate(messages):
        await nc.publish(subject, body, reply=reply)
        if i % 250 == 0:
            await nc.flush()
    await nc.flush()
    await asyncio.sleep(1.0)
    await nc.close()
    return {"refused": refused, "heard": heard}


async def flood_connections(url: str, n: int, *, user: str, password: str,
                            settle_seconds: float = 3.0) -> int:
    """Open `n` connections as `user` at once, none reconnecting; how many are still open
    `settle_seconds` later (the tenant's account refuses those past the user's cap, or the
    connection guard closes them)."""
    tries = await asyncio.gather(*(connect(url, user=user, password=password, reconnect=False)
                                   for _ in range(n)), return_exceptions=True)
    conns = [c for c in tries if not isinstance(c, BaseException)]
    await asyncio.sleep(settle_seconds)
    kept = sum(c.is_connected for c in conns)
    for c in conns:
        await c.close()
    return kept


async def count_foreign(url: str) -> dict[str, int]:
    """Messages in the log, snapshot, work-queue, timer and lease-feed streams that no
    control-plane writer made: each of theirs carries headers (an event's, a snapshot's with
    its log's creation, a message id, a schedule, the log sequence a feed record was made
    from); a stray reply none."""
    nc = await connect(url)
    js = nc.jetstream()
    out = {"foreign_messages": 0, "log_messages": 0}
    for stream in (EVENTS_STREAM, SNAPSHOTS_STREAM, AGENT_STREAM, SCHEDULE_STREAM, FEED_STREAM):
        try:
            state = (await js.stream_info(stream)).state
        except NotFoundError:
            continue  # the snapshots of a deployment older than their stream: none to judge
        if stream == EVENTS_STREAM:
            out["log_messages"] = state.messages
        for seq in range(state.first_seq, state.last_seq + 1 if state.messages else 0):
            try:
                msg = await js.get_msg(stream, seq)
            except Exception:  # noqa: BLE001, S112 - deleted or acked away: nothing to judge
                continue
            headers = dict(msg.headers or {})
            if stream == EVENTS_STREAM:
                ours = is_stored_event(headers)
            elif stream == SNAPSHOTS_STREAM:
                ours = is_stored_event(headers) and HDR_LOG_CREATED in headers
            elif stream == FEED_STREAM:
                ours = HDR_LOG_SEQUENCE in headers
            else:
                ours = bool(headers)
            if not ours:
                out["foreign_messages"] += 1
    await nc.close()
    return out
